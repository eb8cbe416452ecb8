//! `keyshift probe`: checks that HTTP endpoints answer, from inside the `scratch` image (which
//! has no curl or wget). The chart's `helm test` hook runs it against the operator: it finds the
//! ready endpoints of the operator's metrics Service through its EndpointSlices and GETs
//! `/readyz` and `/metrics` on every one of them, pod to pod, so it needs neither a Service proxy
//! nor cluster DNS.
//!
//! Resolving endpoints ([`endpoint_urls`]) is pure; [`probe`] does the I/O.

use k8s_openapi::api::discovery::v1::EndpointSlice;
use std::time::{Duration, Instant};

/// What `keyshift probe` checks.
#[derive(Debug, Clone)]
pub struct ProbeConfig {
    /// URLs to GET, or, with `service`, paths to GET on each of its ready endpoints.
    pub targets: Vec<String>,
    /// A Service whose ready endpoints the paths are resolved against.
    pub service: Option<ServiceTarget>,
    /// How long to keep trying until every target answers with a 2xx status.
    pub timeout: Duration,
    /// Timeout of one request.
    pub request_timeout: Duration,
}

/// A Service to resolve through its EndpointSlices.
#[derive(Debug, Clone)]
pub struct ServiceTarget {
    pub name: String,
    /// None: the client's default namespace (in a pod: its own).
    pub namespace: Option<String>,
    /// The Service port: its name, or the endpoint port number.
    pub port: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("{0:?} is not a path: with --service, give paths such as /readyz")]
    NotAPath(String),
    #[error(
        "{0:?} is not an http:// or https:// URL (or pass --service to probe paths on a Service's endpoints)"
    )]
    NotAUrl(String),
    #[error("nothing to probe: name at least one URL or path")]
    NoTargets,
    #[error("connecting to the Kubernetes API: {0}")]
    Client(#[source] kube::Error),
    #[error("listing the EndpointSlices of service {namespace}/{service}: {source}")]
    List {
        namespace: String,
        service: String,
        #[source]
        source: kube::Error,
    },
    #[error("building the HTTP client: {0}")]
    Http(#[source] reqwest::Error),
    #[error("not every target answered within {seconds} s:\n{}", .failures.join("\n"))]
    Failed { seconds: u64, failures: Vec<String> },
}

/// Why a Service's endpoints cannot be probed yet (retried until the deadline).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    #[error("service {service} has no ready endpoint (no ready pod behind it)")]
    NoReadyEndpoint { service: String },
    #[error("service {service} has no port {port:?} (name or number)")]
    NoSuchPort { service: String, port: String },
}

/// The URLs of `paths` on every ready endpoint of `service`'s EndpointSlices, at the port named
/// (or numbered) `port`. An endpoint whose readiness is unknown counts as ready, as the
/// EndpointSlice API asks; of an endpoint's addresses the first is used (they are the same
/// pod's).
pub fn endpoint_urls(
    service: &str,
    slices: &[EndpointSlice],
    port: &str,
    paths: &[String],
) -> Result<Vec<String>, ResolveError> {
    let mut urls = Vec::new();
    let mut port_seen = false;
    let mut endpoints_seen = false;
    for slice in slices {
        // A Service without endpoints keeps a placeholder slice with neither endpoints nor
        // ports: that is "no ready endpoint", not a wrong port.
        endpoints_seen |= slice.endpoints.iter().flatten().next().is_some();
        let number = slice.ports.iter().flatten().find_map(|p| {
            let by_name = p.name.as_deref() == Some(port);
            let by_number = p.port.is_some_and(|n| n.to_string() == port);
            (by_name || by_number).then_some(p.port).flatten()
        });
        let Some(number) = number else { continue };
        port_seen = true;
        for endpoint in slice.endpoints.iter().flatten() {
            let ready = endpoint
                .conditions
                .as_ref()
                .and_then(|c| c.ready)
                .unwrap_or(true);
            let Some(address) = endpoint.addresses.first().filter(|_| ready) else {
                continue;
            };
            let host = if address.contains(':') {
                format!("[{address}]")
            } else {
                address.clone()
            };
            for path in paths {
                urls.push(format!("http://{host}:{number}{path}"));
            }
        }
    }
    if urls.is_empty() {
        return Err(if port_seen || !endpoints_seen {
            ResolveError::NoReadyEndpoint {
                service: service.to_owned(),
            }
        } else {
            ResolveError::NoSuchPort {
                service: service.to_owned(),
                port: port.to_owned(),
            }
        });
    }
    Ok(urls)
}

/// Checks the targets' shape before anything is dialled.
pub fn check_targets(config: &ProbeConfig) -> Result<(), ProbeError> {
    if config.targets.is_empty() {
        return Err(ProbeError::NoTargets);
    }
    for t in &config.targets {
        if config.service.is_some() {
            if !t.starts_with('/') {
                return Err(ProbeError::NotAPath(t.clone()));
            }
        } else if !(t.starts_with("http://") || t.starts_with("https://")) {
            return Err(ProbeError::NotAUrl(t.clone()));
        }
    }
    Ok(())
}

/// GETs every target until each answers with a 2xx status, retrying every 2 s until
/// `config.timeout`; returns one line per URL that answered.
pub async fn probe(config: &ProbeConfig) -> Result<Vec<String>, ProbeError> {
    check_targets(config)?;
    let http = reqwest::Client::builder()
        .timeout(config.request_timeout)
        .build()
        .map_err(ProbeError::Http)?;
    let kube = match &config.service {
        Some(_) => Some(
            kube::Client::try_default()
                .await
                .map_err(ProbeError::Client)?,
        ),
        None => None,
    };
    let deadline = Instant::now() + config.timeout;
    loop {
        let (answered, failures) = attempt(config, &http, kube.as_ref()).await?;
        if failures.is_empty() {
            return Ok(answered);
        }
        if Instant::now() >= deadline {
            return Err(ProbeError::Failed {
                seconds: config.timeout.as_secs(),
                failures,
            });
        }
        for f in &failures {
            tracing::info!("not yet: {f}");
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// One round over every target: (answers, failures).
async fn attempt(
    config: &ProbeConfig,
    http: &reqwest::Client,
    kube: Option<&kube::Client>,
) -> Result<(Vec<String>, Vec<String>), ProbeError> {
    let urls = match (&config.service, kube) {
        (Some(svc), Some(client)) => {
            let namespace = svc
                .namespace
                .clone()
                .unwrap_or_else(|| client.default_namespace().to_owned());
            let api: kube::Api<EndpointSlice> = kube::Api::namespaced(client.clone(), &namespace);
            let params = kube::api::ListParams::default()
                .labels(&format!("kubernetes.io/service-name={}", svc.name));
            let slices = api.list(&params).await.map_err(|source| ProbeError::List {
                namespace: namespace.clone(),
                service: svc.name.clone(),
                source,
            })?;
            let name = format!("{namespace}/{}", svc.name);
            match endpoint_urls(&name, &slices.items, &svc.port, &config.targets) {
                Ok(urls) => urls,
                Err(e) => return Ok((Vec::new(), vec![e.to_string()])),
            }
        }
        _ => config.targets.clone(),
    };
    let mut answered = Vec::new();
    let mut failures = Vec::new();
    for url in urls {
        match http.get(&url).send().await {
            Ok(r) if r.status().is_success() => {
                answered.push(format!("{url}: {}", r.status()));
            }
            Ok(r) => failures.push(format!("{url}: {}", r.status())),
            Err(e) => failures.push(format!("{url}: {e}")),
        }
    }
    Ok((answered, failures))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort};

    fn slice(port: (&str, i32), endpoints: &[(&str, Option<bool>)]) -> EndpointSlice {
        EndpointSlice {
            address_type: "IPv4".into(),
            ports: Some(vec![EndpointPort {
                name: Some(port.0.into()),
                port: Some(port.1),
                ..Default::default()
            }]),
            endpoints: Some(
                endpoints
                    .iter()
                    .map(|(a, ready)| Endpoint {
                        addresses: vec![(*a).into()],
                        conditions: Some(EndpointConditions {
                            ready: *ready,
                            ..Default::default()
                        }),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        }
    }

    fn paths() -> Vec<String> {
        vec!["/readyz".into(), "/metrics".into()]
    }

    #[test]
    fn every_ready_endpoint_gets_every_path() {
        let slices = [
            slice(("metrics", 8080), &[("10.0.0.1", Some(true))]),
            slice(
                ("metrics", 8080),
                &[
                    ("10.0.0.2", None),
                    ("10.0.0.3", Some(false)),
                    ("fd00::4", Some(true)),
                ],
            ),
        ];
        assert_eq!(
            endpoint_urls("ns/svc", &slices, "metrics", &paths()),
            Ok(vec![
                "http://10.0.0.1:8080/readyz".to_owned(),
                "http://10.0.0.1:8080/metrics".to_owned(),
                "http://10.0.0.2:8080/readyz".to_owned(),
                "http://10.0.0.2:8080/metrics".to_owned(),
                "http://[fd00::4]:8080/readyz".to_owned(),
                "http://[fd00::4]:8080/metrics".to_owned(),
            ])
        );
        // By number too.
        assert_eq!(
            endpoint_urls("ns/svc", &slices[..1], "8080", &paths()).map(|u| u.len()),
            Ok(2)
        );
    }

    #[test]
    fn no_ready_endpoint_or_no_such_port_is_named() {
        let not_ready = [slice(("metrics", 8080), &[("10.0.0.1", Some(false))])];
        assert_eq!(
            endpoint_urls("ns/svc", &not_ready, "metrics", &paths()),
            Err(ResolveError::NoReadyEndpoint {
                service: "ns/svc".into()
            })
        );
        assert_eq!(
            endpoint_urls("ns/svc", &[], "metrics", &paths()),
            Err(ResolveError::NoReadyEndpoint {
                service: "ns/svc".into()
            })
        );
        // What the EndpointSlice controller keeps for a Service with no pod behind it.
        let placeholder = EndpointSlice {
            address_type: "IPv4".into(),
            ..Default::default()
        };
        assert_eq!(
            endpoint_urls("ns/svc", &[placeholder], "metrics", &paths()),
            Err(ResolveError::NoReadyEndpoint {
                service: "ns/svc".into()
            })
        );
        let other_port = [slice(("http", 80), &[("10.0.0.1", Some(true))])];
        let err = endpoint_urls("ns/svc", &other_port, "metrics", &paths()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "service ns/svc has no port \"metrics\" (name or number)"
        );
    }

    #[test]
    fn targets_are_checked_before_anything_is_dialled() {
        let mut c = ProbeConfig {
            targets: vec!["/readyz".into()],
            service: None,
            timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(1),
        };
        assert!(matches!(check_targets(&c), Err(ProbeError::NotAUrl(_))));
        c.service = Some(ServiceTarget {
            name: "svc".into(),
            namespace: None,
            port: "metrics".into(),
        });
        assert!(check_targets(&c).is_ok());
        c.targets = vec!["http://x/readyz".into()];
        assert!(matches!(check_targets(&c), Err(ProbeError::NotAPath(_))));
        c.targets.clear();
        assert!(matches!(check_targets(&c), Err(ProbeError::NoTargets)));
    }
}
