//! Byte sizes as people write them (`4G`, `512M`, `2.5GiB`) and as this crate prints them.

use crate::error::{PlanError, Result};

/// Parses a byte size: a number (decimal point allowed) and an optional unit. `K`, `M`, `G`,
/// `T` and their `KiB`/`MiB`/`GiB`/`TiB` and `KB`/`MB`/`GB`/`TB` spellings are all powers of
/// 1024, as memory sizes are quoted (and as llama.cpp's and ollama's flags read them); `B` or no
/// unit means bytes. Case does not matter; a space may separate number and unit.
///
/// # Errors
/// [`PlanError::BadSize`] for an empty string, a bad number, an unknown unit, a negative or
/// non-finite value, or one beyond `u64`.
///
/// # Examples
/// ```
/// assert_eq!(plan::parse_bytes("4G").unwrap(), 4 << 30);
/// assert_eq!(plan::parse_bytes("2.5GiB").unwrap(), 5 << 29);
/// assert_eq!(plan::parse_bytes("512m").unwrap(), 512 << 20);
/// assert_eq!(plan::parse_bytes("1000").unwrap(), 1000);
/// ```
pub fn parse_bytes(text: &str) -> Result<u64> {
    let bad = |why: &str| PlanError::BadSize { text: text.to_string(), why: why.to_string() };
    let s = text.trim();
    if s.is_empty() {
        return Err(bad("empty"));
    }
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    if number.is_empty() {
        return Err(bad("no number"));
    }
    let value: f64 = number.parse().map_err(|_| bad("not a number"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(bad("unknown unit")),
    };
    let bytes = value * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(bad("too large"));
    }
    Ok(bytes.round() as u64)
}

/// Formats bytes with a binary unit and three significant digits (`3.21 GiB`, `512 MiB`, `17 B`).
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else if value >= 100.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else if value >= 10.0 {
        format!("{value:.1} {}", UNITS[unit])
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_spellings() {
        assert_eq!(parse_bytes("4G").unwrap(), 4 * 1024 * 1024 * 1024);
        assert_eq!(parse_bytes("4 GiB").unwrap(), 4 * 1024 * 1024 * 1024);
        assert_eq!(parse_bytes("4gb").unwrap(), 4 * 1024 * 1024 * 1024);
        assert_eq!(parse_bytes("512M").unwrap(), 512 * 1024 * 1024);
        assert_eq!(parse_bytes("1.5k").unwrap(), 1536);
        assert_eq!(parse_bytes("2.5GiB").unwrap(), 2_684_354_560);
        assert_eq!(parse_bytes("1T").unwrap(), 1_099_511_627_776);
        assert_eq!(parse_bytes("123").unwrap(), 123);
        assert_eq!(parse_bytes("7B").unwrap(), 7);
    }

    #[test]
    fn refuses_bad_sizes() {
        for text in ["", "G", "-4G", "4X", "4.5.6G", "1e3", "99999999999T"] {
            let e = parse_bytes(text).unwrap_err();
            assert_eq!(e.code(), "bad_size", "{text:?}");
        }
    }

    #[test]
    fn formats_with_binary_units() {
        assert_eq!(format_bytes(17), "17 B");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(512 << 20), "512 MiB");
        assert_eq!(format_bytes(3_447_000_000), "3.21 GiB");
        assert_eq!(format_bytes(20 << 30), "20.0 GiB");
    }
}
