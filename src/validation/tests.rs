use super::*;
use crate::crd::JobSpec;
use crate::fixtures::job;
use keyshift_core::reason::Reason;

fn policy(images: &[&str], accounts: &[&str]) -> PodPolicy {
    PodPolicy {
        allowed_image_prefixes: images.iter().map(|s| (*s).to_owned()).collect(),
        allowed_service_accounts: accounts.iter().map(|s| (*s).to_owned()).collect(),
    }
}

fn with(image: Option<&str>, account: Option<&str>) -> StreamJobSpec {
    let mut spec = job().spec;
    spec.image = image.map(str::to_owned);
    spec.pod_template
        .get_or_insert_with(Default::default)
        .service_account_name = account.map(str::to_owned);
    spec
}

const OPERATOR_IMAGE: &str = "ghcr.io/keyshift/keyshift:0.1.0";

#[test]
fn an_empty_policy_allows_any_image_and_service_account() {
    let spec = with(Some("evil.example/miner:latest"), Some("cluster-admin-sa"));
    assert_eq!(
        check_pod_policy(&spec, &PodPolicy::default(), OPERATOR_IMAGE),
        Ok(())
    );
}

#[test]
fn images_must_start_with_an_allowed_prefix() {
    let p = policy(
        &["registry.example.com/streaming/", "ghcr.io/keyshift/"],
        &[],
    );
    for ok in [
        None,
        Some("registry.example.com/streaming/clicks:3"),
        Some("ghcr.io/keyshift/keyshift@sha256:abc"),
    ] {
        assert_eq!(
            check_pod_policy(&with(ok, None), &p, OPERATOR_IMAGE),
            Ok(()),
            "{ok:?}"
        );
    }
    for bad in [
        "registry.example.com/other/clicks:3",
        "registry.example.com.evil.example/streaming/x",
        "docker.io/library/busybox",
        "",
    ] {
        let err = check_pod_policy(&with(Some(bad), None), &p, OPERATOR_IMAGE).unwrap_err();
        assert_eq!(err.reason(), Reason::ImageNotAllowed, "{bad}");
        assert_eq!(
            err,
            PolicyError::ImageNotAllowed {
                image: bad.to_owned(),
                allowed: "`registry.example.com/streaming/`, `ghcr.io/keyshift/`".to_owned()
            }
        );
        let msg = err.to_string();
        assert!(
            msg.starts_with(&format!("spec.image `{bad}` is not allowed")),
            "{msg}"
        );
        assert!(msg.contains("remove spec.image"), "{msg}");
        assert!(msg.contains("policy.allowedImagePrefixes"), "{msg}");
    }
    // The operator's own worker image is allowed even when named explicitly.
    let p = policy(&["registry.example.com/streaming/"], &[]);
    assert_eq!(
        check_pod_policy(&with(Some(OPERATOR_IMAGE), None), &p, OPERATOR_IMAGE),
        Ok(())
    );
    // An empty prefix in the list admits nothing by itself.
    let p = policy(&[""], &[]);
    assert!(check_pod_policy(&with(Some("x/y"), None), &p, OPERATOR_IMAGE).is_err());
}

#[test]
fn service_accounts_must_be_listed_or_the_default() {
    let p = policy(&[], &["stream-workers"]);
    for ok in [None, Some("stream-workers"), Some("default")] {
        assert_eq!(
            check_pod_policy(&with(None, ok), &p, OPERATOR_IMAGE),
            Ok(()),
            "{ok:?}"
        );
    }
    let err = check_pod_policy(&with(None, Some("ci-deployer")), &p, OPERATOR_IMAGE).unwrap_err();
    assert_eq!(err.reason(), Reason::ServiceAccountNotAllowed);
    assert_eq!(
        err.to_string(),
        "spec.podTemplate.serviceAccountName `ci-deployer` is not allowed here: this operator runs workers only as `stream-workers` (or the namespace's default); name one of them, remove the field to use the default ServiceAccount, or ask the cluster admin to extend policy.allowedServiceAccounts"
    );
    // A job without a pod template at all runs as the default.
    let mut spec = job().spec;
    spec.pod_template = None;
    assert_eq!(check_pod_policy(&spec, &p, OPERATOR_IMAGE), Ok(()));
    // The image is checked first, both lists apply.
    let p = policy(&["ok/"], &["stream-workers"]);
    let err = check_pod_policy(&with(Some("bad/x"), Some("bad")), &p, OPERATOR_IMAGE).unwrap_err();
    assert_eq!(err.reason(), Reason::ImageNotAllowed);
}

#[test]
fn the_job_rules_alone_say_what_the_manifest_s_validation_says() {
    let mut spec = job().spec;
    assert_eq!(validate_job(&spec.job), Ok(()));
    spec.replicas = 0;
    // Rules outside spec.job are not the job's.
    assert_eq!(validate_job(&spec.job), Ok(()));
    let generator = spec.job.source.generator.as_mut().expect("a generator job");
    generator.partitions = 0;
    generator.keys = MAX_GENERATOR_KEYS + 1;
    spec.job.sink.sink_type = crate::crd::SinkType::ObjectStore;
    spec.job.sink.url = None;
    spec.job.key.as_mut().expect("a key").field = String::new();
    let job_errors = validate_job(&spec.job).unwrap_err().0;
    assert_eq!(
        job_errors,
        [MSG_PARTITIONS, MSG_KEYS, MSG_KEY_FIELD, MSG_SINK_URL]
    );
    let all = validate(&spec, None).unwrap_err().0;
    assert_eq!(
        all,
        [
            MSG_REPLICAS_MIN,
            MSG_PARTITIONS,
            MSG_KEYS,
            MSG_KEY_FIELD,
            MSG_SINK_URL
        ]
    );
}

fn program_job() -> JobSpec {
    let mut spec = job().spec.job;
    spec.source.generator = None;
    spec.source.file = Some(crate::crd::FileSource {
        path: "/data/heartbeats".into(),
        timestamp_field: None,
    });
    spec.key = None;
    spec.aggregation = None;
    spec.window = None;
    spec.program = Some(keyshift_core::spec::ProgramSpec {
        name: "silence-alert".into(),
        max_out_of_orderness: Some("2s".into()),
        combine: None,
    });
    spec
}

#[test]
fn a_program_replaces_key_aggregation_and_window_and_reads_a_file_or_kafka_source() {
    let ok = program_job();
    assert_eq!(validate_job(&ok), Ok(()));
    let mut on_kafka = ok.clone();
    on_kafka.source = kafka_job().source;
    assert_eq!(validate_job(&on_kafka), Ok(()));
    let mut with_key = ok.clone();
    with_key.key = job().spec.job.key;
    assert_eq!(validate_job(&with_key).unwrap_err().0, [MSG_JOB_LOGIC]);
    let mut with_window = ok.clone();
    with_window.window = Some(crate::crd::WindowSpec {
        size: "1m".into(),
        max_out_of_orderness: None,
    });
    assert_eq!(validate_job(&with_window).unwrap_err().0, [MSG_JOB_LOGIC]);
    let mut neither = ok.clone();
    neither.program = None;
    assert_eq!(validate_job(&neither).unwrap_err().0, [MSG_JOB_LOGIC]);
    let mut no_aggregation = job().spec.job;
    no_aggregation.aggregation = None;
    assert_eq!(
        validate_job(&no_aggregation).unwrap_err().0,
        [MSG_JOB_LOGIC]
    );
    let mut bad = ok.clone();
    let p = bad.program.as_mut().expect("a program");
    p.name = "Silence_Alert".into();
    p.max_out_of_orderness = Some("soon".into());
    assert_eq!(
        validate_job(&bad).unwrap_err().0,
        [MSG_PROGRAM_NAME, MSG_PROGRAM_OUT_OF_ORDERNESS]
    );
    // A program may read the generator (each record a JSON object key/value/ts).
    let mut generated = ok.clone();
    generated.source.file = None;
    generated.source.generator = job().spec.job.source.generator;
    assert!(validate_job(&generated).is_ok());
    for (name, valid) in [
        ("dedup", true),
        ("silence-alert", true),
        ("a1", true),
        ("-a", false),
        ("a-", false),
        ("", false),
        (&"a".repeat(64) as &str, false),
        (&"a".repeat(63), true),
    ] {
        assert_eq!(valid_program_name(name), valid, "{name:?}");
    }
}

fn kafka_job() -> JobSpec {
    let mut spec = job().spec.job;
    spec.source.generator = None;
    spec.source.kafka = Some(crate::crd::KafkaSource {
        bootstrap_servers: "kafka-0.kafka:9092,10.0.0.1:9093".into(),
        topics: vec!["orders".into(), "orders.v2_eu-1".into()],
        key_from: Default::default(),
        timestamp_field: None,
        starting_position: Default::default(),
        starting_timestamp: None,
        group_id: None,
        idle_timeout: Some("30s".into()),
        metadata_refresh_interval: Some("1m".into()),
        properties: [("fetch.max.bytes".to_owned(), "1048576".to_owned())].into(),
        credentials: None,
    });
    spec
}

fn kafka_sink() -> crate::crd::KafkaSink {
    crate::crd::KafkaSink {
        bootstrap_servers: "k:9092".into(),
        topic: "counts".into(),
        delivery_guarantee: Default::default(),
        transactional_id_prefix: None,
        properties: Default::default(),
        credentials: None,
    }
}

#[test]
fn a_kafka_source_is_one_of_the_sources_and_its_fields_are_checked() {
    let ok = kafka_job();
    assert_eq!(validate_job(&ok), Ok(()));
    let mut both = ok.clone();
    both.source.generator = job().spec.job.source.generator;
    assert_eq!(validate_job(&both).unwrap_err().0, [MSG_SOURCE_ONE_OF]);

    let mut bad = ok.clone();
    let k = bad.source.kafka.as_mut().unwrap();
    k.bootstrap_servers = "kafka:9092, other:9092".into();
    k.topics = vec!["ok".into(), "not/ok".into()];
    k.starting_position = crate::crd::KafkaStartingPosition::Timestamp;
    k.idle_timeout = Some("30".into());
    k.metadata_refresh_interval = Some("500ms".into());
    k.properties
        .insert("enable.auto.commit".into(), "true".into());
    k.credentials = Some(crate::crd::KafkaCredentials {
        secret_name: "creds".into(),
        sasl: None,
        tls: Some(crate::crd::KafkaTls {
            ca_key: None,
            cert_key: Some("tls.crt".into()),
            key_key: None,
        }),
    });
    assert_eq!(
        validate_job(&bad).unwrap_err().0,
        [
            MSG_KAFKA_SOURCE_BOOTSTRAP,
            MSG_KAFKA_SOURCE_TOPICS,
            MSG_KAFKA_STARTING_TIMESTAMP,
            MSG_KAFKA_IDLE_TIMEOUT,
            MSG_KAFKA_REFRESH,
            MSG_KAFKA_SOURCE_PROPERTIES,
            MSG_KAFKA_SOURCE_CREDENTIALS,
        ]
    );
    let mut secret = ok.clone();
    secret
        .source
        .kafka
        .as_mut()
        .unwrap()
        .properties
        .insert("sasl.password".into(), "x".into());
    assert_eq!(
        validate_job(&secret).unwrap_err().0,
        [MSG_KAFKA_SOURCE_PROPERTIES]
    );
    let mut none = ok;
    none.source.kafka.as_mut().unwrap().topics.clear();
    assert_eq!(
        validate_job(&none).unwrap_err().0,
        [MSG_KAFKA_SOURCE_TOPICS]
    );
}

#[test]
fn a_kafka_sink_needs_its_type_and_its_fields() {
    let mut j = kafka_job();
    j.sink.sink_type = crate::crd::SinkType::Kafka;
    assert_eq!(validate_job(&j).unwrap_err().0, [MSG_KAFKA_SINK_REQUIRED]);
    j.sink.kafka = Some(kafka_sink());
    assert_eq!(validate_job(&j), Ok(()));
    j.sink.sink_type = crate::crd::SinkType::Log;
    assert_eq!(validate_job(&j).unwrap_err().0, [MSG_KAFKA_SINK_REQUIRED]);
    j.sink.sink_type = crate::crd::SinkType::Kafka;
    let k = j.sink.kafka.as_mut().unwrap();
    k.bootstrap_servers = "nohostport".into();
    k.topic = String::new();
    k.properties.insert("transactional.id".into(), "x".into());
    k.credentials = Some(crate::crd::KafkaCredentials {
        secret_name: "creds".into(),
        sasl: None,
        tls: None,
    });
    assert_eq!(
        validate_job(&j).unwrap_err().0,
        [
            MSG_KAFKA_SINK_BOOTSTRAP,
            MSG_KAFKA_SINK_TOPIC,
            MSG_KAFKA_SINK_PROPERTIES,
            MSG_KAFKA_SINK_CREDENTIALS,
        ]
    );
}

#[test]
fn bootstrap_lists_and_topic_names_follow_the_cel_rules() {
    for ok in [
        "k:9092",
        "a:1,b:65535",
        "[::1]:9092",
        "k.ns.svc.cluster.local:9092",
    ] {
        assert!(valid_bootstrap(ok), "{ok}");
    }
    for bad in [
        "", "k", "k:", ":9092", "k:123456", "a:1,", "a:1 ,b:2", "k:90a",
    ] {
        assert!(!valid_bootstrap(bad), "{bad}");
    }
    assert!(valid_topic("a.b_c-D9"));
    assert!(valid_topic(&"t".repeat(249)));
    assert!(!valid_topic(&"t".repeat(250)));
    assert!(!valid_topic("a b"));
    assert!(!valid_topic(""));
}

#[test]
fn a_kafka_job_s_idle_subtasks_come_from_its_latest_snapshot_s_partitions() {
    let mut spec = job().spec;
    spec.job = kafka_job();
    spec.replicas = 6;
    spec.max_parallelism = Some(64);
    // Unknown before the first snapshot: no subtask is reported idle.
    let a = analyse(&spec, None).unwrap();
    assert_eq!((a.source_partitions, a.idle_subtasks), (None, 0));
    let snap = |id, n| crate::crd::SnapshotRef {
        id,
        source_partitions: n,
        ..Default::default()
    };
    let mut status = StreamJobStatus {
        last_checkpoint: Some(snap(7, Some(4))),
        last_savepoint: Some(snap(5, Some(2))),
        ..Default::default()
    };
    let a = analyse(&spec, Some(&status)).unwrap();
    assert_eq!((a.source_partitions, a.idle_subtasks), (Some(4), 2));
    // The newest snapshot counts (a savepoint taken after the checkpoint).
    status.last_savepoint = Some(snap(8, Some(8)));
    let a = analyse(&spec, Some(&status)).unwrap();
    assert_eq!((a.source_partitions, a.idle_subtasks), (Some(8), 0));
}
