//! What `oxccl launch` is asked to do: [`LaunchConfig`] (the command line's options), CPU
//! binding ([`Bind`]), and the checks made before anything starts.

use std::ffi::OsString;
use std::time::{Duration, Instant};

use super::rendezvous::strip_brackets;
use super::LaunchError;

/// The most ranks one launcher starts on its node ([`LaunchConfig::nproc_per_node`]); also the
/// number of process groups the orphan watchdog can track.
pub const MAX_NPROC_PER_NODE: usize = 4096;

/// Everything [`launch`](super::launch) needs to start a job on this node.
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
    /// Base of `OXCCL_JOB_ID` (`--job-id`); see the [module docs](super).
    pub job_id: Option<String>,
    /// The command to run for every rank.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Extra environment for every rank, applied before the launcher's own variables.
    pub env: Vec<(OsString, OsString)>,
    /// Catch SIGINT, SIGTERM and SIGHUP while the job runs and forward them to the ranks
    /// (default off; `oxccl launch` and the `oxccl perf --np` parent turn it on). The handlers
    /// stay installed (as no-ops) after [`launch`](super::launch) returns.
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

pub(super) fn timeout_too_large(t: Duration) -> String {
    format!(
        "--timeout {}s is too large for this system's clock; leave --timeout out for no limit",
        t.as_secs_f64()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
