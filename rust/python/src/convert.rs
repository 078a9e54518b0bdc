//! Conversions from Python values to core types (tokens, identity values).
//!
//! Conversions never panic and never silently coerce: a value the format
//! cannot carry becomes a typed error (or an invalid token that the core's
//! validation rejects with the reference message, in the reference order).

use lmcache_rc_core::json::{self, Value};
use numpy::{PyArray1, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyMapping, PyString, PyTuple};

use crate::errors::{invalid, invalid_type};

/// A token value that the core rejects as outside the wire limits.
const INVALID_TOKEN: u32 = u32::MAX;

/// Maps one Python token to `u32`, or [`INVALID_TOKEN`] for anything that is
/// not an exact non-negative integer below 2^32 (bools and floats included).
fn token_of(item: &Bound<'_, PyAny>) -> u32 {
    if item.is_instance_of::<PyBool>() || item.is_instance_of::<PyFloat>() {
        return INVALID_TOKEN;
    }
    match item.extract::<i64>() {
        Ok(v) => u32::try_from(v).unwrap_or(INVALID_TOKEN),
        Err(_) => INVALID_TOKEN,
    }
}

/// An integer numpy element that maps to a token id; values outside
/// `[0, 2^32)` map to [`INVALID_TOKEN`] (the core then rejects them). Written as
/// plain casts and selects so the conversion loop vectorises.
trait TokenElement: numpy::Element + Copy {
    fn token(self) -> u32;
}

impl TokenElement for u32 {
    fn token(self) -> u32 {
        self
    }
}
impl TokenElement for i32 {
    // Negative values wrap to >= 2^31, which the core rejects.
    fn token(self) -> u32 {
        self as u32
    }
}
impl TokenElement for i64 {
    fn token(self) -> u32 {
        if (self as u64) >> 32 == 0 {
            self as u32
        } else {
            INVALID_TOKEN
        }
    }
}
impl TokenElement for u64 {
    fn token(self) -> u32 {
        if self >> 32 == 0 {
            self as u32
        } else {
            INVALID_TOKEN
        }
    }
}
impl TokenElement for i16 {
    fn token(self) -> u32 {
        i32::from(self) as u32
    }
}
impl TokenElement for u16 {
    fn token(self) -> u32 {
        u32::from(self)
    }
}
impl TokenElement for i8 {
    fn token(self) -> u32 {
        i32::from(self) as u32
    }
}
impl TokenElement for u8 {
    fn token(self) -> u32 {
        u32::from(self)
    }
}

fn tokens_from_array<T: TokenElement>(array: &Bound<'_, PyUntypedArray>) -> Option<Vec<u32>> {
    let typed = array.cast::<PyArray1<T>>().ok()?;
    let readonly = typed.readonly();
    Some(match readonly.as_slice() {
        // Contiguous: read the buffer in place (one pass, no Python objects).
        Ok(slice) => slice.iter().map(|&v| v.token()).collect(),
        Err(_) => readonly.as_array().iter().map(|&v| v.token()).collect(),
    })
}

/// Reads a token sequence: a 1-D numpy integer array (read in place, no
/// Python objects created) or any sequence of Python ints.
pub fn tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if let Ok(array) = obj.cast::<PyUntypedArray>() {
        if array.ndim() != 1 {
            return Err(invalid(format!(
                "token arrays must be 1-D, got {} dimensions",
                array.ndim()
            )));
        }
        let converted = tokens_from_array::<i64>(array)
            .or_else(|| tokens_from_array::<i32>(array))
            .or_else(|| tokens_from_array::<u32>(array))
            .or_else(|| tokens_from_array::<u64>(array))
            .or_else(|| tokens_from_array::<i16>(array))
            .or_else(|| tokens_from_array::<u16>(array))
            .or_else(|| tokens_from_array::<i8>(array))
            .or_else(|| tokens_from_array::<u8>(array));
        return converted.ok_or_else(|| {
            invalid(format!(
                "checkpoint token tail exceeds the wire limits (token arrays must have an \
                 integer dtype, got {})",
                array.dtype()
            ))
        });
    }
    if obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<pyo3::types::PyBytes>()
        || obj.is_instance_of::<pyo3::types::PyByteArray>()
    {
        return Err(invalid_type(
            "tokens must be a sequence of integers, not text",
        ));
    }
    if let Ok(list) = obj.cast::<PyList>() {
        return Ok(list.iter().map(|t| token_of(&t)).collect());
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return Ok(tuple.iter().map(|t| token_of(&t)).collect());
    }
    let iter = obj.try_iter().map_err(|_| {
        invalid_type("tokens must be a sequence of integers or a 1-D integer array")
    })?;
    iter.map(|t| t.map(|t| token_of(&t))).collect()
}

/// Reads a non-negative count/boundary argument; out-of-range values map to
/// `u64::MAX` or 0 so that the core reports them with its own message.
pub fn boundary(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    let is_integer = obj.is_instance_of::<PyInt>() || obj.hasattr("__index__")?;
    if obj.is_instance_of::<PyBool>() || obj.is_instance_of::<PyFloat>() || !is_integer {
        return Err(invalid_type(format!(
            "a token count must be an int, got {}",
            obj.get_type().name()?
        )));
    }
    let negative = obj.lt(0i64)?;
    Ok(match obj.extract::<i64>() {
        Ok(v) if v < 0 => 0,
        Ok(v) => v as u64,
        Err(_) if negative => 0,
        Err(_) => u64::MAX,
    })
}

/// Deepest nesting accepted in an identity value.
const MAX_DEPTH: usize = 64;

/// Converts a JSON-like Python value of the restricted identity domain.
pub fn identity_value(obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    value_at(obj, 0)
}

fn value_at(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
    if depth > MAX_DEPTH {
        return Err(invalid(format!(
            "checkpoint identity nests deeper than {MAX_DEPTH} levels"
        )));
    }
    if obj.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        return match obj.extract::<i64>() {
            Ok(i) => Ok(Value::Int(i)),
            Err(_) => Err(invalid(json::number_refused(&obj.str()?.to_string_lossy()))),
        };
    }
    if obj.is_instance_of::<PyFloat>() {
        return Err(invalid(json::number_refused(
            &obj.repr()?.to_string_lossy(),
        )));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Value::Str(text(s)?));
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let items = obj
            .try_iter()?
            .map(|item| value_at(&item?, depth + 1))
            .collect::<PyResult<Vec<_>>>()?;
        return Ok(Value::List(items));
    }
    if obj.is_instance_of::<PyDict>() || obj.is_instance_of::<PyMapping>() {
        let mapping = obj.cast::<PyMapping>()?;
        let mut out = std::collections::BTreeMap::new();
        for item in mapping.items()?.iter() {
            let (key, value): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
            let Ok(key) = key.cast::<PyString>() else {
                return Err(invalid_type(format!(
                    "checkpoint identity keys must be strings, got {}",
                    key.get_type().name()?
                )));
            };
            out.insert(text(key)?, value_at(&value, depth + 1)?);
        }
        return Ok(Value::Object(out));
    }
    Err(invalid_type(format!(
        "Object of type {} is not JSON serializable (identity values may be str, bool, None, \
         int, list, tuple or a mapping with str keys)",
        obj.get_type().name()?
    )))
}

/// A Python string as UTF-8, refusing lone surrogates with a typed error.
fn text(s: &Bound<'_, PyString>) -> PyResult<String> {
    s.to_str().map(str::to_owned).map_err(|_| {
        invalid("checkpoint identity strings must be valid Unicode (no lone surrogates)")
    })
}

/// Converts a JSON value of the identity domain back to Python (`dict`,
/// `list`, `str`, `int`, `bool`, `None`).
pub fn value_to_py<'py>(py: Python<'py>, value: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Int(i) => i.into_pyobject(py)?.into_any(),
        Value::Str(s) => PyString::new(py, s).into_any(),
        Value::List(items) => {
            let out = PyList::empty(py);
            for item in items {
                out.append(value_to_py(py, item)?)?;
            }
            out.into_any()
        }
        Value::Object(map) => {
            let out = PyDict::new(py);
            for (k, v) in map {
                out.set_item(k, value_to_py(py, v)?)?;
            }
            out.into_any()
        }
    })
}

/// Reads an exact non-negative integer (no bools, no floats) below 2^64.
pub fn exact_u64(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    if obj.is_instance_of::<PyBool>() || !obj.is_instance_of::<PyInt>() {
        return Err(invalid_type(format!(
            "{what} must be an int, got {}",
            obj.get_type().name()?
        )));
    }
    obj.extract::<u64>().map_err(|_| {
        invalid(format!(
            "{what} must be a non-negative integer below 2**64, got {}",
            obj.str().map(|s| s.to_string()).unwrap_or_default()
        ))
    })
}
