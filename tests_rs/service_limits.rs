//! Hardening rules of the service (issue 12): pending manifests are bounded
//! in bytes, a payload whose group repeats a content key is refused at
//! begin, a generation whose durable flag was lost is marked durable at
//! restart, and an L2 directory is reconciled (its unreferenced objects
//! deleted) only against the index it belongs to.

use lmcache_rc_core::index::{Directory, DirectoryConfig};
use lmcache_rc_core::service::ServiceConfig;
use lmcache_rc_core::{ErrorKind, Manifest, TokenRoots, checkpoint_generation};

use crate::service_common::*;

both_ways!(
    pending_manifests_are_bounded_in_bytes,
    a_group_that_repeats_a_content_key_is_refused_at_begin,
    a_durable_flag_lost_before_a_crash_is_set_at_restart,
    an_l2_directory_is_reconciled_only_against_its_own_index,
);

fn generation_at(base: u32) -> Manifest {
    standard(NS, &seq(base, 48), "prompt", 2)
}

/// Item 9: up to 128 pending generations of 16 MiB manifests could hold
/// 2 GiB; `max_pending_bytes` bounds them (begin answers false beyond it).
fn pending_manifests_are_bounded_in_bytes<T: Target>() {
    // What one pending manifest of this shape costs.
    let size = {
        let svc = T::open(config("lim-pending-size", None)).unwrap();
        let one = generation_at(900);
        assert!(svc.begin(&one).unwrap());
        let size = stat(&svc, "pending_bytes");
        assert!(size >= one.payload().len() as u64, "{size}");
        svc.abort(one.generation()).unwrap();
        assert_eq!(stat(&svc, "pending_bytes"), 0);
        svc.close().unwrap();
        size
    };
    let cfg = ServiceConfig {
        max_pending_bytes: 3 * size + size / 2,
        ..config("lim-pending-bytes", None)
    };
    let svc = T::open(cfg).unwrap();
    let gens: Vec<Manifest> = (0..6).map(|i| generation_at(1_000 + 100 * i)).collect();
    let begun: Vec<bool> = gens.iter().map(|m| svc.begin(m).unwrap()).collect();
    assert_eq!(begun, [true, true, true, false, false, false]);
    assert_eq!(stat(&svc, "pending_bytes"), 3 * size);
    assert_eq!(stat(&svc, "begin_refused_pending_bytes"), 3);
    // Publishing one frees its bytes for the next.
    let first = &gens[0];
    for rank in 0..4 {
        store_one(&svc, first, rank);
    }
    assert!(is_listed(&svc, first));
    let refused = gens.iter().zip(&begun).find(|(_, b)| !**b).unwrap().0;
    assert!(svc.begin(refused).unwrap());
    for (m, b) in gens.iter().zip(&begun).skip(1) {
        if *b {
            svc.abort(m.generation()).unwrap();
        }
    }
    svc.abort(refused.generation()).unwrap();
    assert_eq!(stat(&svc, "pending_bytes"), 0);
    assert_idle(&svc);
    svc.close().unwrap();
}

/// A manifest whose recurrent group has three positions, keyed the old way
/// (one key per group: every position the same) or per position.
fn recurrent_positions(tokens: &[u32], per_position: bool) -> Manifest {
    let roots = TokenRoots::build(NS, tokens.to_vec(), 4096).unwrap();
    let n = tokens.len() as u64;
    let boundaries: Vec<(u64, String)> = (0..3)
        .map(|p| {
            let disc = if per_position {
                format!("recurrent:1:{p}")
            } else {
                "recurrent:1".to_string()
            };
            (n, disc)
        })
        .collect();
    let payload = serde_json::json!({
        "schema_version": 2,
        "kind": "prompt",
        "draft_prefix_len": 0,
        "page_groups": [{
            "name": "engine-kv-group:1",
            "page_bytes": 256,
            "positions": [0, 1, 2],
            "content_keys": roots.content_keys(&boundaries).unwrap(),
        }],
    });
    let payload = serde_json::to_vec(&payload).unwrap();
    let prefix = roots.prefix(n).unwrap();
    Manifest::new(checkpoint_generation(&prefix, &payload), prefix, 1, payload).unwrap()
}

/// Item 9: a recurrent group with several positions got the same content
/// key for every position, so only one page was ever stored and no restore
/// could succeed. Such a payload is refused at begin, saying why; one key per
/// position stores and restores.
fn a_group_that_repeats_a_content_key_is_refused_at_begin<T: Target>() {
    let svc = T::open(config("lim-dup-keys", None)).unwrap();
    let tokens = seq(2_000, 40);
    let same = recurrent_positions(&tokens, false);
    let e = svc.begin(&same).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("same content key"), "{e}");
    assert!(
        e.to_string().contains("recurrent:<group>:<position>"),
        "{e}"
    );
    assert_eq!(stat(&svc, "pending"), 0);
    let distinct = recurrent_positions(&tokens, true);
    store_all(&svc, &distinct);
    assert!(is_listed(&svc, &distinct));
    restore_all(&svc, &distinct);
    assert_idle(&svc);
    svc.close().unwrap();
}

/// Item 9: a sidecar killed between the last object's fsync and the commit
/// of the generation's durable flag restarted with the flag false forever
/// ("4 generations stayed durable=false although all their pages were in
/// L2"). Restart now marks such a generation durable.
fn a_durable_flag_lost_before_a_crash_is_set_at_restart<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let m = generation_at(3_000);
    {
        let svc = T::open(durable_config("lim-durable", dir.path())).unwrap();
        store_all(&svc, &m);
        settle(&svc);
        svc.close().unwrap();
    }
    // The state a crash before the flag's commit leaves behind.
    {
        let index = Directory::open(
            Some(&dir.path().join("index.sqlite")),
            DirectoryConfig::default(),
        )
        .unwrap();
        assert!(index.set_durable(m.generation(), false).unwrap());
        index.close().unwrap();
    }
    let svc = T::open(durable_config("lim-durable2", dir.path())).unwrap();
    settle(&svc);
    let listed = svc.list_generations().unwrap();
    let info = listed
        .iter()
        .find(|g| g.generation == m.generation())
        .expect("listed");
    assert!(info.durable, "{info:?}");
    restore_all(&svc, &m);
    assert_idle(&svc);
    svc.close().unwrap();
}

/// Failure 6: `--l2-path` without `--checkpoint-index-path` deleted every
/// object of a durable L2 (and another index's L2 would be wiped the same
/// way). Both are refused, naming the missing flag; the files stay.
fn an_l2_directory_is_reconciled_only_against_its_own_index<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let m = generation_at(4_000);
    {
        let svc = T::open(durable_config("lim-bind", dir.path())).unwrap();
        store_all(&svc, &m);
        settle(&svc);
        svc.close().unwrap();
    }
    let files = l2_files(&l2);
    assert_eq!(files.0, 28);

    let e = T::open(config("lim-bind-none", Some(&l2)))
        .err()
        .expect("refused without its index");
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    let text = e.to_string();
    assert!(text.contains("--checkpoint-index-path is not given"), "{e}");
    assert!(
        text.contains("index.sqlite"),
        "names the index to pass: {e}"
    );
    assert_eq!(l2_files(&l2), files, "no object deleted");

    let other = tempfile::tempdir().unwrap();
    let e = T::open(ServiceConfig {
        checkpoint_index_path: Some(other.path().join("other.sqlite")),
        ..config("lim-bind-other", Some(&l2))
    })
    .err()
    .expect("refused with another index");
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("another checkpoint index"), "{e}");
    assert_eq!(l2_files(&l2), files, "no object deleted");

    let svc = T::open(durable_config("lim-bind-again", dir.path())).unwrap();
    assert!(is_listed(&svc, &m));
    restore_all(&svc, &m);
    assert_idle(&svc);
    svc.close().unwrap();
}
