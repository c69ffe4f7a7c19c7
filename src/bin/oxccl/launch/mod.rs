//! `oxccl launch`: start the ranks of a job on this node and supervise them (oxccl's torchrun).
//!
//! [`launch`] starts [`LaunchConfig::nproc_per_node`] copies of a command, one per local rank,
//! hands each one its place in the job through environment variables, hosts the rendezvous store
//! on node 0, forwards the ranks' output, and tears the whole job down as soon as one rank fails.
//!
//! # Environment of every rank
//!
//! Each rank inherits the launcher's environment, plus [`LaunchConfig::env`], plus:
//!
//! | variable | value |
//! |---|---|
//! | `OXCCL_RANK` | global rank: `node_rank * nproc_per_node + local_rank` |
//! | `OXCCL_WORLD_SIZE` | `nnodes * nproc_per_node` |
//! | `OXCCL_LOCAL_RANK` | rank on this node, `0..nproc_per_node` |
//! | `OXCCL_LOCAL_WORLD_SIZE` | `nproc_per_node` |
//! | `OXCCL_NNODES`, `OXCCL_NODE_RANK` | the node count and this node's index |
//! | `OXCCL_STORE` | `host:port` of the rendezvous store (the port actually bound; IPv6 literals in brackets) |
//! | `OXCCL_STORE_HOSTED` | `1`: the launcher hosts the store, so rank 0 must not start one itself |
//! | `OXCCL_JOB_ID` | `<base>-r<attempt>`, see below; distinct per attempt, so stale store keys are never reused |
//! | `OXCCL_RESTART_COUNT` | the attempt number, `0` for the first start, `1` after the first restart, ... |
//! | `OXCCL_MAX_RESTARTS` | [`LaunchConfig::max_restarts`] |
//! | `OXCCL_RESPAWN` | [`LaunchConfig::respawn`]: how many failed ranks this node's launcher replaces |
//! | `OXCCL_JOIN` | `1` in a replacement for a failed rank ([`LaunchConfig::respawn`]; its other variables are the failed rank's), `0` in every other rank |
//! | `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` | the torchrun equivalents, for programs that read those |
//!
//! The job id base is [`LaunchConfig::job_id`] if set, else `OXCCL_JOB_ID` from the launcher's
//! environment, else `<launcher pid>-<unix time>` on a single node, or `mn-<master port>` on
//! several nodes (every node's launcher must compute the same id; the store is fresh per launch).
//!
//! The ranks' stdin is `/dev/null`. Their stdout and stderr are piped; every line is written to
//! the launcher's own stdout or stderr respectively as one whole line (lines from different ranks
//! never interleave mid-line), prefixed with `[R] ` where `R` is the global rank unless
//! [`LaunchConfig::prefix_output`] is off. A final line without a newline gets one; a line longer
//! than 1 MiB is cut into 1 MiB pieces.
//!
//! # CPU binding
//!
//! With [`LaunchConfig::bind`] = [`Bind::Core`] (`--bind core`) local rank `i` is bound, before it
//! starts, to the `i % n`-th of the `n` CPUs the launcher may use; with [`Bind::Block`]
//! (`--bind block`) to its own block of `n / nproc_per_node` of them (at least one). The default
//! is no binding.
//!
//! # Exit-code contract ([`LaunchOutcome::exit_code`], [`LaunchError::exit_code`])
//!
//! | code | meaning |
//! |---|---|
//! | `0` | every rank exited with status 0 (with `respawn`: every rank a replacement took over from aside) |
//! | `c` (1..=255) | the first rank seen failing exited with code `c` (after `max_restarts` restarts; with `keep_going`, once every rank is done; with `respawn`, the first failure not replaced) |
//! | `c` | another node reported the job's first failure with code `c` ([`JobEnd::NodeFailed`]); `1` when node 0's launcher was lost |
//! | `128 + s` | the first rank seen failing was killed by signal `s` (e.g. 137 for SIGKILL) |
//! | `128 + s` | the launcher itself received signal `s` (130 SIGINT, 143 SIGTERM, 129 SIGHUP) and forwarded it |
//! | `124` | [`LaunchConfig::timeout`] expired |
//! | `127` / `126` | the command could not be started: not found / not executable |
//! | `2` | invalid configuration (also clap's code for bad command lines) |
//! | `1` | any other launcher error (store could not be bound, pipes, fork...) |
//!
//! A failing rank is reported on stderr as
//! `oxccl launch: rank 2 (pid 1234) failed: exited with code 3` or
//! `... failed: killed by signal 9 (SIGKILL)`.
//!
//! # Process hygiene
//!
//! * Every rank runs in its own process group, and all signals go to the whole group, so
//!   processes a rank starts (a shell's children, data-loader workers) are signalled with it.
//! * On failure, time-out or a forwarded signal the launcher sends SIGTERM (or the forwarded
//!   signal) to every group, waits [`LaunchConfig::failure_grace`] (or
//!   [`LaunchConfig::signal_grace`]), then SIGKILLs what is left. A second signal to the launcher
//!   skips the grace period. Leftover processes of ranks that exited 0 are terminated likewise.
//!   This holds while the ranks are still being started too: a signal, the time-out or a rank
//!   that already failed stops the start, and the ranks started so far are stopped and reaped.
//! * On Linux every rank gets `PR_SET_PDEATHSIG = SIGKILL`, and a small watchdog process forked
//!   by the launcher SIGKILLs every rank's process group if the launcher itself dies (even by
//!   SIGKILL), so grandchildren do not survive either.
//! * With [`LaunchConfig::child_subreaper`] (Linux), orphaned grandchildren are re-parented to the
//!   launcher, which reaps them: no zombies are left behind.
//! * Processes that leave their rank's process group on purpose (`setsid`, `setpgid`) are out of
//!   reach, as they are for any launcher without cgroups.
//!
//! # Several nodes
//!
//! With [`LaunchConfig::nnodes`] > 1, the launchers keep in touch through the store node 0 hosts
//! (as torchrun's agents do through their rendezvous), each with a thread that polls it every
//! 200 ms:
//!
//! * The first node whose ranks fail, whose `--timeout` expires or whose launcher gets a signal
//!   in an attempt records that in the store (first one wins). Every other launcher sees it
//!   within a poll, says `oxccl launch: node 1: rank 3 (pid 1234) failed: exited with code 3;
//!   stopping all 8 local ranks`, and stops its ranks as after a local failure. Without this,
//!   the other nodes' ranks would wait for the failed ones until `OXCCL_TIMEOUT` (10 minutes by
//!   default) when the failure came before or between their collectives.
//! * With `--max-restarts R` (the same on every node) every node then restarts its ranks, up to
//!   R times, each attempt with a fresh job id (`<base>-r<attempt>`), like torchrun's restarts
//!   of the whole worker group. A signal or `--timeout` is never restarted. Once the restarts
//!   are used up, every launcher exits with the failing node's code ([`JobEnd::NodeFailed`] on
//!   the other nodes).
//! * A node whose ranks all succeeded waits for the attempt's outcome: it ends once every node's
//!   ranks are done, and if one node failed meanwhile, this node restarts with the others (or
//!   exits with that node's code), so every node's exit code tells the job's outcome.
//! * With `--keep-going` a failed rank stops nothing: not its node's other ranks, not the other
//!   nodes (its failure is not recorded for them). Each launcher exits with its own first
//!   failed rank's code once every node's ranks are done.
//! * Node 0 keeps the store up until every other node's launcher is done (their ranks may still
//!   create communicators). Waits for other nodes say so after 2 s and stop waiting for a node
//!   whose launcher has not been heard from for 30 s, on a signal, or at `--timeout`.
//! * A node whose store refuses connections for 3 s (nothing listens on its port: node 0's
//!   launcher is gone), or does not answer for 60 s, stops its ranks and exits with code 1.
//!
//! Every store request of the launchers has a 5 s reply time-out. The keys are described in
//! `nodes.rs`.
//!
//! Note that `PR_SET_PDEATHSIG` fires when the *thread* that spawned the ranks exits: call
//! [`launch`] from a thread that outlives the call (it always does, since [`launch`] blocks
//! until every rank is gone).

/// Writes one user-facing `oxccl launch: ...` line to stderr. Unlike `eprintln!` it never
/// panics (a closed stderr must not take the launcher down with ranks still running).
macro_rules! note {
    ($($arg:tt)*) => {{
        use ::std::io::Write as _;
        let _ = ::std::writeln!(
            ::std::io::stderr().lock(),
            "oxccl launch: {}",
            ::std::format_args!($($arg)*)
        );
    }};
}

mod nodes;
mod output;
mod proc;
mod watchdog;

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use oxccl_comm::bootstrap::TcpStoreServer;

use self::nodes::{NodeLink, NodesEnd};
use self::proc::{AttemptEnd, Job, RankSpec, Subreaper, SupervisorCtx};
use self::watchdog::Watchdog;

/// The most ranks one launcher starts on its node ([`LaunchConfig::nproc_per_node`]); also the
/// number of process groups the orphan watchdog can track.
pub const MAX_NPROC_PER_NODE: usize = 4096;

/// Everything [`launch`] needs to start a job on this node.
///
/// Build it with [`LaunchConfig::new`] and adjust the public fields.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LaunchConfig {
    /// Ranks started on this node (`-n`, `--nproc-per-node`, `--np`), 1 to
    /// [`MAX_NPROC_PER_NODE`].
    pub nproc_per_node: usize,
    /// Nodes in the job (`--nnodes`, default 1).
    pub nnodes: usize,
    /// Index of this node, `0..nnodes` (`--node-rank`, default 0). Node 0 hosts the store.
    pub node_rank: usize,
    /// Address of node 0, where the store listens (`--master-addr`, default `127.0.0.1`).
    /// A host name, an IPv4 or an IPv6 literal (brackets optional).
    pub master_addr: String,
    /// Store port (`--master-port`); 0 picks a free port, which is only allowed with one node.
    pub master_port: u16,
    /// How many times the whole local job is restarted after a rank fails (`--max-restarts`,
    /// default 0). With several nodes, every node restarts its ranks when any node's fail
    /// (every node must be given the same value).
    pub max_restarts: u32,
    /// A failed rank does not stop the others (`--keep-going`, default off): they may shrink
    /// their communicators (`Communicator::shrink`) and go on. The launcher waits for every rank
    /// and exits with the first failed rank's code; on several nodes, a rank failing does not
    /// stop the other nodes either. Not with `max_restarts`.
    pub keep_going: bool,
    /// How many replacement processes this launcher may start for failed ranks (`--respawn`,
    /// default 0). A replacement runs the same command with the failed rank's variables plus
    /// `OXCCL_JOIN=1`: `Communicator::from_env` then joins the communicator the survivors grow
    /// (`Communicator::grow`) instead of creating the world. Implies `keep_going`; not with
    /// `max_restarts`. Once they are spent, further failures are kept as with `keep_going`; a
    /// failure that was replaced does not count in the exit code. On a single node a failed rank
    /// is only replaced while another local rank still runs (nobody is left to grow otherwise);
    /// a replacement nobody grows for waits out its `OXCCL_TIMEOUT` and fails.
    pub respawn: u32,
    /// Prefix every forwarded output line with `[R] ` (default on; `--no-prefix` turns it off).
    pub prefix_output: bool,
    /// Kill the job if it runs longer than this, restarts included (`--timeout`).
    pub timeout: Option<Duration>,
    /// Base of `OXCCL_JOB_ID` (`--job-id`); see the [module docs](self).
    pub job_id: Option<String>,
    /// The command to run for every rank.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Extra environment for every rank, applied before the launcher's own variables.
    pub env: Vec<(OsString, OsString)>,
    /// Catch SIGINT, SIGTERM and SIGHUP while the job runs and forward them to the ranks
    /// (default off; `oxccl launch` and the `oxccl perf --np` parent turn it on). The handlers
    /// stay installed (as no-ops) after [`launch`] returns.
    pub forward_signals: bool,
    /// Make the launcher a child subreaper while the job runs (Linux; default on), so orphaned
    /// grandchildren of the ranks are re-parented to it and reaped.
    pub child_subreaper: bool,
    /// How long ranks get between SIGTERM and SIGKILL after a failure or time-out (default 3 s).
    pub failure_grace: Duration,
    /// How long ranks get after a forwarded signal before SIGKILL (default 5 s).
    pub signal_grace: Duration,
    /// After a rank fails (here or on another node), how long the others get to end on their
    /// own (a communicator failure reaches them within milliseconds, and they write their flight
    /// records) before SIGTERM (default 0; `oxccl launch --trace-dir` sets 1 s). Ranks still
    /// running then are terminated as usual.
    pub failure_settle: Duration,
    /// CPU binding of the ranks (`--bind`, default [`Bind::None`]).
    pub bind: Bind,
}

/// How the launcher binds ranks to CPUs (`--bind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Bind {
    /// No binding: ranks run wherever the kernel puts them (torchrun's behaviour; right for ranks
    /// that run threads of their own).
    #[default]
    None,
    /// Local rank `i` runs on the `i`-th CPU the launcher may use (wrapping when there are more
    /// ranks than CPUs), like `mpirun --bind-to core`: two single-threaded ranks never share a
    /// core and never migrate, which keeps latency figures steady.
    Core,
    /// Local rank `i` of `n` runs on its own block of `k = max(1, c / n)` of the `c` CPUs the
    /// launcher may use, the `i`-th such block (CPUs `i k .. (i + 1) k` in the launcher's list,
    /// wrapping when there are more ranks than CPUs), like `mpirun --map-by slot:PE=k`: for ranks
    /// with threads of their own (a DDP rank's backward pass beside its progress thread), which
    /// `Core` would make take turns on one CPU.
    Block,
}

/// The CPUs local rank `local_rank` of `nproc` is bound to under `bind`, out of `cpus` (the
/// CPUs the launcher may use, in order): none under [`Bind::None`] or when `cpus` is empty.
pub(crate) fn bound_cpus(
    bind: Bind,
    cpus: &[usize],
    local_rank: usize,
    nproc: usize,
) -> Vec<usize> {
    let c = cpus.len();
    if c == 0 {
        return Vec::new();
    }
    match bind {
        Bind::None => Vec::new(),
        Bind::Core => vec![cpus[local_rank % c]],
        Bind::Block => {
            let k = (c / nproc.max(1)).max(1);
            let start = (local_rank % (c / k)) * k;
            cpus[start..start + k].to_vec()
        }
    }
}

impl std::str::FromStr for Bind {
    type Err = String;
    fn from_str(s: &str) -> Result<Bind, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" => Ok(Bind::None),
            "core" => Ok(Bind::Core),
            "block" => Ok(Bind::Block),
            _ => Err(format!(
                "unknown binding {s:?}; expected none, core or block"
            )),
        }
    }
}

impl LaunchConfig {
    /// A single-node configuration running `program args...` on `nproc_per_node` ranks with every
    /// other setting at its default.
    pub fn new<P, I, A>(nproc_per_node: usize, program: P, args: I) -> Self
    where
        P: Into<OsString>,
        I: IntoIterator<Item = A>,
        A: Into<OsString>,
    {
        LaunchConfig {
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".to_owned(),
            master_port: 0,
            max_restarts: 0,
            keep_going: false,
            respawn: 0,
            prefix_output: true,
            timeout: None,
            job_id: None,
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
            env: Vec::new(),
            forward_signals: false,
            child_subreaper: true,
            failure_grace: Duration::from_secs(3),
            signal_grace: Duration::from_secs(5),
            failure_settle: Duration::ZERO,
            bind: Bind::None,
        }
    }

    /// Whether a failed rank leaves the others running (`keep_going`, or `respawn`).
    pub fn keeps_going(&self) -> bool {
        self.keep_going || self.respawn > 0
    }

    /// Total number of ranks, `nnodes * nproc_per_node`.
    pub fn world_size(&self) -> usize {
        self.nnodes.saturating_mul(self.nproc_per_node)
    }

    /// Checks the configuration without starting anything.
    pub fn validate(&self) -> Result<(), LaunchError> {
        let bad = |m: String| Err(LaunchError::InvalidConfig(m));
        if self.nproc_per_node == 0 {
            return bad("-n/--nproc-per-node must be at least 1".into());
        }
        if self.nproc_per_node > MAX_NPROC_PER_NODE {
            return bad(format!(
                "-n/--nproc-per-node {} is too large: at most {MAX_NPROC_PER_NODE} ranks per node \
                 are supported",
                self.nproc_per_node
            ));
        }
        if self.nnodes == 0 {
            return bad("--nnodes must be at least 1".into());
        }
        if self.nnodes.checked_mul(self.nproc_per_node).is_none() {
            return bad("--nnodes * --nproc-per-node overflows".into());
        }
        if self.node_rank >= self.nnodes {
            return bad(format!(
                "--node-rank {} is out of range for --nnodes {} (must be 0..{})",
                self.node_rank, self.nnodes, self.nnodes
            ));
        }
        if self.nnodes > 1 && self.master_port == 0 {
            return bad(format!(
                "--master-port is required when --nnodes is {} (> 1): every node must be told the \
                 same store port; a free port (0) can only be picked with --nnodes 1",
                self.nnodes
            ));
        }
        if self.respawn > 0 && self.max_restarts > 0 {
            return bad(format!(
                "--respawn {} and --max-restarts {} exclude each other: --respawn replaces a \
                 failed rank while the others go on, --max-restarts restarts every rank",
                self.respawn, self.max_restarts
            ));
        }
        if self.keep_going && self.max_restarts > 0 {
            return bad(format!(
                "--keep-going and --max-restarts {} exclude each other: with --keep-going a failed \
                 rank's peers go on without it instead of restarting",
                self.max_restarts
            ));
        }
        if strip_brackets(&self.master_addr).is_empty() {
            return bad("--master-addr must not be empty".into());
        }
        if self.timeout == Some(Duration::ZERO) {
            return bad("--timeout must be greater than 0".into());
        }
        if let Some(t) = self.timeout {
            if Instant::now().checked_add(t).is_none() {
                return bad(timeout_too_large(t));
            }
        }
        if self.program.is_empty() {
            return bad("no command given (usage: oxccl launch -n N -- CMD [ARGS...])".into());
        }
        if let Some(id) = &self.job_id {
            if id.is_empty() {
                return bad("--job-id must not be empty".into());
            }
        }
        Ok(())
    }
}

fn timeout_too_large(t: Duration) -> String {
    format!(
        "--timeout {}s is too large for this system's clock; leave --timeout out for no limit",
        t.as_secs_f64()
    )
}

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

    fn from_status(st: std::process::ExitStatus) -> Self {
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
    /// [`LaunchConfig::timeout`] expired.
    TimedOut {
        /// The configured limit.
        after: Duration,
    },
}

/// What [`launch`] returns once every rank is gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchOutcome {
    /// How many times the ranks were started (1 + restarts).
    pub attempts: u32,
    /// How the last attempt ended.
    pub end: JobEnd,
}

impl LaunchOutcome {
    /// The launcher's exit code, per the contract in the [module docs](self).
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

/// Why [`launch`] could not run the job at all.
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
    /// The launcher's exit code for this error, per the contract in the [module docs](self).
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

/// Runs the job described by `cfg` on this node and returns once every rank (and every process
/// they left behind) is gone.
///
/// Failures of ranks are not errors: they come back as [`JobEnd::RankFailed`] (after
/// `max_restarts` restarts). Errors are reserved for jobs that could not run at all.
pub fn launch(cfg: &LaunchConfig) -> Result<LaunchOutcome, LaunchError> {
    cfg.validate()?;

    let signals = if cfg.forward_signals {
        Some(Signals::register()?)
    } else {
        None
    };
    let deadline = match cfg.timeout {
        None => None,
        Some(t) => Some(
            Instant::now()
                .checked_add(t)
                .ok_or_else(|| LaunchError::InvalidConfig(timeout_too_large(t)))?,
        ),
    };

    let store = host_store(cfg)?;
    let job_base = job_id_base(cfg, store.port);
    tracing::debug!(store = %store.rank_addr, job = %job_base, "oxccl launch: store ready");

    let _subreaper = cfg.child_subreaper.then(Subreaper::acquire);
    let mut watchdog = match Watchdog::start() {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!("oxccl launch: cannot start the orphan watchdog: {e}");
            None
        }
    };

    let nodes = if cfg.nnodes > 1 {
        let link = NodeLink::start(
            cfg.node_rank,
            cfg.nnodes,
            store.client_host.clone(),
            store.port,
            &job_base,
        )
        .map_err(|source| LaunchError::Io {
            context: "starting the thread that watches the other nodes",
            source,
        })?;
        Some(link)
    } else {
        None
    };
    let ctx = SupervisorCtx {
        signals: signals.as_ref(),
        deadline,
        failure_grace: cfg.failure_grace,
        signal_grace: cfg.signal_grace,
        failure_settle: cfg.failure_settle,
        nodes: nodes.as_ref(),
        keep_going: cfg.keeps_going(),
    };

    let mut attempt: u32 = 0;
    loop {
        let job_id = format!("{job_base}-r{attempt}");
        let specs = rank_specs(cfg, &store, &job_id, attempt);
        let mut job = match Job::spawn(cfg, specs, watchdog.as_mut(), &ctx) {
            Ok(job) => job,
            Err(e) => {
                // The ranks that did start are gone; they may have created segments.
                remove_shm_segments(&job_id);
                return Err(e);
            }
        };
        let end = job.supervise(&ctx);
        job.finish();
        drop(job);
        remove_shm_segments(&job_id);

        let next = match &nodes {
            Some(link) => after_attempt_on_nodes(cfg, link, &ctx, attempt, end),
            None => after_attempt(cfg, attempt, end),
        };
        match next {
            Next::Restart(why) => {
                if let Some(sig) = signals.as_ref().and_then(Signals::take) {
                    let mut end = JobEnd::Interrupted { signal: sig };
                    if let Some(link) = &nodes {
                        link.record_failure(128 + sig, interrupted_text(sig));
                        end = finish_on_nodes(cfg, link, &ctx, end);
                    }
                    break Ok(LaunchOutcome {
                        attempts: attempt + 1,
                        end,
                    });
                }
                attempt += 1;
                if let Some(link) = &nodes {
                    link.start_attempt(attempt);
                }
                note!(
                    "restarting all {} local ranks (restart {attempt} of {}) after {why}",
                    cfg.nproc_per_node,
                    cfg.max_restarts
                );
            }
            Next::Finish(end) => {
                let end = match &nodes {
                    Some(link) => finish_on_nodes(cfg, link, &ctx, end),
                    None => end,
                };
                break Ok(LaunchOutcome {
                    attempts: attempt + 1,
                    end,
                });
            }
        }
    }
}

/// What to do after an attempt.
enum Next {
    /// Start the next attempt; why the last one failed.
    Restart(String),
    /// The job ends so.
    Finish(JobEnd),
}

fn interrupted_text(sig: libc::c_int) -> String {
    format!(
        "its launcher received {}",
        signal_name(sig).unwrap_or("a signal")
    )
}

/// After an attempt of a single-node job: restart after a failed rank while restarts are left.
fn after_attempt(cfg: &LaunchConfig, attempt: u32, end: AttemptEnd) -> Next {
    match end {
        AttemptEnd::Success => Next::Finish(JobEnd::Success),
        AttemptEnd::Interrupted(signal) => Next::Finish(JobEnd::Interrupted { signal }),
        AttemptEnd::TimedOut => Next::Finish(JobEnd::TimedOut {
            after: cfg.timeout.unwrap_or_default(),
        }),
        AttemptEnd::Failed(f) if attempt < cfg.max_restarts => Next::Restart(f.to_string()),
        AttemptEnd::Failed(f) => Next::Finish(JobEnd::RankFailed(f)),
        AttemptEnd::OtherNode(f) => Next::Finish(JobEnd::NodeFailed(f)),
    }
}

/// After an attempt of a multi-node job: records this node's failure (a rank, `--timeout`, a
/// signal) for the other nodes, and this node's end of the attempt. Every node restarts its
/// ranks after a failure anywhere while restarts are left; a node whose ranks all succeeded
/// waits for the attempt's outcome first (the others may still fail, and restart it).
fn after_attempt_on_nodes(
    cfg: &LaunchConfig,
    link: &NodeLink,
    ctx: &SupervisorCtx<'_>,
    attempt: u32,
    end: AttemptEnd,
) -> Next {
    let restarts_left = || attempt < cfg.max_restarts && !link.lost_node_0();
    let timed_out = || JobEnd::TimedOut {
        after: cfg.timeout.unwrap_or_default(),
    };
    let expired = |after: Option<Duration>| {
        format!(
            "its launcher's --timeout of {}s expired",
            after.unwrap_or_default().as_secs_f64()
        )
    };
    let (end, local_failure) = match end {
        // Kept going: every local rank is done; the other nodes are not stopped.
        AttemptEnd::Failed(f) if cfg.keeps_going() => (AttemptEnd::Success, Some(f)),
        end => (end, None),
    };
    let done = || match &local_failure {
        Some(f) => JobEnd::RankFailed(f.clone()),
        None => JobEnd::Success,
    };
    match end {
        AttemptEnd::Failed(f) => {
            link.record_failure(failure_code(&f), f.to_string());
            link.end_attempt();
            if restarts_left() {
                Next::Restart(f.to_string())
            } else {
                Next::Finish(JobEnd::RankFailed(f))
            }
        }
        AttemptEnd::OtherNode(f) => {
            link.end_attempt();
            if restarts_left() {
                Next::Restart(f.to_string())
            } else {
                Next::Finish(JobEnd::NodeFailed(f))
            }
        }
        AttemptEnd::Interrupted(signal) => {
            link.record_failure(128 + signal, interrupted_text(signal));
            link.end_attempt();
            Next::Finish(JobEnd::Interrupted { signal })
        }
        AttemptEnd::TimedOut => {
            link.record_failure(124, expired(cfg.timeout));
            link.end_attempt();
            Next::Finish(timed_out())
        }
        AttemptEnd::Success => {
            link.end_attempt();
            match link.wait_attempt(ctx) {
                NodesEnd::AllDone => Next::Finish(done()),
                NodesEnd::Failed(f) if restarts_left() => Next::Restart(f.to_string()),
                // Kept going past a local failure: this node's own failure is its outcome.
                NodesEnd::Failed(f) if local_failure.is_some() => {
                    note!("{f}");
                    Next::Finish(done())
                }
                NodesEnd::Failed(f) => {
                    note!("this node's ranks succeeded, but {f}");
                    Next::Finish(JobEnd::NodeFailed(f))
                }
                NodesEnd::Silent(_) if local_failure.is_some() => Next::Finish(done()),
                NodesEnd::Silent(nodes) => Next::Finish(JobEnd::NodeFailed(NodeFailure {
                    node: nodes[0],
                    exit_code: 1,
                    what: "its launcher stopped answering before its ranks were done".into(),
                })),
                NodesEnd::Interrupted(signal) => {
                    link.record_failure(128 + signal, interrupted_text(signal));
                    Next::Finish(JobEnd::Interrupted { signal })
                }
                NodesEnd::TimedOut => {
                    link.record_failure(124, expired(cfg.timeout));
                    Next::Finish(timed_out())
                }
            }
        }
    }
}

/// The end of a multi-node job on this node: its launcher says it is done; node 0 then keeps
/// the store up until every other node's launcher is done too (or silent for 30 s, a signal,
/// `--timeout`).
fn finish_on_nodes(
    cfg: &LaunchConfig,
    link: &NodeLink,
    ctx: &SupervisorCtx<'_>,
    end: JobEnd,
) -> JobEnd {
    link.publish_done();
    if cfg.node_rank != 0 {
        return end;
    }
    match link.wait_for_nodes(ctx) {
        NodesEnd::Interrupted(signal) if end == JobEnd::Success => JobEnd::Interrupted { signal },
        NodesEnd::TimedOut if end == JobEnd::Success => JobEnd::TimedOut {
            after: cfg.timeout.unwrap_or_default(),
        },
        NodesEnd::Silent(nodes) if end == JobEnd::Success => JobEnd::NodeFailed(NodeFailure {
            node: nodes[0],
            exit_code: 1,
            what: "its launcher stopped answering before it was done".into(),
        }),
        _ => end,
    }
}

/// The launcher's exit code for a failed rank (its code, `128 + s` for signal `s`, 1 if out of
/// range), as [`LaunchOutcome::exit_code`] gives it.
fn failure_code(f: &RankFailure) -> i32 {
    match f.termination.exit_code() {
        c @ 1..=255 => c,
        _ => 1,
    }
}

/// Removes whatever shared-memory segments of this job are left in `/dev/shm` (a rank killed
/// between creating its segment and its peers mapping it). Every rank is gone when this runs.
fn remove_shm_segments(job_id: &str) {
    let prefix = oxccl_comm::transport::shm::job_prefix(job_id);
    let Ok(dir) = std::fs::read_dir(oxccl_comm::transport::shm::SHM_DIR) else {
        return;
    };
    for entry in dir.flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => tracing::debug!(
                    "oxccl launch: removed stale segment {}",
                    entry.path().display()
                ),
                Err(e) => tracing::warn!(
                    "oxccl launch: could not remove {}: {e}",
                    entry.path().display()
                ),
            }
        }
    }
}

/// The store as the ranks see it; keeps the server (node 0) alive.
pub(crate) struct HostedStore {
    _server: Option<TcpStoreServer>,
    /// `host:port` given to the ranks as `OXCCL_STORE`.
    rank_addr: String,
    /// The host part of `rank_addr`, without brackets (the launchers' own connections).
    client_host: String,
    /// The store's port (`MASTER_PORT`).
    port: u16,
}

fn strip_brackets(addr: &str) -> &str {
    addr.strip_prefix('[')
        .and_then(|a| a.strip_suffix(']'))
        .unwrap_or(addr)
}

/// `host:port`, with IPv6 literals in brackets.
fn join_host_port(host: &str, port: u16) -> String {
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V6(_)) => format!("[{host}]:{port}"),
        _ => format!("{host}:{port}"),
    }
}

fn host_store(cfg: &LaunchConfig) -> Result<HostedStore, LaunchError> {
    let host = strip_brackets(&cfg.master_addr);
    if cfg.node_rank != 0 {
        return Ok(HostedStore {
            _server: None,
            rank_addr: join_host_port(host, cfg.master_port),
            client_host: host.to_owned(),
            port: cfg.master_port,
        });
    }
    let shown = join_host_port(host, cfg.master_port);
    let store_err = |message: String| LaunchError::Store {
        addr: shown.clone(),
        message,
    };
    let addrs: Vec<SocketAddr> = (host, cfg.master_port)
        .to_socket_addrs()
        .map_err(|e| store_err(format!("cannot resolve --master-addr '{host}': {e}")))?
        .collect();
    let addr = addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| store_err(format!("--master-addr '{host}' resolves to no address")))?;
    let server = TcpStoreServer::bind(addr).map_err(|e| store_err(e.to_string()))?;
    let mut bound = server.local_addr();
    if bound.ip().is_unspecified() {
        let loopback: IpAddr = if bound.is_ipv4() {
            std::net::Ipv4Addr::LOCALHOST.into()
        } else {
            std::net::Ipv6Addr::LOCALHOST.into()
        };
        bound.set_ip(loopback);
    }
    Ok(HostedStore {
        _server: Some(server),
        rank_addr: bound.to_string(),
        client_host: bound.ip().to_string(),
        port: bound.port(),
    })
}

fn job_id_base(cfg: &LaunchConfig, port: u16) -> String {
    if let Some(id) = &cfg.job_id {
        return id.clone();
    }
    if let Some(id) = std::env::var_os("OXCCL_JOB_ID").filter(|v| !v.is_empty()) {
        return id.to_string_lossy().into_owned();
    }
    if cfg.nnodes > 1 {
        return format!("mn-{port}");
    }
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!("{}-{secs}", std::process::id())
}

fn rank_specs(
    cfg: &LaunchConfig,
    store: &HostedStore,
    job_id: &str,
    attempt: u32,
) -> Vec<RankSpec> {
    let n = cfg.nproc_per_node;
    let world = cfg.world_size();
    (0..n)
        .map(|local| {
            let rank = cfg.node_rank * n + local;
            let env: Vec<(&str, String)> = vec![
                ("OXCCL_RANK", rank.to_string()),
                ("OXCCL_WORLD_SIZE", world.to_string()),
                ("OXCCL_LOCAL_RANK", local.to_string()),
                ("OXCCL_LOCAL_WORLD_SIZE", n.to_string()),
                ("OXCCL_NNODES", cfg.nnodes.to_string()),
                ("OXCCL_NODE_RANK", cfg.node_rank.to_string()),
                ("OXCCL_STORE", store.rank_addr.clone()),
                ("OXCCL_STORE_HOSTED", "1".to_owned()),
                ("OXCCL_JOB_ID", job_id.to_owned()),
                ("OXCCL_RESTART_COUNT", attempt.to_string()),
                ("OXCCL_MAX_RESTARTS", cfg.max_restarts.to_string()),
                ("OXCCL_RESPAWN", cfg.respawn.to_string()),
                // A replacement gets "1" instead; "0" keeps a value from the launcher's own
                // environment from making every rank join.
                ("OXCCL_JOIN", "0".to_owned()),
                ("RANK", rank.to_string()),
                ("WORLD_SIZE", world.to_string()),
                ("LOCAL_RANK", local.to_string()),
                ("LOCAL_WORLD_SIZE", n.to_string()),
                ("MASTER_ADDR", strip_brackets(&cfg.master_addr).to_owned()),
                ("MASTER_PORT", store.port.to_string()),
            ];
            RankSpec {
                rank,
                local_rank: local,
                env,
            }
        })
        .collect()
}

/// SIGINT, SIGTERM and SIGHUP caught while a job runs.
pub(crate) struct Signals {
    flags: Vec<(libc::c_int, Arc<AtomicBool>)>,
    ids: Vec<signal_hook::SigId>,
}

impl Signals {
    fn register() -> Result<Self, LaunchError> {
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

#[cfg(test)]
mod tests {
    use std::time::{SystemTime, UNIX_EPOCH};

    use super::*;

    #[test]
    fn store_addresses_bracket_ipv6() {
        assert_eq!(join_host_port(strip_brackets("[::1]"), 5), "[::1]:5");
        assert_eq!(join_host_port(strip_brackets("fe80::1"), 5), "[fe80::1]:5");
        assert_eq!(join_host_port("10.0.0.1", 5), "10.0.0.1:5");
        assert_eq!(join_host_port("node-3", 5), "node-3:5");
    }

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

    #[test]
    fn validation_names_the_offending_option() {
        let mut cfg = LaunchConfig::new(2, "true", Vec::<String>::new());
        assert!(cfg.validate().is_ok());
        cfg.node_rank = 1;
        assert!(cfg
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--node-rank"));
        cfg.node_rank = 0;
        cfg.nnodes = 2;
        assert!(cfg
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--master-port"));
        cfg.master_port = 29500;
        assert!(cfg.validate().is_ok());
        cfg.max_restarts = 1; // restarts across nodes are coordinated through the store
        assert!(cfg.validate().is_ok());
    }

    #[test]
    fn bound_cpus_by_binding() {
        let cpus: Vec<usize> = (0..16).collect();
        assert!(bound_cpus(Bind::None, &cpus, 0, 4).is_empty());
        assert!(bound_cpus(Bind::Block, &[], 0, 4).is_empty());
        assert_eq!(bound_cpus(Bind::Core, &cpus, 5, 4), [5]);
        assert_eq!(bound_cpus(Bind::Core, &cpus, 17, 20), [1]);
        // 16 CPUs, 4 ranks: blocks of 4.
        assert_eq!(bound_cpus(Bind::Block, &cpus, 0, 4), [0, 1, 2, 3]);
        assert_eq!(bound_cpus(Bind::Block, &cpus, 3, 4), [12, 13, 14, 15]);
        // 3 ranks: blocks of 5, CPU 15 left over.
        assert_eq!(bound_cpus(Bind::Block, &cpus, 2, 3), [10, 11, 12, 13, 14]);
        // More ranks than CPUs: one each, wrapping, as Core.
        assert_eq!(bound_cpus(Bind::Block, &cpus[..2], 3, 4), [1]);
        // The launcher's own list, whatever its numbers.
        assert_eq!(bound_cpus(Bind::Block, &[2, 3, 6, 7], 1, 2), [6, 7]);
        assert_eq!("Block".parse::<Bind>(), Ok(Bind::Block));
    }

    #[test]
    fn library_api_reports_outcomes() {
        let mut cfg = LaunchConfig::new(2, "sh", ["-c", "test \"$OXCCL_WORLD_SIZE\" = 2"]);
        let ok = launch(&cfg).unwrap();
        assert_eq!(ok.end, JobEnd::Success);
        assert_eq!((ok.attempts, ok.exit_code()), (1, 0));

        cfg.args = vec!["-c".into(), "exit $((OXCCL_LOCAL_RANK + 6))".into()];
        let failed = launch(&cfg).unwrap();
        let JobEnd::RankFailed(f) = &failed.end else {
            panic!("{failed:?}")
        };
        assert!(matches!(f.termination, Termination::Exited(6 | 7)), "{f:?}");
        assert_eq!(failed.exit_code(), f.termination.exit_code());

        cfg.nnodes = 2;
        assert_eq!(launch(&cfg).unwrap_err().exit_code(), 2);
    }

    #[test]
    fn a_rank_that_cannot_start_leaves_no_segments() {
        // A stale segment of the attempt (as a rank started before the failing one could leave).
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let job = format!("spawnfail-shm-{}-{nanos}", std::process::id());
        let prefix = oxccl_comm::transport::shm::job_prefix(&format!("{job}-r0"));
        let stale = std::path::Path::new(oxccl_comm::transport::shm::SHM_DIR)
            .join(format!("{prefix}stale"));
        std::fs::write(&stale, b"x").unwrap();
        let mut cfg = LaunchConfig::new(2, "/nonexistent/oxccl-no-such-cmd", Vec::<String>::new());
        cfg.job_id = Some(job);
        let err = launch(&cfg).unwrap_err();
        let left = stale.exists();
        let _ = std::fs::remove_file(&stale);
        assert_eq!(err.exit_code(), 127, "{err}");
        assert!(!left, "{} was left behind", stale.display());
    }
}
