//! The stable hash behind the identities keyshift records: the job's fingerprint in snapshots, the
//! pods' spec hash label and the digest of a start request's job. Values are stored in snapshots and
//! labels, so the function never changes.

/// The 64-bit FNV-1a hash of `bytes`, as 16 hex digits.
pub fn fnv(bytes: &[u8]) -> String {
    format!("{:016x}", fnv64(bytes))
}

/// The 64-bit FNV-1a hash of `bytes` ([`fnv`] as a number).
pub fn fnv64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_1a_of_known_inputs() {
        assert_eq!(fnv(b""), "cbf29ce484222325");
        assert_eq!(fnv(b"a"), "af63dc4c8601ec8c");
        assert_eq!(fnv(br#"{"key":"user"}"#), "8eef443076dc45dd");
    }
}
