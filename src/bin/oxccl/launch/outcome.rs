//! How a job ended ([`LaunchOutcome`], [`JobEnd`], [`RankFailure`], [`NodeFailure`]), how one
//! rank ended ([`Termination`]), why a job could not run ([`LaunchError`]), and the exit code of
//! each.

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::time::Duration;

use super::signals::signal_name;

/// How a rank's process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Termination {
    /// It exited with this status code.
    Exited(i32),
    /// It was killed by this signal.
    Signaled {
        /// Signal number.
        signal: i32,
        /// Whether it dumped core.
        core_dumped: bool,
    },
}

impl Termination {
    /// The shell-style exit code for this termination: the code itself, or `128 + signal`.
    pub fn exit_code(&self) -> i32 {
        match *self {
            Termination::Exited(c) => c,
            Termination::Signaled { signal, .. } => 128 + signal,
        }
    }

    /// Whether this is a clean exit with status 0.
    pub fn success(&self) -> bool {
        *self == Termination::Exited(0)
    }

    pub(super) fn from_status(st: std::process::ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        match (st.code(), st.signal()) {
            (Some(c), _) => Termination::Exited(c),
            (None, Some(signal)) => Termination::Signaled {
                signal,
                core_dumped: st.core_dumped(),
            },
            // Stopped/continued statuses are never returned by a plain waitpid.
            (None, None) => Termination::Exited(1),
        }
    }
}

impl fmt::Display for Termination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Termination::Exited(c) => write!(f, "exited with code {c}"),
            Termination::Signaled {
                signal,
                core_dumped,
            } => {
                write!(f, "killed by signal {signal}")?;
                match (signal_name(signal), core_dumped) {
                    (Some(n), false) => write!(f, " ({n})"),
                    (Some(n), true) => write!(f, " ({n}, core dumped)"),
                    (None, true) => write!(f, " (core dumped)"),
                    (None, false) => Ok(()),
                }
            }
        }
    }
}

/// The rank whose failure ended an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFailure {
    /// Global rank.
    pub rank: usize,
    /// Rank on this node.
    pub local_rank: usize,
    /// Its process id.
    pub pid: u32,
    /// How it ended.
    pub termination: Termination,
}

impl fmt::Display for RankFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} (pid {}) failed: {}",
            self.rank, self.pid, self.termination
        )
    }
}

/// The end of a multi-node job that another node caused: what its launcher reported through the
/// store (a failed rank, its time-out, a signal), or the loss of node 0's launcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeFailure {
    /// The node it happened on.
    pub node: usize,
    /// That node's exit code (the failed rank's, 124 for a time-out, 128 + s for a signal; 1
    /// when node 0 was lost).
    pub exit_code: i32,
    /// What happened there, e.g. `rank 3 (pid 1234) failed: exited with code 3`.
    pub what: String,
}

impl fmt::Display for NodeFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node {}: {}", self.node, self.what)
    }
}

/// How a job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobEnd {
    /// Every rank exited with status 0.
    Success,
    /// A rank failed and no restart was left.
    RankFailed(RankFailure),
    /// Another node of a multi-node job failed (its ranks, its time-out, a signal to its
    /// launcher) or node 0's launcher was lost; this node's ranks were stopped, or had already
    /// succeeded.
    NodeFailed(NodeFailure),
    /// The launcher received this signal and forwarded it to the ranks.
    Interrupted {
        /// Signal number (SIGINT, SIGTERM or SIGHUP).
        signal: i32,
    },
    /// [`LaunchConfig::timeout`](super::LaunchConfig::timeout) expired.
    TimedOut {
        /// The configured limit.
        after: Duration,
    },
}

/// What [`launch`](super::launch) returns once every rank is gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchOutcome {
    /// How many times the ranks were started (1 + restarts).
    pub attempts: u32,
    /// How the last attempt ended.
    pub end: JobEnd,
}

impl LaunchOutcome {
    /// The launcher's exit code, per the contract in the [module docs](super).
    pub fn exit_code(&self) -> i32 {
        match &self.end {
            JobEnd::Success => 0,
            JobEnd::RankFailed(f) => failure_code(f),
            JobEnd::NodeFailed(f) => match f.exit_code {
                c @ 1..=255 => c,
                _ => 1,
            },
            JobEnd::Interrupted { signal } => 128 + signal,
            JobEnd::TimedOut { .. } => 124,
        }
    }
}

/// Why [`launch`](super::launch) could not run the job at all.
#[derive(Debug)]
#[non_exhaustive]
pub enum LaunchError {
    /// The configuration is inconsistent (nothing was started).
    InvalidConfig(String),
    /// The rendezvous store could not be hosted.
    Store {
        /// The address it was to listen on.
        addr: String,
        /// What went wrong.
        message: String,
    },
    /// A rank's command could not be started; ranks already started were killed and reaped.
    Spawn {
        /// Global rank being started.
        rank: usize,
        /// The command.
        program: OsString,
        /// The OS error.
        source: io::Error,
    },
    /// Any other OS-level failure of the launcher (signal handlers, watchdog, threads).
    Io {
        /// What the launcher was doing.
        context: &'static str,
        /// The OS error.
        source: io::Error,
    },
}

impl LaunchError {
    /// The launcher's exit code for this error, per the contract in the [module docs](super).
    pub fn exit_code(&self) -> i32 {
        match self {
            LaunchError::InvalidConfig(_) => 2,
            LaunchError::Spawn { source, .. } => match source.kind() {
                io::ErrorKind::NotFound => 127,
                io::ErrorKind::PermissionDenied => 126,
                _ => 1,
            },
            LaunchError::Store { .. } | LaunchError::Io { .. } => 1,
        }
    }
}

impl fmt::Display for LaunchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LaunchError::InvalidConfig(m) => write!(f, "invalid arguments: {m}"),
            LaunchError::Store { addr, message } if message.contains(addr.as_str()) => {
                write!(f, "{message}")
            }
            LaunchError::Store { addr, message } => {
                write!(f, "cannot host the rendezvous store on {addr}: {message}")
            }
            LaunchError::Spawn {
                rank,
                program,
                source,
            } => {
                let program = program.to_string_lossy();
                match source.kind() {
                    io::ErrorKind::NotFound => write!(
                        f,
                        "cannot start rank {rank}: command not found: '{program}' ({source})"
                    ),
                    io::ErrorKind::PermissionDenied => write!(
                        f,
                        "cannot start rank {rank}: '{program}' is not executable ({source})"
                    ),
                    _ => write!(f, "cannot start rank {rank}: '{program}': {source}"),
                }
            }
            LaunchError::Io { context, source } => write!(f, "{context}: {source}"),
        }
    }
}

impl std::error::Error for LaunchError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LaunchError::Spawn { source, .. } | LaunchError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// The launcher's exit code for a failed rank (its code, `128 + s` for signal `s`, 1 if out of
/// range), as [`LaunchOutcome::exit_code`] gives it.
pub(super) fn failure_code(f: &RankFailure) -> i32 {
    match f.termination.exit_code() {
        c @ 1..=255 => c,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminations_read_like_shell_statuses() {
        let killed = Termination::Signaled {
            signal: libc::SIGKILL,
            core_dumped: false,
        };
        assert_eq!(killed.to_string(), "killed by signal 9 (SIGKILL)");
        assert_eq!(killed.exit_code(), 137);
        assert_eq!(Termination::Exited(3).to_string(), "exited with code 3");
        let f = RankFailure {
            rank: 2,
            local_rank: 2,
            pid: 77,
            termination: killed,
        };
        let out = LaunchOutcome {
            attempts: 1,
            end: JobEnd::RankFailed(f),
        };
        assert_eq!(out.exit_code(), 137);
    }
}
