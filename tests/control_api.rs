//! The worker's control API at its edge: every control route refuses a request without the job's
//! token before it reads or parses the body (so a stranger learns nothing from parse errors and
//! cannot make the worker buffer a large body), bodies are bounded, and the unauthenticated
//! probes stay open.

use keyshift::runtime::worker::{self, WorkerConfig};
use std::time::Duration;

const TOKEN: &str = "control-api-test-token";

/// A serving worker on loopback: (control API URL, data-plane address).
async fn worker() -> (String, String) {
    let loopback = "127.0.0.1:0".parse().expect("loopback");
    let bound = worker::bind(WorkerConfig {
        control_addr: loopback,
        data_addr: loopback,
        token: TOKEN.to_owned(),
    })
    .await
    .expect("bind");
    let addrs = (
        format!("http://{}", bound.control_addr),
        bound.data_addr.to_string(),
    );
    tokio::spawn(bound.serve(std::future::pending()));
    addrs
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
    let (url, _) = worker().await;
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

/// A stray, silent or forged connection to a starting worker's data port neither kills it nor
/// takes a peer's place: the forger claims subtask 1 with the right run id but without the run's
/// secret, before the real subtask 1 connects; both workers still start, connect to each other
/// and process records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stray_and_forged_data_connections_neither_kill_nor_replace_a_peer() {
    use keyshift::runtime::protocol::{RunSecret, StartRequest};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let workers = vec![worker().await, worker().await];
    let run_id = "job-abc123";
    // Before the start: a connection that says nothing, one that sends garbage, and one that
    // answers the challenge with a hello for subtask 1 and a made-up proof.
    let target = workers[0].1.clone();
    let _silent = tokio::net::TcpStream::connect(&target)
        .await
        .expect("connect");
    let mut garbage = tokio::net::TcpStream::connect(&target)
        .await
        .expect("connect");
    garbage.write_all(&[0xff; 64]).await.expect("write garbage");
    let forger = tokio::spawn({
        let target = target.clone();
        async move {
            let mut s = tokio::net::TcpStream::connect(&target)
                .await
                .expect("connect");
            let mut challenge = [0u8; 21];
            s.read_exact(&mut challenge).await.expect("a challenge");
            let mut hello = Vec::new();
            hello.extend_from_slice(&((5 + 32 + run_id.len()) as u32).to_le_bytes());
            hello.push(3);
            hello.extend_from_slice(&1u32.to_le_bytes());
            hello.extend_from_slice(&[7u8; 32]);
            hello.extend_from_slice(run_id.as_bytes());
            s.write_all(&hello).await.expect("hello");
            // Refused: the worker closes the connection.
            let mut rest = Vec::new();
            s.read_to_end(&mut rest).await.map(|_| rest.is_empty())
        }
    });
    let job: keyshift::crd::JobSpec = serde_yaml::from_str(
        "{source: {generator: {partitions: 2, keys: 50, recordsPerSecond: 500}}, key: {field: key}, aggregation: {function: count}}",
    )
    .expect("job");
    let c = http();
    let peers: Vec<String> = workers.iter().map(|(_, d)| d.clone()).collect();
    let starts = workers.iter().enumerate().map(|(i, (url, _))| {
        let req = StartRequest {
            namespace: "ns".into(),
            name: "job".into(),
            job: job.clone(),
            subtask: i as u32,
            parallelism: 2,
            max_parallelism: 8,
            peers: peers.clone(),
            storage: format!("memory://{}/state", std::process::id()),
            restore_from: None,
            allow_non_restored_state: false,
            state_payload_bytes: 0,
            run_id: run_id.into(),
            data_secret: RunSecret("the-run-secret".into()),
        };
        c.post(format!("{url}/v1/start"))
            .bearer_auth(TOKEN)
            .json(&req)
            .send()
    });
    for r in futures::future::join_all(starts).await {
        let r = r.expect("start answered");
        assert!(r.status().is_success(), "start: {}", r.status());
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    for (url, _) in &workers {
        loop {
            let ready = c
                .get(format!("{url}/v1/readyz"))
                .send()
                .await
                .expect("readyz");
            if ready.status().as_u16() == 200 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{url} never connected to its peer"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    assert_eq!(
        forger.await.expect("forger task").ok(),
        Some(true),
        "the forged connection was closed without a byte"
    );
    // Records flow between the two real workers.
    let processed = |url: String| {
        let c = c.clone();
        async move {
            let st: serde_json::Value = c
                .get(format!("{url}/v1/status"))
                .bearer_auth(TOKEN)
                .send()
                .await
                .expect("status")
                .json()
                .await
                .expect("json");
            st["recordsProcessed"].as_u64().unwrap_or(0)
        }
    };
    loop {
        let both = [
            processed(workers[0].0.clone()).await,
            processed(workers[1].0.clone()).await,
        ];
        if both.iter().all(|n| *n > 0) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no records processed: {both:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
