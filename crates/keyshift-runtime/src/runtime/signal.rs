//! How a process learns it should stop: the worker, the operator and `keyshift local` alike.

/// Resolves on SIGTERM or Ctrl-C (what a pod's shutdown sends). The SIGTERM handler is
/// installed when this is called, not when the future is first polled, so a signal that arrives
/// in between is not lost (and does not kill the process). Call it inside a Tokio runtime.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send {
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
    async move {
        match term {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
}
