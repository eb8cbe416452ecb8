//! Isolation between jobs: no job's sink may write where another job's sink writes. Two
//! exactly-once Kafka sinks with one transactional id (on the same cluster) fence each other's
//! transactions and each take the other's publish marker for its own; two object-store sinks
//! with one output directory (or one inside the other) overwrite and list each other's files.
//! The job created first keeps the place; a later one is refused before it gets a pod.

use super::*;
use crate::crd::{KafkaDeliveryGuarantee, SinkType};

/// One job as the check sees it: its identity, when it was created, and its spec.
#[derive(Debug, Clone, Copy)]
pub struct JobIdentity<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    /// `metadata.creationTimestamp`; a job without one (not yet stored) counts as the newest.
    pub created: Option<k8s_openapi::jiff::Timestamp>,
    pub spec: &'a StreamJobSpec,
}

impl JobIdentity<'_> {
    /// The order in which jobs hold a place: the older first, then by namespace and name.
    fn seniority(&self) -> (bool, Option<k8s_openapi::jiff::Timestamp>, &str, &str) {
        (
            self.created.is_none(),
            self.created,
            self.namespace,
            self.name,
        )
    }

    fn is(&self, other: &JobIdentity<'_>) -> bool {
        self.namespace == other.namespace && self.name == other.name
    }
}

/// Where a job's sink writes that no other job's may.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Place<'a> {
    /// An exactly-once Kafka sink's transactional id, on these brokers.
    Transactional {
        id: String,
        brokers: std::collections::BTreeSet<&'a str>,
    },
    /// An object-store sink's output directory (no trailing `/`).
    Directory(&'a str),
}

fn place<'a>(job: &JobIdentity<'a>) -> Option<Place<'a>> {
    let sink = &job.spec.job.sink;
    match sink.sink_type {
        SinkType::Kafka => {
            let kafka = sink.kafka.as_ref()?;
            (kafka.delivery_guarantee == KafkaDeliveryGuarantee::ExactlyOnce).then(|| {
                Place::Transactional {
                    id: kafka.transactional_id(job.namespace, job.name),
                    brokers: kafka.brokers(),
                }
            })
        }
        SinkType::ObjectStore => {
            let dir = sink.url.as_deref()?.trim_end_matches('/');
            (!dir.is_empty()).then_some(Place::Directory(dir))
        }
        SinkType::Log => None,
    }
}

/// A job whose sink would write where an older job's sink writes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SharedSink {
    #[error(
        "spec.job.sink.kafka writes with transactional id `{id}`, which job {holder} (created first) already writes with to the same Kafka cluster ({broker}): the two jobs would fence each other's transactions and each take the other's published output for its own. Give this job its own spec.job.sink.kafka.transactionalIdPrefix (or remove it: the default, keyshift.<namespace>.<job>, is unique to the job)"
    )]
    TransactionalId {
        id: String,
        holder: String,
        broker: String,
    },
    #[error(
        "spec.job.sink.url `{url}` is where job {holder} (created first) publishes its output (`{theirs}`): the two jobs would overwrite and list each other's files. Give this job an output directory of its own, outside the other's"
    )]
    Directory {
        url: String,
        holder: String,
        theirs: String,
    },
}

impl SharedSink {
    /// The reason of the Stalled condition.
    pub fn reason(&self) -> keyshift_core::reason::Reason {
        keyshift_core::reason::Reason::SinkInUse
    }
}

/// Whether `dir` is `other` or lies inside it, or `other` inside `dir` (at a `/`).
fn nested(dir: &str, other: &str) -> bool {
    let inside =
        |a: &str, b: &str| a == b || a.strip_prefix(b).is_some_and(|rest| rest.starts_with('/'));
    inside(dir, other) || inside(other, dir)
}

/// Whether `job`'s sink may write where it is set to, given every other job the operator knows
/// (`others` may include `job` itself, which is skipped). Refused when an older job's sink
/// writes there: the older job keeps its place, whichever was applied or changed last.
pub fn check_sink_isolation<'a>(
    job: &JobIdentity<'a>,
    others: impl IntoIterator<Item = JobIdentity<'a>>,
) -> Result<(), SharedSink> {
    let Some(mine) = place(job) else {
        return Ok(());
    };
    let mut holders: Vec<(JobIdentity<'a>, SharedSink)> = Vec::new();
    for other in others {
        if other.is(job) || other.seniority() > job.seniority() {
            continue;
        }
        let holder = format!("{}/{}", other.namespace, other.name);
        let clash = match (&mine, place(&other)) {
            (
                Place::Transactional { id, brokers },
                Some(Place::Transactional {
                    id: theirs,
                    brokers: their_brokers,
                }),
            ) if *id == theirs => brokers.intersection(&their_brokers).next().map(|broker| {
                SharedSink::TransactionalId {
                    id: id.clone(),
                    holder,
                    broker: (*broker).to_owned(),
                }
            }),
            (Place::Directory(dir), Some(Place::Directory(theirs))) if nested(dir, theirs) => {
                Some(SharedSink::Directory {
                    url: (*dir).to_owned(),
                    holder,
                    theirs: theirs.to_owned(),
                })
            }
            _ => None,
        };
        if let Some(clash) = clash {
            holders.push((other, clash));
        }
    }
    // The oldest holder is named: it is the one that keeps the place.
    holders.sort_by(|a, b| a.0.seniority().cmp(&b.0.seniority()));
    match holders.into_iter().next() {
        Some((_, clash)) => Err(clash),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::SinkSpec;

    fn at(minute: u32) -> Option<k8s_openapi::jiff::Timestamp> {
        k8s_openapi::jiff::Timestamp::from_second(1_796_637_600 + 60 * i64::from(minute)).ok()
    }

    fn kafka(brokers: &str, prefix: Option<&str>, exactly_once: bool) -> StreamJobSpec {
        let mut spec = crate::fixtures::job().spec;
        spec.job.sink = serde_yaml::from_str(&format!(
            "type: kafka\nkafka: {{bootstrapServers: '{brokers}', topic: out, deliveryGuarantee: {}{}}}",
            if exactly_once { "exactlyOnce" } else { "atLeastOnce" },
            prefix.map_or(String::new(), |p| format!(", transactionalIdPrefix: {p}"))
        ))
        .unwrap();
        spec
    }

    fn store(url: &str) -> StreamJobSpec {
        let mut spec = crate::fixtures::job().spec;
        spec.job.sink = SinkSpec {
            sink_type: SinkType::ObjectStore,
            url: Some(url.into()),
            kafka: None,
        };
        spec
    }

    fn id<'a>(ns: &'a str, name: &'a str, minute: u32, spec: &'a StreamJobSpec) -> JobIdentity<'a> {
        JobIdentity {
            namespace: ns,
            name,
            created: at(minute),
            spec,
        }
    }

    #[test]
    fn a_later_job_with_an_older_jobs_transactional_id_on_the_same_cluster_is_refused() {
        let a = kafka("k1:9092,k2:9092", Some("shared"), true);
        let b = kafka(" k2:9092 ", Some("shared"), true);
        let older = id("team-a", "orders", 1, &a);
        let newer = id("team-b", "payments", 2, &b);
        let err = check_sink_isolation(&newer, [older, newer]).unwrap_err();
        assert_eq!(
            err,
            SharedSink::TransactionalId {
                id: "shared.sink".into(),
                holder: "team-a/orders".into(),
                broker: "k2:9092".into(),
            }
        );
        assert_eq!(err.reason(), keyshift_core::reason::Reason::SinkInUse);
        let msg = err.to_string();
        for needle in [
            "spec.job.sink.kafka",
            "`shared.sink`",
            "team-a/orders",
            "transactionalIdPrefix",
        ] {
            assert!(msg.contains(needle), "{needle} in {msg}");
        }
        // The older one keeps its id, whichever of the two was changed last.
        assert_eq!(check_sink_isolation(&older, [older, newer]), Ok(()));
    }

    #[test]
    fn jobs_that_cannot_collide_pass() {
        let shared = kafka("k1:9092", Some("shared"), true);
        let other_cluster = kafka("k9:9092", Some("shared"), true);
        let at_least_once = kafka("k1:9092", Some("shared"), false);
        let defaults = kafka("k1:9092", None, true);
        let older = id("ns", "a", 1, &shared);
        for (newer, why) in [
            (id("ns", "b", 2, &other_cluster), "another cluster"),
            (id("ns", "b", 2, &at_least_once), "no transactions"),
            (
                id("ns", "b", 2, &defaults),
                "the default prefix names the job",
            ),
            (id("ns", "a", 2, &shared), "the job itself"),
        ] {
            assert_eq!(check_sink_isolation(&newer, [older]), Ok(()), "{why}");
        }
        // Default prefixes: one per job, even for look-alike names (a namespace holds no dot).
        let (x, y) = (kafka("k1:9092", None, true), kafka("k1:9092", None, true));
        assert_eq!(
            check_sink_isolation(&id("a", "b.c", 2, &x), [id("a-b", "c", 1, &y)]),
            Ok(())
        );
    }

    #[test]
    fn an_output_directory_inside_or_around_an_older_jobs_is_refused() {
        let a = store("s3://out/team/orders/");
        let older = id("ns", "orders", 1, &a);
        for (url, refused) in [
            ("s3://out/team/orders", true),
            ("s3://out/team/orders/late", true),
            ("s3://out/team", true),
            ("s3://out/team/orders-2", false),
            ("s3://other/team/orders", false),
        ] {
            let b = store(url);
            let got = check_sink_isolation(&id("ns", "b", 2, &b), [older]);
            assert_eq!(got.is_err(), refused, "{url}: {got:?}");
            if let Err(e) = got {
                assert!(e.to_string().contains("ns/orders"), "{e}");
                assert!(e.to_string().contains(url.trim_end_matches('/')), "{e}");
            }
        }
    }

    #[test]
    fn of_several_holders_the_oldest_is_named() {
        let s = kafka("k1:9092", Some("p"), true);
        let jobs = [
            id("z", "third", 3, &s),
            id("y", "first", 1, &s),
            id("x", "second", 2, &s),
        ];
        let newest = id("w", "fourth", 4, &s);
        match check_sink_isolation(&newest, jobs) {
            Err(SharedSink::TransactionalId { holder, .. }) => assert_eq!(holder, "y/first"),
            other => panic!("{other:?}"),
        }
        // A job not yet stored (no creation time) is the newest.
        let unstored = JobIdentity {
            created: None,
            ..id("a", "new", 0, &s)
        };
        assert!(check_sink_isolation(&unstored, jobs).is_err());
        assert_eq!(check_sink_isolation(&jobs[1], [unstored]), Ok(()));
    }
}
