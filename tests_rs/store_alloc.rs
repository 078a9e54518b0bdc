//! The L1 slot allocator: aligned slots inside capacity, exhaustion, best
//! fit, coalescing, refusal of double and foreign frees, the change
//! generation, and a model test over random alloc/free sequences.

use lmcache_rc_core::ErrorKind;
use lmcache_rc_core::store::alloc::{DEFAULT_ALIGN, Slot, SlotAllocator};
use proptest::prelude::*;

const A: u64 = DEFAULT_ALIGN;

#[test]
fn construction_requires_power_of_two_alignment_and_aligned_capacity() {
    assert_eq!(
        SlotAllocator::with_align(4096, 3).unwrap_err().kind(),
        ErrorKind::InvalidInput
    );
    assert_eq!(
        SlotAllocator::with_align(4096, 0).unwrap_err().kind(),
        ErrorKind::InvalidInput
    );
    assert_eq!(
        SlotAllocator::new(4097).unwrap_err().kind(),
        ErrorKind::InvalidInput
    );
    assert_eq!(
        SlotAllocator::new(0).unwrap_err().kind(),
        ErrorKind::InvalidInput
    );
    let a = SlotAllocator::new(16 * A).unwrap();
    assert_eq!(a.capacity(), 16 * A);
    assert_eq!(a.align(), A);
    assert_eq!(a.available(), 16 * A);
    assert_eq!(a.used(), 0);
    assert_eq!(a.largest_free(), 16 * A);
    assert_eq!(a.allocations(), 0);
    assert_eq!(a.free_ranges(), 1);
    let small = SlotAllocator::with_align(64, 16).unwrap();
    assert_eq!(small.align(), 16);
}

#[test]
fn slots_are_aligned_and_reserve_rounded_up_lengths() {
    let mut a = SlotAllocator::new(16 * A).unwrap();
    let s1 = a.alloc(1).unwrap();
    assert_eq!(
        s1,
        Slot {
            offset: 0,
            len: 1,
            reserved: A
        }
    );
    let s2 = a.alloc(A + 1).unwrap();
    assert_eq!(
        s2,
        Slot {
            offset: A,
            len: A + 1,
            reserved: 2 * A
        }
    );
    assert_eq!(s2.end(), 3 * A);
    let s3 = a.alloc(A).unwrap();
    assert_eq!((s3.offset, s3.reserved), (3 * A, A));
    assert_eq!(a.used(), 4 * A);
    assert_eq!(a.available(), 12 * A);
    assert_eq!(a.allocations(), 3);
    assert_eq!(a.reserved_for(1), Some(A));
    assert_eq!(a.reserved_for(0), None);
    assert_eq!(a.reserved_for(16 * A + 1), None);

    let mut b = SlotAllocator::with_align(1024, 64).unwrap();
    let s = b.alloc(65).unwrap();
    assert_eq!((s.offset, s.reserved), (0, 128));
    assert_eq!(b.alloc(1).unwrap().offset, 128);
}

#[test]
fn zero_length_and_oversized_requests_get_none_and_change_nothing() {
    let mut a = SlotAllocator::new(4 * A).unwrap();
    let g = a.change_generation();
    assert_eq!(a.alloc(0), None);
    assert_eq!(a.alloc(4 * A + 1), None);
    assert_eq!(a.alloc(u64::MAX), None);
    assert_eq!(a.change_generation(), g);
    assert_eq!(a.used(), 0);
    assert!(a.alloc(4 * A).is_some());
}

#[test]
fn exhaustion_returns_none_until_a_slot_is_freed() {
    let mut a = SlotAllocator::new(4 * A).unwrap();
    let slots: Vec<Slot> = (0..4).map(|_| a.alloc(A).unwrap()).collect();
    assert_eq!(a.available(), 0);
    assert_eq!(a.largest_free(), 0);
    let g = a.change_generation();
    assert_eq!(a.alloc(1), None);
    assert_eq!(a.change_generation(), g, "a failed alloc is not a change");
    a.free(slots[2]).unwrap();
    assert_eq!(a.alloc(A).unwrap().offset, 2 * A);
    assert_eq!(a.alloc(1), None);
}

#[test]
fn fragmented_space_refuses_a_slot_larger_than_the_largest_free_range() {
    let mut a = SlotAllocator::new(4 * A).unwrap();
    let slots: Vec<Slot> = (0..4).map(|_| a.alloc(A).unwrap()).collect();
    a.free(slots[0]).unwrap();
    a.free(slots[2]).unwrap();
    assert_eq!(a.available(), 2 * A);
    assert_eq!(a.largest_free(), A);
    assert_eq!(a.free_ranges(), 2);
    assert_eq!(a.alloc(2 * A), None);
}

#[test]
fn alloc_picks_the_smallest_free_range_that_fits() {
    let mut a = SlotAllocator::new(10 * A).unwrap();
    let big = a.alloc(3 * A).unwrap(); // [0, 3)
    let _sep1 = a.alloc(A).unwrap(); // [3, 4)
    let small = a.alloc(A).unwrap(); // [4, 5)
    let _sep2 = a.alloc(A).unwrap(); // [5, 6), tail [6, 10) free
    a.free(big).unwrap();
    a.free(small).unwrap();
    // Holes of 3, 1 and 4 pages: a one-page request takes the one-page hole.
    assert_eq!(a.alloc(A).unwrap().offset, 4 * A);
    // A two-page request takes the three-page hole, not the four-page tail.
    assert_eq!(a.alloc(2 * A).unwrap().offset, 0);
}

#[test]
fn freeing_coalesces_neighbours_into_one_full_range() {
    let mut a = SlotAllocator::new(6 * A).unwrap();
    let left = a.alloc(2 * A).unwrap();
    let middle = a.alloc(2 * A).unwrap();
    let right = a.alloc(2 * A).unwrap();
    a.free(middle).unwrap();
    assert_eq!(a.free_ranges(), 1);
    assert_eq!(a.largest_free(), 2 * A);
    a.free(left).unwrap();
    assert_eq!(a.free_ranges(), 1);
    assert_eq!(a.largest_free(), 4 * A);
    a.free(right).unwrap();
    assert_eq!(a.free_ranges(), 1);
    assert_eq!(a.largest_free(), 6 * A);
    assert_eq!(a.used(), 0);
    assert_eq!(a.allocations(), 0);
    // The whole capacity is one slot again.
    assert_eq!(a.alloc(6 * A).unwrap().offset, 0);
}

#[test]
fn freeing_between_two_free_neighbours_merges_all_three() {
    let mut a = SlotAllocator::new(3 * A).unwrap();
    let s: Vec<Slot> = (0..3).map(|_| a.alloc(A).unwrap()).collect();
    a.free(s[0]).unwrap();
    a.free(s[2]).unwrap();
    assert_eq!(a.free_ranges(), 2);
    a.free(s[1]).unwrap();
    assert_eq!(a.free_ranges(), 1);
    assert_eq!(a.largest_free(), 3 * A);
}

#[test]
fn double_free_is_refused_and_changes_nothing() {
    let mut a = SlotAllocator::new(4 * A).unwrap();
    let s = a.alloc(A).unwrap();
    let _other = a.alloc(A).unwrap();
    a.free(s).unwrap();
    let (used, gen_, ranges) = (a.used(), a.change_generation(), a.free_ranges());
    assert_eq!(a.free(s).unwrap_err().kind(), ErrorKind::InvalidInput);
    assert_eq!(
        (a.used(), a.change_generation(), a.free_ranges()),
        (used, gen_, ranges)
    );
    assert!(!a.is_live(&s));
}

#[test]
fn foreign_or_altered_slots_are_refused_and_change_nothing() {
    let mut a = SlotAllocator::new(8 * A).unwrap();
    let s = a.alloc(A + 10).unwrap();
    let before = (
        a.used(),
        a.change_generation(),
        a.free_ranges(),
        a.allocations(),
    );
    let foreign = [
        Slot {
            offset: 4 * A,
            len: A,
            reserved: A,
        },
        Slot {
            offset: s.offset,
            len: s.len + 1,
            reserved: s.reserved,
        },
        Slot {
            offset: s.offset,
            len: s.len,
            reserved: A,
        },
        Slot {
            offset: A,
            len: A,
            reserved: A,
        },
        Slot {
            offset: 100 * A,
            len: 1,
            reserved: A,
        },
    ];
    for slot in foreign {
        assert_eq!(
            a.free(slot).unwrap_err().kind(),
            ErrorKind::InvalidInput,
            "{slot:?}"
        );
        assert_eq!(
            (
                a.used(),
                a.change_generation(),
                a.free_ranges(),
                a.allocations()
            ),
            before
        );
    }
    assert!(a.is_live(&s));
    a.free(s).unwrap();
}

#[test]
fn change_generation_counts_every_alloc_and_free() {
    let mut a = SlotAllocator::new(4 * A).unwrap();
    let g0 = a.change_generation();
    let s = a.alloc(A).unwrap();
    let g1 = a.change_generation();
    assert_ne!(g1, g0);
    a.free(s).unwrap();
    let g2 = a.change_generation();
    assert_ne!(g2, g1);
    assert_eq!(g2.wrapping_sub(g0), 2);
}

#[test]
fn allocator_is_send() {
    fn assert_send<T: Send>() {}
    assert_send::<SlotAllocator>();
}

#[derive(Debug, Clone)]
enum Op {
    Alloc(u64),
    Free(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1u64..=5 * 4096).prop_map(Op::Alloc),
        2 => any::<usize>().prop_map(Op::Free),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_alloc_free_sequences_keep_slots_disjoint_aligned_and_accounted(
        pages in 1u64..48,
        align_shift in 6u32..13,
        ops in prop::collection::vec(op(), 1..200),
    ) {
        let align = 1u64 << align_shift;
        let capacity = pages * 4096;
        let mut a = SlotAllocator::with_align(capacity, align).unwrap();
        let mut live: Vec<Slot> = Vec::new();
        for op in ops {
            let generation = a.change_generation();
            match op {
                Op::Alloc(len) => match a.alloc(len) {
                    Some(slot) => {
                        prop_assert_eq!(slot.len, len);
                        prop_assert_eq!(slot.reserved, len.next_multiple_of(align));
                        prop_assert_eq!(slot.offset % align, 0);
                        prop_assert!(slot.end() <= capacity);
                        for other in &live {
                            prop_assert!(
                                slot.end() <= other.offset || other.end() <= slot.offset,
                                "{:?} overlaps {:?}", slot, other
                            );
                        }
                        prop_assert_ne!(a.change_generation(), generation);
                        live.push(slot);
                    }
                    None => {
                        prop_assert!(a.largest_free() < len.next_multiple_of(align));
                        prop_assert_eq!(a.change_generation(), generation);
                    }
                },
                Op::Free(i) => {
                    if live.is_empty() {
                        continue;
                    }
                    let slot = live.swap_remove(i % live.len());
                    a.free(slot).unwrap();
                    prop_assert_ne!(a.change_generation(), generation);
                    prop_assert!(a.free(slot).is_err());
                }
            }
            let used: u64 = live.iter().map(|s| s.reserved).sum();
            prop_assert_eq!(a.used(), used);
            prop_assert_eq!(a.used() + a.available(), capacity);
            prop_assert_eq!(a.allocations(), live.len());
            prop_assert!(a.largest_free() <= a.available());
        }
        for slot in live.drain(..) {
            a.free(slot).unwrap();
        }
        prop_assert_eq!(a.largest_free(), capacity);
        prop_assert_eq!(a.free_ranges(), 1);
        prop_assert_eq!(a.used(), 0);
    }
}
