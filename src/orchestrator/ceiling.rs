//! A managed change of the key-group count (spec.maxParallelism): the pure pieces — where the
//! rewritten savepoint goes, whether it may be restored, what status says about undoing the
//! change, and the rewrite's memory settings. The steps themselves are in [`keyshift_core::step`], the
//! decisions in the `decide` module, the I/O in the pass.

use crate::crd::KeyGroupChangeStatus;
use crate::snapshot::Manifest;
use std::path::PathBuf;

/// The memory a rewrite in the orchestrator aims to use when `KEYSHIFT_REWRITE_MEMORY` does not
/// say (its spill files go to local disk; see `offline::rewrite`).
pub const DEFAULT_REWRITE_MEMORY: usize = 256 * 1024 * 1024;

/// Environment variable: the rewrite's memory budget, in bytes or with a `Ki`/`Mi`/`Gi` suffix.
pub const REWRITE_MEMORY_ENV: &str = "KEYSHIFT_REWRITE_MEMORY";
/// Environment variable: the directory a rewrite spills to (the system temp directory if unset).
pub const REWRITE_SPILL_DIR_ENV: &str = "KEYSHIFT_REWRITE_SPILL_DIR";

/// Why a memory setting cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{REWRITE_MEMORY_ENV}={0:?} is not a size: give bytes, or a number with Ki, Mi or Gi (e.g. 512Mi), of at least 1Mi"
)]
pub struct BadMemory(pub String);

/// Parses a memory size (`268435456`, `256Mi`, `1Gi`, `512Ki`). Pure.
pub fn parse_memory(text: &str) -> Result<usize, BadMemory> {
    let t = text.trim();
    let (digits, unit) = match t.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => t.split_at(i),
        None => (t, ""),
    };
    let n: u64 = digits.parse().map_err(|_| BadMemory(text.to_owned()))?;
    let scale: u64 = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        _ => return Err(BadMemory(text.to_owned())),
    };
    let bytes = n
        .checked_mul(scale)
        .filter(|b| *b >= 1 << 20)
        .ok_or_else(|| BadMemory(text.to_owned()))?;
    usize::try_from(bytes).map_err(|_| BadMemory(text.to_owned()))
}

/// The rewrite's memory budget and spill directory, from the environment.
pub fn rewrite_settings() -> Result<(usize, Option<PathBuf>), BadMemory> {
    let memory = match std::env::var(REWRITE_MEMORY_ENV) {
        Ok(v) if !v.trim().is_empty() => parse_memory(&v)?,
        _ => DEFAULT_REWRITE_MEMORY,
    };
    let spill = std::env::var_os(REWRITE_SPILL_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from);
    Ok((memory, spill))
}

/// Whether the rewritten savepoint may be restored in place of its source: same job, state
/// schema, source positions and watermark, the new key-group count and parallelism, and as many
/// keys as the source, both by the manifests and by the keys the full verification decoded.
/// Returns what was checked (for an Event) or the first difference. Pure.
pub fn check_rewrite(
    source: &Manifest,
    target: &Manifest,
    groups: u32,
    parallelism: u32,
    keys_decoded: u64,
) -> Result<String, String> {
    if target.max_parallelism != groups {
        return Err(format!(
            "it has {} key groups, not {groups}",
            target.max_parallelism
        ));
    }
    if target.parallelism != parallelism {
        return Err(format!(
            "it was written for parallelism {}, not {parallelism}",
            target.parallelism
        ));
    }
    if target.job != source.job {
        return Err("it names another job than the savepoint it was rewritten from".into());
    }
    if target.state_schema != source.state_schema {
        return Err(format!(
            "its state schema {:?} differs from the source's {:?}",
            target.state_schema, source.state_schema
        ));
    }
    if target.source_positions != source.source_positions
        || target.source_partitions != source.source_partitions
    {
        return Err("its source positions differ from the source savepoint's".into());
    }
    if target.watermark != source.watermark {
        return Err(format!(
            "its watermark {:?} differs from the source's {:?}",
            target.watermark, source.watermark
        ));
    }
    if target.stats.total_keys != source.stats.total_keys {
        return Err(format!(
            "its manifest counts {} keys, the source's {}",
            target.stats.total_keys, source.stats.total_keys
        ));
    }
    if keys_decoded != source.stats.total_keys {
        return Err(format!(
            "{keys_decoded} keys were decoded from it, but the source holds {}",
            source.stats.total_keys
        ));
    }
    Ok(format!(
        "every block and every key's key group checked: {keys_decoded} keys in {groups} key groups at parallelism {parallelism}, the same job, schema, source positions and watermark as the source"
    ))
}

/// What setting spec.maxParallelism back does, for status.keyGroupChange.message. Pure.
pub fn change_message(c: &KeyGroupChangeStatus) -> String {
    match c.point_of_no_return {
        None => format!(
            "reversible: the new run has committed no checkpoint yet; setting spec.maxParallelism back to {} restores the original savepoint {} at parallelism {} (nothing the new run did is lost: no output of it is visible yet)",
            c.from_max_parallelism, c.original_savepoint, c.from_replicas
        ),
        Some(id) => format!(
            "past the point of no return: the new run committed checkpoint {id}{}, and its output is visible; the original savepoint {} ({} key groups) is kept. Restoring it (spec.restoreFrom with spec.maxParallelism {}) would lose the state and output produced since; setting spec.maxParallelism back to {} instead rewrites the current state, losing nothing",
            c.point_of_no_return_time
                .as_deref()
                .map_or(String::new(), |t| format!(" at {t}")),
            c.original_savepoint,
            c.from_max_parallelism,
            c.from_max_parallelism,
            c.from_max_parallelism
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::{JobIdentity, SnapshotKind};

    fn manifest(groups: u32, parallelism: u32, keys: u64) -> Manifest {
        let mut m = Manifest {
            format_version: 1,
            job: JobIdentity {
                namespace: "ns".into(),
                name: "job".into(),
                job_fingerprint: "f".into(),
                layout: None,
            },
            snapshot_id: 3,
            kind: SnapshotKind::Savepoint,
            completed_at: jiff::Timestamp::UNIX_EPOCH,
            max_parallelism: groups,
            parallelism,
            state_schema: "s1".into(),
            checksum_algorithm: "crc32c".into(),
            source_positions: [(0, 10), (1, 20)].into(),
            source_partitions: Default::default(),
            watermark: Some(5),
            stats: Default::default(),
            files: Vec::new(),
            key_groups: Vec::new(),
            operator_state: Vec::new(),
        };
        m.stats.total_keys = keys;
        m
    }

    #[test]
    fn a_faithful_rewrite_checks_out() {
        let src = manifest(128, 24, 1000);
        let dst = manifest(1024, 200, 1000);
        let ok = check_rewrite(&src, &dst, 1024, 200, 1000).unwrap();
        assert!(ok.contains("1000 keys in 1024 key groups"), "{ok}");
    }

    #[test]
    fn every_difference_is_refused() {
        let src = manifest(128, 24, 1000);
        let good = manifest(1024, 200, 1000);
        let cases: Vec<(Manifest, u64, &str)> = vec![
            (manifest(512, 200, 1000), 1000, "key groups"),
            (manifest(1024, 100, 1000), 1000, "parallelism"),
            (manifest(1024, 200, 999), 1000, "manifest counts 999"),
            (good.clone(), 999, "999 keys were decoded"),
            (
                Manifest {
                    watermark: Some(6),
                    ..good.clone()
                },
                1000,
                "watermark",
            ),
            (
                Manifest {
                    source_positions: [(0, 10)].into(),
                    ..good.clone()
                },
                1000,
                "source positions",
            ),
            (
                Manifest {
                    state_schema: "s2".into(),
                    ..good.clone()
                },
                1000,
                "schema",
            ),
            (
                Manifest {
                    job: JobIdentity {
                        namespace: "ns".into(),
                        name: "other".into(),
                        job_fingerprint: "f".into(),
                        layout: None,
                    },
                    ..good.clone()
                },
                1000,
                "another job",
            ),
        ];
        for (dst, decoded, want) in cases {
            let e = check_rewrite(&src, &dst, 1024, 200, decoded).unwrap_err();
            assert!(e.contains(want), "{want}: {e}");
        }
    }

    #[test]
    fn memory_sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_memory("256Mi").unwrap(), 256 << 20);
        assert_eq!(parse_memory("1Gi").unwrap(), 1 << 30);
        assert_eq!(parse_memory("2048Ki").unwrap(), 2 << 20);
        assert_eq!(parse_memory(" 1048576 ").unwrap(), 1 << 20);
        for bad in ["", "1", "512Ki", "12MB", "-1Mi", "Mi", "1.5Gi"] {
            let e = parse_memory(bad).unwrap_err();
            assert!(e.to_string().contains(REWRITE_MEMORY_ENV), "{bad}: {e}");
        }
    }

    #[test]
    fn the_message_says_whether_the_change_is_reversible() {
        let mut c = KeyGroupChangeStatus {
            from_max_parallelism: 128,
            to_max_parallelism: 1024,
            from_replicas: 24,
            original_savepoint: "file:///s/ns/job/savepoints/sp-3".into(),
            rewritten_savepoint: "file:///s/ns/job/savepoints/sp-4".into(),
            finished: "t".into(),
            point_of_no_return: None,
            point_of_no_return_time: None,
            message: String::new(),
        };
        let m = change_message(&c);
        assert!(m.starts_with("reversible"), "{m}");
        assert!(m.contains("back to 128"), "{m}");
        assert!(m.contains("sp-3 at parallelism 24"), "{m}");
        c.point_of_no_return = Some(7);
        c.point_of_no_return_time = Some("2026-12-02T12:00:00Z".into());
        let m = change_message(&c);
        assert!(m.starts_with("past the point of no return"), "{m}");
        assert!(m.contains("checkpoint 7 at 2026-12-02T12:00:00Z"), "{m}");
        assert!(m.contains("would lose"), "{m}");
    }
}
