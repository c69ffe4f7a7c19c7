//! Multi-node tests on one machine: every "node" is a Linux network namespace with an address
//! of its own, all joined by a bridge, made by `scripts/netns.sh`, which runs
//! `oxccl launch --nnodes N --node-rank k` inside each (with `OXCCL_NODE_ID=node<k>`, so ranks in
//! different namespaces count as different nodes). Between nodes the ranks really talk TCP over
//! veth pairs; inside a node they use shared memory.
//!
//! The namespaces need root and iproute2. Without them the script exits 77 with a `SKIP: why`
//! line, and every test here prints `skipped: why` to stderr and passes
//! (`OXCCL_REQUIRE_NETNS=1` makes that a failure instead).
//!
//! Each test uses its own namespace prefix (`oxmn<pid>-<test>`), so they run concurrently, and
//! checks afterwards that `ip netns list` shows none of its namespaces. The ranks are this test
//! binary itself (`rank_entry`, see `common.rs`).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::common::{rank_cmd, results_of, SCENARIO};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/netns.sh");

/// The script's "skipped" exit code.
const SKIP: i32 = 77;

/// A namespace prefix unique to this test process and test.
fn prefix(tag: &str) -> String {
    format!("oxmn{}-{tag}", std::process::id())
}

/// `bash scripts/netns.sh ARGS`, with the oxccl binary of this build and none of the caller's
/// oxccl variables that would change what is tested.
fn script(args: &[&str]) -> Command {
    let mut cmd = Command::new("bash");
    cmd.arg(SCRIPT).args(args);
    cmd.env("OXCCL_BIN", env!("CARGO_BIN_EXE_oxccl"));
    for var in [
        "OXCCL_DEBUG",
        "OXCCL_TRANSPORT",
        "OXCCL_ALGO",
        "OXCCL_SOCKET_IFNAME",
        "OXCCL_SOCKET_FAMILY",
        "OXCCL_STORE",
        "OXCCL_STORE_HOSTED",
        "OXCCL_JOB_ID",
        "OXCCL_NODE_ID",
        SCENARIO,
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// Namespaces whose name starts with `prefix-`.
fn namespaces(prefix: &str) -> Vec<String> {
    let path = std::env::var("PATH").unwrap_or_default();
    let out = Command::new("ip")
        .args(["netns", "list"])
        .env("PATH", format!("{path}:/usr/sbin:/sbin"))
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    out.lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&format!("{prefix}-")))
        .map(String::from)
        .collect()
}

/// Runs `netns.sh down` for a prefix when dropped, so that a failing test leaves nothing behind.
struct Cleanup(String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = script(&["down", "--prefix", &self.0])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// A running `netns.sh run`, its stdout lines arriving on a channel, its stderr collected.
struct Job {
    prefix: String,
    child: Child,
    lines: mpsc::Receiver<(Instant, String)>,
    /// Lines received so far, with their arrival time.
    seen: Vec<(Instant, String)>,
    stderr: Arc<Mutex<String>>,
    readers: Vec<JoinHandle<()>>,
    _cleanup: Cleanup,
}

/// How a [`Job`] ended.
struct Finished {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    /// Arrival time of every stdout line.
    timed: Vec<(Instant, String)>,
}

impl Finished {
    /// The reason the script gave if it skipped (exit 77).
    fn skipped(&self) -> Option<String> {
        (self.code == Some(SKIP)).then(|| {
            self.stderr
                .lines()
                .chain(self.stdout.lines())
                .find_map(|l| l.strip_prefix("SKIP:"))
                .map_or_else(
                    || "netns.sh exited with 77 (skip)".to_owned(),
                    |r| r.trim().to_owned(),
                )
        })
    }

    fn show(&self) -> String {
        format!(
            "exit code {:?}\nstdout:\n{}\nstderr:\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

impl Job {
    /// `netns.sh run RUN_ARGS --prefix PREFIX -- CMD` with `env` added to its environment.
    fn start(prefix: &str, run_args: &[&str], env: &[(&str, &str)], cmd: &[String]) -> Job {
        let cleanup = Cleanup(prefix.to_owned());
        let mut args = vec!["run", "--prefix", prefix];
        args.extend_from_slice(run_args);
        args.push("--");
        let mut c = script(&args);
        c.args(cmd)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            c.env(k, v);
        }
        let mut child = c.spawn().expect("starting bash scripts/netns.sh");
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        let stdout_reader = thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send((Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut err = child.stderr.take().unwrap();
        let sink = Arc::clone(&stderr);
        let stderr_reader = thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = err.read(&mut buf) {
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Job {
            prefix: prefix.to_owned(),
            child,
            lines,
            seen: Vec::new(),
            stderr,
            readers: vec![stdout_reader, stderr_reader],
            _cleanup: cleanup,
        }
    }

    /// Reads stdout lines until `done(lines so far)` holds (true), stdout closes or the deadline
    /// passes (false).
    fn wait_for(&mut self, deadline: Instant, done: impl Fn(&[(Instant, String)]) -> bool) -> bool {
        loop {
            if done(&self.seen) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => self.seen.push(l),
                Err(_) => return false,
            }
        }
    }

    /// What has been collected so far (for failure messages).
    fn partial(&mut self) -> String {
        while let Ok(l) = self.lines.try_recv() {
            self.seen.push(l);
        }
        let out: Vec<&str> = self.seen.iter().map(|(_, l)| l.as_str()).collect();
        format!(
            "stdout:\n{}\nstderr:\n{}",
            out.join("\n"),
            self.stderr.lock().unwrap()
        )
    }

    /// Sends `sig` to the script (not to the ranks: the script's trap must handle it).
    fn signal(&self, sig: libc::c_int) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("pid fits pid_t");
        // SAFETY: kill(2) on the pid of our own child (not yet reaped, so the pid is not reused);
        // no memory is passed.
        unsafe {
            libc::kill(pid, sig);
        }
    }

    /// Waits for the script to exit. Past `deadline` it gets SIGTERM (its trap stops the nodes
    /// and removes the namespaces), 15 s later SIGKILL, and the test fails.
    fn finish(mut self, deadline: Instant) -> Finished {
        let status = loop {
            if let Some(st) = self.child.try_wait().expect("waiting for netns.sh") {
                break st;
            }
            if Instant::now() >= deadline {
                self.signal(libc::SIGTERM);
                let kill_at = Instant::now() + Duration::from_secs(15);
                while Instant::now() < kill_at {
                    if self.child.try_wait().ok().flatten().is_some() {
                        break;
                    }
                    thread::sleep(Duration::from_millis(100));
                }
                let _ = self.child.kill();
                let _ = self.child.wait();
                let _ = script(&["down", "--prefix", &self.prefix]).status();
                let partial = self.partial();
                panic!(
                    "netns.sh run --prefix {} did not finish in time (hang); killed it\n{partial}",
                    self.prefix
                );
            }
            thread::sleep(Duration::from_millis(50));
        };
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        while let Ok(l) = self.lines.try_recv() {
            self.seen.push(l);
        }
        let stdout: Vec<&str> = self.seen.iter().map(|(_, l)| l.as_str()).collect();
        let stdout = stdout.join("\n");
        let stderr = self.stderr.lock().unwrap().clone();
        Finished {
            code: status.code().or_else(|| {
                use std::os::unix::process::ExitStatusExt;
                status.signal().map(|s| 128 + s)
            }),
            stdout,
            stderr,
            timed: std::mem::take(&mut self.seen),
        }
    }
}

/// Runs the rank program with `scenario` on 2 nodes x 2 ranks and waits (at most `limit`).
fn run_ranks(tag: &str, scenario: &str, env: &[(&str, &str)], limit: Duration) -> Finished {
    let mut env = env.to_vec();
    env.push((SCENARIO, scenario));
    run_program(tag, &env, limit)
}

/// Runs the rank program on 2 nodes x 2 ranks with `env` (naming what the ranks play) and
/// waits (at most `limit`).
fn run_program(tag: &str, env: &[(&str, &str)], limit: Duration) -> Finished {
    let prefix = prefix(tag);
    let mut env = env.to_vec();
    if !env.iter().any(|(k, _)| *k == "OXCCL_TIMEOUT") {
        env.push(("OXCCL_TIMEOUT", "60"));
    }
    let job = Job::start(
        &prefix,
        &["--nodes", "2", "--nproc", "2", "--timeout", "90"],
        &env,
        &rank_cmd(),
    );
    let done = job.finish(Instant::now() + limit);
    assert_no_namespaces(&prefix, &done);
    done
}

fn assert_no_namespaces(prefix: &str, done: &Finished) {
    let left = namespaces(prefix);
    assert!(
        left.is_empty(),
        "namespaces left behind: {left:?}\n{}",
        done.show()
    );
}

/// Whether the script skipped (exit 77). Prints `skipped: <reason>` straight to stderr (past
/// libtest's output capture, so it shows in a normal `cargo test` run), or fails the test if
/// `OXCCL_REQUIRE_NETNS=1`.
fn skipped(done: &Finished) -> bool {
    let Some(why) = done.skipped() else {
        return false;
    };
    assert!(
        std::env::var("OXCCL_REQUIRE_NETNS").as_deref() != Ok("1"),
        "OXCCL_REQUIRE_NETNS=1 but netns.sh skipped: {why}"
    );
    let _ = writeln!(std::io::stderr(), "skipped: {why}");
    true
}

/// Every collective (the `all` scenario of `multiprocess`) on 2 nodes x 2 ranks: shared
/// memory inside a node, TCP between the namespaces.
#[test]
fn every_collective_is_correct_across_two_nodes() {
    let done = run_ranks("all", "all", &[], Duration::from_secs(120));
    if skipped(&done) {
        return;
    }
    assert_eq!(done.code, Some(0), "{}", done.show());
    let res = results_of(&done.stdout);
    for r in 0..4 {
        let node = r / 2;
        assert!(
            res.get(&r).is_some_and(|l| l.ends_with(" ok")),
            "rank {r}: {}",
            done.show()
        );
        // The script prefixes each node's lines; the launcher then the rank.
        assert!(
            done.stdout
                .contains(&format!("[node {node}] [{r}] RESULT rank={r} ok")),
            "rank {r} not reported by node {node}: {}",
            done.show()
        );
    }
}

/// Node-local ZeRO-2 training the MLP (tests/oxccl/zero_mlp.rs, checked against one process
/// after every step, replicas compared at the end) on 2 nodes x 2 ranks: each node's ranks are
/// a shard group (shared memory), the ranks with the same local rank a replica group (TCP
/// between the namespaces).
#[test]
fn node_local_zero_across_two_nodes() {
    let done = run_program(
        "zero",
        &[("OXCCL_TEST_ZERO", "4")],
        Duration::from_secs(120),
    );
    if skipped(&done) {
        return;
    }
    assert_eq!(done.code, Some(0), "{}", done.show());
    let res = results_of(&done.stdout);
    for r in 0..4 {
        let want = format!("{r} ok node={} shard={}", r / 2, r % 2);
        assert!(
            res.get(&r).is_some_and(|l| l.starts_with(&want)),
            "rank {r}: {}",
            done.show()
        );
    }
}

/// Large all-reduces cut across 2 channels (`OXCCL_SOCKET_CHANNELS`) on 2 nodes x 2 ranks: each
/// channel a hierarchical communicator of its own (shared memory inside a node, TCP across).
#[test]
fn channels_across_two_nodes() {
    let done = run_ranks(
        "chan",
        "big",
        &[("OXCCL_SOCKET_CHANNELS", "2")],
        Duration::from_secs(120),
    );
    if skipped(&done) {
        return;
    }
    assert_eq!(done.code, Some(0), "{}", done.show());
    let res = results_of(&done.stdout);
    for r in 0..4 {
        assert!(
            res.get(&r).is_some_and(|l| l.ends_with(" ok")),
            "rank {r}: {}",
            done.show()
        );
        assert!(
            done.stdout.contains(&format!("CUT rank={r} ops=6")),
            "rank {r}: {}",
            done.show()
        );
    }
}

/// One `connected` line: (global rank, peer, transport).
fn connected(line: &str) -> Option<(usize, usize, String)> {
    if !line.contains(" connected ") {
        return None;
    }
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .map(|v| v.trim_matches('"').to_owned())
    };
    Some((
        field("rank=")?.parse().ok()?,
        field("peer=")?.parse().ok()?,
        field("transport=")?,
    ))
}

/// With `OXCCL_DEBUG=info` every rank logs one `connected` line per peer: shared memory to the
/// rank in its own namespace, TCP to the two in the other one.
#[test]
fn transports_are_shm_inside_a_node_and_tcp_across() {
    let done = run_ranks(
        "transports",
        "hello",
        &[("OXCCL_DEBUG", "info")],
        Duration::from_secs(60),
    );
    if skipped(&done) {
        return;
    }
    assert_eq!(done.code, Some(0), "{}", done.show());
    let mut pairs = std::collections::BTreeMap::new();
    for r in 0..4 {
        // The world communicator's lines are this rank's first three `connected` lines (its
        // stderr is one stream, in order); `[node k] [r] ` comes from the script and launcher.
        let tag = format!("[node {}] [{r}] ", r / 2);
        let lines: Vec<_> = done
            .stderr
            .lines()
            .filter(|l| l.starts_with(&tag))
            .filter_map(connected)
            .take(3)
            .collect();
        assert_eq!(lines.len(), 3, "rank {r}: {}", done.show());
        for (rank, peer, transport) in lines {
            assert_eq!(rank, r, "{}", done.show());
            pairs.insert((rank, peer), transport);
        }
    }
    for r in 0..4 {
        for p in (0..4).filter(|&p| p != r) {
            let want = if r / 2 == p / 2 { "shm" } else { "tcp" };
            assert_eq!(
                pairs.get(&(r, p)).map(String::as_str),
                Some(want),
                "rank {r} -> peer {p}: {pairs:?}\n{}",
                done.show()
            );
        }
    }
}

/// `--racks 2 --rack-rate 1gbit` on 4 nodes of 1 rank: each node's switch port is on its rack's
/// bridge (nodes 0-1 on rk0, 2-3 on rk1), each rack reaches the spine through a rate-limited
/// uplink, and every collective is correct across the racks.
#[test]
fn racks_put_nodes_behind_rate_limited_uplinks() {
    let prefix = prefix("racks");
    // Each rank first prints its node's switch port (its bridge is named after "master") and
    // the qdiscs of both ends of its rack's uplink, then runs the `all` scenario.
    let sw = format!("{prefix}-sw");
    let mut cmd: Vec<String> = vec![
        "sh".into(),
        "-c".into(),
        format!(
            "k=$OXCCL_NODE_RANK; echo \"PORT $k $(ip -n {sw} -o link show v$k)\"; \
             echo \"UPLINK $k $(tc -n {sw} qdisc show dev up$((k / 2)))\"; \
             echo \"DOWNLINK $k $(tc -n {sw} qdisc show dev dn$((k / 2)))\"; exec \"$@\""
        ),
        "sh".into(),
    ];
    cmd.extend(rank_cmd());
    let job = Job::start(
        &prefix,
        &[
            "--nodes",
            "4",
            "--racks",
            "2",
            "--rack-rate",
            "1gbit",
            "--rate",
            "10gbit",
            "--timeout",
            "90",
        ],
        &[(SCENARIO, "all"), ("OXCCL_TIMEOUT", "60")],
        &cmd,
    );
    let done = job.finish(Instant::now() + Duration::from_secs(120));
    assert_no_namespaces(&prefix, &done);
    if skipped(&done) {
        return;
    }
    assert_eq!(done.code, Some(0), "{}", done.show());
    let res = results_of(&done.stdout);
    for k in 0..4 {
        assert!(
            res.get(&k).is_some_and(|l| l.ends_with(" ok")),
            "rank {k}: {}",
            done.show()
        );
        let port = done
            .stdout
            .lines()
            .find_map(|l| l.split_once(&format!("PORT {k} ")).map(|(_, p)| p))
            .unwrap_or_else(|| panic!("node {k} printed no PORT line: {}", done.show()));
        let rack = format!(" master rk{} ", k / 2);
        assert!(port.contains(&rack), "node {k}: {port:?} lacks {rack:?}");
        // Both ways: the rack's end (towards the spine) and the spine's end (towards the rack).
        for end in ["UPLINK", "DOWNLINK"] {
            let qdisc = done
                .stdout
                .lines()
                .find_map(|l| l.split_once(&format!("{end} {k} ")).map(|(_, q)| q))
                .unwrap_or_else(|| panic!("node {k} printed no {end} line: {}", done.show()));
            assert!(
                qdisc.contains("tbf") && qdisc.contains("rate 1Gbit"),
                "rack {}'s {end}: {qdisc:?}",
                k / 2
            );
        }
    }
}

/// How long a rank on the far side of a cut from the store may additionally take to report: a
/// failing rank tries for at most 3 s to publish its error in the store (comm's engine,
/// `PUBLISH_BUDGET`) before it closes its connections.
const STORE_UNREACHABLE_DELAY_S: u64 = 3;

/// Node 1's link goes down in the middle of a loop of 1 MiB all-reduces: every rank, on both
/// sides of the cut, must report an error (time-out, lost peer, or aborted because another rank
/// failed first) within a few `OXCCL_TIMEOUT`s, and everything must end (no hang) with the
/// namespaces removed.
#[test]
fn a_link_cut_mid_collective_fails_every_rank_in_time() {
    const TIMEOUT_S: u64 = 5;
    let prefix = prefix("cut");
    let timeout = TIMEOUT_S.to_string();
    let mut job = Job::start(
        &prefix,
        &["--nodes", "2", "--nproc", "2", "--timeout", "150"],
        &[
            (SCENARIO, "loop"),
            ("OXCCL_TIMEOUT", timeout.as_str()),
            ("OXCCL_TEST_LOOP_SECS", "100"),
        ],
        &rank_cmd(),
    );
    let looping = job.wait_for(Instant::now() + Duration::from_secs(60), |seen| {
        (0..4).all(|r| {
            seen.iter()
                .any(|(_, l)| l.ends_with(&format!("LOOPING rank={r}")))
        })
    });
    if !looping {
        let done = job.finish(Instant::now() + Duration::from_secs(30));
        if skipped(&done) {
            return;
        }
        panic!("the ranks never all started looping\n{}", done.show());
    }
    let down = script(&["link-down", "--node", "1", "--prefix", &prefix])
        .output()
        .expect("running netns.sh link-down");
    let cut = Instant::now();
    assert!(
        down.status.success(),
        "link-down failed: {}\n{}",
        String::from_utf8_lossy(&down.stderr),
        job.partial()
    );
    // The ranks report within a few time-outs (checked below); the launchers then give up on
    // each other after 30 s without a word (`oxccl launch`'s silent-node limit), plus store
    // requests of 5 s each into the cut link.
    let done =
        job.finish(cut + Duration::from_secs(3 * TIMEOUT_S + STORE_UNREACHABLE_DELAY_S + 60));
    assert_no_namespaces(&prefix, &done);
    let res = results_of(&done.stdout);
    for r in 0..4 {
        let line = res
            .get(&r)
            .unwrap_or_else(|| panic!("rank {r} reported nothing\n{}", done.show()));
        assert!(
            ["timeout", "peer-lost", "aborted"]
                .iter()
                .any(|k| line.contains(&format!("err={k} "))),
            "rank {r}: expected err=timeout, peer-lost or aborted, got: {line}\n{}",
            done.show()
        );
        let (at, _) = done
            .timed
            .iter()
            .find(|(_, l)| l.contains(&format!("RESULT rank={r} ")))
            .unwrap();
        let after = at.saturating_duration_since(cut);
        // Ranks 0 and 1 share node 0 with the store; 2 and 3 are cut off from it.
        let limit = Duration::from_secs(
            3 * TIMEOUT_S + 5 + if r >= 2 { STORE_UNREACHABLE_DELAY_S } else { 0 },
        );
        assert!(
            after <= limit,
            "rank {r} reported {after:?} after the cut (limit {limit:?}): {line}\n{}",
            done.show()
        );
        eprintln!("rank {r}: {after:.1?} after the cut: RESULT rank={line}");
    }
}

/// A command failing on one node: the script exits with its code, the other node is stopped,
/// and the namespaces are gone. Also checks the command ran in the right namespace.
#[test]
fn namespaces_are_removed_when_a_node_fails() {
    let prefix = prefix("fail");
    let job = Job::start(
        &prefix,
        &["--nodes", "2", "--nproc", "1", "--fail-grace", "2"],
        &[],
        &[
            "sh".into(),
            "-c".into(),
            "echo \"IN $(ip netns identify) $OXCCL_NODE_ID rank=$OXCCL_RANK\"; \
             if [ \"$OXCCL_NODE_RANK\" = 1 ]; then exit 3; fi; sleep 30"
                .into(),
        ],
    );
    let done = job.finish(Instant::now() + Duration::from_secs(40));
    if skipped(&done) {
        return;
    }
    assert_no_namespaces(&prefix, &done);
    assert_eq!(done.code, Some(3), "{}", done.show());
    for k in 0..2 {
        let want = format!("[node {k}] [{k}] IN {prefix}-n{k} node{k} rank={k}");
        assert!(done.stdout.contains(&want), "{want}: {}", done.show());
    }
    assert!(
        done.stderr.contains("node 1 exited with code 3"),
        "{}",
        done.show()
    );
}

/// SIGTERM to the script mid-run: the ranks are stopped, the namespaces removed, exit 143.
#[test]
fn namespaces_are_removed_when_the_script_is_terminated() {
    let prefix = prefix("term");
    let mut job = Job::start(
        &prefix,
        &["--nodes", "2", "--nproc", "1"],
        &[],
        &[
            "sh".into(),
            "-c".into(),
            "echo \"READY pid=$$\"; exec sleep 60".into(),
        ],
    );
    let ready = job.wait_for(Instant::now() + Duration::from_secs(30), |seen| {
        seen.iter()
            .filter(|(_, l)| l.contains("READY pid="))
            .count()
            == 2
    });
    if !ready {
        let done = job.finish(Instant::now() + Duration::from_secs(30));
        if skipped(&done) {
            return;
        }
        panic!("the nodes never started\n{}", done.show());
    }
    job.signal(libc::SIGTERM);
    let t = Instant::now();
    let done = job.finish(Instant::now() + Duration::from_secs(30));
    assert_eq!(done.code, Some(143), "{}", done.show());
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
    assert_no_namespaces(&prefix, &done);
    for line in done.stdout.lines().filter(|l| l.contains("READY pid=")) {
        let pid = line.rsplit("pid=").next().unwrap().trim();
        // Gone, or at most a zombie waiting for a parent that is not ours to reap it.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .next();
        assert!(
            matches!(state, None | Some("Z")),
            "rank process {pid} survived: {stat}"
        );
    }
}

/// Not root: the script says `SKIP: ...` and exits 77 (the path every test here takes on
/// machines without namespaces). Needs root itself, to drop to `nobody` with setpriv.
#[test]
fn without_root_the_script_skips_with_77() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        let _ = writeln!(
            std::io::stderr(),
            "skipped: not root (the other tests took the non-root path)"
        );
        return;
    }
    let mut cmd = Command::new("setpriv");
    cmd.args([
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "bash",
        SCRIPT,
    ])
    .args(["up", "--nodes", "2", "--prefix", &prefix("noroot")]);
    let out = match cmd.output() {
        Ok(o) => o,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "skipped: setpriv cannot run: {e}");
            return;
        }
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() != Some(SKIP) && stderr.contains("Permission denied") {
        let _ = writeln!(std::io::stderr(), "skipped: nobody cannot read {SCRIPT}");
        return;
    }
    assert_eq!(out.status.code(), Some(SKIP), "{stderr}");
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with("SKIP: ") && l.contains("root")),
        "{stderr}"
    );
}
