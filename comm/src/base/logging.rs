//! `OXCCL_DEBUG`: installs a `tracing` subscriber once per process (unless the application
//! installed its own). Levels: `error`, `warn` (default), `info` (transport per peer, algorithm per
//! collective), `debug`, `trace`. Every event carries the rank as a field.

use std::io::IsTerminal;
use std::sync::Once;

static INIT: Once = Once::new();

/// Installs the stderr subscriber for `OXCCL_DEBUG` (first call only; no-op if the application
/// already set a global subscriber).
pub fn init() {
    INIT.call_once(|| {
        let level = std::env::var("OXCCL_DEBUG").unwrap_or_else(|_| "warn".into()).to_ascii_lowercase();
        let level = match level.as_str() {
            "error" | "warn" | "info" | "debug" | "trace" => level,
            "version" => "info".into(),
            other => {
                eprintln!("oxccl: OXCCL_DEBUG={other:?} is not one of error, warn, info, debug, trace; using warn");
                "warn".into()
            }
        };
        let filter = tracing_subscriber::EnvFilter::new(format!("oxccl={level},oxccl_comm={level},oxccl_kernels={level}"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_target(false)
            .with_ansi(std::io::stderr().is_terminal())
            .try_init();
    });
}
