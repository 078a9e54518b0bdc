//! The compute a restored prefix saves, and the eviction policies that use
//! it: the one cost model of lmcache-rc.
//!
//! **The model.** Prefilling `n` tokens of a hybrid model costs
//!
//! ```text
//! prefill_flops(n) = linear · n + quadratic · n²
//!   linear    = 2 · active_params                       (every matmul, once per token)
//!   quadratic = 2 · attention_layers · q_heads · head_dim (causal QKᵀ and AV:
//!               n²/2 query-key pairs, 2·d FLOPs each for both products)
//! ```
//!
//! Restoring a checkpoint of `n` tokens for a prompt of `p ≥ n` tokens
//! leaves the `p − n` new tokens to compute, attending to all `p`: the
//! work saved is exactly `prefill_flops(n)` (`p² − (p² − n²)` for the
//! quadratic part). Recurrent layers cost a constant per token whatever the
//! context, so they are in the linear term (their parameters are counted
//! in `active_params`); their scan's own arithmetic is left out (small
//! beside the projections). The shapes ([`SHAPES`]) also give the bytes a
//! checkpoint holds — KV bytes per token of the attention layers and the
//! recurrent state, a constant per checkpoint — which the trace benchmark
//! (`lmcache_rc/trace.py`) uses to size its pages. The sidecar needs no
//! shape of the served model: it measures bytes itself, and its policy only
//! compares generations, for which the default shape's ratio of quadratic
//! to linear cost is what counts.
//!
//! **The policies** ([`Eviction`], the sidecar's `eviction` setting):
//! - `lru`: every tier evicts its least recently used pages (the behaviour
//!   of every earlier release, and the default);
//! - `cost`: a generation's *utility* is its recency blended with the
//!   compute it saves per byte it alone holds ([`utility`]); pages go in
//!   order of the highest utility among the generations naming them, so
//!   the pages of the least useful generation go first, and a page another
//!   kept generation names is never taken before that generation's own
//!   (`docs/design/leases.md#eviction`).
//!
//! Pure arithmetic: no I/O, no clock, no state.

use crate::error::{Error, Result};

/// A model shape: what a prefix costs to compute and to keep.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelShape {
    /// The shape's name (`lmcache-rc trace --shape`).
    pub name: &'static str,
    /// What it is modelled on, for people.
    pub description: &'static str,
    /// Parameters active per token (all layers; the MoE experts a token uses).
    pub active_params: f64,
    /// Full-attention layers (the quadratic term).
    pub attention_layers: u32,
    /// Recurrent (linear-attention, Mamba, GDN) layers.
    pub recurrent_layers: u32,
    /// Query heads of an attention layer.
    pub q_heads: u32,
    /// Dimension of an attention head.
    pub head_dim: u32,
    /// Bytes of KV cache one token takes, over all attention layers.
    pub kv_bytes_per_token: u64,
    /// Bytes of recurrent state one checkpoint holds, over all recurrent
    /// layers (whatever its length).
    pub state_bytes: u64,
}

impl ModelShape {
    /// FLOPs per token of the linear term (`2 · active_params`).
    pub fn linear(&self) -> f64 {
        2.0 * self.active_params
    }

    /// FLOPs per token² of the quadratic term
    /// (`2 · attention_layers · q_heads · head_dim`).
    pub fn quadratic(&self) -> f64 {
        2.0 * f64::from(self.attention_layers) * f64::from(self.q_heads) * f64::from(self.head_dim)
    }

    /// FLOPs to prefill `tokens` tokens from nothing: the compute a restore
    /// of a `tokens`-token checkpoint saves.
    pub fn prefill_flops(&self, tokens: u64) -> f64 {
        let n = tokens as f64;
        self.linear() * n + self.quadratic() * n * n
    }

    /// Bytes a checkpoint of `tokens` tokens holds at full size.
    pub fn checkpoint_bytes(&self, tokens: u64) -> u64 {
        self.state_bytes
            .saturating_add(self.kv_bytes_per_token.saturating_mul(tokens))
    }
}

/// The shape modelled on Qwen3-Next-80B-A3B: 48 layers, one full-attention
/// layer (16 query heads, 2 KV heads, head dimension 256) per three gated
/// DeltaNet layers (32 value heads of 128 × 128 state each, bf16), about 3 B
/// parameters active per token. The quadratic term matches the linear one
/// at about 61 000 tokens; the recurrent state (≈ 37 MiB) is the KV cache of
/// ≈ 1 600 tokens.
pub const QWEN3_NEXT_80B_A3B: ModelShape = ModelShape {
    name: "qwen3-next-80b-a3b",
    description: "hybrid, 1 attention : 3 gated-DeltaNet layers (48), ~3B active; \
                  modelled on Qwen3-Next-80B-A3B",
    active_params: 3.0e9,
    attention_layers: 12,
    recurrent_layers: 36,
    q_heads: 16,
    head_dim: 256,
    // 12 layers × (K + V) × 2 KV heads × 256 × 2 bytes.
    kv_bytes_per_token: 12 * 2 * 2 * 256 * 2,
    // 36 layers × (32 heads × 128 × 128 state + 3 × 8192 conv) × 2 bytes.
    state_bytes: 36 * (32 * 128 * 128 + 3 * 8192) * 2,
};

/// The shape modelled on Nemotron-H-8B: 52 layers, 4 of them full attention
/// (32 query heads, 8 KV heads, head dimension 128) and 24 Mamba-2 layers
/// (128 heads of 64 × 128 state, bf16) beside MLPs, 8 B parameters (dense).
/// Attention is a small share here: the quadratic term matches the linear
/// one only at about 500 000 tokens.
pub const NEMOTRON_H_8B: ModelShape = ModelShape {
    name: "nemotron-h-8b",
    description: "hybrid, 4 attention + 24 Mamba-2 layers (52 with MLPs), 8B dense; \
                  modelled on Nemotron-H-8B",
    active_params: 8.0e9,
    attention_layers: 4,
    recurrent_layers: 24,
    q_heads: 32,
    head_dim: 128,
    // 4 layers × (K + V) × 8 KV heads × 128 × 2 bytes.
    kv_bytes_per_token: 4 * 2 * 8 * 128 * 2,
    // 24 layers × (128 heads × 64 × 128 state + 3 × 10240 conv) × 2 bytes.
    state_bytes: 24 * (128 * 64 * 128 + 3 * 10240) * 2,
};

/// Every named shape; the first is the default ([`DEFAULT_SHAPE`]).
pub const SHAPES: &[ModelShape] = &[QWEN3_NEXT_80B_A3B, NEMOTRON_H_8B];

/// The shape the sidecar's `cost` policy weighs generations with, and the
/// trace benchmark's default.
pub const DEFAULT_SHAPE: ModelShape = QWEN3_NEXT_80B_A3B;

/// The shape named `name`; an unknown name is `InvalidInput` listing them.
pub fn shape(name: &str) -> Result<ModelShape> {
    SHAPES
        .iter()
        .find(|s| s.name == name)
        .copied()
        .ok_or_else(|| {
            let names: Vec<&str> = SHAPES.iter().map(|s| s.name).collect();
            Error::invalid(format!(
                "unknown model shape {name:?}; the shapes are {}",
                names.join(", ")
            ))
        })
}

/// How the sidecar picks what to evict (setting `eviction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Eviction {
    /// Least recently used pages first (the default).
    #[default]
    Lru,
    /// Lowest utility first ([`utility`]).
    Cost,
}

impl Eviction {
    /// Every policy, by name.
    pub const ALL: [Eviction; 2] = [Eviction::Lru, Eviction::Cost];

    /// The policy's name (`lru`, `cost`).
    pub fn as_str(self) -> &'static str {
        match self {
            Eviction::Lru => "lru",
            Eviction::Cost => "cost",
        }
    }

    /// The policy named `name` (`lru` or `cost`, any case).
    pub fn parse(name: &str) -> Result<Eviction> {
        Eviction::ALL
            .into_iter()
            .find(|e| e.as_str().eq_ignore_ascii_case(name.trim()))
            .ok_or_else(|| Error::invalid(format!("expected lru or cost, got {name:?}")))
    }
}

impl std::fmt::Display for Eviction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The weight of compute per byte against recency in [`utility`] (Marconi's
/// α). At 1 the two count alike: the most recently used generation beats
/// the most efficient one of the same age, and an old generation is kept
/// over a new one only when its efficiency is higher by more than their
/// difference in recency (both measured on `[0, 1]` over the generations
/// compared).
pub const ALPHA: f64 = 1.0;

/// Bytes below which a generation's own bytes count as this much (a
/// generation whose every page is shared holds nothing alone; its
/// efficiency is capped, not infinite).
pub const MIN_BYTES: u64 = 4096;

/// The compute a generation of `tokens` tokens saves per byte it alone holds
/// (`exclusive_bytes`, at least [`MIN_BYTES`]), under [`DEFAULT_SHAPE`]; its
/// natural logarithm, so that efficiencies spread over orders of magnitude
/// compare by ratio.
pub fn log_efficiency(tokens: u64, exclusive_bytes: u64) -> f64 {
    let saved = DEFAULT_SHAPE.prefill_flops(tokens.max(1));
    (saved / exclusive_bytes.max(MIN_BYTES) as f64).ln()
}

/// Min-max normalisation of a set of values onto `[0, 1]`.
#[derive(Debug, Clone, Copy)]
pub struct Range {
    lo: f64,
    hi: f64,
}

impl Range {
    /// The range of `values` (empty: `[0, 0]`).
    pub fn of(values: impl IntoIterator<Item = f64>) -> Range {
        let mut r = Range {
            lo: f64::INFINITY,
            hi: f64::NEG_INFINITY,
        };
        for v in values {
            r.lo = r.lo.min(v);
            r.hi = r.hi.max(v);
        }
        if r.lo > r.hi {
            r = Range { lo: 0.0, hi: 0.0 };
        }
        r
    }

    /// `value` on `[0, 1]` (1 when the range is one point).
    pub fn normalise(&self, value: f64) -> f64 {
        if self.hi > self.lo {
            ((value - self.lo) / (self.hi - self.lo)).clamp(0.0, 1.0)
        } else {
            1.0
        }
    }
}

/// A generation's utility under `cost` (Marconi's, MLSys 2025): its
/// recency and its compute saved per byte it alone holds
/// ([`log_efficiency`]), each normalised over the generations compared,
/// `recency + ALPHA · efficiency`. The lowest goes first.
pub fn utility(recency: f64, log_eff: f64, recencies: &Range, efficiencies: &Range) -> f64 {
    recencies.normalise(recency) + ALPHA * efficiencies.normalise(log_eff)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_grows_faster_than_linearly_and_matches_the_stated_crossover() {
        let s = DEFAULT_SHAPE;
        assert!(s.prefill_flops(20_000) > 100.0 * s.prefill_flops(200));
        let crossover = s.linear() / s.quadratic();
        assert!((60_000.0..62_000.0).contains(&crossover), "{crossover}");
        assert_eq!(s.prefill_flops(0), 0.0);
        let n = NEMOTRON_H_8B.linear() / NEMOTRON_H_8B.quadratic();
        assert!((480_000.0..500_000.0).contains(&n), "{n}");
        // The state is the KV of about 1600 tokens.
        let t = s.state_bytes / s.kv_bytes_per_token;
        assert!((1500..1700).contains(&t), "{t}");
    }

    #[test]
    fn names_parse_and_unknown_ones_are_refused() {
        assert_eq!(Eviction::parse("lru").unwrap(), Eviction::Lru);
        assert_eq!(Eviction::parse(" COST ").unwrap(), Eviction::Cost);
        assert_eq!(Eviction::default(), Eviction::Lru);
        let e = Eviction::parse("lfu").unwrap_err().to_string();
        assert!(e.contains("lru or cost"), "{e}");
        assert_eq!(shape("nemotron-h-8b").unwrap(), NEMOTRON_H_8B);
        let e = shape("gpt").unwrap_err().to_string();
        assert!(e.contains("qwen3-next-80b-a3b"), "{e}");
    }

    #[test]
    fn a_long_checkpoint_is_worth_more_per_byte_than_a_short_one() {
        let s = DEFAULT_SHAPE;
        let long = log_efficiency(20_000, s.checkpoint_bytes(20_000));
        let short = log_efficiency(200, s.checkpoint_bytes(200));
        assert!(long > short);
        let r = Range::of([long, short]);
        assert_eq!(r.normalise(long), 1.0);
        assert_eq!(r.normalise(short), 0.0);
        assert_eq!(Range::of([]).normalise(3.0), 1.0);
        let ticks = Range::of([1.0, 2.0]);
        // Equally recent, the long one wins; the short one wins only when
        // newer by more than the efficiency gap (ALPHA = 1: never here).
        assert!(utility(2.0, long, &ticks, &r) > utility(2.0, short, &ticks, &r));
        assert!(utility(1.0, long, &ticks, &r) >= utility(2.0, short, &ticks, &r));
    }
}
