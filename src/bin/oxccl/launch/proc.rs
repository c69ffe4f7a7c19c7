//! Starting, watching, signalling and reaping the ranks of one attempt.

use std::io;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::nodes::NodeLink;
use super::output::{self, Sink};
use super::watchdog::Watchdog;
use super::{
    signal_name, LaunchConfig, LaunchError, NodeFailure, RankFailure, Signals, Termination,
};

/// How often children are polled.
const POLL: Duration = Duration::from_millis(10);
/// How long SIGKILLed processes get to disappear before the launcher gives up on them.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// How long output threads get to see end-of-file once every process is gone.
const DRAIN_WAIT: Duration = Duration::from_secs(2);

/// `now + d`, or a moment a century away when that does not fit in an `Instant` (a huge grace
/// period set through the library), or `now` if even that does not fit.
fn deadline_in(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 86_400)))
        .unwrap_or(now)
}

/// The affinity set of local rank `local_rank` of `nproc` under `bind` (see
/// [`super::bound_cpus`]); `None` without binding or if the launcher's CPUs cannot be read.
#[cfg(target_os = "linux")]
fn cpu_set(bind: super::Bind, local_rank: usize, nproc: usize) -> Option<libc::cpu_set_t> {
    let cpus = oxccl_comm::affinity::allowed_cpus();
    let chosen = super::bound_cpus(bind, &cpus, local_rank, nproc);
    if chosen.is_empty() {
        return None;
    }
    // SAFETY: cpu_set_t is plain data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for cpu in chosen {
        // SAFETY: `cpu` came from the kernel's own mask, so it is below CPU_SETSIZE.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    Some(set)
}

/// One rank to start.
#[derive(Clone)]
pub(super) struct RankSpec {
    pub(super) rank: usize,
    pub(super) local_rank: usize,
    pub(super) env: Vec<(&'static str, String)>,
}

/// What the supervision loop needs besides the ranks.
pub(super) struct SupervisorCtx<'a> {
    pub(super) signals: Option<&'a Signals>,
    pub(super) deadline: Option<Instant>,
    pub(super) failure_grace: Duration,
    pub(super) signal_grace: Duration,
    /// How long the other ranks get to end on their own after a failure, before SIGTERM.
    pub(super) failure_settle: Duration,
    /// The other nodes of a multi-node job.
    pub(super) nodes: Option<&'a NodeLink>,
    /// A failed rank does not stop the others (`--keep-going`).
    pub(super) keep_going: bool,
}

impl SupervisorCtx<'_> {
    pub(super) fn take_signal(&self) -> Option<libc::c_int> {
        self.signals.and_then(Signals::take)
    }
}

/// How one attempt ended.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum AttemptEnd {
    Success,
    Failed(RankFailure),
    Interrupted(libc::c_int),
    TimedOut,
    /// Another node reported a failure (or node 0 was lost); the local ranks were stopped.
    OtherNode(NodeFailure),
}

struct RankProc {
    rank: usize,
    local_rank: usize,
    /// Process id of the rank, also the id of its process group.
    pid: u32,
    /// Set once the rank's own process was reaped.
    status: Option<ExitStatus>,
    /// Whether its exit was already looked at by the supervision loop.
    seen: bool,
    /// Set once the process group has no member left (only checked after `status` is set).
    group_gone: bool,
}

impl RankProc {
    fn gone(&self) -> bool {
        self.status.is_some() && self.group_gone
    }
}

/// The running ranks of one attempt.
pub(super) struct Job<'w> {
    ranks: Vec<RankProc>,
    readers: Vec<JoinHandle<()>>,
    watchdog: Option<&'w mut Watchdog>,
    cleaned: bool,
    /// Ranks this attempt is to start.
    expected: usize,
    /// How the attempt ended while its ranks were being started (a launcher signal, the
    /// deadline, a failed rank); every started rank is gone already. [`Job::supervise`]
    /// returns it.
    ended_early: Option<AttemptEnd>,
    /// With `--keep-going`: the first rank that failed, reported once every rank is done.
    kept_failure: Option<RankFailure>,
    /// With `--respawn`: what replacements are started from (the configuration and every
    /// rank's spec), and how many were started.
    respawn: Option<(LaunchConfig, Vec<RankSpec>)>,
    respawned: u32,
}

fn kill(pid: i32, sig: libc::c_int) -> io::Result<()> {
    // SAFETY: kill(2) takes plain integers; callers only pass ids of processes or groups they
    // started and have not seen disappear (see `RankProc`).
    if unsafe { libc::kill(pid, sig) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl<'w> Job<'w> {
    /// Starts every rank. If one cannot be started, the ranks already running are terminated
    /// and reaped before the error is returned (unless a launcher signal arrives meanwhile: the
    /// error is then reported on stderr and the attempt ends as interrupted by that signal).
    ///
    /// Between two starts, a launcher signal, the deadline or a rank that already failed stops
    /// the start: the ranks started so far are stopped and reaped, and [`Job::supervise`]
    /// returns how the attempt ended without waiting for anything.
    pub(super) fn spawn(
        cfg: &LaunchConfig,
        specs: Vec<RankSpec>,
        watchdog: Option<&'w mut Watchdog>,
        ctx: &SupervisorCtx<'_>,
    ) -> Result<Self, LaunchError> {
        let mut job = Job::new(watchdog, specs.len());
        if cfg.respawn > 0 {
            job.respawn = Some((cfg.clone(), specs.clone()));
        }
        job.start(cfg, specs, ctx)?;
        Ok(job)
    }

    fn new(watchdog: Option<&'w mut Watchdog>, expected: usize) -> Self {
        Job {
            ranks: Vec::with_capacity(expected),
            readers: Vec::new(),
            watchdog,
            cleaned: false,
            expected,
            ended_early: None,
            kept_failure: None,
            respawn: None,
            respawned: 0,
        }
    }

    /// The starting loop of [`Job::spawn`].
    fn start(
        &mut self,
        cfg: &LaunchConfig,
        specs: Vec<RankSpec>,
        ctx: &SupervisorCtx<'_>,
    ) -> Result<(), LaunchError> {
        // Collecting exits costs a few system calls per started rank: do it at most every POLL
        // (as the supervision loop does), not before every start.
        let mut last_reap: Option<Instant> = None;
        for spec in specs {
            let reap = last_reap.is_none_or(|t| t.elapsed() >= POLL);
            if reap {
                last_reap = Some(Instant::now());
            }
            if let Some(end) = self.check(ctx, reap) {
                self.ended_early = Some(end);
                return Ok(());
            }
            if let Err(e) = self.spawn_one(cfg, spec) {
                let sig = self
                    .shutdown(libc::SIGTERM, ctx.failure_grace, ctx)
                    .or_else(|| ctx.take_signal());
                self.finish();
                if let Some(sig) = sig {
                    note!("error: {e}");
                    self.ended_early = Some(AttemptEnd::Interrupted(sig));
                    return Ok(());
                }
                return Err(e);
            }
        }
        Ok(())
    }

    fn spawn_one(&mut self, cfg: &LaunchConfig, spec: RankSpec) -> Result<(), LaunchError> {
        let mut cmd = Command::new(&cfg.program);
        cmd.args(&cfg.args)
            .envs(cfg.env.iter().map(|(k, v)| (k, v)))
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        #[cfg(target_os = "linux")]
        {
            let parent = std::process::id() as libc::pid_t;
            let cpu_set = cpu_set(cfg.bind, spec.local_rank, cfg.nproc_per_node);
            let hook = move || -> io::Result<()> {
                if let Some(set) = &cpu_set {
                    // SAFETY: sched_setaffinity on this (the child) process with a set built
                    // before the fork and the size of its type.
                    let rc = unsafe {
                        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set)
                    };
                    if rc != 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                // SAFETY: prctl(PR_SET_PDEATHSIG) with integer arguments only.
                if unsafe {
                    libc::prctl(
                        libc::PR_SET_PDEATHSIG,
                        libc::SIGKILL as libc::c_ulong,
                        0,
                        0,
                        0,
                    )
                } != 0
                {
                    return Err(io::Error::last_os_error());
                }
                // The launcher may have died before the prctl took effect.
                // SAFETY: getppid has no preconditions.
                if unsafe { libc::getppid() } != parent {
                    return Err(io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            };
            // SAFETY: the hook runs in the forked child before exec and only makes the
            // async-signal-safe sched_setaffinity/prctl/getppid system calls; it allocates
            // nothing (the set is built before the fork, the error values are raw OS errors).
            unsafe { cmd.pre_exec(hook) };
        }

        let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
            rank: spec.rank,
            program: cfg.program.clone(),
            source,
        })?;
        let pid = child.id();
        tracing::debug!(rank = spec.rank, pid, "oxccl launch: rank started");
        if let Some(w) = self.watchdog.as_deref_mut() {
            w.watch(pid);
        }
        self.ranks.push(RankProc {
            rank: spec.rank,
            local_rank: spec.local_rank,
            pid,
            status: None,
            seen: false,
            group_gone: false,
        });

        let prefix = if cfg.prefix_output {
            format!("[{}] ", spec.rank).into_bytes()
        } else {
            Vec::new()
        };
        let pipes = [
            child
                .stdout
                .take()
                .map(|p| (Box::new(p) as Box<dyn io::Read + Send>, Sink::Stdout, "out")),
            child
                .stderr
                .take()
                .map(|p| (Box::new(p) as Box<dyn io::Read + Send>, Sink::Stderr, "err")),
        ];
        for (pipe, sink, tag) in pipes.into_iter().flatten() {
            let name = format!("oxccl-r{}-{tag}", spec.rank);
            let h = output::forward(pipe, prefix.clone(), sink, name).map_err(|source| {
                LaunchError::Io {
                    context: "starting an output thread",
                    source,
                }
            })?;
            self.readers.push(h);
        }
        Ok(())
    }

    /// Reaps whatever exited: the ranks' own processes and, when the launcher is a subreaper,
    /// orphans re-parented from their groups; then notes which groups are empty.
    fn reap(&mut self) {
        for r in &mut self.ranks {
            let pid = r.pid as libc::pid_t;
            if r.status.is_none() {
                let mut st = 0;
                // SAFETY: waitpid on our own child with a valid out-pointer.
                if unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) } == pid {
                    r.status = Some(ExitStatus::from_raw(st));
                }
            }
            loop {
                let mut st = 0;
                // SAFETY: waitpid on a process group we created, with a valid out-pointer.
                let got = unsafe { libc::waitpid(-pid, &mut st, libc::WNOHANG) };
                if got <= 0 {
                    break;
                }
                if got == pid {
                    r.status = Some(ExitStatus::from_raw(st));
                } else {
                    tracing::debug!(rank = r.rank, pid = got, "oxccl launch: reaped an orphan");
                }
            }
            if r.status.is_some() && !r.group_gone {
                // Only after the rank itself was reaped: its zombie is a group member too.
                if matches!(kill(-pid, 0), Err(e) if e.raw_os_error() == Some(libc::ESRCH)) {
                    r.group_gone = true;
                    if let Some(w) = self.watchdog.as_deref_mut() {
                        w.forget(r.pid);
                    }
                }
            }
        }
    }

    fn all_gone(&self) -> bool {
        self.ranks.iter().all(RankProc::gone)
    }

    /// Sends `sig` to every group with members left, and to ranks that left their group.
    fn signal_all(&self, sig: libc::c_int) {
        for r in &self.ranks {
            if r.gone() {
                continue;
            }
            let pid = r.pid as libc::pid_t;
            if let Err(e) = kill(-pid, sig) {
                tracing::debug!(rank = r.rank, "oxccl launch: kill(-{pid}, {sig}): {e}");
            }
            if r.status.is_none() {
                // SAFETY: getpgid takes a plain pid of our unreaped child.
                if unsafe { libc::getpgid(pid) } != pid {
                    let _ = kill(pid, sig);
                }
            }
        }
    }

    /// Terminates the attempt: `sig` to every group, up to `grace` for them to go, then SIGKILL,
    /// then waits for everything to be reaped. Returns a launcher signal received meanwhile
    /// (which cuts the grace period short).
    fn shutdown(
        &mut self,
        sig: libc::c_int,
        grace: Duration,
        ctx: &SupervisorCtx<'_>,
    ) -> Option<libc::c_int> {
        let mut interrupted = None;
        self.reap();
        if !self.all_gone() {
            self.signal_all(sig);
            let deadline = deadline_in(grace);
            loop {
                self.reap();
                if self.all_gone() {
                    break;
                }
                if let Some(s) = ctx.take_signal() {
                    note!(
                        "received {} while stopping the ranks; killing them now",
                        signal_name(s).unwrap_or("a signal")
                    );
                    interrupted = Some(s);
                    break;
                }
                if Instant::now() >= deadline {
                    tracing::debug!("oxccl launch: grace period over; sending SIGKILL");
                    break;
                }
                thread::sleep(POLL);
            }
        }
        let deadline = Instant::now() + KILL_WAIT;
        while !self.all_gone() {
            self.signal_all(libc::SIGKILL);
            thread::sleep(Duration::from_millis(2));
            self.reap();
            if Instant::now() >= deadline {
                let left: Vec<_> = self
                    .ranks
                    .iter()
                    .filter(|r| !r.gone())
                    .map(|r| r.rank)
                    .collect();
                note!("processes of ranks {left:?} did not die after SIGKILL");
                break;
            }
        }
        self.cleaned = self.ranks.iter().all(|r| r.status.is_some());
        interrupted
    }

    /// Watches the ranks until the attempt ends; on any failure, every rank is terminated and
    /// reaped before this returns.
    pub(super) fn supervise(&mut self, ctx: &SupervisorCtx<'_>) -> AttemptEnd {
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
    fn check(&mut self, ctx: &SupervisorCtx<'_>, reap: bool) -> Option<AttemptEnd> {
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

    /// Waits for the output threads (after the processes are gone).
    pub(super) fn finish(&mut self) {
        output::drain(std::mem::take(&mut self.readers), DRAIN_WAIT);
    }
}

impl Drop for Job<'_> {
    fn drop(&mut self) {
        if !self.cleaned {
            // Only on unwinding out of the supervision loop: leave nothing behind.
            self.reap();
            self.signal_all(libc::SIGKILL);
            let deadline = Instant::now() + KILL_WAIT;
            while !self.ranks.iter().all(|r| r.status.is_some()) && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(2));
                self.reap();
            }
        }
    }
}

/// Makes the launcher a child subreaper (Linux) while at least one job runs in this process,
/// restoring the previous setting afterwards.
pub(super) struct Subreaper(());

/// (active jobs, setting before the first one)
static SUBREAPER: Mutex<(usize, bool)> = Mutex::new((0, false));

impl Subreaper {
    pub(super) fn acquire() -> Self {
        let mut s = SUBREAPER.lock().unwrap_or_else(|p| p.into_inner());
        if s.0 == 0 {
            s.1 = get_subreaper();
            set_subreaper(true);
        }
        s.0 += 1;
        Subreaper(())
    }
}

impl Drop for Subreaper {
    fn drop(&mut self) {
        let mut s = SUBREAPER.lock().unwrap_or_else(|p| p.into_inner());
        s.0 -= 1;
        if s.0 == 0 {
            set_subreaper(s.1);
        }
    }
}

#[cfg(target_os = "linux")]
fn get_subreaper() -> bool {
    let mut v: libc::c_int = 0;
    // SAFETY: PR_GET_CHILD_SUBREAPER writes one int through the given valid pointer.
    let r = unsafe {
        libc::prctl(
            libc::PR_GET_CHILD_SUBREAPER,
            &mut v as *mut libc::c_int,
            0,
            0,
            0,
        )
    };
    r == 0 && v != 0
}

#[cfg(target_os = "linux")]
fn set_subreaper(on: bool) {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) with integer arguments only.
    let r = unsafe {
        libc::prctl(
            libc::PR_SET_CHILD_SUBREAPER,
            libc::c_ulong::from(on),
            0,
            0,
            0,
        )
    };
    if r != 0 {
        tracing::debug!(
            "oxccl launch: PR_SET_CHILD_SUBREAPER: {}",
            io::Error::last_os_error()
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn get_subreaper() -> bool {
    false
}

#[cfg(not(target_os = "linux"))]
fn set_subreaper(_on: bool) {}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::*;

    fn specs(ranks: std::ops::Range<usize>) -> Vec<RankSpec> {
        ranks
            .map(|rank| RankSpec {
                rank,
                local_rank: rank,
                env: vec![("OXCCL_RANK", rank.to_string())],
            })
            .collect()
    }

    fn cfg(script: &str) -> LaunchConfig {
        let mut cfg = LaunchConfig::new(1, "sh", ["-c", script]);
        cfg.prefix_output = false;
        cfg
    }

    /// Signals with a flag for SIGTERM (no handler is installed).
    fn sigterm_flag() -> (Signals, Arc<AtomicBool>) {
        let flag = Arc::new(AtomicBool::new(false));
        let signals = Signals {
            flags: vec![(libc::SIGTERM, Arc::clone(&flag))],
            ids: Vec::new(),
        };
        (signals, flag)
    }

    fn ctx(signals: Option<&Signals>, deadline: Option<Instant>) -> SupervisorCtx<'_> {
        SupervisorCtx {
            signals,
            deadline,
            failure_grace: Duration::from_secs(30),
            signal_grace: Duration::from_secs(30),
            failure_settle: Duration::ZERO,
            nodes: None,
            keep_going: false,
        }
    }

    #[test]
    fn a_pending_signal_stops_the_start() {
        let (signals, flag) = sigterm_flag();
        flag.store(true, Ordering::SeqCst);
        let ctx = ctx(Some(&signals), None);
        let mut job = Job::spawn(&cfg("exec sleep 30"), specs(0..4), None, &ctx).unwrap();
        assert_eq!(job.ranks.len(), 0, "ranks were started despite the signal");
        assert_eq!(job.supervise(&ctx), AttemptEnd::Interrupted(libc::SIGTERM));
        job.finish();
    }

    #[test]
    fn the_deadline_stops_the_start() {
        let ctx = ctx(None, Some(Instant::now()));
        let mut job = Job::spawn(&cfg("exec sleep 30"), specs(0..4), None, &ctx).unwrap();
        assert_eq!(job.ranks.len(), 0, "ranks were started after the deadline");
        assert_eq!(job.supervise(&ctx), AttemptEnd::TimedOut);
        job.finish();
    }

    #[test]
    fn a_failed_rank_stops_the_start() {
        let ctx = ctx(None, None);
        let cfg = cfg("if [ \"$OXCCL_RANK\" = 0 ]; then exit 3; fi; exec sleep 30");
        let mut job = Job::new(None, 3);
        job.start(&cfg, specs(0..1), &ctx).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while job.ranks[0].status.is_none() {
            assert!(Instant::now() < deadline, "rank 0 did not exit");
            thread::sleep(Duration::from_millis(5));
            job.reap();
        }
        job.start(&cfg, specs(1..3), &ctx).unwrap();
        assert_eq!(job.ranks.len(), 1, "ranks were started after rank 0 failed");
        match job.supervise(&ctx) {
            AttemptEnd::Failed(f) => {
                assert_eq!((f.rank, f.termination), (0, Termination::Exited(3)))
            }
            other => panic!("{other:?}"),
        }
        job.finish();
    }

    /// With a settle time the other ranks end on their own after a failure (here: exit 0 after
    /// 2 s, standing for the time a rank takes to notice the failure and write its flight
    /// record); without one they are terminated at once.
    #[test]
    fn the_others_get_the_settle_time_to_end_on_their_own() {
        let script = "if [ \"$OXCCL_RANK\" = 0 ]; then exit 3; fi; sleep 2; exit 0";
        for (settle, want) in [
            (Duration::from_secs(20), Termination::Exited(0)),
            (
                Duration::ZERO,
                Termination::Signaled {
                    signal: libc::SIGTERM,
                    core_dumped: false,
                },
            ),
        ] {
            let ctx = SupervisorCtx {
                failure_settle: settle,
                ..ctx(None, None)
            };
            let mut job = Job::spawn(&cfg(script), specs(0..2), None, &ctx).unwrap();
            match job.supervise(&ctx) {
                AttemptEnd::Failed(f) => assert_eq!(f.rank, 0),
                other => panic!("{other:?}"),
            }
            let st = job.ranks[1].status.expect("rank 1 reaped");
            assert_eq!(Termination::from_status(st), want, "settle {settle:?}");
            job.finish();
        }
    }

    #[test]
    fn a_signal_while_stopping_after_a_spawn_error_is_the_outcome() {
        let (signals, flag) = sigterm_flag();
        let ctx = ctx(Some(&signals), None);
        let mut job = Job::new(None, 2);
        // Rank 0 ignores SIGTERM, so stopping it takes the whole (30 s) grace period unless the
        // launcher gets a signal meanwhile.
        job.start(&cfg("trap '' TERM; exec sleep 30"), specs(0..1), &ctx)
            .unwrap();
        // Wait until the trap is in place (SigIgn has SIGTERM's bit).
        let status = format!("/proc/{}/status", job.ranks[0].pid);
        let term_bit = 1u64 << (libc::SIGTERM - 1);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ignored = std::fs::read_to_string(&status)
                .ok()
                .and_then(|s| {
                    let line = s.lines().find(|l| l.starts_with("SigIgn:"))?.to_owned();
                    u64::from_str_radix(line.trim_start_matches("SigIgn:").trim(), 16).ok()
                })
                .unwrap_or(0);
            if ignored & term_bit != 0 {
                break;
            }
            assert!(Instant::now() < deadline, "rank 0 never ignored SIGTERM");
            thread::sleep(Duration::from_millis(5));
        }
        let setter = {
            let flag = Arc::clone(&flag);
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(200));
                flag.store(true, Ordering::SeqCst);
            })
        };
        let missing = LaunchConfig::new(1, "/nonexistent/oxccl-no-such-cmd", Vec::<String>::new());
        let started = job.start(&missing, specs(1..2), &ctx);
        setter.join().unwrap();
        assert!(
            started.is_ok(),
            "the signal was dropped: {:?}",
            started.err()
        );
        assert_eq!(job.supervise(&ctx), AttemptEnd::Interrupted(libc::SIGTERM));
        assert!(job.ranks.iter().all(RankProc::gone));
        job.finish();
    }
}
