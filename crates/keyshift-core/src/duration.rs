//! Durations in the StreamJob's syntax (`30s`, `1h30m`, `500ms`): one parser for every field that
//! takes one, so the API server's CEL rule, the Rust validation, the orchestrator's timeouts and the
//! worker's windows read the same text the same way.

use std::time::Duration;

/// A duration in the CRD's syntax: one or more `<digits><unit>` with unit `ms`, `s`, `m` or `h`
/// (the same language as the CEL rule's regex). `None` when the text is not of that form or the
/// total overflows.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let bytes = text.as_bytes();
    let mut i = 0;
    let mut total = Duration::ZERO;
    if bytes.is_empty() {
        return None;
    }
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        if i == start {
            return None;
        }
        let n: u64 = text[start..i].parse().ok()?;
        let (unit_ms, len) = match (bytes.get(i), bytes.get(i + 1)) {
            (Some(b'm'), Some(b's')) => (1u64, 2),
            (Some(b's'), _) => (1_000, 1),
            (Some(b'm'), _) => (60_000, 1),
            (Some(b'h'), _) => (3_600_000, 1),
            _ => return None,
        };
        i += len;
        total = total.checked_add(Duration::from_millis(n.checked_mul(unit_ms)?))?;
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn malformed_text_is_refused() {
        for text in ["", "s", "10", "1mss", "1d", "-1s", "1.5s", " 1s", "1s "] {
            assert_eq!(parse_duration(text), None, "{text:?}");
        }
        assert_eq!(parse_duration("99999999999999999999h"), None);
    }

    proptest! {
        /// Any sum of terms parses to the sum of their values.
        #[test]
        fn a_sum_of_terms_is_their_total(terms in proptest::collection::vec((0u64..100_000, 0usize..4), 1..6)) {
            let units = [("ms", 1u64), ("s", 1_000), ("m", 60_000), ("h", 3_600_000)];
            let text: String = terms.iter().map(|(n, u)| format!("{n}{}", units[*u].0)).collect();
            let total: u64 = terms.iter().map(|(n, u)| n * units[*u].1).sum();
            prop_assert_eq!(parse_duration(&text), Some(Duration::from_millis(total)));
        }
    }
}
