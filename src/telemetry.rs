//! Logging set-up (the runtime's [`keyshift_runtime::telemetry`], shared with a job's own worker
//! binary) and the process's crypto provider.

pub use keyshift_runtime::telemetry::color_allowed;

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Installs the global subscriber on stderr (see [`keyshift_runtime::telemetry::init`]).
pub fn init(format: LogFormat) {
    keyshift_runtime::telemetry::init(format == LogFormat::Json);
}

/// Installs the process's TLS crypto provider: aws-lc-rs, the only one compiled in (kube's
/// client, object_store's HTTP client and rustls all use it). rustls would also pick it from its
/// crate features; installing it explicitly keeps that true if another provider is ever pulled in
/// by a dependency. Call this first thing in every binary.
pub fn install_crypto_provider() {
    // Err means a provider is already installed, which is what we want.
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}
