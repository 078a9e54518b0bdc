//! Where a page's bytes live in a worker's KV memory
//! (`docs/design/transfers.md#page-layouts-transferlayoutrs`).
//!
//! A bound page memory is a list of buffers (sizes here; addresses stay with
//! the backend), `num_blocks` physical blocks, and named page groups. Each
//! group is a list of [`RegionTemplate`]s: the page of that group at block
//! `b` is the concatenation, in template order, of
//! `buffer[t.buffer][t.offset + b * t.block_stride ..][.. t.length]` for
//! every template `t`. This covers both:
//!
//! - the boundary fork's pool: one `[num_blocks, page_bytes]` buffer and one
//!   default template `(0, 0, page_bytes, page_bytes)` that serves every
//!   group name ([`PageLayout::pool`]);
//! - stock vLLM's per-layer KV-cache tensors: one buffer per tensor and, per
//!   KV-cache group, one template per tensor region of a block (K and V
//!   halves with a stride; attention and Mamba groups sharing one tensor)
//!   ([`PageLayout::regions`]).
//!
//! A [`PageLayout`] is validated once, when it is built, and is immutable:
//! every template lies inside its buffer for every block `0..num_blocks`
//! (checked arithmetic), so a block id below `num_blocks` can never address
//! a byte outside the buffers. What a single job may do (overlap, widths)
//! is checked per job in [`super::plan`].

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::manifest::{MAX_GROUP_NAME_CHARS, MAX_PAGE_BYTES, MAX_PAGE_GROUPS};

/// Most buffers one layout binds (a model's KV-cache tensors).
pub const MAX_BUFFERS: usize = 1 << 16;
/// Most region templates of one page group.
pub const MAX_REGIONS_PER_GROUP: usize = 1 << 16;

/// The geometry of a contiguous 2-D page pool: `num_blocks` rows of
/// `page_bytes` (the boundary fork's layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolShape {
    /// Number of rows; row 0 is the null page and is never touched.
    pub num_blocks: u64,
    /// Width of every row in bytes.
    pub page_bytes: u64,
}

/// One region of a page, for every block: bytes
/// `offset + block * block_stride .. + length` of buffer `buffer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionTemplate {
    /// Index of the buffer in the layout's buffer list.
    pub buffer: usize,
    /// Byte offset of block 0's region.
    pub offset: u64,
    /// Bytes between the regions of consecutive blocks (at least `length`).
    pub block_stride: u64,
    /// Bytes of the region (at least 1).
    pub length: u64,
}

impl RegionTemplate {
    /// Start of this region for `block` (no overflow for a block of a
    /// validated layout: the layout proved the region fits its buffer).
    fn start(&self, block: u64) -> Option<u64> {
        block
            .checked_mul(self.block_stride)
            .and_then(|o| o.checked_add(self.offset))
    }
}

/// The regions of one page group, with their total width.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupLayout {
    /// The group's name; `None` for the 2-D pool's default group, which
    /// serves every manifest group name.
    name: Option<String>,
    regions: Vec<RegionTemplate>,
    page_bytes: u64,
}

impl GroupLayout {
    /// The group name (`None` = the default group of a 2-D pool).
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }
    /// The region templates, in page order.
    pub fn regions(&self) -> &[RegionTemplate] {
        &self.regions
    }
    /// Bytes of one page: the sum of the regions' lengths.
    pub fn page_bytes(&self) -> u64 {
        self.page_bytes
    }
    /// The page's regions at `block` as `(buffer, offset, length)`, in page
    /// order. `block` must be below the layout's `num_blocks` (then no
    /// arithmetic overflows: the layout proved every region fits).
    pub fn regions_at(&self, block: u64) -> impl Iterator<Item = (usize, u64, u64)> + '_ {
        self.regions.iter().map(move |r| {
            // Cannot fail for a block below num_blocks (checked at build);
            // saturating keeps an out-of-contract call from wrapping.
            (r.buffer, r.start(block).unwrap_or(u64::MAX), r.length)
        })
    }
}

/// A validated page layout: buffer sizes, block count and page groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageLayout {
    buffer_sizes: Vec<u64>,
    num_blocks: u64,
    groups: Vec<GroupLayout>,
    by_name: HashMap<String, usize>,
    /// The group that serves names not in `by_name` (2-D pools only).
    default: Option<usize>,
    /// Set for a layout built by [`PageLayout::pool`].
    shape: Option<PoolShape>,
}

impl PageLayout {
    /// The layout of a contiguous `[num_blocks, page_bytes]` pool: one
    /// buffer, one default group of one full-row region that serves every
    /// page group name.
    pub fn pool(shape: PoolShape) -> Result<PageLayout> {
        if shape.num_blocks < 2 || shape.page_bytes == 0 {
            return Err(Error::invalid(format!(
                "a page pool needs at least 2 rows (row 0 is the null page) of at least 1 byte, \
                 got {} rows of {} bytes",
                shape.num_blocks, shape.page_bytes
            )));
        }
        let total = shape.num_blocks.checked_mul(shape.page_bytes);
        let Some(total) = total.filter(|t| fits_address_space(*t)) else {
            return Err(Error::invalid(
                "the page pool is larger than the address space",
            ));
        };
        let group = GroupLayout {
            name: None,
            regions: vec![RegionTemplate {
                buffer: 0,
                offset: 0,
                block_stride: shape.page_bytes,
                length: shape.page_bytes,
            }],
            page_bytes: shape.page_bytes,
        };
        Ok(PageLayout {
            buffer_sizes: vec![total],
            num_blocks: shape.num_blocks,
            groups: vec![group],
            by_name: HashMap::new(),
            default: Some(0),
            shape: Some(shape),
        })
    }

    /// A region layout: `buffer_sizes[i]` bytes per buffer, `num_blocks`
    /// blocks (block 0 is the null block and is never touched), and named
    /// groups of region templates. Refuses (`InvalidInput`) a layout where
    /// any template leaves its buffer for some block, a group without
    /// regions, a region of 0 bytes or whose blocks overlap each other
    /// (`block_stride < length`), duplicate or bad names, or a page larger
    /// than a manifest allows (1 GiB).
    pub fn regions(
        buffer_sizes: &[u64],
        num_blocks: u64,
        groups: impl IntoIterator<Item = (String, Vec<RegionTemplate>)>,
    ) -> Result<PageLayout> {
        if buffer_sizes.is_empty() || buffer_sizes.len() > MAX_BUFFERS {
            return Err(Error::invalid(format!(
                "a region layout needs 1..={MAX_BUFFERS} buffers, got {}",
                buffer_sizes.len()
            )));
        }
        for (i, &size) in buffer_sizes.iter().enumerate() {
            if size == 0 || !fits_address_space(size) {
                return Err(Error::invalid(format!(
                    "buffer {i} has {size} bytes: a buffer must hold 1 byte or more and fit the \
                     address space"
                )));
            }
        }
        if num_blocks < 2 {
            return Err(Error::invalid(format!(
                "a region layout needs at least 2 blocks (block 0 is the null block), got \
                 {num_blocks}"
            )));
        }
        let last = num_blocks - 1;
        let mut out = Vec::new();
        let mut by_name = HashMap::new();
        for (name, regions) in groups {
            let chars = name.chars().count();
            if chars == 0 || chars > MAX_GROUP_NAME_CHARS {
                return Err(Error::invalid(format!(
                    "page group name {name:?} must contain 1..={MAX_GROUP_NAME_CHARS} characters"
                )));
            }
            if by_name.contains_key(&name) {
                return Err(Error::invalid(format!(
                    "page group {name:?} is described twice"
                )));
            }
            if regions.is_empty() || regions.len() > MAX_REGIONS_PER_GROUP {
                return Err(Error::invalid(format!(
                    "page group {name:?} needs 1..={MAX_REGIONS_PER_GROUP} regions, got {}",
                    regions.len()
                )));
            }
            let mut page_bytes = 0u64;
            for (j, r) in regions.iter().enumerate() {
                let Some(&size) = buffer_sizes.get(r.buffer) else {
                    return Err(Error::invalid(format!(
                        "region {j} of page group {name:?} names buffer {}, but the layout has \
                         {} buffers",
                        r.buffer,
                        buffer_sizes.len()
                    )));
                };
                if r.length == 0 || r.block_stride < r.length {
                    return Err(Error::invalid(format!(
                        "region {j} of page group {name:?} has length {} and block stride {}: a \
                         region holds at least 1 byte and consecutive blocks' regions must not \
                         overlap (block_stride >= length)",
                        r.length, r.block_stride
                    )));
                }
                // Regions start at offset + b * stride, increasing in b: the
                // last block's region is the one that must still fit.
                let end = r.start(last).and_then(|s| s.checked_add(r.length));
                if end.is_none_or(|e| e > size) {
                    return Err(Error::invalid(format!(
                        "region {j} of page group {name:?} (offset {}, block stride {}, length \
                         {}) leaves buffer {} ({size} bytes) at block {last}",
                        r.offset, r.block_stride, r.length, r.buffer
                    )));
                }
                page_bytes = page_bytes.saturating_add(r.length);
            }
            if page_bytes > MAX_PAGE_BYTES {
                return Err(Error::invalid(format!(
                    "page group {name:?} has {page_bytes}-byte pages; a manifest allows at most \
                     {MAX_PAGE_BYTES}"
                )));
            }
            if out.len() >= MAX_PAGE_GROUPS {
                return Err(Error::invalid(format!(
                    "a region layout holds at most {MAX_PAGE_GROUPS} page groups"
                )));
            }
            by_name.insert(name.clone(), out.len());
            out.push(GroupLayout {
                name: Some(name),
                regions,
                page_bytes,
            });
        }
        if out.is_empty() {
            return Err(Error::invalid(
                "a region layout needs at least one page group",
            ));
        }
        Ok(PageLayout {
            buffer_sizes: buffer_sizes.to_vec(),
            num_blocks,
            groups: out,
            by_name,
            default: None,
            shape: None,
        })
    }

    /// Number of blocks (valid block ids of a job are `1..num_blocks`).
    pub fn num_blocks(&self) -> u64 {
        self.num_blocks
    }

    /// Bytes of every buffer, in buffer order.
    pub fn buffer_sizes(&self) -> &[u64] {
        &self.buffer_sizes
    }

    /// The 2-D pool shape, for a layout built by [`PageLayout::pool`].
    pub fn pool_shape(&self) -> Option<PoolShape> {
        self.shape
    }

    /// Every group, in the order given (the 2-D pool: its default group).
    pub fn groups(&self) -> &[GroupLayout] {
        &self.groups
    }

    /// The index of the group that lays out manifest group `name`: the
    /// group of that name, else the default group (2-D pools), else None.
    pub fn resolve(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied().or(self.default)
    }

    /// The group at `index` (from [`PageLayout::resolve`]).
    pub fn group(&self, index: usize) -> Option<&GroupLayout> {
        self.groups.get(index)
    }
}

/// Whether `bytes` can be the size of one object in this address space.
fn fits_address_space(bytes: u64) -> bool {
    usize::try_from(bytes).is_ok() && bytes <= isize::MAX as u64
}

/// Refuses buffers whose address ranges overlap (or wrap): the overlap rule
/// of a job is checked per buffer, which is sound only for disjoint buffers.
/// `buffers` are `(address, size)`.
pub fn check_disjoint(buffers: &[(u64, u64)]) -> Result<()> {
    let mut ranges = Vec::with_capacity(buffers.len());
    for (i, &(base, size)) in buffers.iter().enumerate() {
        if base == 0 {
            return Err(Error::invalid(format!("buffer {i}'s address is null")));
        }
        let Some(end) = base.checked_add(size) else {
            return Err(Error::invalid(format!(
                "buffer {i} ({size} bytes at {base:#x}) wraps the address space"
            )));
        };
        ranges.push((base, end, i));
    }
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(Error::invalid(format!(
                "buffers {} and {} overlap in memory: pass each KV-cache allocation once and \
                 describe shared bytes with region templates",
                w[0].2, w[1].2
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(buffer: usize, offset: u64, block_stride: u64, length: u64) -> RegionTemplate {
        RegionTemplate {
            buffer,
            offset,
            block_stride,
            length,
        }
    }

    #[test]
    fn the_last_block_of_every_template_must_fit_its_buffer() {
        // 4 blocks of stride 100 from offset 10, 90 bytes: the last region
        // is 310..400, which fits 400 bytes exactly and not 399.
        let g = || vec![("a".to_string(), vec![r(0, 10, 100, 90)])];
        PageLayout::regions(&[400], 4, g()).unwrap();
        let e = PageLayout::regions(&[399], 4, g()).unwrap_err();
        assert!(e.to_string().contains("leaves buffer 0"), "{e}");
        // Overflowing arithmetic is refused, not wrapped.
        let huge = vec![("a".to_string(), vec![r(0, u64::MAX - 5, u64::MAX / 2, 1)])];
        assert!(PageLayout::regions(&[u64::MAX / 4], 4, huge).is_err());
    }

    #[test]
    fn groups_sum_their_regions_and_resolve_by_name_only() {
        let l = PageLayout::regions(
            &[1000, 1000],
            5,
            vec![
                (
                    "kv".to_string(),
                    vec![r(0, 0, 200, 100), r(0, 100, 200, 100)],
                ),
                ("ssm".to_string(), vec![r(1, 0, 200, 150)]),
            ],
        )
        .unwrap();
        let kv = l.group(l.resolve("kv").unwrap()).unwrap();
        assert_eq!(kv.page_bytes(), 200);
        assert_eq!(
            kv.regions_at(3).collect::<Vec<_>>(),
            vec![(0, 600, 100), (0, 700, 100)]
        );
        assert_eq!(l.resolve("other"), None);
        assert_eq!(l.pool_shape(), None);
    }

    #[test]
    fn a_pool_serves_every_group_name_with_one_row() {
        let shape = PoolShape {
            num_blocks: 8,
            page_bytes: 64,
        };
        let l = PageLayout::pool(shape).unwrap();
        let g = l.group(l.resolve("anything").unwrap()).unwrap();
        assert_eq!(g.regions_at(5).collect::<Vec<_>>(), vec![(0, 320, 64)]);
        assert_eq!(l.buffer_sizes(), &[512]);
        assert_eq!(l.pool_shape(), Some(shape));
    }

    #[test]
    fn bad_templates_are_refused() {
        let cases: Vec<(Vec<RegionTemplate>, &str)> = vec![
            (vec![], "regions"),
            (vec![r(2, 0, 10, 10)], "names buffer 2"),
            (vec![r(0, 0, 10, 0)], "at least 1 byte"),
            (vec![r(0, 0, 5, 10)], "block_stride >= length"),
        ];
        for (regions, needle) in cases {
            let e = PageLayout::regions(&[1000, 1000], 4, vec![("g".to_string(), regions)])
                .unwrap_err();
            assert!(e.to_string().contains(needle), "{needle}: {e}");
        }
        let twice = vec![
            ("g".to_string(), vec![r(0, 0, 10, 10)]),
            ("g".to_string(), vec![r(1, 0, 10, 10)]),
        ];
        assert!(PageLayout::regions(&[1000, 1000], 4, twice).is_err());
        assert!(PageLayout::regions(&[1000], 1, vec![("g".into(), vec![r(0, 0, 1, 1)])]).is_err());
        assert!(PageLayout::regions(&[], 4, vec![("g".into(), vec![r(0, 0, 1, 1)])]).is_err());
        assert!(PageLayout::regions(&[0], 4, vec![("g".into(), vec![r(0, 0, 1, 1)])]).is_err());
        assert!(PageLayout::regions(&[1000], 4, Vec::new()).is_err());
    }

    #[test]
    fn overlapping_or_null_buffers_are_refused() {
        check_disjoint(&[(0x1000, 0x100), (0x1100, 0x100)]).unwrap();
        assert!(check_disjoint(&[(0x1000, 0x101), (0x1100, 0x100)]).is_err());
        assert!(check_disjoint(&[(0x2000, 0x10), (0x1000, 0x1001)]).is_err());
        assert!(check_disjoint(&[(0, 1)]).is_err());
        assert!(check_disjoint(&[(u64::MAX, 2)]).is_err());
    }
}
