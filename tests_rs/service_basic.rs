//! Basic store → publish → find → retrieve round trips through the service.

use lmcache_rc_core::TokenRoots;
use lmcache_rc_core::service::LeaseStatus;

use crate::service_common::*;

both_ways!(
    four_rank_generation_publishes_only_after_the_last_rank_and_restores_byte_exact,
    exact_replay_is_suppressed_at_begin_and_continuation_copies_only_new_pages,
);

fn four_rank_generation_publishes_only_after_the_last_rank_and_restores_byte_exact<T: Target>() {
    let svc = T::open(config("basic", None)).unwrap();
    let tokens: Vec<u32> = (0..100).collect();
    let m = manifest(&tokens, 4, 8192, 16);
    assert!(svc.begin(&m).unwrap());
    let roots = TokenRoots::build(m.prefix().namespace(), tokens.clone(), 4096).unwrap();
    for rank in 0..4 {
        assert_eq!(
            svc.find(&roots.roots()).unwrap(),
            None,
            "visible before all ranks"
        );
        let (published, copied) = store_rank(&svc, &m, rank);
        assert_eq!(published, rank == 3);
        assert_eq!(copied, 9 * 8192);
    }
    assert_eq!(svc.find(&roots.roots()).unwrap().as_ref(), Some(&m));
    for rank in 0..4 {
        assert!(retrieve_rank(&svc, &m, rank));
    }
    assert_idle(&svc);
    svc.close().unwrap();
}

fn exact_replay_is_suppressed_at_begin_and_continuation_copies_only_new_pages<T: Target>() {
    let svc = T::open(config("replay", None)).unwrap();
    let tokens: Vec<u32> = (0..64).collect();
    let m = manifest(&tokens, 2, 4096, 16);
    assert!(svc.begin(&m).unwrap());
    for rank in 0..2 {
        store_rank(&svc, &m, rank);
    }
    assert!(!svc.begin(&m).unwrap(), "exact replay must be suppressed");
    let longer: Vec<u32> = (0..80).collect();
    let m2 = manifest(&longer, 2, 4096, 16);
    assert!(svc.begin(&m2).unwrap());
    for rank in 0..2 {
        let lease = svc.prepare_store(&m2, rank).unwrap();
        assert_eq!(lease.status, LeaseStatus::Ready);
        let new_pages: usize = lease.slots.iter().flatten().filter(|s| s.is_some()).count();
        // 4 full attention pages are shared; the 5th attention page, the
        // recurrent page and the auxiliary page are new.
        assert_eq!(new_pages, 3, "rank {rank}: {:?}", lease.slots);
        write_slots(&svc, &m2, rank, &lease);
        svc.finish_store(lease.lease_id.as_deref().unwrap(), true, None)
            .unwrap();
    }
    assert!(retrieve_rank(&svc, &m2, 0));
    assert!(retrieve_rank(&svc, &m, 1));
    assert_idle(&svc);
    svc.close().unwrap();
}
