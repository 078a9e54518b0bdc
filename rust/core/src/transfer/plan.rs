//! Validation of a transfer before the first byte moves
//! (`docs/design/transfers.md#1-check-before-any-lease`,
//! `docs/design/transfers.md#4-validate-the-lease-planplan_copy`).
//!
//! A job is checked twice. [`check_job`] runs before any lease is requested:
//! the manifest's page groups against the job's block ids and the bound page
//! layout (group names, widths, counts, bounds, block 0, distinct ids, no two
//! pages sharing bytes). [`plan_copy`] runs when the sidecar lends slots: the
//! lease against the mapped pool (pool identity and size, slot counts,
//! widths, bounds, no overlap). Only a plan that passed both reaches a copy
//! backend, so a malformed lease can never make a backend touch memory
//! outside the slots it was lent.

use std::collections::HashSet;

use crate::error::{Error, Result};
use crate::manifest::PayloadSchema;
use crate::protocol::{Capabilities, Lease, LeaseStatus};
use crate::store::shm::ShmPool;

use super::layout::PageLayout;

/// Which way a job copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Page pool → shared memory (then the sidecar commits the pages).
    Store,
    /// Shared memory → page pool.
    Retrieve,
}

impl Direction {
    /// `"STORE"` or `"RETRIEVE"` (the names the connector uses).
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Store => "STORE",
            Direction::Retrieve => "RETRIEVE",
        }
    }

    /// Parses `"STORE"` / `"RETRIEVE"` (case-insensitive).
    pub fn parse(text: &str) -> Result<Direction> {
        if text.eq_ignore_ascii_case("store") {
            Ok(Direction::Store)
        } else if text.eq_ignore_ascii_case("retrieve") {
            Ok(Direction::Retrieve)
        } else {
            Err(Error::invalid(format!(
                "transfer direction must be \"STORE\" or \"RETRIEVE\", got {text:?}"
            )))
        }
    }
}

/// One page to move: a page of one group at one block, and its
/// shared-memory slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageCopy {
    /// The page's group in the bound layout ([`PageLayout::resolve`]).
    pub group: usize,
    /// The physical block (never 0).
    pub block: u64,
    /// Byte offset of the slot in the shared-memory pool.
    pub shm_offset: u64,
    /// Bytes of the page (the group's page width).
    pub page_bytes: u64,
}

/// A validated copy: every page lies inside the bound memory and the
/// shared memory, no two slots overlap, no two pages share bound bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyPlan {
    /// Which way the bytes move.
    pub direction: Direction,
    /// Pages to copy, in manifest group/page order.
    pub pages: Vec<PageCopy>,
    /// Pages not copied: store pages already resident in the sidecar, and
    /// retrieve pages the worker already holds (block [`SKIP`]).
    pub skipped: usize,
}

impl CopyPlan {
    /// Bytes this plan moves.
    pub fn bytes(&self) -> u64 {
        self.pages.iter().map(|p| p.page_bytes).sum()
    }
}

/// Checks a job's block ids against its manifest and the bound layout
/// (`docs/design/transfers.md#1-check-before-any-lease`), before any lease is
/// requested, and returns the layout group of every manifest group (in manifest
/// order).
///
/// A RETRIEVE may name block 0 for a page the worker already holds (vLLM's
/// local prefix hit): that page is leased like the others but not copied.
///
/// Refused: a group count or position count that differs from the block
/// ids; a manifest group the layout has no template for; a page width other
/// than the template's; a block id outside `1..num_blocks` (0 is the null
/// block; on a retrieve it means "skip"); a block id used twice; a retrieve
/// that skips every page; and any two pages of the job whose bytes
/// in the bound memory overlap. The last rule is the real safety rule (a
/// retrieve must never write one byte twice, and a store that reads one byte
/// into two pages names the wrong blocks); with a 2-D pool it follows from
/// distinct ids, with region layouts it must be computed.
pub fn check_job(
    direction: Direction,
    schema: &PayloadSchema,
    block_ids: &[Vec<u64>],
    layout: &PageLayout,
) -> Result<Vec<usize>> {
    let groups = &schema.page_groups;
    if groups.len() != block_ids.len() {
        return Err(Error::invalid(format!(
            "the manifest has {} page groups but the job lists block ids for {}",
            groups.len(),
            block_ids.len()
        )));
    }
    let num_blocks = layout.num_blocks();
    let mut seen = HashSet::new();
    let mut resolved = Vec::with_capacity(groups.len());
    let mut copied = 0usize;
    for (group, ids) in groups.iter().zip(block_ids) {
        let Some((index, template)) = layout
            .resolve(&group.name)
            .and_then(|i| layout.group(i).map(|t| (i, t)))
        else {
            return Err(Error::invalid(format!(
                "page group {:?} is not in this worker's page layout (it lays out {})",
                group.name,
                group_names(layout)
            )));
        };
        if group.page_bytes != template.page_bytes() {
            let what = if layout.pool_shape().is_some() {
                "the page pool's rows are"
            } else {
                "this worker's regions of that group are"
            };
            return Err(Error::invalid(format!(
                "page group {:?} has {}-byte pages but {what} {} bytes wide",
                group.name,
                group.page_bytes,
                template.page_bytes()
            )));
        }
        if group.positions.len() != ids.len() {
            return Err(Error::invalid(format!(
                "page group {:?} has {} positions but the job lists {} block ids for it",
                group.name,
                group.positions.len(),
                ids.len()
            )));
        }
        for &id in ids {
            if id == SKIP && direction == Direction::Retrieve {
                continue; // already in place on this worker: leased, not copied
            }
            copied += 1;
            if id == 0 || id >= num_blocks {
                return Err(Error::invalid(format!(
                    "block id {id} of page group {:?} is outside 1..{num_blocks} (block 0 is the \
                     null page)",
                    group.name
                )));
            }
            if !seen.insert(id) {
                return Err(Error::invalid(format!(
                    "block id {id} appears twice: page groups must own distinct physical pages"
                )));
            }
        }
        resolved.push(index);
    }
    if copied == 0 {
        return Err(Error::invalid(
            "the job copies no page: every block id of the retrieve is 0 (skip)",
        ));
    }
    check_no_overlap(schema, block_ids, layout, &resolved)?;
    Ok(resolved)
}

/// The block id a RETRIEVE job gives a page it must not copy.
pub const SKIP: u64 = 0;

/// The first names of a layout's groups, for messages.
fn group_names(layout: &PageLayout) -> String {
    const SHOWN: usize = 16;
    let names: Vec<String> = layout
        .groups()
        .iter()
        .filter_map(|g| g.name())
        .take(SHOWN)
        .map(|n| format!("{n:?}"))
        .collect();
    let more = layout.groups().len().saturating_sub(SHOWN);
    if more > 0 {
        format!("{} and {more} more", names.join(", "))
    } else {
        names.join(", ")
    }
}

/// Refuses a job two of whose pages share bytes of the bound memory: the
/// job's actual regions, sorted by (buffer, start), must not overlap.
/// Buffers are disjoint (checked when the backend was built), so comparing
/// within each buffer covers all memory.
fn check_no_overlap(
    schema: &PayloadSchema,
    block_ids: &[Vec<u64>],
    layout: &PageLayout,
    resolved: &[usize],
) -> Result<()> {
    // (buffer, start, end, manifest group, block)
    let mut regions: Vec<(usize, u64, u64, usize, u64)> = Vec::new();
    for (g, (ids, &index)) in block_ids.iter().zip(resolved).enumerate() {
        let Some(template) = layout.group(index) else {
            continue; // resolved by check_job from this layout
        };
        for &block in ids.iter().filter(|&&b| b != SKIP) {
            for (buffer, start, len) in template.regions_at(block) {
                regions.push((buffer, start, start.saturating_add(len), g, block));
            }
        }
    }
    regions.sort_unstable();
    for w in regions.windows(2) {
        let ((buf_a, _, end_a, g_a, b_a), (buf_b, start_b, _, g_b, b_b)) = (w[0], w[1]);
        if buf_a == buf_b && start_b < end_a {
            let name = |g: usize| schema.page_groups.get(g).map_or("?", |p| p.name.as_str());
            return Err(Error::invalid(format!(
                "the job's pages overlap in this worker's memory: block {b_a} of page group {:?} \
                 and block {b_b} of page group {:?} share bytes of buffer {buf_a}",
                name(g_a),
                name(g_b)
            )));
        }
    }
    Ok(())
}

/// Checks that the sidecar's capabilities describe the mapped pool.
pub fn check_pool(caps: &Capabilities, pool: &ShmPool) -> Result<()> {
    if caps.format_version != 1 {
        return Err(Error::UnsupportedFormat(format!(
            "the sidecar uses slot format version {}; this build reads version 1",
            caps.format_version
        )));
    }
    if caps.pool_id != pool.id() || caps.pool_size != pool.size() {
        return Err(Error::invalid(format!(
            "the lease does not identify this SHM pool/layout: the sidecar names pool {:?} of \
             {} bytes, the worker mapped {:?} of {} bytes",
            caps.pool_id,
            caps.pool_size,
            pool.id(),
            pool.size()
        )));
    }
    Ok(())
}

/// Validates a ready lease against the mapped pool and the job and returns the
/// pages to copy
/// (`docs/design/transfers.md#4-validate-the-lease-planplan_copy`): nothing is
/// copied unless all of it holds.
///
/// `groups` is what [`check_job`] returned for this job (the layout group of
/// every manifest group).
pub fn plan_copy(
    direction: Direction,
    schema: &PayloadSchema,
    block_ids: &[Vec<u64>],
    groups: &[usize],
    lease: &Lease,
    caps: &Capabilities,
    pool: &ShmPool,
) -> Result<CopyPlan> {
    check_pool(caps, pool)?;
    if lease.status != LeaseStatus::Ready {
        return Err(Error::invalid(format!(
            "a {} lease is not ready (status {})",
            direction.as_str(),
            lease.status.as_str()
        )));
    }
    if lease.pool_id.as_deref() != Some(pool.id()) {
        return Err(Error::invalid(format!(
            "the lease does not identify this SHM pool/layout: its slots are in pool {:?}, the \
             worker mapped {:?}",
            lease.pool_id.as_deref().unwrap_or("(none named)"),
            pool.id()
        )));
    }
    let layout_groups = groups;
    let groups = &schema.page_groups;
    if lease.slots.len() != groups.len() {
        return Err(Error::invalid(format!(
            "the lease has {} slot groups but the manifest has {} page groups",
            lease.slots.len(),
            groups.len()
        )));
    }
    if block_ids.len() != groups.len() || layout_groups.len() != groups.len() {
        return Err(Error::invalid(format!(
            "the job lists {} block-id groups and {} layout groups for {} page groups",
            block_ids.len(),
            layout_groups.len(),
            groups.len()
        )));
    }
    let mut pages = Vec::new();
    let mut skipped = 0;
    for (((group, slots), ids), &layout_group) in groups
        .iter()
        .zip(&lease.slots)
        .zip(block_ids)
        .zip(layout_groups)
    {
        if slots.len() != group.positions.len() || slots.len() != ids.len() {
            return Err(Error::invalid(format!(
                "the lease has {} slots for page group {:?}, which has {} positions",
                slots.len(),
                group.name,
                group.positions.len()
            )));
        }
        for (slot, &block) in slots.iter().zip(ids) {
            let Some((offset, length)) = *slot else {
                if direction == Direction::Retrieve {
                    return Err(Error::invalid(
                        "a retrieve lease has a slot without bytes: every page must be lent",
                    ));
                }
                skipped += 1;
                continue;
            };
            let end = offset.checked_add(length);
            if length == 0 || length != group.page_bytes || end.is_none_or(|e| e > pool.size()) {
                return Err(Error::invalid(format!(
                    "slot ({offset}, {length}) of page group {:?} has the wrong width or bounds: \
                     pages are {} bytes and the pool holds {} bytes",
                    group.name,
                    group.page_bytes,
                    pool.size()
                )));
            }
            if block == SKIP && direction == Direction::Retrieve {
                skipped += 1; // leased with the rest; the worker's page is in place
                continue;
            }
            pages.push(PageCopy {
                group: layout_group,
                block,
                shm_offset: offset,
                page_bytes: length,
            });
        }
    }
    // (start, end): every end was checked not to overflow above.
    let mut ranges: Vec<(u64, u64)> = pages
        .iter()
        .map(|p| (p.shm_offset, p.shm_offset + p.page_bytes))
        .collect();
    ranges.sort_unstable();
    if ranges.windows(2).any(|w| w[1].0 < w[0].1) {
        return Err(Error::invalid(
            "the lease's slots must not overlap: two pages share shared-memory bytes",
        ));
    }
    Ok(CopyPlan {
        direction,
        pages,
        skipped,
    })
}
