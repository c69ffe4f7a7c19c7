//! Starting, watching, signalling and reaping the ranks of one attempt.

use std::io;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, ExitStatus, Stdio};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

mod supervise;
#[cfg(test)]
mod tests;

use super::nodes::NodeLink;
use super::output::{self, Sink};
use super::watchdog::Watchdog;
use super::{signal_name, LaunchConfig, LaunchError, NodeFailure, RankFailure, Signals};

/// How often children are polled.
const POLL: Duration = Duration::from_millis(10);
/// How long SIGKILLed processes get to disappear before the launcher gives up on them.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// How long output threads get to see end-of-file once every process is gone.
const DRAIN_WAIT: Duration = Duration::from_secs(2);

/// `now + d`, or a moment a century away when that does not fit in an `Instant` (a huge grace
/// period in a [`LaunchConfig`]), or `now` if even that does not fit.
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
    let cpus = oxccl_comm::internal::affinity::allowed_cpus();
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
