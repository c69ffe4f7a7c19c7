//! Logging. The library only emits `tracing` events (every one with the rank as a field); it
//! never installs a subscriber, so a trainer's own (`tracing_subscriber::fmt().init()`, say)
//! keeps working and sees oxccl's events under the targets `oxccl_comm`, `oxccl_ddp`, ...
//!
//! [`init`] is the opt-in subscriber, NCCL_DEBUG's counterpart: oxccl's events only, to stderr,
//! at the level `OXCCL_DEBUG` names: `error`, `warn` (the default), `info` (transport per peer,
//! algorithm per collective), `debug`, `trace`. The `oxccl` command line calls it.
//!
//! When `OXCCL_DEBUG` is set but no subscriber exists at the first communicator's creation,
//! oxccl says once on stderr how to see its logs.

use std::io::IsTerminal;
use std::sync::Once;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// The crates whose events [`init`] prints (each event's target is its module path).
pub const CRATES: &[&str] = &[
    "oxccl",
    "oxccl_comm",
    "oxccl_kernels",
    "oxccl_ddp",
    "oxccl_zero",
    "oxccl_pipeline",
];

/// Whether an event of `target` comes from oxccl (a crate of [`CRATES`], not just a name that
/// starts the same: `oxccl_trainer`'s events are the trainer's).
pub fn is_oxccl(target: &str) -> bool {
    CRATES.contains(&target.split("::").next().unwrap_or(target))
}

/// `OXCCL_DEBUG`'s level (`warn` when unset or not a level, with a note on stderr for the
/// latter).
fn level() -> tracing::Level {
    let v = std::env::var("OXCCL_DEBUG").unwrap_or_default();
    match v.trim().to_ascii_lowercase().as_str() {
        "error" => tracing::Level::ERROR,
        "" | "warn" => tracing::Level::WARN,
        "info" | "version" => tracing::Level::INFO,
        "debug" => tracing::Level::DEBUG,
        "trace" => tracing::Level::TRACE,
        other => {
            eprintln!(
                "oxccl: OXCCL_DEBUG={other:?} is not one of error, warn, info, debug, trace; using warn"
            );
            tracing::Level::WARN
        }
    }
}

static INIT: Once = Once::new();

/// Installs a stderr subscriber for oxccl's events at `OXCCL_DEBUG`'s level, as the process's
/// global default. Returns false when the process has a global subscriber already (the
/// application's: oxccl's events go there) or on any call after the first.
///
/// ```
/// oxccl_comm::logging::init(); // then OXCCL_DEBUG=info shows transports and algorithms
/// ```
pub fn init() -> bool {
    let mut installed = false;
    INIT.call_once(|| {
        let level = level();
        let layer = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_target(false)
            .with_ansi(std::io::stderr().is_terminal())
            .with_filter(tracing_subscriber::filter::filter_fn(move |m| {
                is_oxccl(m.target()) && *m.level() <= level
            }));
        installed = tracing_subscriber::registry()
            .with(layer)
            .try_init()
            .is_ok();
    });
    installed
}

/// Says once per process, on stderr, how to see oxccl's logs when `OXCCL_DEBUG` asks for more
/// than warnings and nothing would print them (no global subscriber).
pub(crate) fn hint_if_unseen() {
    static HINT: Once = Once::new();
    let wanted = std::env::var("OXCCL_DEBUG").is_ok_and(|v| !v.trim().is_empty());
    if !wanted || tracing::dispatcher::has_been_set() {
        return;
    }
    HINT.call_once(|| {
        eprintln!(
            "oxccl: OXCCL_DEBUG is set but this process has no tracing subscriber, so oxccl's \
             logs go nowhere: call oxccl::logging::init() at start (or install your own \
             subscriber; oxccl's events have the targets oxccl_comm, oxccl_ddp, ...)"
        );
    });
}

/// A warning that must be seen: a `tracing` warning, and on stderr too when the process has no
/// subscriber (a rendezvous that keeps failing must not stay silent).
pub(crate) fn notice(msg: &str) {
    tracing::warn!("{msg}");
    if !tracing::dispatcher::has_been_set() {
        eprintln!("oxccl: {msg}");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_oxccls_own_crates_are_oxccl() {
        for t in ["oxccl", "oxccl_comm::engine", "oxccl_ddp", "oxccl::bin"] {
            assert!(super::is_oxccl(t), "{t}");
        }
        for t in ["oxccl_trainer", "oxcclx::a", "my_app", "oxccl_commx"] {
            assert!(!super::is_oxccl(t), "{t}");
        }
    }
}
