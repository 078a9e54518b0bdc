//! Canonical JSON text, byte-identical to CPython's `json.dumps`.
//!
//! Identity hashes are computed over JSON text, so the text must be exactly what
//! the reference (CPython `json.dumps(..., sort_keys=True, separators=(",", ":"))`)
//! produces: keys sorted by code point at every depth, no whitespace, and either
//! ASCII escaping (`\uXXXX`, lowercase hex, surrogate pairs above U+FFFF, DEL
//! escaped) or raw UTF-8. Numbers are restricted to integers that fit in `i64`
//! (`docs/design/identity.md#the-restricted-json-domain`), so no hash ever
//! depends on a language's float formatting.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::error::{Error, Result};

/// A JSON value of the restricted identity domain: strings, booleans, null,
/// `i64` integers, lists and string-keyed objects. Objects are kept sorted
/// (`BTreeMap<String, _>` orders by UTF-8 bytes, which equals code-point order).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Value {
    /// `null`
    Null,
    /// `true` / `false`
    Bool(bool),
    /// An integer within `i64`.
    Int(i64),
    /// A Unicode string.
    Str(String),
    /// An array (lists and tuples alike).
    List(Vec<Value>),
    /// An object with string keys.
    Object(BTreeMap<String, Value>),
}

impl Value {
    /// Python truthiness: `""`, `0`, `false`, `null`, `[]` and `{}` are falsy.
    pub fn is_truthy(&self) -> bool {
        match self {
            Value::Null => false,
            Value::Bool(b) => *b,
            Value::Int(i) => *i != 0,
            Value::Str(s) => !s.is_empty(),
            Value::List(l) => !l.is_empty(),
            Value::Object(o) => !o.is_empty(),
        }
    }

    /// Converts a parsed `serde_json` value, refusing floats and integers outside `i64`.
    pub fn from_serde(value: &serde_json::Value) -> Result<Value> {
        Ok(match value {
            serde_json::Value::Null => Value::Null,
            serde_json::Value::Bool(b) => Value::Bool(*b),
            serde_json::Value::Number(n) => match n.as_i64() {
                Some(i) => Value::Int(i),
                None => return Err(Error::invalid(number_refused(&n.to_string()))),
            },
            serde_json::Value::String(s) => Value::Str(s.clone()),
            serde_json::Value::Array(items) => {
                Value::List(items.iter().map(Value::from_serde).collect::<Result<_>>()?)
            }
            serde_json::Value::Object(map) => Value::Object(
                map.iter()
                    .map(|(k, v)| Ok((k.clone(), Value::from_serde(v)?)))
                    .collect::<Result<_>>()?,
            ),
        })
    }

    /// Canonical text with ASCII escaping (the namespace and prefix-digest form).
    pub fn to_canonical_ascii(&self) -> String {
        let mut out = String::new();
        write_value(&mut out, self, true);
        out
    }

    /// Canonical text with non-ASCII characters kept as UTF-8.
    pub fn to_canonical_utf8(&self) -> String {
        let mut out = String::new();
        write_value(&mut out, self, false);
        out
    }
}

/// The message for a refused number (a float or an integer beyond `i64`).
pub fn number_refused(text: &str) -> String {
    format!(
        "checkpoint identity values may not contain the number {text}: only integers within \
         signed 64 bits are allowed (floats and larger integers are refused so that no hash \
         depends on number formatting)"
    )
}

fn write_value(out: &mut String, value: &Value, ascii: bool) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Int(i) => {
            // Writing to a String cannot fail.
            let _ = write!(out, "{i}");
        }
        Value::Str(s) => write_string(out, s, ascii),
        Value::List(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(out, item, ascii);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(out, k, ascii);
                out.push(':');
                write_value(out, v, ascii);
            }
            out.push('}');
        }
    }
}

/// Writes `s` as a JSON string literal the way CPython does.
///
/// `ascii = true` is `ensure_ascii=True` (everything outside printable ASCII
/// escaped, DEL included); `ascii = false` keeps DEL and non-ASCII raw.
pub fn write_string(out: &mut String, s: &str, ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => push_u_escape(out, c as u32),
            c if ascii && (c as u32) >= 0x7f => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    push_u_escape(out, u32::from(*unit));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn push_u_escape(out: &mut String, unit: u32) {
    let _ = write!(out, "\\u{unit:04x}");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(pairs: &[(&str, Value)]) -> Value {
        Value::Object(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        )
    }

    #[test]
    fn keys_sort_by_code_point_and_escape_lowercase() {
        let v = obj(&[
            ("b", Value::Int(1)),
            ("B", Value::Int(2)),
            ("é", Value::Int(4)),
            ("10", Value::Int(7)),
            ("9", Value::Int(8)),
        ]);
        assert_eq!(
            v.to_canonical_ascii(),
            r#"{"10":7,"9":8,"B":2,"b":1,"\u00e9":4}"#
        );
    }

    #[test]
    fn astral_characters_become_surrogate_pairs_only_in_ascii_mode() {
        let v = Value::Str("a🙂\u{7f}\u{1}/".into());
        assert_eq!(v.to_canonical_ascii(), r#""a\ud83d\ude42\u007f\u0001/""#);
        assert_eq!(v.to_canonical_utf8(), "\"a🙂\u{7f}\\u0001/\"");
    }

    #[test]
    fn floats_and_big_integers_are_refused() {
        let parsed: serde_json::Value = serde_json::from_str(r#"{"a":1.0}"#).unwrap();
        assert!(matches!(
            Value::from_serde(&parsed),
            Err(Error::InvalidInput(_))
        ));
        let parsed: serde_json::Value = serde_json::from_str(r#"[18446744073709551615]"#).unwrap();
        assert!(matches!(
            Value::from_serde(&parsed),
            Err(Error::InvalidInput(_))
        ));
    }
}
