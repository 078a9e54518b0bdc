//! The slot allocator of the L1 pool: hands out aligned byte ranges of
//! `[0, capacity)`.
//!
//! Free space is kept as non-adjacent ranges in two indexes: by offset (to
//! coalesce a freed slot with its neighbours) and by `(length, offset)` (to
//! find the smallest range that fits, lowest offset first). Allocation and
//! free are O(log n) in the number of free ranges and live slots. Live slots
//! are recorded too, so a double free or a slot this allocator never handed
//! out is refused without changing anything.
//!
//! The allocator is not synchronised: the service keeps it under its object
//! table lock. [`SlotAllocator::change_generation`] counts every successful
//! allocation and free, so a store waiting for capacity (admission
//! backpressure) can tell whether space may have been released.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::error::{Error, Result};

/// Default slot alignment (and granularity): 4 KiB.
pub const DEFAULT_ALIGN: u64 = 4096;

/// One allocated byte range of the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Slot {
    /// Start of the range; a multiple of the allocator's alignment.
    pub offset: u64,
    /// Bytes requested (the payload length).
    pub len: u64,
    /// Bytes occupied: `len` rounded up to the alignment.
    pub reserved: u64,
}

impl Slot {
    /// One past the last occupied byte (`offset + reserved`).
    pub fn end(&self) -> u64 {
        self.offset + self.reserved
    }
}

/// Aligned best-fit allocator over `[0, capacity)`.
#[derive(Debug, Clone)]
pub struct SlotAllocator {
    capacity: u64,
    align: u64,
    /// Free ranges: offset -> length. Never two adjacent ranges.
    free_by_offset: BTreeMap<u64, u64>,
    /// The same free ranges as `(length, offset)`.
    free_by_size: BTreeSet<(u64, u64)>,
    /// Live slots: offset -> (len, reserved).
    live: HashMap<u64, (u64, u64)>,
    used: u64,
    generation: u64,
}

impl SlotAllocator {
    /// An allocator over `capacity` bytes with [`DEFAULT_ALIGN`] alignment.
    ///
    /// `capacity` must be a positive multiple of the alignment.
    pub fn new(capacity: u64) -> Result<SlotAllocator> {
        SlotAllocator::with_align(capacity, DEFAULT_ALIGN)
    }

    /// An allocator over `capacity` bytes whose slots start at multiples of
    /// `align` and occupy multiples of `align` bytes.
    ///
    /// `align` must be a power of two and `capacity` a positive multiple of
    /// it; otherwise [`Error::InvalidInput`].
    pub fn with_align(capacity: u64, align: u64) -> Result<SlotAllocator> {
        if !align.is_power_of_two() {
            return Err(Error::invalid(format!(
                "slot alignment must be a power of two, got {align}"
            )));
        }
        if capacity == 0 || !capacity.is_multiple_of(align) {
            return Err(Error::invalid(format!(
                "pool capacity must be a positive multiple of the slot alignment {align}, got {capacity}"
            )));
        }
        let mut allocator = SlotAllocator {
            capacity,
            align,
            free_by_offset: BTreeMap::new(),
            free_by_size: BTreeSet::new(),
            live: HashMap::new(),
            used: 0,
            generation: 0,
        };
        allocator.insert_free(0, capacity);
        Ok(allocator)
    }

    /// Bytes a request of `len` bytes occupies (`len` rounded up to the
    /// alignment), or `None` when `len` is 0 or the result exceeds the
    /// capacity (such a request can never succeed).
    pub fn reserved_for(&self, len: u64) -> Option<u64> {
        if len == 0 {
            return None;
        }
        len.checked_next_multiple_of(self.align)
            .filter(|&reserved| reserved <= self.capacity)
    }

    /// Allocates a slot for `len` bytes: the smallest free range that fits,
    /// lowest offset among equals.
    ///
    /// Returns `None` when no free range is large enough, and also for
    /// `len == 0` or `len > capacity` (requests that can never succeed; the
    /// caller treats every `None` as "no capacity" and validates page sizes
    /// itself).
    pub fn alloc(&mut self, len: u64) -> Option<Slot> {
        let need = self.reserved_for(len)?;
        let &(range_len, offset) = self.free_by_size.range((need, 0)..).next()?;
        self.remove_free(offset, range_len);
        if range_len > need {
            self.insert_free(offset + need, range_len - need);
        }
        self.live.insert(offset, (len, need));
        self.used += need;
        self.generation = self.generation.wrapping_add(1);
        Some(Slot {
            offset,
            len,
            reserved: need,
        })
    }

    /// Returns `slot` to the free space, merging it with free neighbours.
    ///
    /// A slot that is not live in this allocator (already freed, never
    /// allocated here, or with a different length) is refused with
    /// [`Error::InvalidInput`] and nothing changes.
    pub fn free(&mut self, slot: Slot) -> Result<()> {
        match self.live.get(&slot.offset) {
            Some(&(len, reserved)) if len == slot.len && reserved == slot.reserved => {}
            Some(&(len, reserved)) => {
                return Err(Error::invalid(format!(
                    "slot at offset {} is live with len {len} (reserved {reserved}), not len {} \
                     (reserved {}); refusing to free it",
                    slot.offset, slot.len, slot.reserved
                )));
            }
            None => {
                return Err(Error::invalid(format!(
                    "slot at offset {} (len {}) is not allocated: double free or foreign slot",
                    slot.offset, slot.len
                )));
            }
        }
        self.live.remove(&slot.offset);
        self.used -= slot.reserved;

        let mut start = slot.offset;
        let mut end = slot.offset + slot.reserved;
        if let Some((&prev, &prev_len)) = self.free_by_offset.range(..start).next_back()
            && prev + prev_len == start
        {
            self.remove_free(prev, prev_len);
            start = prev;
        }
        if let Some(&next_len) = self.free_by_offset.get(&end) {
            self.remove_free(end, next_len);
            end += next_len;
        }
        self.insert_free(start, end - start);
        self.generation = self.generation.wrapping_add(1);
        Ok(())
    }

    /// Whether `slot` is currently allocated (exactly as handed out).
    pub fn is_live(&self, slot: &Slot) -> bool {
        self.live.get(&slot.offset) == Some(&(slot.len, slot.reserved))
    }

    /// Bytes occupied by live slots (sum of their `reserved`).
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Free bytes (`capacity - used`), possibly fragmented.
    pub fn available(&self) -> u64 {
        self.capacity - self.used
    }

    /// Total bytes managed.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The slot alignment.
    pub fn align(&self) -> u64 {
        self.align
    }

    /// Length of the largest free range (0 when full): the largest
    /// reservation that can succeed now.
    pub fn largest_free(&self) -> u64 {
        self.free_by_size
            .last()
            .map_or(0, |&(range_len, _)| range_len)
    }

    /// Number of free ranges (1 when empty: free space is always coalesced).
    pub fn free_ranges(&self) -> usize {
        self.free_by_offset.len()
    }

    /// Number of live slots.
    pub fn allocations(&self) -> usize {
        self.live.len()
    }

    /// A counter bumped by every successful [`alloc`](Self::alloc) and
    /// [`free`](Self::free) (wrapping). Compare two readings for inequality.
    pub fn change_generation(&self) -> u64 {
        self.generation
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        self.free_by_offset.insert(offset, len);
        self.free_by_size.insert((len, offset));
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        self.free_by_offset.remove(&offset);
        self.free_by_size.remove(&(len, offset));
    }
}
