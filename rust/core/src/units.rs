//! Sizes and durations: how settings write them and how messages print them.
//!
//! The ground floor of the crate (it uses only [`crate::error`]): the
//! configuration, the stores and the CLI (through the binding) read and print
//! sizes and durations here, so each has one grammar.
//!
//! - A size ([`parse_size`], [`SIZE_GRAMMAR`]): a whole number of bytes, or
//!   a number with a binary unit (`512`, `4K`, `1.5G`, `2GiB`, `8 gb`).
//! - A duration ([`parse_duration`], [`DURATION_GRAMMAR`]): a number of
//!   seconds, or a number with a unit `ms`, `s`, `m`, `h`, `d` or `w` (`30`,
//!   `2.5`, `30s`, `5m`, `36h`, `1.5d`). Plain numbers are seconds, so every
//!   value written before units were accepted still reads the same.

use std::time::Duration;

use crate::error::{Error, Result};

/// What a size may look like (error messages, `docs/configuration.md`).
pub const SIZE_GRAMMAR: &str = "a size: a whole number of bytes, or a number with a binary unit \
     K/KB/KiB, M/MB/MiB, G/GB/GiB or T/TB/TiB (any case; every unit is a power of 1024)";

/// What a duration may look like (error messages, `docs/configuration.md`).
pub const DURATION_GRAMMAR: &str = "a duration: a number of seconds, or a number with a unit \
     ms, s, m, h, d or w (any case), e.g. 30, 2.5, 30s, 5m, 36h, 1.5d";

/// The longest duration any setting takes (about 31 700 years): beyond it a
/// value is a mistake, and `Duration` arithmetic stays far from overflow.
const MAX_SECONDS: f64 = 1e12;

/// A size: a number of bytes with an optional unit (`512`, `4K`, `1.5G`,
/// `2GiB`, `8 gb`). Every unit is binary (K = KB = KiB = 1024 bytes); a
/// fraction must come out as whole bytes. None for anything else.
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = (&t[..split], t[split..].trim());
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    if number.is_empty() || number.starts_with('.') || number.ends_with('.') {
        return None;
    }
    if let Ok(n) = number.parse::<u64>() {
        return n.checked_mul(1u64 << shift);
    }
    // A fraction: exact in f64 for every size below 2^53 bytes.
    let value: f64 = number.parse().ok()?;
    let bytes = value * (1u64 << shift) as f64;
    (bytes.is_finite() && bytes.fract() == 0.0 && bytes < 9.0e15).then_some(bytes as u64)
}

/// A size for people, in binary units with one decimal: `8.0 GiB`,
/// `512.0 MiB`, `4.0 KiB`; below 1 KiB `100 bytes`. Log lines and messages
/// print sizes this way (the CLI too, through the binding).
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} bytes");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// A duration: a non-negative number of seconds with an optional unit (see
/// [`DURATION_GRAMMAR`]); blanks around the number and unit are ignored.
/// None for anything else (a sign, `nan`, `inf`, an unknown unit, more than
/// 10^12 seconds).
pub fn parse_duration(text: &str) -> Option<Duration> {
    let t = text.trim();
    // The unit is the trailing run of letters; `1e3` keeps its exponent
    // because it ends in a digit.
    let split = t
        .rfind(|c: char| !c.is_ascii_alphabetic())
        .map_or(0, |i| i + 1);
    let (number, unit) = (t[..split].trim_end(), &t[split..]);
    let scale = match unit.to_ascii_lowercase().as_str() {
        "" | "s" => 1.0,
        "ms" => 0.001,
        "m" => 60.0,
        "h" => 3600.0,
        "d" => 86400.0,
        "w" => 604_800.0,
        _ => return None,
    };
    if number.is_empty() || !number.starts_with(|c: char| c.is_ascii_digit() || c == '.') {
        return None;
    }
    let value: f64 = number.parse().ok()?;
    seconds(value * scale).ok()
}

/// A duration from seconds: finite, not negative, at most 10^12 seconds.
pub fn seconds(value: f64) -> Result<Duration> {
    if !(0.0..=MAX_SECONDS).contains(&value) {
        return Err(Error::invalid(format!(
            "expected a non-negative number of seconds, got {value}"
        )));
    }
    Ok(Duration::from_secs_f64(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_with_binary_units_and_print_in_them() {
        for (text, bytes) in [
            ("8G", 8u64 << 30),
            ("512MiB", 512 << 20),
            ("1.5GB", 3 << 29),
            ("2 tib", 2 << 40),
            ("4k", 4096),
            ("100b", 100),
        ] {
            assert_eq!(parse_size(text), Some(bytes), "{text}");
        }
        for text in [
            "banana",
            "",
            "G",
            "1.5",
            "0.1K",
            "-1G",
            "1e3",
            "1.G",
            "8GX",
            "99999999T",
        ] {
            assert_eq!(parse_size(text), None, "{text}");
        }
        assert_eq!(human_size(8 << 30), "8.0 GiB");
        assert_eq!(human_size(1536), "1.5 KiB");
        assert_eq!(human_size(1023), "1023 bytes");
        assert_eq!(human_size(3 << 41), "6.0 TiB");
        assert_eq!(human_size(3 << 51), "6144.0 TiB");
    }

    #[test]
    fn durations_are_seconds_or_a_number_with_a_unit() {
        let d = |s: f64| Some(Duration::from_secs_f64(s));
        for (text, want) in [
            ("30", d(30.0)),
            ("2.5", d(2.5)),
            (".5", d(0.5)),
            ("1e3", d(1000.0)),
            ("0", d(0.0)),
            ("30s", d(30.0)),
            ("250ms", d(0.25)),
            ("5m", d(300.0)),
            ("36h", d(129_600.0)),
            ("1.5d", d(129_600.0)),
            ("2w", d(1_209_600.0)),
            (" 90 M ", d(5400.0)),
            ("7D", d(604_800.0)),
        ] {
            assert_eq!(parse_duration(text), want, "{text}");
        }
        for text in [
            "", "s", "-1", "-1s", "+1", "nan", "inf", "1x", "1 hour", "1h30m", "1e13", "5 5",
        ] {
            assert_eq!(parse_duration(text), None, "{text}");
        }
    }

    #[test]
    fn seconds_must_be_finite_and_not_negative() {
        assert_eq!(seconds(1.5).unwrap(), Duration::from_millis(1500));
        for bad in [-1.0, f64::NAN, f64::INFINITY, 2e12] {
            assert!(seconds(bad).is_err(), "{bad}");
        }
    }
}
