//! The supervision of one attempt's ranks: watching them, replacing failed ones
//! (`--respawn`), and stopping every rank on a failure, a signal or the deadline.

use std::thread;
use std::time::Instant;

use super::{AttemptEnd, Job, SupervisorCtx, POLL};
use crate::launch::nodes::NodeLink;
use crate::launch::{signal_name, RankFailure, Termination};

impl Job<'_> {
    /// Watches the ranks until the attempt ends; on any failure, every rank is terminated and
    /// reaped before this returns.
    pub(crate) fn supervise(&mut self, ctx: &SupervisorCtx<'_>) -> AttemptEnd {
        if let Some(end) = self.ended_early.take() {
            return end;
        }
        loop {
            if let Some(end) = self.check(ctx, true) {
                return end;
            }
            if self.ranks.iter().all(|r| r.status.is_some()) {
                if !self.all_gone() {
                    tracing::warn!(
                        "oxccl launch: ranks exited but left processes behind; terminating them"
                    );
                    if let Some(sig) = self.shutdown(libc::SIGTERM, ctx.failure_grace, ctx) {
                        return AttemptEnd::Interrupted(sig);
                    }
                }
                self.cleaned = true;
                return match self.kept_failure.take() {
                    Some(f) => AttemptEnd::Failed(f),
                    None => AttemptEnd::Success,
                };
            }
            thread::sleep(POLL);
        }
    }

    /// `"all 4 local ranks"`, or `"the 3 local ranks started so far (of 8)"` while starting.
    fn started(&self) -> String {
        // Replacements are not ranks of their own.
        let n = self.ranks.len() - self.respawned as usize;
        if n < self.expected {
            format!("the {n} local ranks started so far (of {})", self.expected)
        } else {
            format!("all {} local ranks", self.expected)
        }
    }

    /// One look at the attempt: a launcher signal, the deadline, a rank that failed (after
    /// collecting exits when `reap` is set). On any of them every rank started is stopped and
    /// reaped, and how the attempt ended is returned.
    pub(super) fn check(&mut self, ctx: &SupervisorCtx<'_>, reap: bool) -> Option<AttemptEnd> {
        if let Some(sig) = ctx.take_signal() {
            note!(
                "received {}; forwarding it to {}",
                signal_name(sig).unwrap_or("a signal"),
                self.started()
            );
            self.shutdown(sig, ctx.signal_grace, ctx);
            return Some(AttemptEnd::Interrupted(sig));
        }
        if ctx.deadline.is_some_and(|d| Instant::now() >= d) {
            note!("time-out reached; terminating {}", self.started());
            if let Some(sig) = self.shutdown(libc::SIGTERM, ctx.failure_grace, ctx) {
                return Some(AttemptEnd::Interrupted(sig));
            }
            return Some(AttemptEnd::TimedOut);
        }

        if reap {
            self.reap();
        }
        let mut failures = Vec::new();
        for r in &mut self.ranks {
            let (Some(st), false) = (r.status, r.seen) else {
                continue;
            };
            r.seen = true;
            let termination = Termination::from_status(st);
            if termination.success() {
                tracing::debug!(rank = r.rank, "oxccl launch: rank exited cleanly");
                continue;
            }
            let f = RankFailure {
                rank: r.rank,
                local_rank: r.local_rank,
                pid: r.pid,
                termination,
            };
            note!("{f}");
            failures.push(f);
        }
        // With --respawn, failed ranks are replaced while replacements are left.
        let mut first_failure = None;
        let mut why_kept = "--keep-going";
        for f in failures {
            if let Err(why) = self.replace(&f) {
                if first_failure.is_none() {
                    why_kept = why;
                }
                first_failure.get_or_insert(f);
            }
        }
        if let (Some(f), true) = (&first_failure, ctx.keep_going) {
            if self.kept_failure.is_none() {
                note!(
                    "{why_kept}: the other local ranks go on (the launcher exits with rank {}'s \
                     code once they are done)",
                    f.rank
                );
                self.kept_failure = Some(f.clone());
            }
            first_failure = None;
        }
        if let Some(f) = first_failure {
            if let Some(sig) = self.settle(ctx) {
                self.shutdown(sig, ctx.signal_grace, ctx);
                return Some(AttemptEnd::Interrupted(sig));
            }
            if let Some(sig) = self.shutdown(libc::SIGTERM, ctx.failure_grace, ctx) {
                return Some(AttemptEnd::Interrupted(sig));
            }
            return Some(AttemptEnd::Failed(f));
        }
        if let Some(f) = ctx.nodes.and_then(NodeLink::failure) {
            note!("{f}; stopping {}", self.started());
            if let Some(sig) = self.settle(ctx) {
                self.shutdown(sig, ctx.signal_grace, ctx);
                return Some(AttemptEnd::Interrupted(sig));
            }
            if let Some(sig) = self.shutdown(libc::SIGTERM, ctx.failure_grace, ctx) {
                return Some(AttemptEnd::Interrupted(sig));
            }
            return Some(AttemptEnd::OtherNode(f));
        }
        None
    }

    /// After a failure (of a local rank, or on another node): waits up to
    /// [`SupervisorCtx::failure_settle`] for the ranks to end on their own (reaping them), or
    /// for a signal to the launcher, which is returned.
    fn settle(&mut self, ctx: &SupervisorCtx<'_>) -> Option<libc::c_int> {
        let end = Instant::now() + ctx.failure_settle;
        while Instant::now() < end && !self.ranks.iter().all(|r| r.status.is_some()) {
            if let Some(sig) = ctx.take_signal() {
                return Some(sig);
            }
            thread::sleep(POLL);
            self.reap();
        }
        None
    }

    /// With `--respawn` and replacements left: starts one for the failed rank `f` (its
    /// variables plus `OXCCL_JOIN=1`). On a single node only while another local process still
    /// runs: with nobody left to grow, a replacement would only wait out its time-out. `Err`
    /// says why none was started; the failure then counts as with `--keep-going`.
    fn replace(&mut self, f: &RankFailure) -> Result<(), &'static str> {
        let Some((cfg, specs)) = self.respawn.take() else {
            return Err("--keep-going");
        };
        let others_run = cfg.nnodes > 1 || self.ranks.iter().any(|r| r.status.is_none());
        let result = match specs.iter().find(|s| s.rank == f.rank) {
            _ if self.respawned >= cfg.respawn => Err("--respawn: no replacement left"),
            _ if !others_run => Err("--respawn: no other local rank runs to take a replacement in"),
            None => Err("--respawn: no spec for this rank"),
            Some(spec) => {
                let mut spec = spec.clone();
                spec.env.retain(|(k, _)| *k != "OXCCL_JOIN");
                spec.env.push(("OXCCL_JOIN", "1".to_owned()));
                note!(
                    "--respawn: starting a replacement for rank {} (replacement {} of {}); it \
                     joins when the others grow their communicator",
                    f.rank,
                    self.respawned + 1,
                    cfg.respawn
                );
                let before = self.ranks.len();
                let started = self.spawn_one(&cfg, spec);
                // A process that started counts, even if forwarding its output failed after.
                if self.ranks.len() > before {
                    self.respawned += 1;
                }
                match started {
                    Ok(()) => Ok(()),
                    Err(e) if self.ranks.len() > before => {
                        note!("error: the replacement for rank {} runs, but: {e}", f.rank);
                        Ok(())
                    }
                    Err(e) => {
                        note!(
                            "error: the replacement for rank {} did not start: {e}",
                            f.rank
                        );
                        Err("--respawn: the replacement did not start")
                    }
                }
            }
        };
        self.respawn = Some((cfg, specs));
        result
    }
}
