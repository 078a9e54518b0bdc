//! The wire format byte for byte: a request and a reply of every operation
//! (plus the error reply and a few reply variants) encode to exactly the
//! frames committed under `tests_rs/fixtures/wire/`, and those frames decode
//! back to the same messages. A change of any byte fails here: it is a new
//! protocol version (`protocol::PROTOCOL_VERSION`), never a silent change.
//!
//! Regenerate the fixtures only with a protocol version bump:
//! `LMCACHE_RC_BLESS_WIRE=1 cargo test -p lmcache-rc-core --test integration rpc_golden`.
//! An operation or value variant appended within a version (append only,
//! `docs/design/wire-protocol.md`, e.g. `find_located`) is blessed the same
//! way: it adds its own files, and every existing file must come out
//! byte-identical (no change in `git status`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use lmcache_rc_core::protocol::{
    Capabilities, Change, ChangeBatch, ClearReport, EngineReport, GenerationInfo, Lease,
    MissReason, OPERATIONS, ServiceStatus, TierLoad,
};
use lmcache_rc_core::rpc::wire::{
    self, Reply, Request, Value, WireLocated, WireManifest, WirePrefix,
};
use lmcache_rc_core::{ErrorKind, Manifest, TokenRoots, checkpoint_generation};

/// The request id every fixture frame carries.
const ID: u64 = 0x0102_0304_0506_0708;

/// The wire tag of every request type: append only, never renumbered.
const TAGS: &[(&str, u8)] = &[
    ("capabilities", 0),
    ("find", 1),
    ("begin", 2),
    ("abort", 3),
    ("prepare_store", 4),
    ("finish_store", 5),
    ("begin_retrieve", 6),
    ("poll_retrieve", 7),
    ("finish_retrieve", 8),
    ("cancel_retrieve", 9),
    ("status", 10),
    ("clear", 11),
    ("list_generations", 12),
    ("invalidate_namespace", 13),
    ("changes", 14),
    ("find_located", 15),
    ("report_engine", 16),
    ("engines", 17),
];

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests_rs/fixtures/wire")
}

fn manifest() -> Manifest {
    let ns = "recurrent-sha256-v1:golden";
    let tokens: Vec<u32> = (0..40).collect();
    let roots = TokenRoots::build(ns, tokens, 16).unwrap();
    let prefix = roots.prefix(40).unwrap();
    let payload = br#"{"schema_version":1}"#.to_vec();
    Manifest::new(checkpoint_generation(&prefix, &payload), prefix, 2, payload).unwrap()
}

fn roots() -> Vec<WirePrefix> {
    let roots = TokenRoots::build("recurrent-sha256-v1:golden", (0..40).collect(), 16).unwrap();
    roots.roots().iter().map(WirePrefix::from).collect()
}

/// One request per operation, named by the operation.
fn requests() -> Vec<(&'static str, Request)> {
    let m = WireManifest::from(&manifest());
    vec![
        ("capabilities", Request::Capabilities {}),
        ("find", Request::Find { roots: roots() }),
        (
            "begin",
            Request::Begin {
                manifest: m.clone(),
            },
        ),
        (
            "abort",
            Request::Abort {
                generation: "recurrent-content-v1:abc".into(),
            },
        ),
        (
            "prepare_store",
            Request::PrepareStore {
                manifest: m.clone(),
                rank: 1,
            },
        ),
        (
            "finish_store",
            Request::FinishStore {
                lease_id: "lease-1".into(),
                success: true,
                rank: Some(1),
            },
        ),
        (
            "begin_retrieve",
            Request::BeginRetrieve {
                manifest: m,
                rank: 0,
            },
        ),
        (
            "poll_retrieve",
            Request::PollRetrieve {
                lease_id: "lease-2".into(),
                rank: None,
            },
        ),
        (
            "finish_retrieve",
            Request::FinishRetrieve {
                lease_id: "lease-2".into(),
                rank: Some(300),
            },
        ),
        (
            "cancel_retrieve",
            Request::CancelRetrieve {
                lease_id: "lease-3".into(),
                rank: None,
            },
        ),
        ("status", Request::Status {}),
        (
            "clear",
            Request::Clear {
                force: false,
                all_tiers: true,
            },
        ),
        ("list_generations", Request::ListGenerations {}),
        (
            "invalidate_namespace",
            Request::InvalidateNamespace {
                namespace: "recurrent-sha256-v1:golden".into(),
            },
        ),
        (
            "changes",
            Request::Changes {
                since: 300,
                watch: vec!["recurrent-content-v1:abc".into()],
            },
        ),
        ("find_located", Request::FindLocated { roots: roots() }),
        (
            "report_engine",
            Request::ReportEngine {
                engine: "engine-a".into(),
                counters: vec![("lookups".into(), 300), ("restores_done".into(), 7)],
            },
        ),
        ("engines", Request::Engines {}),
    ]
}

/// A reply of every operation (named `<operation>`), plus further variants
/// of the same shapes (`<operation>.<case>`) and the error reply.
fn replies() -> Vec<(&'static str, Reply)> {
    let ok = Reply::Ok;
    let caps = Capabilities {
        format_version: 1,
        protocol_version: 3,
        pool_id: "0123456789abcdef0123456789abcdef".into(),
        pool_size: 1 << 30,
        durable_index: true,
    };
    let ready = Lease::ready(
        "lease-1".into(),
        "0123456789abcdef0123456789abcdef".into(),
        vec![vec![Some((0, 4096)), None], vec![Some((1 << 40, 65536))]],
    );
    let status = ServiceStatus {
        values: BTreeMap::from([("l1_bytes".to_string(), 4096), ("leases".to_string(), 0)]),
        misses: BTreeMap::from([("capacity".to_string(), 3)]),
        info: BTreeMap::from([
            ("socket".to_string(), None),
            ("version".to_string(), Some("0.1.0".to_string())),
        ]),
    };
    let report = ClearReport {
        l1_objects: 1,
        l1_bytes: 4096,
        l2_objects: 2,
        retired_generations: 3,
        kept_objects: 300,
    };
    let generations = vec![
        GenerationInfo {
            generation: "recurrent-content-v1:abc".into(),
            num_tokens: 40,
            world_size: 2,
            payload_bytes: 1 << 20,
            durable: true,
            access_order: 7,
        },
        GenerationInfo {
            generation: "recurrent-content-v1:def".into(),
            num_tokens: 4096,
            world_size: 1,
            payload_bytes: 0,
            durable: false,
            access_order: -1,
        },
    ];
    let changes = ChangeBatch {
        epoch: "0123456789abcdef0123456789abcdef".into(),
        next_seq: 302,
        truncated: false,
        more: true,
        changes: vec![
            Change {
                seq: 300,
                generation: "recurrent-content-v1:abc".into(),
                kind: "listed".into(),
                tier: Some("l1".into()),
            },
            Change {
                seq: 301,
                generation: "recurrent-content-v1:def".into(),
                kind: "unlisted".into(),
                tier: None,
            },
        ],
        watched: vec![Some("l2".into()), None],
    };
    vec![
        ("capabilities", ok(Value::Capabilities(caps))),
        (
            "find",
            ok(Value::Manifest(Some(WireManifest::from(&manifest())))),
        ),
        ("find.miss", ok(Value::Manifest(None))),
        ("begin", ok(Value::Bool(true))),
        ("abort", ok(Value::Unit)),
        ("prepare_store", ok(Value::Lease(ready))),
        ("prepare_store.busy", ok(Value::Lease(Lease::busy()))),
        ("finish_store", ok(Value::Bool(false))),
        (
            "begin_retrieve",
            ok(Value::Lease(Lease::pending("lease-2".into()))),
        ),
        (
            "poll_retrieve",
            ok(Value::Lease(Lease::miss(MissReason::LostObject))),
        ),
        ("finish_retrieve", ok(Value::Unit)),
        ("cancel_retrieve", ok(Value::Unit)),
        ("status", ok(Value::Status(status))),
        ("clear", ok(Value::Clear(report))),
        ("list_generations", ok(Value::Generations(generations))),
        ("invalidate_namespace", ok(Value::Count(300))),
        ("changes", ok(Value::Changes(changes))),
        (
            "find_located",
            ok(Value::Located(Some(WireLocated {
                manifest: WireManifest::from(&manifest()),
                tiers: vec![
                    TierLoad {
                        tier: "l1".into(),
                        pages: 2,
                        bytes: 8192,
                        samples: 0,
                        latency_us: 0,
                        bytes_per_s: 0,
                        parallelism: 1,
                    },
                    TierLoad {
                        tier: "shared".into(),
                        pages: 300,
                        bytes: 1 << 30,
                        samples: 70_000,
                        latency_us: 50_000,
                        bytes_per_s: u64::MAX,
                        parallelism: 4,
                    },
                ],
            }))),
        ),
        ("find_located.miss", ok(Value::Located(None))),
        ("report_engine", ok(Value::Unit)),
        (
            "engines",
            ok(Value::Engines(vec![EngineReport {
                engine: "engine-a".into(),
                age_ms: 300,
                counters: BTreeMap::from([
                    ("lookups".to_string(), 300),
                    ("restores_done".to_string(), 7),
                ]),
            }])),
        ),
        (
            "error",
            Reply::error(
                ErrorKind::InvalidInput,
                "a namespace must have 1..256 characters",
            ),
        ),
    ]
}

fn to_hex(bytes: &[u8]) -> String {
    let mut out = String::new();
    for line in bytes.chunks(32) {
        out.push_str(&hex::encode(line));
        out.push('\n');
    }
    out
}

fn from_hex(text: &str) -> Vec<u8> {
    let joined: String = text.split_whitespace().collect();
    hex::decode(joined).unwrap()
}

/// Compares `frame` with the fixture `file` (or writes it when blessing);
/// answers the fixture's bytes.
fn check_fixture(file: &str, frame: &[u8]) -> Vec<u8> {
    let path = fixtures().join(file);
    if std::env::var_os("LMCACHE_RC_BLESS_WIRE").is_some() {
        std::fs::create_dir_all(fixtures()).unwrap();
        std::fs::write(&path, to_hex(frame)).unwrap();
    }
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("missing wire fixture {}: {e}", path.display()));
    let expected = from_hex(&text);
    assert_eq!(
        to_hex(frame),
        to_hex(&expected),
        "the bytes of {file} changed: a wire change needs a protocol version bump"
    );
    expected
}

#[test]
fn every_request_encodes_to_its_committed_bytes() {
    for (name, request) in requests() {
        assert_eq!(request.name(), name);
        let frame = wire::encode_request(ID, &request, wire::DEFAULT_MAX_FRAME).unwrap();
        let fixture = check_fixture(&format!("{name}.request.hex"), &frame);
        let (id, body) = wire::split_id(&fixture[wire::LEN_BYTES..]).unwrap();
        assert_eq!(id, ID);
        assert_eq!(wire::decode_request(body).unwrap(), request, "{name}");
    }
}

#[test]
fn every_reply_encodes_to_its_committed_bytes() {
    for (name, reply) in replies() {
        let frame = wire::encode_reply(ID, &reply, wire::DEFAULT_MAX_FRAME).unwrap();
        let fixture = check_fixture(&format!("{name}.reply.hex"), &frame);
        let (id, body) = wire::split_id(&fixture[wire::LEN_BYTES..]).unwrap();
        assert_eq!(id, ID);
        assert_eq!(wire::decode_reply(body).unwrap(), reply, "{name}");
    }
}

#[test]
fn every_operation_has_golden_frames() {
    let requests: Vec<_> = requests().into_iter().map(|(name, _)| name).collect();
    let replies: Vec<_> = replies().into_iter().map(|(name, _)| name).collect();
    assert_eq!(
        requests, OPERATIONS,
        "one golden request per operation, in order"
    );
    for op in OPERATIONS {
        assert!(replies.contains(op), "no golden reply for {op}");
    }
}

#[test]
fn request_tags_are_pinned() {
    let tags: Vec<_> = TAGS.iter().map(|(name, _)| *name).collect();
    assert_eq!(tags, OPERATIONS, "a new operation appends its tag");
    for ((name, request), (_, tag)) in requests().into_iter().zip(TAGS) {
        let frame = wire::encode_request(ID, &request, wire::DEFAULT_MAX_FRAME).unwrap();
        let body = &frame[wire::LEN_BYTES + wire::ID_BYTES..];
        assert_eq!(body[0], *tag, "the wire tag of {name}");
    }
}
