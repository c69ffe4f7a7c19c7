//! The signals the launcher catches and forwards to the ranks, and signal names.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::LaunchError;

/// SIGINT, SIGTERM and SIGHUP caught while a job runs.
pub(crate) struct Signals {
    flags: Vec<(libc::c_int, Arc<AtomicBool>)>,
    ids: Vec<signal_hook::SigId>,
}

impl Signals {
    pub(super) fn register() -> Result<Self, LaunchError> {
        let mut s = Signals {
            flags: Vec::new(),
            ids: Vec::new(),
        };
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            let flag = Arc::new(AtomicBool::new(false));
            let id = signal_hook::flag::register(sig, Arc::clone(&flag)).map_err(|source| {
                LaunchError::Io {
                    context: "installing signal handlers",
                    source,
                }
            })?;
            s.flags.push((sig, flag));
            s.ids.push(id);
        }
        Ok(s)
    }

    /// Signals with a flag for `sig` and no handler installed: setting the flag stands for
    /// catching the signal.
    #[cfg(test)]
    pub(super) fn flag_only(sig: libc::c_int) -> (Self, Arc<AtomicBool>) {
        let flag = Arc::new(AtomicBool::new(false));
        let signals = Signals {
            flags: vec![(sig, Arc::clone(&flag))],
            ids: Vec::new(),
        };
        (signals, flag)
    }

    /// The first pending signal, cleared.
    pub(crate) fn take(&self) -> Option<libc::c_int> {
        self.flags
            .iter()
            .find(|(_, f)| f.swap(false, Ordering::SeqCst))
            .map(|(s, _)| *s)
    }
}

impl Drop for Signals {
    fn drop(&mut self) {
        for id in self.ids.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

/// The conventional name of a signal number, if it is a common one.
pub fn signal_name(sig: i32) -> Option<&'static str> {
    Some(match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSYS => "SIGSYS",
        _ => return None,
    })
}

/// What the other nodes are told when this node's launcher received `sig`.
pub(super) fn interrupted_text(sig: libc::c_int) -> String {
    format!(
        "its launcher received {}",
        signal_name(sig).unwrap_or("a signal")
    )
}
