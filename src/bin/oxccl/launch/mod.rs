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
//!
//! Modules: `config` (the options and their checks), `outcome` (how a job ends, exit codes),
//! `rendezvous` (the store, the job id, the ranks' variables), `proc` (starting and supervising
//! the ranks of an attempt), `output` (forwarding their lines), `signals`, `subreaper`,
//! `watchdog` (the orphan watchdog) and `nodes` (the launchers of a multi-node job); this file
//! holds the run loop: attempts, restarts and the cleanup after each.

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

mod config;
mod nodes;
mod outcome;
mod output;
mod proc;
mod rendezvous;
mod signals;
mod subreaper;
#[cfg(test)]
mod tests;
mod watchdog;

use std::time::{Duration, Instant};

use self::config::{bound_cpus, timeout_too_large};
pub use self::config::{Bind, LaunchConfig, MAX_NPROC_PER_NODE};
use self::nodes::{NodeLink, NodesEnd};
use self::outcome::failure_code;
pub use self::outcome::{
    JobEnd, LaunchError, LaunchOutcome, NodeFailure, RankFailure, Termination,
};
use self::proc::{AttemptEnd, Job, SupervisorCtx};
use self::rendezvous::{host_store, job_id_base, job_token, rank_specs};
pub use self::signals::signal_name;
use self::signals::{interrupted_text, Signals};
use self::subreaper::Subreaper;
use self::watchdog::Watchdog;

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

    let token = job_token(cfg);
    let store = host_store(cfg, token.as_deref())?;
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
            token.clone(),
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
        let specs = rank_specs(cfg, &store, &job_id, attempt, token.as_deref());
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

/// Removes whatever shared-memory segments of this job are left in `/dev/shm` (a rank killed
/// between creating its segment and its peers mapping it). Every rank is gone when this runs.
fn remove_shm_segments(job_id: &str) {
    let prefix = oxccl_comm::internal::shm::job_prefix(job_id);
    let Ok(dir) = std::fs::read_dir(oxccl_comm::internal::shm::SHM_DIR) else {
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
