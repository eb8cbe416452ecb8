//! Logging set-up: structured `tracing` output as text or JSON, filtered by `RUST_LOG`.

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Whether output may carry colour (ANSI escapes): only on a terminal, and never when
/// `NO_COLOR` is set to anything but the empty string (<https://no-color.org>).
pub fn color_allowed(no_color: Option<&std::ffi::OsStr>, terminal: bool) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

/// Installs the global subscriber, writing to stderr so stdout stays machine-readable.
/// `RUST_LOG` overrides the default level (`info`). Colour only on a terminal without
/// `NO_COLOR` ([`color_allowed`]).
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(color_allowed(
            std::env::var_os("NO_COLOR").as_deref(),
            std::io::IsTerminal::is_terminal(&std::io::stderr()),
        ));
    // A second init (tests) is harmless: keep the first subscriber.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// Installs the process's TLS crypto provider: aws-lc-rs, the only one compiled in (kube's
/// client, object_store's HTTP client and rustls all use it). rustls would also pick it from its
/// crate features; installing it explicitly keeps that true if another provider is ever pulled in
/// by a dependency. Call this first thing in every binary.
pub fn install_crypto_provider() {
    // Err means a provider is already installed, which is what we want.
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(color_allowed(None, true));
        assert!(color_allowed(Some(OsStr::new("")), true));
        assert!(!color_allowed(Some(OsStr::new("1")), true));
        assert!(!color_allowed(Some(OsStr::new("false")), true));
        assert!(!color_allowed(None, false));
    }
}
