//! The compute-saved model of `lmcache_rc_core::cost`: its model shapes and
//! `prefill_flops`, for the trace benchmark (`lmcache_rc/trace.py`), and the
//! eviction policies' names.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::to_pyerr;
use lmcache_rc_core::cost::{self, ModelShape};

fn shape_of(name: Option<&str>) -> PyResult<ModelShape> {
    match name {
        None => Ok(cost::DEFAULT_SHAPE),
        Some(name) => cost::shape(name).map_err(to_pyerr),
    }
}

/// Every named model shape as a dict (name, description, active_params,
/// attention_layers, recurrent_layers, q_heads, head_dim,
/// kv_bytes_per_token, state_bytes, linear, quadratic); the first is the
/// default.
#[pyfunction]
pub fn model_shapes(py: Python<'_>) -> PyResult<Vec<Bound<'_, PyDict>>> {
    cost::SHAPES
        .iter()
        .map(|s| {
            let d = PyDict::new(py);
            d.set_item("name", s.name)?;
            d.set_item("description", s.description)?;
            d.set_item("active_params", s.active_params)?;
            d.set_item("attention_layers", s.attention_layers)?;
            d.set_item("recurrent_layers", s.recurrent_layers)?;
            d.set_item("q_heads", s.q_heads)?;
            d.set_item("head_dim", s.head_dim)?;
            d.set_item("kv_bytes_per_token", s.kv_bytes_per_token)?;
            d.set_item("state_bytes", s.state_bytes)?;
            d.set_item("linear", s.linear())?;
            d.set_item("quadratic", s.quadratic())?;
            Ok(d)
        })
        .collect()
}

/// FLOPs to prefill `tokens` tokens with the shape `shape` (default: the
/// sidecar's): what restoring a checkpoint of that many tokens saves. An
/// unknown shape is `InvalidInput`.
#[pyfunction]
#[pyo3(signature = (tokens, shape = None))]
pub fn prefill_flops(tokens: u64, shape: Option<&str>) -> PyResult<f64> {
    Ok(shape_of(shape)?.prefill_flops(tokens))
}

/// The eviction policies' names (`lru` first: the default).
#[pyfunction]
pub fn eviction_policies() -> Vec<&'static str> {
    cost::Eviction::ALL.iter().map(|e| e.as_str()).collect()
}
