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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_agree_with_their_number() {
        assert_eq!(count(1, "worker"), "1 worker");
        assert_eq!(count(2, "worker"), "2 workers");
        assert_eq!(count(0, "problem"), "0 problems");
        assert_eq!(noun(1, "snapshot"), "snapshot");
        assert_eq!(list(&[3, 4]), "3, 4");
    }
}
