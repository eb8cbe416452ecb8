//! The worker's control API at its edge: every control route refuses a request without the job's
//! token before it reads or parses the body (so a stranger learns nothing from parse errors and
//! cannot make the worker buffer a large body), bodies are bounded, and the unauthenticated
//! probes stay open.

use keyshift::runtime::worker::{self, WorkerConfig};
use std::time::Duration;

const TOKEN: &str = "control-api-test-token";

async fn worker() -> String {
    let loopback = "127.0.0.1:0".parse().expect("loopback");
    let bound = worker::bind(WorkerConfig {
        control_addr: loopback,
        data_addr: loopback,
        token: TOKEN.to_owned(),
    })
    .await
    .expect("bind");
    let url = format!("http://{}", bound.control_addr);
    tokio::spawn(bound.serve(std::future::pending()));
    url
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .no_proxy()
        .build()
        .expect("client")
}

#[tokio::test]
async fn control_routes_refuse_strangers_before_reading_the_body() {
    let url = worker().await;
    let c = http();
    let big = vec![b'x'; 8 << 20];
    for (path, body) in [
        ("/v1/start", b"not json".to_vec()),
        ("/v1/start", b"{\"subtask\": 1}".to_vec()),
        ("/v1/start", big.clone()),
        ("/v1/checkpoints", b"{".to_vec()),
        ("/v1/resume", Vec::new()),
    ] {
        for auth in [None, Some("wrong-token"), Some(TOKEN)] {
            let mut req = c
                .post(format!("{url}{path}"))
                .header("content-type", "application/json")
                .body(body.clone());
            if let Some(a) = auth {
                req = req.bearer_auth(a);
            }
            let status = req.send().await.map(|r| r.status().as_u16());
            match auth {
                Some(TOKEN) => {
                    // With the token the body is read: bounded, then parsed.
                    let status = status.expect("an answer");
                    assert_ne!(status, 401, "{path}");
                    if body.len() > 4 << 20 {
                        assert_eq!(status, 413, "{path}: an oversized body is refused");
                    }
                }
                // Without it, 401 before the body is looked at (the server may close the
                // connection while a large body is still being sent).
                _ => match status {
                    Ok(s) => assert_eq!(s, 401, "{path} {auth:?}: {s}"),
                    Err(e) => assert!(body.len() > 1 << 20, "{path}: {e}"),
                },
            }
        }
    }
    for path in ["/v1/status", "/v1/checkpoints/1"] {
        let s = c.get(format!("{url}{path}")).send().await.expect("answer");
        assert_eq!(s.status().as_u16(), 401, "{path}");
        let s = c
            .get(format!("{url}{path}"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .expect("answer");
        assert_eq!(s.status().as_u16(), 200, "{path}");
    }
    // The probes need no token.
    for path in ["/v1/healthz", "/metrics"] {
        let s = c.get(format!("{url}{path}")).send().await.expect("answer");
        assert_eq!(s.status().as_u16(), 200, "{path}");
    }
    let s = c
        .get(format!("{url}/v1/readyz"))
        .send()
        .await
        .expect("answer");
    assert_eq!(s.status().as_u16(), 503, "not started");
}
