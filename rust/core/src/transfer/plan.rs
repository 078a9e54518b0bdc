//! Validation of a transfer before the first byte moves (spec §6.2, §9.2).
//!
//! A job is checked twice. [`check_job`] runs before any lease is requested:
//! the manifest's page groups against the job's block ids and the bound page
//! pool (widths, counts, bounds, block 0, distinct ids). [`plan_copy`] runs
//! when the sidecar lends slots: the lease against the mapped pool (pool
//! identity and size, slot counts, widths, bounds, no overlap). Only a plan
//! that passed both reaches a copy backend, so a malformed lease can never
//! make a backend touch memory outside the slots it was lent.

use std::collections::HashSet;

use crate::error::{Error, Result};
use crate::manifest::PayloadSchema;
use crate::protocol::{Capabilities, Lease, LeaseStatus};
use crate::store::shm::ShmPool;

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

/// The geometry of a bound page pool: `num_blocks` rows of `page_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolShape {
    /// Number of rows; row 0 is the null page and is never touched.
    pub num_blocks: u64,
    /// Width of every row in bytes.
    pub page_bytes: u64,
}

/// One page to move: a page-pool row and its shared-memory slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageCopy {
    /// Row of the page pool (never 0).
    pub block: u64,
    /// Byte offset of the slot in the shared-memory pool.
    pub shm_offset: u64,
}

/// A validated copy: every page lies inside both pools, no two slots overlap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyPlan {
    /// Which way the bytes move.
    pub direction: Direction,
    /// Bytes of every page (the pool's row width).
    pub page_bytes: u64,
    /// Pages to copy, in manifest group/page order.
    pub pages: Vec<PageCopy>,
    /// Store pages already resident in the sidecar (nothing to copy).
    pub skipped: usize,
}

impl CopyPlan {
    /// Bytes this plan moves.
    pub fn bytes(&self) -> u64 {
        self.pages.len() as u64 * self.page_bytes
    }
}

/// Checks a job's block ids against its manifest and the bound pool
/// (spec §9.2 steps 2–4), before any lease is requested.
pub fn check_job(schema: &PayloadSchema, block_ids: &[Vec<u64>], shape: PoolShape) -> Result<()> {
    let groups = &schema.page_groups;
    if groups.len() != block_ids.len() {
        return Err(Error::invalid(format!(
            "the manifest has {} page groups but the job lists block ids for {}",
            groups.len(),
            block_ids.len()
        )));
    }
    let mut seen = HashSet::new();
    for (group, ids) in groups.iter().zip(block_ids) {
        if group.page_bytes != shape.page_bytes {
            return Err(Error::invalid(format!(
                "page group {:?} has {}-byte pages but the page pool's rows are {} bytes wide",
                group.name, group.page_bytes, shape.page_bytes
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
            if id == 0 || id >= shape.num_blocks {
                return Err(Error::invalid(format!(
                    "block id {id} of page group {:?} is outside 1..{} (block 0 is the null page)",
                    group.name, shape.num_blocks
                )));
            }
            if !seen.insert(id) {
                return Err(Error::invalid(format!(
                    "block id {id} appears twice: page groups must own distinct physical pages"
                )));
            }
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
    let name = caps.shm_name.trim_start_matches('/');
    if name != pool.name() || caps.pool_size != pool.size() {
        return Err(Error::invalid(format!(
            "the lease does not identify this SHM pool/layout: the sidecar names pool {name:?} of \
             {} bytes, the worker mapped {:?} of {} bytes",
            caps.pool_size,
            pool.name(),
            pool.size()
        )));
    }
    Ok(())
}

/// Validates a ready lease against the mapped pool and the job and returns
/// the pages to copy (spec §6.2): nothing is copied unless all of it holds.
pub fn plan_copy(
    direction: Direction,
    schema: &PayloadSchema,
    block_ids: &[Vec<u64>],
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
    let groups = &schema.page_groups;
    if lease.slots.len() != groups.len() {
        return Err(Error::invalid(format!(
            "the lease has {} slot groups but the manifest has {} page groups",
            lease.slots.len(),
            groups.len()
        )));
    }
    let page_bytes = groups.first().map_or(0, |g| g.page_bytes);
    let mut pages = Vec::new();
    let mut skipped = 0;
    for ((group, slots), ids) in groups.iter().zip(&lease.slots).zip(block_ids) {
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
            pages.push(PageCopy {
                block,
                shm_offset: offset,
            });
        }
    }
    let mut ranges: Vec<u64> = pages.iter().map(|p| p.shm_offset).collect();
    ranges.sort_unstable();
    if ranges.windows(2).any(|w| w[1] - w[0] < page_bytes) {
        return Err(Error::invalid(
            "the lease's slots must not overlap: two pages share shared-memory bytes",
        ));
    }
    Ok(CopyPlan {
        direction,
        page_bytes,
        pages,
        skipped,
    })
}
