//! Read-only views of the service for operators (`lmcache-rc inspect`).

use crate::error::Result;

use super::CheckpointService;

/// One published generation as an operator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenerationInfo {
    /// The generation id.
    pub generation: String,
    /// Tokens the checkpoint covers.
    pub num_tokens: u64,
    /// Ranks that stored it.
    pub world_size: u32,
    /// Payload bytes of all ranks.
    pub payload_bytes: u64,
    /// Whether every object is durable in L2.
    pub durable: bool,
    /// Recency stamp (larger = more recently published or found).
    pub access_order: i64,
}

impl CheckpointService {
    /// Every listed generation, ordered by id (pages through the directory).
    pub fn list_generations(&self) -> Result<Vec<GenerationInfo>> {
        let mut out = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let page = self.directory().list(after.as_deref(), 1024)?;
            out.extend(page.generations.into_iter().map(|g| GenerationInfo {
                generation: g.manifest.generation().to_string(),
                num_tokens: g.manifest.prefix().num_tokens(),
                world_size: g.manifest.world_size(),
                payload_bytes: g.payload_bytes,
                durable: g.durable,
                access_order: g.access_order,
            }));
            match page.next_after {
                Some(next) => after = Some(next),
                None => return Ok(out),
            }
        }
    }
}
