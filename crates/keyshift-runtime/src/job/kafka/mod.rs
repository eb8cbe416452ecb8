//! Kafka clients of the source and the sink: what both share.
//!
//! * [`consumer_properties`] / [`producer_properties`]: the librdkafka properties of a client,
//!   built from the spec (bootstrap servers, the user's `properties`) and the credentials the
//!   worker holds ([`Credentials`]), in one order: keyshift's defaults, then the user's
//!   properties, then what keyshift must set (reserved names are refused by validation, and
//!   overwritten here as a second line of defence). Pure: unit-tested without a broker.
//! * [`credential_env`]: how a credentials Secret reaches a worker: one environment variable per
//!   Secret key used (`KEYSHIFT_KAFKA_<SOURCE|SINK>_<SASL_USERNAME|...>`, set from the Secret
//!   with `secretKeyRef`), read back by [`Credentials::from_env`].
//! * With the `kafka` feature: [`client_config`] turns properties into an `rdkafka` config.
//!
//! The source ([`source`]) talks to the brokers; everything else in [`crate::job`] stays pure.

use keyshift_core::spec::{KAFKA_SECRET_PROPERTIES, KAFKA_SINK_RESERVED, KAFKA_SOURCE_RESERVED};
use keyshift_core::spec::{KafkaCredentials, KafkaSaslMechanism, KafkaSink, KafkaSource};
use std::collections::BTreeMap;

pub mod sink;
#[cfg(feature = "kafka")]
pub mod source;

/// Which client a credential or property is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The source's consumer.
    Source,
    /// The sink's producer.
    Sink,
}

impl Role {
    fn env_prefix(self) -> &'static str {
        match self {
            Role::Source => "KEYSHIFT_KAFKA_SOURCE_",
            Role::Sink => "KEYSHIFT_KAFKA_SINK_",
        }
    }
}

/// One piece of a credentials Secret a client uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CredentialPart {
    /// The SASL username.
    SaslUsername,
    /// The SASL password.
    SaslPassword,
    /// The CA certificates to trust (PEM).
    TlsCa,
    /// The client certificate (PEM).
    TlsCert,
    /// The client certificate's key (PEM).
    TlsKey,
}

impl CredentialPart {
    const ALL: [CredentialPart; 5] = [
        CredentialPart::SaslUsername,
        CredentialPart::SaslPassword,
        CredentialPart::TlsCa,
        CredentialPart::TlsCert,
        CredentialPart::TlsKey,
    ];

    fn suffix(self) -> &'static str {
        match self {
            CredentialPart::SaslUsername => "SASL_USERNAME",
            CredentialPart::SaslPassword => "SASL_PASSWORD",
            CredentialPart::TlsCa => "TLS_CA",
            CredentialPart::TlsCert => "TLS_CERT",
            CredentialPart::TlsKey => "TLS_KEY",
        }
    }

    /// The environment variable a worker reads this part from.
    pub fn env_name(self, role: Role) -> String {
        format!("{}{}", role.env_prefix(), self.suffix())
    }
}

/// A worker environment variable set from a key of the credentials Secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CredentialEnv {
    /// The variable's name (`KEYSHIFT_KAFKA_SOURCE_SASL_PASSWORD`, ...).
    pub env: String,
    /// The Secret.
    pub secret: String,
    /// The key of the Secret.
    pub key: String,
}

/// The Secret keys a client's credentials use, as worker environment variables (for the pod's
/// `env` with `valueFrom.secretKeyRef`).
pub fn credential_env(role: Role, creds: &KafkaCredentials) -> Vec<CredentialEnv> {
    let mut out = Vec::new();
    let mut push = |part: CredentialPart, key: &str| {
        out.push(CredentialEnv {
            env: part.env_name(role),
            secret: creds.secret_name.clone(),
            key: key.to_owned(),
        })
    };
    if let Some(sasl) = &creds.sasl {
        push(CredentialPart::SaslUsername, &sasl.username_key);
        push(CredentialPart::SaslPassword, &sasl.password_key);
    }
    if let Some(tls) = &creds.tls {
        if let Some(k) = &tls.ca_key {
            push(CredentialPart::TlsCa, k);
        }
        if let Some(k) = &tls.cert_key {
            push(CredentialPart::TlsCert, k);
        }
        if let Some(k) = &tls.key_key {
            push(CredentialPart::TlsKey, k);
        }
    }
    out
}

/// The credentials a worker holds for one client (from its environment).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Credentials {
    parts: BTreeMap<&'static str, String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the values.
        f.debug_struct("Credentials")
            .field("parts", &self.parts.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// A credential the spec names that the worker does not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the Kafka credentials need {env} (key {key:?} of Secret {secret:?}), which the worker's environment does not have: check that the Secret has that key"
)]
pub struct MissingCredential {
    pub env: String,
    pub secret: String,
    pub key: String,
}

/// A key of the Kafka credentials Secret that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "key {key:?} of Secret {secret:?} {problem}: the Kafka credentials (spec.job.*.kafka.credentials) name it; add it to the Secret in the job's namespace, or change the key the spec names"
)]
pub struct SecretKeyError {
    pub secret: String,
    pub key: String,
    pub problem: &'static str,
}

impl Credentials {
    /// Reads the parts `creds` uses through `lookup` (the environment, in a worker).
    pub fn read(
        role: Role,
        creds: Option<&KafkaCredentials>,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Credentials, MissingCredential> {
        let mut parts = BTreeMap::new();
        let Some(creds) = creds else {
            return Ok(Credentials { parts });
        };
        for e in credential_env(role, creds) {
            let part = CredentialPart::ALL
                .into_iter()
                .find(|p| p.env_name(role) == e.env);
            let (Some(part), Some(value)) = (part, lookup(&e.env)) else {
                return Err(MissingCredential {
                    env: e.env,
                    secret: e.secret,
                    key: e.key,
                });
            };
            parts.insert(part.suffix(), value);
        }
        Ok(Credentials { parts })
    }

    /// [`Credentials::read`] from the data of the Secret `creds` names (`data`: its keys and
    /// values, as the API server returns them): how the operator gets the credentials of the
    /// clients it runs itself. A key the spec names that the Secret lacks, or that is not UTF-8,
    /// is refused with the key's name.
    pub fn from_secret(
        role: Role,
        creds: &KafkaCredentials,
        data: &BTreeMap<String, Vec<u8>>,
    ) -> Result<Credentials, SecretKeyError> {
        let wanted = credential_env(role, creds);
        let mut by_env = BTreeMap::new();
        for e in &wanted {
            let value = data.get(&e.key).ok_or_else(|| SecretKeyError {
                secret: e.secret.clone(),
                key: e.key.clone(),
                problem: "is missing",
            })?;
            let value = String::from_utf8(value.clone()).map_err(|_| SecretKeyError {
                secret: e.secret.clone(),
                key: e.key.clone(),
                problem: "is not UTF-8 text",
            })?;
            by_env.insert(e.env.clone(), value);
        }
        Credentials::read(role, Some(creds), |name| by_env.get(name).cloned()).map_err(|e| {
            SecretKeyError {
                secret: e.secret,
                key: e.key,
                problem: "is missing",
            }
        })
    }

    /// [`Credentials::read`] from the process environment.
    pub fn from_env(
        role: Role,
        creds: Option<&KafkaCredentials>,
    ) -> Result<Credentials, MissingCredential> {
        Credentials::read(role, creds, |name| std::env::var(name).ok())
    }

    fn get(&self, part: CredentialPart) -> Option<&str> {
        self.parts.get(part.suffix()).map(String::as_str)
    }
}

fn sasl_mechanism(m: KafkaSaslMechanism) -> &'static str {
    match m {
        KafkaSaslMechanism::Plain => "PLAIN",
        KafkaSaslMechanism::ScramSha256 => "SCRAM-SHA-256",
        KafkaSaslMechanism::ScramSha512 => "SCRAM-SHA-512",
    }
}

/// Properties of either client: bootstrap servers, the user's properties (less reserved and
/// secret names) and the credentials.
fn common_properties(
    bootstrap: &str,
    user: &BTreeMap<String, String>,
    reserved: &[&str],
    spec_creds: Option<&KafkaCredentials>,
    creds: &Credentials,
    defaults: &[(&str, &str)],
) -> BTreeMap<String, String> {
    let mut p: BTreeMap<String, String> = defaults
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    if let Some(c) = spec_creds {
        let protocol = match (c.sasl.is_some(), c.tls.is_some()) {
            (true, true) => Some("SASL_SSL"),
            (true, false) => Some("SASL_PLAINTEXT"),
            (false, true) => Some("SSL"),
            (false, false) => None,
        };
        if let Some(protocol) = protocol {
            p.insert("security.protocol".into(), protocol.into());
        }
        if let Some(sasl) = &c.sasl {
            p.insert(
                "sasl.mechanism".into(),
                sasl_mechanism(sasl.mechanism).into(),
            );
        }
    }
    for (k, v) in user {
        if reserved.contains(&k.as_str()) || KAFKA_SECRET_PROPERTIES.contains(&k.as_str()) {
            continue;
        }
        p.insert(k.clone(), v.clone());
    }
    p.insert("bootstrap.servers".into(), bootstrap.to_owned());
    for (part, prop) in [
        (CredentialPart::SaslUsername, "sasl.username"),
        (CredentialPart::SaslPassword, "sasl.password"),
        (CredentialPart::TlsCa, "ssl.ca.pem"),
        (CredentialPart::TlsCert, "ssl.certificate.pem"),
        (CredentialPart::TlsKey, "ssl.key.pem"),
    ] {
        if let Some(v) = creds.get(part) {
            p.insert(prop.into(), v.to_owned());
        }
    }
    p
}

/// The default consumer group of a job's source (offsets committed for lag tools only).
pub fn default_group_id(namespace: &str, name: &str) -> String {
    format!("keyshift.{namespace}.{name}")
}

pub use keyshift_core::spec::default_transactional_id_prefix;

/// The source consumer's properties. The consumer is assigned partitions by hand and seeks to
/// the snapshot's offsets, so the group is used only to commit offsets after checkpoints:
/// automatic commits and offset stores are off; reads are `read_committed` unless the user
/// says otherwise.
pub fn consumer_properties(
    spec: &KafkaSource,
    group_id: &str,
    creds: &Credentials,
) -> BTreeMap<String, String> {
    let mut p = common_properties(
        &spec.bootstrap_servers,
        &spec.properties,
        KAFKA_SOURCE_RESERVED,
        spec.credentials.as_ref(),
        creds,
        &[
            ("isolation.level", "read_committed"),
            // An offset below the log start (retention removed it) or past the end: restart
            // from the earliest the partition still holds, never skip ahead silently.
            ("auto.offset.reset", "earliest"),
            ("client.id", "keyshift-source"),
            // Each partition's fetcher, for the stall watchdog (source.rs, `stalled`); must
            // match source::STATISTICS_INTERVAL.
            ("statistics.interval.ms", "5000"),
        ],
    );
    p.insert("group.id".into(), group_id.to_owned());
    p.insert("enable.auto.commit".into(), "false".into());
    p.insert("enable.auto.offset.store".into(), "false".into());
    p.insert("enable.partition.eof".into(), "false".into());
    p
}

/// The sink producer's properties; `transactional_id` set for the exactly-once sink.
pub fn producer_properties(
    spec: &KafkaSink,
    transactional_id: Option<&str>,
    creds: &Credentials,
) -> BTreeMap<String, String> {
    let mut p = common_properties(
        &spec.bootstrap_servers,
        &spec.properties,
        KAFKA_SINK_RESERVED,
        spec.credentials.as_ref(),
        creds,
        &[("client.id", "keyshift-sink"), ("acks", "all")],
    );
    p.insert("enable.idempotence".into(), "true".into());
    if let Some(id) = transactional_id {
        p.insert("transactional.id".into(), id.to_owned());
    }
    p
}

/// An `rdkafka` client config holding exactly `properties`.
#[cfg(feature = "kafka")]
pub fn client_config(properties: &BTreeMap<String, String>) -> rdkafka::ClientConfig {
    let mut c = rdkafka::ClientConfig::new();
    for (k, v) in properties {
        c.set(k, v);
    }
    c
}

/// The properties with secret values masked, for logs and errors.
pub fn redacted(properties: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    properties
        .iter()
        .map(|(k, v)| {
            let secret = KAFKA_SECRET_PROPERTIES.contains(&k.as_str()) || k == "ssl.ca.pem";
            let v = if secret || k.ends_with(".pem") {
                "<redacted>".to_owned()
            } else {
                v.clone()
            };
            (k.clone(), v)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use keyshift_core::spec::{KafkaSasl, KafkaStartingPosition, KafkaTls};

    fn source() -> KafkaSource {
        KafkaSource {
            bootstrap_servers: "k0:9092,k1:9092".into(),
            topics: vec!["in".into()],
            key_from: Default::default(),
            timestamp_field: None,
            starting_position: KafkaStartingPosition::Earliest,
            starting_timestamp: None,
            group_id: None,
            idle_timeout: None,
            metadata_refresh_interval: None,
            properties: BTreeMap::new(),
            credentials: None,
        }
    }

    fn creds(sasl: bool, tls: bool) -> KafkaCredentials {
        KafkaCredentials {
            secret_name: "kafka-creds".into(),
            sasl: sasl.then(|| KafkaSasl {
                mechanism: KafkaSaslMechanism::ScramSha512,
                username_key: "user".into(),
                password_key: "pass".into(),
            }),
            tls: tls.then(|| KafkaTls {
                ca_key: Some("ca.crt".into()),
                cert_key: Some("tls.crt".into()),
                key_key: Some("tls.key".into()),
            }),
        }
    }

    #[test]
    fn the_consumer_is_manual_read_committed_and_keeps_the_users_properties() {
        let mut s = source();
        s.properties.insert("fetch.max.bytes".into(), "1000".into());
        s.properties
            .insert("isolation.level".into(), "read_uncommitted".into());
        // Reserved and secret names are dropped even if validation was bypassed.
        s.properties
            .insert("enable.auto.commit".into(), "true".into());
        s.properties.insert("group.id".into(), "theirs".into());
        s.properties.insert("sasl.password".into(), "leak".into());
        let p = consumer_properties(&s, "keyshift.ns.job", &Credentials::default());
        assert_eq!(p["bootstrap.servers"], "k0:9092,k1:9092");
        assert_eq!(p["group.id"], "keyshift.ns.job");
        assert_eq!(p["enable.auto.commit"], "false");
        assert_eq!(p["enable.auto.offset.store"], "false");
        assert_eq!(p["fetch.max.bytes"], "1000");
        assert_eq!(p["isolation.level"], "read_uncommitted");
        assert!(!p.contains_key("sasl.password"));
        assert!(!p.contains_key("security.protocol"));
    }

    #[test]
    fn credentials_become_env_vars_and_then_properties() {
        let c = creds(true, true);
        let env = credential_env(Role::Source, &c);
        let names: Vec<_> = env.iter().map(|e| e.env.as_str()).collect();
        assert_eq!(
            names,
            [
                "KEYSHIFT_KAFKA_SOURCE_SASL_USERNAME",
                "KEYSHIFT_KAFKA_SOURCE_SASL_PASSWORD",
                "KEYSHIFT_KAFKA_SOURCE_TLS_CA",
                "KEYSHIFT_KAFKA_SOURCE_TLS_CERT",
                "KEYSHIFT_KAFKA_SOURCE_TLS_KEY",
            ]
        );
        assert_eq!(env[1].key, "pass");
        assert_eq!(env[1].secret, "kafka-creds");
        let held: BTreeMap<String, String> = env
            .iter()
            .map(|e| (e.env.clone(), format!("value-of-{}", e.key)))
            .collect();
        let resolved = Credentials::read(Role::Source, Some(&c), |n| held.get(n).cloned()).unwrap();
        assert!(!format!("{resolved:?}").contains("value-of"));
        let mut s = source();
        s.credentials = Some(c);
        let p = consumer_properties(&s, "g", &resolved);
        assert_eq!(p["security.protocol"], "SASL_SSL");
        assert_eq!(p["sasl.mechanism"], "SCRAM-SHA-512");
        assert_eq!(p["sasl.username"], "value-of-user");
        assert_eq!(p["sasl.password"], "value-of-pass");
        assert_eq!(p["ssl.ca.pem"], "value-of-ca.crt");
        assert_eq!(p["ssl.certificate.pem"], "value-of-tls.crt");
        assert_eq!(p["ssl.key.pem"], "value-of-tls.key");
        let shown = redacted(&p);
        assert_eq!(shown["sasl.password"], "<redacted>");
        assert_eq!(shown["ssl.key.pem"], "<redacted>");
        assert_eq!(shown["sasl.username"], "value-of-user");
    }

    #[test]
    fn the_operator_reads_the_same_credentials_from_the_secret() {
        let c = creds(true, true);
        let mut data: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        for e in credential_env(Role::Sink, &c) {
            data.insert(e.key.clone(), format!("value of {}", e.key).into_bytes());
        }
        let from_secret = Credentials::from_secret(Role::Sink, &c, &data).unwrap();
        // The same as a worker gets through its environment from the same Secret.
        let env: BTreeMap<String, String> = credential_env(Role::Sink, &c)
            .into_iter()
            .map(|e| (e.env, format!("value of {}", e.key)))
            .collect();
        let from_env = Credentials::read(Role::Sink, Some(&c), |n| env.get(n).cloned()).unwrap();
        assert_eq!(from_secret, from_env);
        assert!(!from_secret.parts.is_empty());

        let missing = credential_env(Role::Sink, &c)[1].key.clone();
        data.remove(&missing);
        let e = Credentials::from_secret(Role::Sink, &c, &data).unwrap_err();
        assert_eq!(
            (e.secret.as_str(), e.key.as_str()),
            ("kafka-creds", missing.as_str())
        );
        assert!(e.to_string().contains("is missing"), "{e}");
        data.insert(missing, vec![0xff, 0xfe]);
        let e = Credentials::from_secret(Role::Sink, &c, &data).unwrap_err();
        assert!(e.to_string().contains("not UTF-8"), "{e}");
    }

    #[test]
    fn a_missing_credential_names_the_secret_key() {
        let c = creds(true, false);
        let e = Credentials::read(Role::Sink, Some(&c), |n| {
            (n == "KEYSHIFT_KAFKA_SINK_SASL_USERNAME").then(|| "u".to_owned())
        })
        .unwrap_err();
        assert_eq!(e.env, "KEYSHIFT_KAFKA_SINK_SASL_PASSWORD");
        assert_eq!(e.key, "pass");
        assert!(e.to_string().contains("kafka-creds"), "{e}");
    }

    #[test]
    fn security_protocol_follows_the_credentials_unless_the_user_sets_it() {
        for (sasl, tls, want) in [
            (true, false, "SASL_PLAINTEXT"),
            (false, true, "SSL"),
            (true, true, "SASL_SSL"),
        ] {
            let mut s = source();
            s.credentials = Some(creds(sasl, tls));
            let p = consumer_properties(&s, "g", &Credentials::default());
            assert_eq!(p["security.protocol"], want);
            s.properties
                .insert("security.protocol".into(), "PLAINTEXT".into());
            let p = consumer_properties(&s, "g", &Credentials::default());
            assert_eq!(p["security.protocol"], "PLAINTEXT");
        }
    }

    #[test]
    fn the_producer_is_idempotent_and_transactional_only_when_asked() {
        let mut sink = KafkaSink {
            bootstrap_servers: "k:9092".into(),
            topic: "out".into(),
            delivery_guarantee: Default::default(),
            transactional_id_prefix: None,
            properties: BTreeMap::new(),
            credentials: None,
        };
        sink.properties
            .insert("transactional.id".into(), "theirs".into());
        sink.properties.insert("linger.ms".into(), "5".into());
        let p = producer_properties(&sink, None, &Credentials::default());
        assert!(!p.contains_key("transactional.id"));
        assert_eq!(p["enable.idempotence"], "true");
        assert_eq!(p["linger.ms"], "5");
        let p = producer_properties(&sink, Some("keyshift.ns.job-0"), &Credentials::default());
        assert_eq!(p["transactional.id"], "keyshift.ns.job-0");
    }
}
