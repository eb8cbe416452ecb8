//! Wording of the lines people read: counts with the right singular or plural.

/// `n` followed by `noun`, in the plural unless `n` is 1: "1 worker", "2 workers", "0 workers".
/// Regular plurals only (`noun` + "s").
pub fn count(n: u64, noun: &str) -> String {
    format!("{n} {noun}{}", plural(n))
}

/// A list of ids or names as people write it: `3, 4, 7`.
pub fn list<T: std::fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// `noun` in the number of `n`, without the number: "snapshot" for 1, "snapshots" otherwise.
pub fn noun(n: u64, noun: &str) -> String {
    format!("{noun}{}", plural(n))
}

/// The plural ending for a count: "" for 1, "s" otherwise.
pub fn plural(n: u64) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// Bytes in binary units with one decimal: `512 B`, `1.5 KiB`, `979.0 MiB`, `1.2 TiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_in_binary_units() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1024), "1.0 KiB");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(979 << 20), "979.0 MiB");
        assert_eq!(bytes(3 << 40), "3.0 TiB");
        assert_eq!(bytes(5 << 50), "5.0 PiB");
        assert_eq!(bytes(2048 << 50), "2048.0 PiB");
    }

    #[test]
    fn counts_agree_with_their_number() {
        assert_eq!(count(1, "worker"), "1 worker");
        assert_eq!(count(2, "worker"), "2 workers");
        assert_eq!(count(0, "problem"), "0 problems");
        assert_eq!(noun(1, "snapshot"), "snapshot");
        assert_eq!(list(&[3, 4]), "3, 4");
    }
}
