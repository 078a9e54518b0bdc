//! Region page layouts (stock vLLM's per-layer KV-cache tensors): one page
//! is several byte regions of several buffers. Pages move byte-exact both
//! ways, in process and over RPC, with groups of different page sizes, K/V
//! halves with a block stride, and an attention and a Mamba group sharing
//! one buffer per layer (vLLM's layer-outermost hybrid layout); bytes
//! outside the pages' regions are never written. Deduplicated store pages
//! are skipped. A job that does not fit the layout (unknown group, page
//! width, overlapping regions, bad or repeated blocks) is refused before any
//! lease with nothing touched; a template that leaves its buffer is refused
//! when the layout is built; the fault hook works as with a 2-D pool.

use std::sync::Arc;

use lmcache_rc_core::protocol::{Checkpoints, Lease};
use lmcache_rc_core::transfer::{
    CpuBackend, Direction, EngineConfig, Fault, Job, LeaseApi, PageLayout, PoolShape,
    RegionTemplate, TransferEngine, plan,
};
use lmcache_rc_core::{ErrorKind, Manifest, Result};

use crate::rpc_common;
use crate::service_common::{GroupSpec, HANG_GUARD, Role, assert_idle, is_listed, seq};
use crate::service_common::{object_bytes, rank_keys};
use crate::transfer_common::*;

/// Blocks of every buffer (block 0 is the null block).
const NB: u64 = 32;
/// One layer's bytes per block: a K half and a V half; the Mamba state of
/// the same layer is padded to it.
const P: u64 = 512;
const HALF: u64 = P / 2;
/// Bytes of one layer's Mamba state (less than `P`: padded pages).
const STATE: u64 = 384;
/// Bytes of an auxiliary page (its own buffer).
const AUX: u64 = 96;

const ATTN: &str = "engine-kv-group:0";
const MAMBA: &str = "engine-kv-group:1";
const AUXG: &str = "target-draft-auxiliary";
/// Attention page: K and V of both layers.
const ATTN_PAGE: u64 = 4 * HALF;
/// Mamba page: the state of both layers.
const MAMBA_PAGE: u64 = 2 * STATE;

fn t(buffer: usize, offset: u64, block_stride: u64, length: u64) -> RegionTemplate {
    RegionTemplate {
        buffer,
        offset,
        block_stride,
        length,
    }
}

/// Buffers L0, L1 (one per layer, `[NB, P]`) and X (auxiliary, `[NB, AUX]`).
fn hybrid_sizes() -> Vec<u64> {
    vec![NB * P, NB * P, NB * AUX]
}

/// Attention: K half then V half of each layer's block (stride `P`); Mamba:
/// the first `STATE` bytes of the same layers' blocks; auxiliary: rows of X.
fn hybrid_groups() -> Vec<(String, Vec<RegionTemplate>)> {
    vec![
        (
            ATTN.into(),
            vec![
                t(0, 0, P, HALF),
                t(0, HALF, P, HALF),
                t(1, 0, P, HALF),
                t(1, HALF, P, HALF),
            ],
        ),
        (MAMBA.into(), vec![t(0, 0, P, STATE), t(1, 0, P, STATE)]),
        (AUXG.into(), vec![t(2, 0, AUX, AUX)]),
    ]
}

fn hybrid_layout() -> PageLayout {
    PageLayout::regions(&hybrid_sizes(), NB, hybrid_groups()).unwrap()
}

/// The address-free layout descriptor the region workers are bound to.
fn region_layout_json() -> serde_json::Value {
    serde_json::json!({"schema_version": 1, "layout": "hybrid-regions", "blocks": NB})
}

fn region_config(rpc_timeout: std::time::Duration) -> EngineConfig {
    EngineConfig {
        layout: Some(region_layout_json()),
        ..engine_config(rpc_timeout)
    }
}

fn hybrid_specs(kind: &str) -> Vec<GroupSpec> {
    vec![
        GroupSpec::new(ATTN, ATTN_PAGE, vec![0, 1, 2], Role::Attention(16)),
        GroupSpec::new(
            MAMBA,
            MAMBA_PAGE,
            vec![2],
            Role::Endpoint("recurrent:1".into()),
        ),
        GroupSpec::new(
            AUXG,
            AUX,
            vec![0],
            Role::Endpoint(format!("auxiliary:0:{kind}")),
        ),
    ]
}

/// A world-1 manifest of 40 tokens from `base` over the hybrid groups.
fn hybrid_manifest(base: u32, kind: &str) -> Manifest {
    manifest_with(
        &seq(base, 40),
        1,
        &hybrid_specs(kind),
        Some(region_layout_json()),
        kind,
    )
}

/// Block ids of one hybrid job from `first`: 3 attention, 1 Mamba, 1 auxiliary.
fn hybrid_ids(first: u64) -> Vec<Vec<u64>> {
    vec![
        vec![first, first + 1, first + 2],
        vec![first + 3],
        vec![first + 4],
    ]
}

// ---------------------------------------------------------------------------
// A worker over several host buffers

/// One rank bound to host buffers through a region layout. Fields drop in
/// order: the engine (which drains its copies) before the buffers; the
/// buffers are leaked when the engine ended unsafe.
struct RegionWorker {
    engine: TransferEngine,
    backend: Arc<CpuBackend>,
    bufs: Vec<HostPool>,
    layout: PageLayout,
}

impl RegionWorker {
    fn start(
        api: Box<dyn LeaseApi>,
        layout: PageLayout,
        config: EngineConfig,
    ) -> Result<RegionWorker> {
        let bufs: Vec<HostPool> = layout
            .buffer_sizes()
            .iter()
            .map(|&len| {
                HostPool::new(PoolShape {
                    num_blocks: 1,
                    page_bytes: len,
                })
            })
            .collect();
        let bases = bufs.iter().map(HostPool::base).collect();
        // SAFETY: each buffer holds exactly its layout size of writable
        // bytes and outlives the backend: `RegionWorker` drops the engine
        // (which joins its copy threads, the only other holders of the
        // backend) before the buffers, and leaks them when it is unsafe.
        let backend = Arc::new(unsafe { CpuBackend::with_layout(bases, layout.clone()) }?);
        let engine = TransferEngine::start(api, backend.clone(), config)?;
        Ok(RegionWorker {
            engine,
            backend,
            bufs,
            layout,
        })
    }

    fn hybrid(api: Box<dyn LeaseApi>) -> RegionWorker {
        RegionWorker::start(api, hybrid_layout(), region_config(SLOW)).unwrap()
    }

    /// `(buffer, offset, len)` of every region of `group`'s page at `block`.
    fn regions(&self, group: &str, block: u64) -> Vec<(usize, u64, u64)> {
        let g = self.layout.resolve(group).expect("a group of the layout");
        self.layout.group(g).unwrap().regions_at(block).collect()
    }

    /// The page's bytes: its regions, concatenated in template order.
    fn page(&self, group: &str, block: u64) -> Vec<u8> {
        let mut out = Vec::new();
        for (b, off, len) in self.regions(group, block) {
            out.extend(self.bufs[b].read_at(off, len));
        }
        out
    }

    fn write_page(&self, group: &str, block: u64, bytes: &[u8]) {
        let mut at = 0usize;
        for (b, off, len) in self.regions(group, block) {
            self.bufs[b].write_at(off, &bytes[at..at + len as usize]);
            at += len as usize;
        }
        assert_eq!(at, bytes.len(), "page width");
    }

    fn snapshot(&self) -> Vec<Vec<u8>> {
        self.bufs.iter().map(HostPool::snapshot).collect()
    }

    fn fill(&self, byte: u8) {
        for b in &self.bufs {
            b.fill(byte);
        }
    }

    /// Writes every page's expected bytes of `m` (rank 0) at `ids`.
    fn fill_pages(&self, m: &Manifest, ids: &[Vec<u64>]) {
        for (g, (keys, blocks)) in rank_keys(m, 0).iter().zip(ids).enumerate() {
            let group = &m.payload_schema().unwrap().page_groups[g];
            for (key, &block) in keys.iter().zip(blocks) {
                self.write_page(&group.name, block, &object_bytes(key, group.page_bytes));
            }
        }
    }

    /// What the buffers hold after [`RegionWorker::fill`] with `background`
    /// and [`RegionWorker::fill_pages`] of each `(manifest, ids)`.
    fn image(&self, background: u8, pages: &[(&Manifest, &[Vec<u64>])]) -> Vec<Vec<u8>> {
        let mut image: Vec<Vec<u8>> = self
            .layout
            .buffer_sizes()
            .iter()
            .map(|&n| vec![background; n as usize])
            .collect();
        for (m, ids) in pages {
            let schema = m.payload_schema().unwrap();
            for (g, (keys, blocks)) in rank_keys(m, 0).iter().zip(ids.iter()).enumerate() {
                let group = &schema.page_groups[g];
                for (key, &block) in keys.iter().zip(blocks) {
                    let bytes = object_bytes(key, group.page_bytes);
                    let mut at = 0usize;
                    for (b, off, len) in self.regions(&group.name, block) {
                        let (off, len) = (off as usize, len as usize);
                        image[b][off..off + len].copy_from_slice(&bytes[at..at + len]);
                        at += len;
                    }
                }
            }
        }
        image
    }

    fn submit(&self, job: Job) -> lmcache_rc_core::transfer::JobHandle {
        self.engine
            .submit(job)
            .expect("a valid job")
            .expect("the job is admitted")
    }

    fn run(&self, job: Job) -> Done {
        done(&self.submit(job))
    }
}

impl Drop for RegionWorker {
    fn drop(&mut self) {
        let _ = self.engine.close(Some(HANG_GUARD));
        if self.engine.is_unsafe() || self.engine.in_flight() > 0 {
            for b in &self.bufs {
                b.keep_forever();
            }
        }
    }
}

fn copied() -> Done {
    Done {
        kind: "copied",
        reason: String::new(),
        error: None,
    }
}

// ---------------------------------------------------------------------------
// Round trips

/// Stores four generations at once from blocks 1..=20 (every byte outside
/// their regions 0xAA), then restores them at once into buffers filled with
/// 0x55: the buffers must equal the background with exactly those pages
/// written — no pad byte of a Mamba page, no null block, nothing else.
fn four_generations(worker: &RegionWorker, begin_gen: impl Fn(&Manifest)) {
    let gens: Vec<Manifest> = (0..4)
        .map(|g| hybrid_manifest(20_000 + 1_000 * g, "prompt"))
        .collect();
    let ids: Vec<Vec<Vec<u64>>> = (0..4).map(|g| hybrid_ids(1 + 5 * g)).collect();
    for m in &gens {
        begin_gen(m);
    }
    worker.fill(0xAA);
    for (m, b) in gens.iter().zip(&ids) {
        worker.fill_pages(m, b);
    }
    let before = worker.snapshot();
    let handles: Vec<_> = gens
        .iter()
        .zip(&ids)
        .map(|(m, b)| worker.submit(job(m, 0, Direction::Store, b)))
        .collect();
    for h in &handles {
        assert_eq!(done(h), copied());
    }
    assert!(
        worker.snapshot() == before,
        "a store wrote the bound memory"
    );

    worker.fill(0x55);
    let handles: Vec<_> = gens
        .iter()
        .zip(&ids)
        .map(|(m, b)| worker.submit(job(m, 0, Direction::Retrieve, b)))
        .collect();
    for h in &handles {
        assert_eq!(done(h), copied());
    }
    let pages: Vec<(&Manifest, &[Vec<u64>])> = gens
        .iter()
        .zip(&ids)
        .map(|(m, b)| (m, b.as_slice()))
        .collect();
    assert!(
        worker.snapshot() == worker.image(0x55, &pages),
        "the restored buffers differ from the expected image"
    );
    // Spot check through the page view: a Mamba page is its two layers'
    // states; the pad bytes after each state kept the background.
    let keys = rank_keys(&gens[2], 0);
    assert_eq!(
        worker.page(MAMBA, ids[2][1][0]),
        object_bytes(&keys[1][0], MAMBA_PAGE)
    );
    let pad = worker.bufs[0].read_at(ids[2][1][0] * P + STATE, P - STATE);
    assert!(
        pad.iter().all(|&b| b == 0x55),
        "a Mamba pad byte was written"
    );
    assert!(worker.engine.wait_idle(Some(HANG_GUARD)));
}

#[test]
fn hybrid_region_pages_roundtrip_byte_exact_in_process() {
    let svc = service("reg-rt");
    let worker = RegionWorker::hybrid(Box::new(svc.clone()));
    four_generations(&worker, |m| begin(&svc, m));
    assert_idle(&svc);
    assert!(!worker.engine.is_unsafe());
    worker.engine.close(Some(HANG_GUARD)).unwrap();
}

#[test]
fn hybrid_region_pages_roundtrip_byte_exact_over_rpc() {
    let rig = rpc_common::rig("reg-rt-rpc");
    let ctl = rpc_common::client(&rig.socket);
    let worker = RegionWorker::hybrid(Box::new(rpc_common::client(&rig.socket)));
    four_generations(&worker, |m| assert!(ctl.begin(m).unwrap()));
    rpc_common::assert_idle(&ctl);
    assert_idle(rig.server.service());
    worker.engine.close(Some(HANG_GUARD)).unwrap();
}

#[test]
fn a_region_restore_reads_what_a_2d_pool_stored() {
    // The bytes of a page do not depend on where a rank keeps them: a rank
    // with a 2-D pool of 1024-byte rows stores a single-group generation, a
    // rank with K/V-split regions restores it.
    let svc = service("reg-mixed");
    let groups = [GroupSpec::new(
        ATTN,
        ATTN_PAGE,
        vec![0, 1, 2],
        Role::Attention(16),
    )];
    let m = manifest_with(
        &seq(40_000, 40),
        1,
        &groups,
        Some(region_layout_json()),
        "prompt",
    );
    let pool_worker = Worker::start(
        Box::new(svc.clone()),
        PoolShape {
            num_blocks: 16,
            page_bytes: ATTN_PAGE,
        },
        region_config(SLOW),
    )
    .unwrap();
    begin(&svc, &m);
    let keys = rank_keys(&m, 0);
    for (i, key) in keys[0].iter().enumerate() {
        pool_worker
            .pool
            .write_row(1 + i as u64, &object_bytes(key, ATTN_PAGE));
    }
    assert_eq!(
        pool_worker.run(job(&m, 0, Direction::Store, &[vec![1, 2, 3]])),
        copied()
    );
    let worker = RegionWorker::hybrid(Box::new(svc.clone()));
    let ids = vec![vec![9, 4, 30]];
    assert_eq!(worker.run(job(&m, 0, Direction::Retrieve, &ids)), copied());
    for (key, &block) in keys[0].iter().zip(&ids[0]) {
        assert_eq!(worker.page(ATTN, block), object_bytes(key, ATTN_PAGE));
    }
    assert_idle(&svc);
}

#[test]
fn deduplicated_region_pages_are_skipped_and_still_restore() {
    // The same tokens with another kind: the attention and Mamba pages are
    // shared (same content keys), only the auxiliary page is new.
    let (svc, api) = scripted_service("reg-dedup");
    let worker = RegionWorker::hybrid(Box::new(api.clone()));
    let first = hybrid_manifest(50_000, "prompt");
    let second = hybrid_manifest(50_000, "decode");
    let (k1, k2) = (rank_keys(&first, 0), rank_keys(&second, 0));
    assert_eq!(k1[..2], k2[..2]);
    assert_ne!(k1[2], k2[2]);
    begin(&svc, &first);
    worker.fill_pages(&first, &hybrid_ids(1));
    assert_eq!(
        worker.run(job(&first, 0, Direction::Store, &hybrid_ids(1))),
        copied()
    );

    let skipped = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let seen = skipped.clone();
    api.then(
        "prepare_store",
        Step::edit(move |l: &mut Lease| {
            seen.lock()
                .push(l.slots.iter().flatten().filter(|s| s.is_none()).count())
        }),
        1,
    );
    begin(&svc, &second);
    let ids = hybrid_ids(10);
    worker.fill_pages(&second, &ids);
    // The deduplicated pages hold garbage: had the engine copied them
    // anywhere, the restore below would not be byte-exact.
    for &block in &ids[0] {
        worker.write_page(ATTN, block, &[0xEE; ATTN_PAGE as usize]);
    }
    worker.write_page(MAMBA, ids[1][0], &[0xEE; MAMBA_PAGE as usize]);
    assert_eq!(
        worker.run(job(&second, 0, Direction::Store, &ids)),
        copied()
    );
    assert_eq!(*skipped.lock(), vec![4]);
    assert_eq!(api.store_finishes(), vec![true, true]);
    assert!(is_listed(&svc, &second));

    worker.fill(0);
    let back = hybrid_ids(20);
    assert_eq!(
        worker.run(job(&second, 0, Direction::Retrieve, &back)),
        copied()
    );
    assert!(worker.snapshot() == worker.image(0, &[(&second, &back)]));
    assert_idle(&svc);
}

// ---------------------------------------------------------------------------
// Jobs refused before any lease

/// Runs `refused` (after one valid store, so a retrieve could lease) and
/// asserts: failed with `InvalidInput` mentioning `needle`, no lease call,
/// the buffers and the shared memory untouched, the service idle, and the
/// engine still usable.
fn refused_region_job(
    tag: &str,
    layout: PageLayout,
    valid: (&Manifest, Vec<Vec<u64>>),
    refused: Job,
    needle: &str,
) {
    let (svc, api) = scripted_service(tag);
    let worker = RegionWorker::start(Box::new(api.clone()), layout, region_config(SLOW)).unwrap();
    let (m, ids) = valid;
    begin(&svc, m);
    worker.fill(0x11);
    worker.fill_pages(m, &ids);
    assert_eq!(worker.run(job(m, 0, Direction::Store, &ids)), copied());
    if refused.direction == Direction::Store && refused.manifest != *m {
        begin(&svc, &refused.manifest);
    }
    let calls = api.calls().len();
    let bufs = worker.snapshot();
    let shm = shm_bytes(&svc);
    let d = worker.run(refused.clone());
    d.expect("failed", needle);
    assert_eq!(d.error, Some(ErrorKind::InvalidInput), "{d:?}");
    assert_eq!(
        api.calls().len(),
        calls,
        "a lease call was made: {:?}",
        &api.calls()[calls..]
    );
    assert!(worker.snapshot() == bufs, "the bound memory changed");
    assert!(shm_bytes(&svc) == shm, "the shared memory changed");
    assert!(!worker.engine.is_unsafe());
    // Still usable: the valid generation restores.
    worker.fill(0);
    assert_eq!(worker.run(job(m, 0, Direction::Retrieve, &ids)), copied());
    if refused.direction == Direction::Store && refused.manifest != *m {
        svc.abort(refused.manifest.generation()).unwrap();
    }
    assert_idle(&svc);
}

#[test]
fn a_page_width_other_than_the_groups_regions_is_refused() {
    let mut specs = hybrid_specs("prompt");
    specs[1].page_bytes = MAMBA_PAGE - 8;
    let bad = manifest_with(
        &seq(60_000, 40),
        1,
        &specs,
        Some(region_layout_json()),
        "prompt",
    );
    let good = hybrid_manifest(60_000, "decode");
    for direction in [Direction::Store, Direction::Retrieve] {
        refused_region_job(
            &format!("reg-width-{}", direction.as_str()),
            hybrid_layout(),
            (&good, hybrid_ids(1)),
            job(&bad, 0, direction, &hybrid_ids(10)),
            "bytes wide",
        );
    }
}

#[test]
fn a_group_the_layout_does_not_describe_is_refused() {
    let mut specs = hybrid_specs("prompt");
    specs[1].name = "engine-kv-group:7".into();
    let bad = manifest_with(
        &seq(61_000, 40),
        1,
        &specs,
        Some(region_layout_json()),
        "prompt",
    );
    let good = hybrid_manifest(61_000, "decode");
    for direction in [Direction::Store, Direction::Retrieve] {
        refused_region_job(
            &format!("reg-name-{}", direction.as_str()),
            hybrid_layout(),
            (&good, hybrid_ids(1)),
            job(&bad, 0, direction, &hybrid_ids(10)),
            "not in this worker's page layout",
        );
    }
}

#[test]
fn null_out_of_range_and_repeated_blocks_are_refused() {
    let m = hybrid_manifest(62_000, "prompt");
    // block 0 is refused in a store; a retrieve skips it (tests_rs/transfer_skip.rs)
    let cases: Vec<(Vec<Vec<u64>>, &str, Direction)> = vec![
        (
            vec![vec![0, 2, 3], vec![4], vec![5]],
            "outside 1..32",
            Direction::Store,
        ),
        (
            vec![vec![1, 2, 3], vec![NB], vec![5]],
            "outside 1..32",
            Direction::Retrieve,
        ),
        (
            vec![vec![1, 2, 3], vec![3], vec![5]],
            "appears twice",
            Direction::Retrieve,
        ),
    ];
    for (i, (ids, needle, direction)) in cases.into_iter().enumerate() {
        refused_region_job(
            &format!("reg-blocks-{i}"),
            hybrid_layout(),
            (&m, hybrid_ids(10)),
            job(&m, 0, direction, &ids),
            needle,
        );
    }
}

/// Two groups of one buffer whose blocks are misaligned by half a block:
/// block `b` of B shares bytes with block `b + 1` of A although the ids
/// differ — the case only the computed overlap rule catches.
fn skewed_layout() -> PageLayout {
    PageLayout::regions(
        &[NB * P + HALF],
        NB,
        vec![
            ("A".to_string(), vec![t(0, 0, P, P)]),
            ("B".to_string(), vec![t(0, HALF, P, P)]),
        ],
    )
    .unwrap()
}

fn skewed_manifest(base: u32) -> Manifest {
    let specs = [
        GroupSpec::new("A", P, vec![0], Role::Endpoint("a".into())),
        GroupSpec::new("B", P, vec![0], Role::Endpoint("b".into())),
    ];
    manifest_with(
        &seq(base, 40),
        1,
        &specs,
        Some(region_layout_json()),
        "prompt",
    )
}

#[test]
fn overlapping_destination_regions_are_refused_in_both_directions() {
    let m = skewed_manifest(63_000);
    // A at 4 is bytes 2048..2560, B at 3 is 1792..2304: they overlap.
    let overlapping = vec![vec![4], vec![3]];
    // A at 4 and B at 5 (2816..3328) do not.
    let apart = vec![vec![4], vec![5]];
    let schema = m.payload_schema().unwrap();
    let e = plan::check_job(Direction::Store, &schema, &overlapping, &skewed_layout()).unwrap_err();
    assert!(e.to_string().contains("overlap"), "{e}");
    assert_eq!(
        plan::check_job(Direction::Store, &schema, &apart, &skewed_layout()).unwrap(),
        vec![0, 1]
    );
    for direction in [Direction::Store, Direction::Retrieve] {
        refused_region_job(
            &format!("reg-overlap-{}", direction.as_str()),
            skewed_layout(),
            (&m, apart.clone()),
            job(&m, 0, direction, &overlapping),
            "overlap in this worker's memory",
        );
    }
}

// ---------------------------------------------------------------------------
// Layouts refused when bound

#[test]
fn a_template_outside_its_buffer_is_refused_when_the_layout_is_built() {
    // L1 one byte short: the last block's V half of layer 1 leaves it.
    let mut sizes = hybrid_sizes();
    sizes[1] -= 1;
    let e = PageLayout::regions(&sizes, NB, hybrid_groups()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert!(e.to_string().contains("leaves buffer 1"), "{e}");
    // One block more than the buffers hold.
    let e = PageLayout::regions(&hybrid_sizes(), NB + 1, hybrid_groups()).unwrap_err();
    assert!(e.to_string().contains("leaves buffer"), "{e}");
    // A region naming a buffer that does not exist.
    let mut groups = hybrid_groups();
    groups[2].1[0].buffer = 3;
    let e = PageLayout::regions(&hybrid_sizes(), NB, groups).unwrap_err();
    assert!(e.to_string().contains("names buffer 3"), "{e}");
    // Blocks of one template that overlap each other.
    let mut groups = hybrid_groups();
    groups[1].1[0].block_stride = STATE - 1;
    let e = PageLayout::regions(&hybrid_sizes(), NB, groups).unwrap_err();
    assert!(e.to_string().contains("block_stride >= length"), "{e}");
    // Nothing was bound, so no engine and no lease can exist: the same
    // layout with correct sizes binds and serves.
    let svc = service("reg-bind");
    let worker = RegionWorker::hybrid(Box::new(svc.clone()));
    let m = hybrid_manifest(64_000, "prompt");
    begin(&svc, &m);
    worker.fill_pages(&m, &hybrid_ids(1));
    assert_eq!(
        worker.run(job(&m, 0, Direction::Store, &hybrid_ids(1))),
        copied()
    );
    assert_idle(&svc);
}

#[test]
fn buffer_addresses_must_match_the_layout_and_not_overlap() {
    let layout = hybrid_layout();
    let bufs: Vec<HostPool> = hybrid_sizes()
        .iter()
        .map(|&len| {
            HostPool::new(PoolShape {
                num_blocks: 1,
                page_bytes: len,
            })
        })
        .collect();
    let bases: Vec<*mut u8> = bufs.iter().map(HostPool::base).collect();
    // SAFETY: refused before any address is stored or used.
    let e = unsafe { CpuBackend::with_layout(bases[..2].to_vec(), layout.clone()) }
        .err()
        .expect("a missing buffer is refused");
    assert!(e.to_string().contains("3 buffers but 2"), "{e}");
    // L1 placed inside L0.
    let inside = vec![bases[0], bases[0].wrapping_add(8), bases[2]];
    // SAFETY: refused before any address is stored or used.
    let e = unsafe { CpuBackend::with_layout(inside, layout.clone()) }
        .err()
        .expect("overlapping buffers are refused");
    assert!(e.to_string().contains("overlap in memory"), "{e}");
    let null = vec![bases[0], std::ptr::null_mut(), bases[2]];
    // SAFETY: refused before any address is stored or used.
    let e = unsafe { CpuBackend::with_layout(null, layout) }
        .err()
        .expect("a null buffer is refused");
    assert!(e.to_string().contains("null"), "{e}");
}

// ---------------------------------------------------------------------------
// The fault hook

#[test]
fn the_fault_hook_fails_or_poisons_a_region_copy() {
    let (svc, api) = scripted_service("reg-faults");
    let worker = RegionWorker::hybrid(Box::new(api.clone()));
    let m = hybrid_manifest(70_000, "prompt");
    begin(&svc, &m);
    let ids = hybrid_ids(1);
    worker.fill_pages(&m, &ids);
    let bufs = worker.snapshot();
    let shm = shm_bytes(&svc);
    // A recoverable failure: nothing moved, the lease finished as failed.
    worker.backend.faults().push(Fault::Fail, 1);
    let d = worker.run(job(&m, 0, Direction::Store, &ids));
    d.expect("failed", "injected copy failure");
    assert_eq!(api.store_finishes(), vec![false]);
    assert!(worker.snapshot() == bufs && shm_bytes(&svc) == shm);
    assert!(!is_listed(&svc, &m));
    assert_idle(&svc);
    // The engine stays usable.
    begin(&svc, &m);
    assert_eq!(worker.run(job(&m, 0, Direction::Store, &ids)), copied());
    // A copy that may still be in flight: unsafe, the lease is never
    // finished, later submits are refused.
    worker.backend.faults().push(Fault::InFlight, 1);
    let d = worker.run(job(&m, 0, Direction::Retrieve, &hybrid_ids(10)));
    assert_eq!(d.kind, "unsafe", "{d:?}");
    assert!(worker.engine.is_unsafe());
    assert_eq!(
        api.count("finish_retrieve"),
        0,
        "an unsafe copy's lease was finished"
    );
    assert!(
        worker
            .engine
            .submit(job(&m, 0, Direction::Retrieve, &hybrid_ids(20)))
            .unwrap()
            .is_none()
    );
    assert_eq!(
        worker.engine.close(Some(HANG_GUARD)).unwrap_err().kind(),
        ErrorKind::UnsafeCopy
    );
}
