//! The coordinator's requests to a worker's control API: bounded in time and in the size of the
//! answer, failures named by subtask.

use super::*;

/// One request of the coordinator to a worker's control API.
pub const CONTROL_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The most a worker's answer to the coordinator may hold: a subtask's acknowledgement is part of
/// a snapshot's manifest, which is bounded the same ([`snapshot::MAX_MANIFEST_BYTES`]).
pub const MAX_WORKER_ANSWER_BYTES: u64 = snapshot::MAX_MANIFEST_BYTES;

/// A worker's error answer as words: the `error` of its JSON body (`{"error": "..."}`), else
/// the body as it is.
fn error_text(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("error")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned())
}

impl Coordinator {
    pub(super) fn fail(&self, subtask: usize, reason: impl std::fmt::Display) -> CoordinatorError {
        CoordinatorError::Worker {
            subtask,
            url: self.workers[subtask].control.clone(),
            reason: reason.to_string(),
        }
    }

    /// The body of a worker's answer, read up to a bound: a worker never makes the coordinator
    /// buffer more than [`MAX_WORKER_ANSWER_BYTES`] (checked on `Content-Length` before reading,
    /// then as the body streams).
    pub(super) async fn body(
        &self,
        subtask: usize,
        path: &str,
        mut resp: reqwest::Response,
    ) -> Result<Vec<u8>, CoordinatorError> {
        let too_large = |n: u64| {
            self.fail(
                subtask,
                format!(
                    "{path}: the answer is larger than {MAX_WORKER_ANSWER_BYTES} bytes ({n} or more); refused"
                ),
            )
        };
        if let Some(n) = resp.content_length()
            && n > MAX_WORKER_ANSWER_BYTES
        {
            return Err(too_large(n));
        }
        let mut out = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| self.fail(subtask, e))? {
            let n = (out.len() + chunk.len()) as u64;
            if n > MAX_WORKER_ANSWER_BYTES {
                return Err(too_large(n));
            }
            out.extend_from_slice(&chunk);
        }
        Ok(out)
    }

    pub(super) async fn post<T: serde::Serialize, R: serde::de::DeserializeOwned>(
        &self,
        subtask: usize,
        path: &str,
        body: &T,
    ) -> Result<Option<R>, CoordinatorError> {
        let url = format!("{}{path}", self.workers[subtask].control);
        let resp = self
            .http
            .post(&url)
            .bearer_auth(&self.token)
            .json(body)
            .send()
            .await
            .map_err(|e| self.fail(subtask, e))?;
        let status = resp.status();
        if !status.is_success() {
            let text = match self.body(subtask, path, resp).await {
                Ok(bytes) => error_text(&bytes),
                Err(e) => e.to_string(),
            };
            if status == reqwest::StatusCode::UNPROCESSABLE_ENTITY {
                return Err(CoordinatorError::Refused {
                    subtask,
                    url: self.workers[subtask].control.clone(),
                    reason: format!("{path}: {text}"),
                });
            }
            return Err(self.fail(subtask, format!("{path}: HTTP {status}: {text}")));
        }
        if status == reqwest::StatusCode::NO_CONTENT {
            return Ok(None);
        }
        let bytes = self.body(subtask, path, resp).await?;
        if bytes.is_empty() {
            return Ok(None);
        }
        // An accepted request's body is informative (what a start reads in all): one that
        // cannot be read is no failure.
        if status == reqwest::StatusCode::ACCEPTED {
            return Ok(serde_json::from_slice(&bytes).ok());
        }
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| self.fail(subtask, format!("{path}: bad answer: {e}")))
    }

    pub(super) async fn get<R: serde::de::DeserializeOwned>(
        &self,
        subtask: usize,
        path: &str,
    ) -> Result<R, CoordinatorError> {
        let url = format!("{}{path}", self.workers[subtask].control);
        let resp = self
            .http
            .get(&url)
            .bearer_auth(&self.token)
            .send()
            .await
            .map_err(|e| self.fail(subtask, e))?;
        let status = resp.status();
        if !status.is_success() {
            return Err(self.fail(subtask, format!("{path}: HTTP {status}")));
        }
        let bytes = self.body(subtask, path, resp).await?;
        serde_json::from_slice(&bytes).map_err(|e| self.fail(subtask, format!("{path}: {e}")))
    }

    /// Every worker's status, in subtask order.
    pub async fn status(&self) -> Result<Vec<WorkerStatus>, CoordinatorError> {
        try_join_all((0..self.workers.len()).map(|i| self.get::<WorkerStatus>(i, "/v1/status")))
            .await
    }
}
