//! Logging set-up: structured `tracing` output as text or JSON on stderr, filtered by
//! `RUST_LOG` (default `info`). keyshift's binary and a job's own worker binary
//! ([`crate::runtime::worker::main`]) log alike.

use tracing_subscriber::EnvFilter;

/// Whether output may carry colour (ANSI escapes): only on a terminal, and never when
/// `NO_COLOR` is set to anything but the empty string (<https://no-color.org>).
pub fn color_allowed(no_color: Option<&std::ffi::OsStr>, terminal: bool) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

/// Installs the global subscriber, writing to stderr so stdout stays machine-readable: one JSON
/// object per line with `json`, human-readable lines otherwise. Colour only on a terminal
/// without `NO_COLOR` ([`color_allowed`]). A second call keeps the first subscriber.
pub fn init(json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(color_allowed(
            std::env::var_os("NO_COLOR").as_deref(),
            std::io::IsTerminal::is_terminal(&std::io::stderr()),
        ));
    let _ = match json {
        false => builder.try_init(),
        true => builder.json().flatten_event(true).try_init(),
    };
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
