//! The worker's control API at its edge: every control route refuses a request without the job's
//! token before it reads or parses the body (so a stranger learns nothing from parse errors and
//! cannot make the worker buffer a large body), bodies are bounded, and the unauthenticated
//! probes stay open.

use keyshift::runtime::worker::{self, WorkerConfig};
use std::time::Duration;

const TOKEN: &str = "control-api-test-token";

/// A serving worker on loopback: (control API URL, data-plane address).
async fn worker() -> (String, String) {
    let (control, data, _) = serving_worker().await;
    (control, data)
}

/// A worker serving on loopback: its control URL, its data address and the task serving it
/// (which ends when the worker stops).
async fn serving_worker() -> (
    String,
    String,
    tokio::task::JoinHandle<Result<(), worker::WorkerError>>,
) {
    let loopback = "127.0.0.1:0".parse().expect("loopback");
    let bound = worker::bind(WorkerConfig {
        control_addr: loopback,
        data_addr: loopback,
        token: TOKEN.to_owned(),
        programs: Default::default(),
    })
    .await
    .expect("bind");
    let (control, data) = (
        format!("http://{}", bound.control_addr),
        bound.data_addr.to_string(),
    );
    (
        control,
        data,
        tokio::spawn(bound.serve(std::future::pending())),
    )
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
        ("/v1/checkpoints/1/abort", Vec::new()),
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
            protocol: keyshift::runtime::protocol::PROTOCOL_VERSION,
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
            incremental: Default::default(),
            ready_timeout_secs: None,
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

/// A start request for subtask 0 of 1 of a small generator job (valid as it is).
fn start_request(peer: &str) -> keyshift::runtime::protocol::StartRequest {
    keyshift::runtime::protocol::StartRequest {
        protocol: keyshift::runtime::protocol::PROTOCOL_VERSION,
        namespace: "ns".into(),
        name: "job".into(),
        job: serde_yaml::from_str(
            "{source: {generator: {partitions: 1, keys: 5, recordsPerSecond: 100}}, key: {field: key}, aggregation: {function: count}}",
        )
        .expect("job"),
        subtask: 0,
        parallelism: 1,
        max_parallelism: 8,
        peers: vec![peer.to_owned()],
        storage: format!("memory://{}/bounds", std::process::id()),
        restore_from: None,
        allow_non_restored_state: false,
        state_payload_bytes: 0,
        run_id: "job-abc123".into(),
        data_secret: keyshift::runtime::protocol::RunSecret("the-run-secret".into()),
        incremental: Default::default(),
        ready_timeout_secs: None,
    }
}

/// A start request with absurd sizes is refused with 422 and a message naming the field and
/// its bound, before anything is allocated for it; the worker can still be started after.
#[tokio::test]
async fn absurd_start_requests_are_refused_naming_the_field_and_the_bound() {
    use keyshift::runtime::protocol::{self, StartRequest};
    let (url, data) = worker().await;
    let c = http();
    type Edit = Box<dyn Fn(&mut StartRequest)>;
    let cases: Vec<(Edit, String)> = vec![
        (
            Box::new(|r| r.state_payload_bytes = 1 << 40),
            format!(
                "statePayloadBytes is {}: it may be at most {}",
                1u64 << 40,
                protocol::MAX_STATE_PAYLOAD_BYTES
            ),
        ),
        (
            Box::new(|r| r.run_id = "r".repeat(100_000)),
            format!(
                "runId is 100000 bytes long: it may be at most {} bytes",
                protocol::MAX_RUN_ID_LEN
            ),
        ),
        (
            Box::new(|r| r.namespace = "n".repeat(64)),
            "namespace is 64 bytes long: it may be at most 63 bytes".into(),
        ),
        (
            Box::new(|r| r.name = "n".repeat(254)),
            "name is 254 bytes long: it may be at most 253 bytes".into(),
        ),
        (
            Box::new(|r| r.storage = format!("memory://{}", "s".repeat(3000))),
            "storage is 3009 bytes long: it may be at most 2048 bytes".into(),
        ),
        (
            Box::new(|r| r.peers = vec!["p".repeat(600)]),
            "peers[0] is 600 bytes long: it may be at most 512 bytes".into(),
        ),
    ];
    for (edit, message) in cases {
        let mut req = start_request(&data);
        edit(&mut req);
        let r = post_start(&c, &url, &req).await;
        let status = r.status().as_u16();
        let body = r.text().await.expect("body");
        assert_eq!(status, 422, "{message}: {body}");
        assert!(body.contains(&message), "{body} does not say {message}");
    }
    let r = post_start(&c, &url, &start_request(&data)).await;
    assert_eq!(r.status().as_u16(), 202, "a valid start after the refusals");
}

/// `GET /v1/checkpoints/{id}{query}` of the worker at `url`.
async fn checkpoint_status(
    c: &reqwest::Client,
    url: &str,
    id: u64,
    query: &str,
) -> keyshift::runtime::protocol::CheckpointStatus {
    c.get(format!("{url}/v1/checkpoints/{id}{query}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("status answered")
        .json()
        .await
        .expect("a status")
}

/// A serving worker that accepted a valid start: its control URL and a client.
async fn started_worker() -> (String, reqwest::Client) {
    let (url, data) = worker().await;
    let c = http();
    let r = post_start(&c, &url, &start_request(&data)).await;
    assert_eq!(r.status().as_u16(), 202);
    (url, c)
}

/// `POST /v1/start` with `req` to the worker at `url`, as the coordinator sends it.
async fn post_start(
    c: &reqwest::Client,
    url: &str,
    req: &keyshift::runtime::protocol::StartRequest,
) -> reqwest::Response {
    c.post(format!("{url}/v1/start"))
        .bearer_auth(TOKEN)
        .json(req)
        .send()
        .await
        .expect("start answered")
}

/// Triggers checkpoint `id` as soon as the worker at `url` runs (its trigger is refused until
/// then), within 30 s.
async fn trigger_once_running(c: &reqwest::Client, url: &str, id: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let r = c
            .post(format!("{url}/v1/checkpoints"))
            .bearer_auth(TOKEN)
            .json(&serde_json::json!({"id": id, "kind": "checkpoint"}))
            .send()
            .await
            .expect("trigger answered");
        if r.status().as_u16() == 202 {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "never started");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `POST /v1/checkpoints/{id}/abort` is idempotent and makes the id report failed (aborted),
/// also on a worker that never saw its trigger; a trigger of it afterwards injects nothing.
#[tokio::test]
async fn an_abort_marks_the_snapshot_failed_and_is_idempotent() {
    use keyshift::runtime::protocol::CheckpointStatus;
    let (url, c) = started_worker().await;
    let aborted = |s: &CheckpointStatus| matches!(s, CheckpointStatus::Failed { error } if error.starts_with("aborted"));
    for _ in 0..2 {
        let r = c
            .post(format!("{url}/v1/checkpoints/7/abort"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .expect("abort answered");
        assert_eq!(r.status().as_u16(), 200);
        let st: CheckpointStatus = r.json().await.expect("a status");
        assert!(aborted(&st), "{st:?}");
    }
    // Wait until the worker runs, then trigger 7 (ignored) and 8 (taken).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    trigger_once_running(&c, &url, 7).await;
    let r = c
        .post(format!("{url}/v1/checkpoints"))
        .bearer_auth(TOKEN)
        .json(&serde_json::json!({"id": 8, "kind": "checkpoint", "lastCommitted": 0}))
        .send()
        .await
        .expect("trigger answered");
    assert_eq!(r.status().as_u16(), 202);
    let status = |id: u64| {
        let c = c.clone();
        let url = url.clone();
        async move { checkpoint_status(&c, &url, id, "").await }
    };
    loop {
        match status(8).await {
            CheckpointStatus::Completed(_) => break,
            CheckpointStatus::Pending => {}
            other => panic!("checkpoint 8: {other:?}"),
        }
        assert!(std::time::Instant::now() < deadline, "8 never completed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(aborted(&status(7).await), "7 stays aborted");
    // Below the newest finished snapshot, an id it never saw is refused.
    let r = c
        .post(format!("{url}/v1/checkpoints"))
        .bearer_auth(TOKEN)
        .json(&serde_json::json!({"id": 6, "kind": "checkpoint"}))
        .send()
        .await
        .expect("trigger answered");
    assert_eq!(r.status().as_u16(), 409);
}

/// `GET /v1/checkpoints/{id}?waitMs=N` holds its answer until the snapshot is done: one
/// request right after the trigger gets the acknowledgement; a done or unknown id is answered
/// at once.
#[tokio::test]
async fn a_long_poll_answers_once_the_snapshot_is_done() {
    use keyshift::runtime::protocol::CheckpointStatus;
    let (url, c) = started_worker().await;
    trigger_once_running(&c, &url, 1).await;
    let poll = |id: u64, wait_ms: u64| {
        let c = c.clone();
        let url = url.clone();
        async move {
            let asked = std::time::Instant::now();
            let status = checkpoint_status(&c, &url, id, &format!("?waitMs={wait_ms}")).await;
            (status, asked.elapsed())
        }
    };
    let (status, _) = poll(1, 8000).await;
    assert!(
        matches!(status, CheckpointStatus::Completed(_)),
        "one long poll gets the acknowledgement: {status:?}"
    );
    // Done, or never seen: no reason to hold the answer (the client's timeout is 10 s).
    for id in [1, 99] {
        let (status, took) = poll(id, 60_000).await;
        assert!(!matches!(status, CheckpointStatus::Pending), "{status:?}");
        assert!(took < Duration::from_secs(5), "{id}: held {took:?}");
    }
}

/// A start request's dataflow is checked by the CRD's rules, as a manifest is: one the API
/// server would refuse is refused with 422 and the API server's message naming the field (before,
/// a generator with 70000 partitions or 10^13 keys, or an object-store sink without a URL, was
/// accepted, and other faults got the runtime's own words); the worker can still be started
/// after.
#[tokio::test]
async fn a_start_request_s_job_is_checked_by_the_crd_rules() {
    use keyshift::validation;
    let (url, data) = worker().await;
    let c = http();
    let job = |yaml: &str| -> keyshift::crd::JobSpec { serde_yaml::from_str(yaml).expect("job") };
    let cases = [
        (
            "{source: {generator: {partitions: 70000, keys: 5}}, key: {field: key}, aggregation: {function: count}}",
            validation::MSG_PARTITIONS,
        ),
        (
            "{source: {generator: {partitions: 0, keys: 5}}, key: {field: key}, aggregation: {function: count}}",
            validation::MSG_PARTITIONS,
        ),
        (
            "{source: {generator: {partitions: 1, keys: 10000000000000}}, key: {field: key}, aggregation: {function: count}}",
            validation::MSG_KEYS,
        ),
        (
            "{source: {generator: {partitions: 1, keys: 5}}, key: {field: key}, aggregation: {function: count}, sink: {type: objectStore}}",
            validation::MSG_SINK_URL,
        ),
        (
            "{source: {generator: {partitions: 1, keys: 5}}, key: {field: key}, aggregation: {function: count}, window: {size: 5 minutes}}",
            validation::MSG_WINDOW_SIZE,
        ),
    ];
    for (yaml, message) in cases {
        let mut req = start_request(&data);
        req.job = job(yaml);
        // The manifest's validation says the same.
        assert_eq!(
            validation::validate_job(&req.job).map_err(|e| e.0),
            Err(vec![message.to_owned()]),
            "{yaml}"
        );
        let r = post_start(&c, &url, &req).await;
        let status = r.status().as_u16();
        let body = r.text().await.expect("body");
        assert_eq!(status, 422, "{yaml}: {body}");
        assert!(body.contains(message), "{body} does not say {message}");
    }
    let r = post_start(&c, &url, &start_request(&data)).await;
    assert_eq!(r.status().as_u16(), 202, "a valid start after the refusals");
}

/// A subtask waits for its peers' data connections as long as the start request says (the
/// coordinator's own wait, `readyTimeoutSecs`), counted from the request: here 2 s with a peer
/// that never starts, after which the worker stops with the failure (not after a fixed 120 s).
#[tokio::test]
async fn a_subtask_waits_for_its_peers_as_long_as_the_start_request_says() {
    let (url, data, serving) = serving_worker().await;
    let (_, other_data) = worker().await;
    let mut req = start_request(&data);
    req.parallelism = 2;
    req.peers = vec![data, other_data];
    req.ready_timeout_secs = Some(2);
    let started = std::time::Instant::now();
    let r = http()
        .post(format!("{url}/v1/start"))
        .bearer_auth(TOKEN)
        .json(&req)
        .send()
        .await
        .expect("start sent");
    assert!(r.status().is_success(), "{}", r.status());
    let ended = tokio::time::timeout(Duration::from_secs(30), serving)
        .await
        .expect("the worker gave up on its peer within 30 s")
        .expect("the worker task");
    let waited = started.elapsed();
    let failure = ended
        .expect_err("the worker stops with the failure")
        .to_string();
    assert!(failure.contains("connecting the data plane"), "{failure}");
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(15),
        "gave up after {waited:?}: {failure}"
    );
}
