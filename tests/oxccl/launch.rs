//! End-to-end tests of `oxccl launch` (the binary; the `launch` function it calls has unit tests
//! of its own in `src/bin/oxccl/launch/`).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::common;

const MARKER_VAR: &str = "OXCCL_LAUNCH_TEST_MARKER";

/// A marker unique to one test, inherited by every process of the job it launches.
fn marker(test: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{test}-{}-{nanos}", std::process::id())
}

fn oxccl(marker: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_oxccl"));
    c.env(MARKER_VAR, marker).env_remove("OXCCL_JOB_ID");
    c
}

fn run(cmd: &mut Command) -> (Output, String, String, Duration) {
    let t = Instant::now();
    let out = cmd.output().expect("run oxccl");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr, t.elapsed())
}

/// Pids of live processes whose environment carries `marker`.
fn processes_with(marker: &str) -> Vec<(u32, String)> {
    let needle = format!("{MARKER_VAR}={marker}");
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(env) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if env.split(|&b| b == 0).any(|kv| kv == needle.as_bytes()) {
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            found.push((pid, cmdline));
        }
    }
    found
}

/// Asserts that no process of the job is left (allowing a moment for the kernel to finish
/// tearing down processes SIGKILLed by a watchdog).
fn assert_no_survivors(marker: &str) {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let left = processes_with(marker);
        if left.is_empty() {
            return;
        }
        if Instant::now() >= deadline {
            for (pid, _) in &left {
                // SAFETY: kill(2) on pids we just found carrying this test's marker.
                unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
            }
            panic!("processes of the job survived: {left:?}");
        }
        thread::sleep(Duration::from_millis(20));
    }
}

fn wait_timeout(child: &mut Child, limit: Duration) -> ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("launcher did not exit within {limit:?}");
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// Starts a launcher whose `n` ranks each print `ready` and then sleep; returns once all are up.
fn start_sleeping_job(marker: &str, n: usize) -> (Child, mpsc::Receiver<String>) {
    let mut child = oxccl(marker)
        .args(["launch", "-n", &n.to_string(), "--", "sh", "-c"])
        .arg("sleep 30 & echo ready; sleep 31; echo never")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let _ = tx.send(line.unwrap_or_default());
        }
    });
    let mut ready = 0;
    while ready < n {
        let line = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("ranks did not start");
        if line.ends_with("ready") {
            ready += 1;
        }
    }
    (child, rx)
}

#[test]
fn four_ranks_get_their_env_and_prefixed_output() {
    let m = marker("env");
    let (out, stdout, stderr, _) =
        run(oxccl(&m).args(["launch", "-n", "4", "--", "sh", "-c"]).arg(
            "echo rank=$OXCCL_RANK world=$OXCCL_WORLD_SIZE local=$OXCCL_LOCAL_RANK \
         store=$OXCCL_STORE hosted=$OXCCL_STORE_HOSTED port=$MASTER_PORT torch=$RANK/$WORLD_SIZE \
         job=$OXCCL_JOB_ID; echo to-stderr >&2",
        ));
    assert!(
        out.status.success(),
        "status {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    let mut job_ids = Vec::new();
    for r in 0..4 {
        let prefix = format!("[{r}] rank={r} world=4 local={r} store=127.0.0.1:");
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("no line for rank {r} in:\n{stdout}"));
        let store_port = line
            .split("store=127.0.0.1:")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap();
        assert!(store_port.parse::<u16>().unwrap() > 0, "{line}");
        assert!(line.contains(&format!(" port={store_port} ")), "{line}");
        assert!(line.contains(" hosted=1 "), "{line}");
        assert!(line.contains(&format!(" torch={r}/4 ")), "{line}");
        job_ids.push(line.split("job=").nth(1).unwrap().to_owned());
        assert!(
            stderr.lines().any(|l| l == format!("[{r}] to-stderr")),
            "stderr:\n{stderr}"
        );
    }
    assert!(
        job_ids
            .iter()
            .all(|j| j == &job_ids[0] && j.ends_with("-r0")),
        "{job_ids:?}"
    );
    assert_eq!(stdout.lines().count(), 4, "{stdout}");
    assert_no_survivors(&m);
}

#[test]
fn no_prefix_leaves_lines_bare() {
    let m = marker("noprefix");
    let (out, stdout, _, _) = run(oxccl(&m).args([
        "launch",
        "--np",
        "2",
        "--no-prefix",
        "--",
        "echo",
        "hello",
        "-x",
    ]));
    assert!(out.status.success());
    assert_eq!(stdout, "hello -x\nhello -x\n");
}

#[test]
fn bind_core_gives_each_local_rank_its_own_cpu() {
    // Each rank prints its allowed CPUs; with --bind core local rank i gets the launcher's i-th
    // CPU (wrapping), without it every rank keeps the launcher's whole set.
    let cpus = oxccl::comm::internal::affinity::allowed_cpus();
    let show = "grep Cpus_allowed_list /proc/self/status | cut -f2";
    let m = marker("bind");
    let (out, stdout, stderr, _) = run(oxccl(&m).args([
        "launch", "--np", "3", "--bind", "core", "--", "sh", "-c", show,
    ]));
    assert!(out.status.success(), "{stdout}{stderr}");
    for lr in 0..3 {
        let want = cpus[lr % cpus.len()].to_string();
        assert!(
            stdout.lines().any(|l| l == format!("[{lr}] {want}")),
            "rank {lr} should run on CPU {want}:\n{stdout}"
        );
    }
    let (out, stdout, _, _) = run(oxccl(&m).args(["launch", "--np", "2", "--", "sh", "-c", show]));
    assert!(out.status.success());
    let all = oxccl::comm::internal::affinity::encode_cpus(&cpus);
    assert_eq!(stdout.matches(&format!("] {all}\n")).count(), 2, "{stdout}");
    let (out, _, stderr, _) =
        run(oxccl(&m).args(["launch", "--np", "2", "--bind", "socket", "--", "true"]));
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("none, core or block"), "{stderr}");
}

#[test]
fn bind_block_gives_each_local_rank_its_share_of_the_cpus() {
    // With --bind block, local rank i of n gets the i-th block of max(1, cpus / n) of the
    // launcher's CPUs: one rank keeps them all, two split them in halves (one each on 2 CPUs).
    let cpus = oxccl::comm::internal::affinity::allowed_cpus();
    let show = "grep Cpus_allowed_list /proc/self/status | cut -f2";
    let m = marker("bindblock");
    for np in [1usize, 2] {
        let (out, stdout, stderr, _) = run(oxccl(&m).args([
            "launch",
            "--np",
            &np.to_string(),
            "--bind",
            "block",
            "--",
            "sh",
            "-c",
            show,
        ]));
        assert!(out.status.success(), "{stdout}{stderr}");
        // One rank: all of them; two: the first and the second half (one CPU each on 1 CPU).
        let half = (cpus.len() / 2).max(1);
        let blocks: Vec<&[usize]> = match (np, cpus.len()) {
            (1, _) => vec![&cpus[..]],
            (_, 1) => vec![&cpus[..1], &cpus[..1]],
            _ => vec![&cpus[..half], &cpus[half..2 * half]],
        };
        for (lr, block) in blocks.iter().enumerate() {
            let want = oxccl::comm::internal::affinity::encode_cpus(block);
            assert!(
                stdout.lines().any(|l| l == format!("[{lr}] {want}")),
                "{np} ranks: rank {lr} should run on CPUs {want}:\n{stdout}"
            );
        }
    }
}

#[test]
fn a_killed_rank_takes_the_job_down() {
    let m = marker("kill9");
    let (out, _, stderr, took) = run(oxccl(&m).args(["launch", "-n", "4", "--", "sh", "-c"]).arg(
        "if [ \"$OXCCL_RANK\" = 2 ]; then kill -9 $$; fi; sleep 30 & sleep 31; echo survived",
    ));
    assert!(!out.status.success());
    assert_eq!(out.status.code(), Some(128 + 9));
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(
        stderr.contains("rank 2 (pid ") && stderr.contains("killed by signal 9 (SIGKILL)"),
        "stderr:\n{stderr}"
    );
    assert_no_survivors(&m);
}

#[test]
fn a_failing_rank_is_named_with_its_code() {
    let m = marker("code3");
    let (out, _, stderr, took) = run(oxccl(&m)
        .args(["launch", "-n", "3", "--", "sh", "-c"])
        .arg("if [ \"$OXCCL_RANK\" = 1 ]; then exit 3; fi; sleep 30"));
    assert_eq!(out.status.code(), Some(3), "stderr:\n{stderr}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(
        stderr.contains("rank 1 (pid ") && stderr.contains("failed: exited with code 3"),
        "{stderr}"
    );
    assert_no_survivors(&m);
}

/// With `--keep-going` a failed rank stops nothing: the other ranks finish their work (without
/// it they are terminated at once, see above), and the launcher exits with the failed rank's
/// code once they are done.
#[test]
fn keep_going_lets_the_other_ranks_finish() {
    let m = marker("keepgoing");
    let (out, stdout, stderr, _) = run(oxccl(&m)
        .args(["launch", "-n", "3", "--keep-going", "--", "sh", "-c"])
        .arg("if [ \"$OXCCL_RANK\" = 1 ]; then exit 3; fi; sleep 2; echo finished $OXCCL_RANK"));
    assert_eq!(out.status.code(), Some(3), "stderr:\n{stderr}");
    assert!(
        stdout.contains("finished 0") && stdout.contains("finished 2"),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stderr.contains("failed: exited with code 3")
            && stderr.contains("--keep-going: the other local ranks go on"),
        "{stderr}"
    );
    assert_no_survivors(&m);
    let (out, _, stderr, _) = run(oxccl(&m).args([
        "launch",
        "-n",
        "2",
        "--keep-going",
        "--max-restarts",
        "1",
        "--",
        "true",
    ]));
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("exclude each other"), "{stderr}");
}

/// With `--respawn N` a failed rank is replaced by a process with its variables and
/// `OXCCL_JOIN=1`, while the others go on; a replaced failure does not count (exit 0). Once the
/// replacements are spent a failure is kept as with `--keep-going`; `--respawn` and
/// `--max-restarts` exclude each other.
#[test]
fn respawn_replaces_failed_ranks_while_replacements_last() {
    let m = marker("respawn");
    // Rank 1 fails at once; its replacement reports what it was given and succeeds. The
    // launcher's own OXCCL_JOIN=1 does not reach the other ranks.
    let script = "if [ \"$OXCCL_RANK\" = 1 ] && [ \"$OXCCL_JOIN\" = 0 ]; then exit 3; fi; \
                  sleep 1; echo finished $OXCCL_RANK join=$OXCCL_JOIN respawn=$OXCCL_RESPAWN";
    let (out, stdout, stderr, _) = run(oxccl(&m)
        .args(["launch", "-n", "3", "--respawn", "1", "--", "sh", "-c"])
        .arg(script)
        .env("OXCCL_JOIN", "1"));
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    for want in [
        "finished 0 join=0 respawn=1",
        "finished 2 join=0 respawn=1",
        "finished 1 join=1 respawn=1",
    ] {
        assert!(
            stdout.contains(want),
            "{want}\nstdout:\n{stdout}\nstderr:\n{stderr}"
        );
    }
    assert!(
        stderr.contains("rank 1 (pid ")
            && stderr.contains("--respawn: starting a replacement for rank 1 (replacement 1 of 1)"),
        "{stderr}"
    );
    assert_no_survivors(&m);

    // Rank 1 and its replacements always fail: two replacements, then the third failure is
    // kept and the others still finish.
    let (out, stdout, stderr, _) = run(oxccl(&m)
        .args(["launch", "-n", "2", "--respawn", "2", "--", "sh", "-c"])
        .arg("if [ \"$OXCCL_RANK\" = 1 ]; then exit 5; fi; sleep 1; echo finished $OXCCL_RANK"));
    assert_eq!(
        out.status.code(),
        Some(5),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stdout.contains("finished 0"),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert_eq!(
        stderr.matches("launch: rank 1 (pid ").count(),
        3,
        "{stderr}"
    );
    assert!(
        stderr.contains("(replacement 2 of 2)")
            && !stderr.contains("(replacement 3")
            && stderr.contains("--respawn: no replacement left: the other local ranks go on"),
        "{stderr}"
    );
    assert_no_survivors(&m);

    // A lone rank that fails has nobody left to take a replacement in: none is started.
    let (out, _, stderr, _) = run(oxccl(&m).args([
        "launch",
        "-n",
        "1",
        "--respawn",
        "1",
        "--",
        "sh",
        "-c",
        "exit 4",
    ]));
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(
        stderr.contains("--respawn: no other local rank runs to take a replacement in")
            && !stderr.contains("starting a replacement"),
        "{stderr}"
    );
    assert_no_survivors(&m);

    let (out, _, stderr, _) = run(oxccl(&m).args([
        "launch",
        "-n",
        "2",
        "--respawn",
        "1",
        "--max-restarts",
        "1",
        "--",
        "true",
    ]));
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("exclude each other"), "{stderr}");
}

#[test]
fn sigterm_is_forwarded_and_nothing_survives() {
    let m = marker("sigterm");
    let (mut child, _rx) = start_sleeping_job(&m, 3);
    // Launcher, watchdog, and 3 x (sh + 2 sleeps); the second sleep may start just after `ready`.
    let deadline = Instant::now() + Duration::from_secs(5);
    while processes_with(&m).len() < 1 + 1 + 3 * 3 {
        assert!(
            Instant::now() < deadline,
            "job not fully up: {:?}",
            processes_with(&m)
        );
        thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: kill(2) on the launcher we spawned and have not reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let st = wait_timeout(&mut child, Duration::from_secs(10));
    assert_eq!(st.code(), Some(128 + libc::SIGTERM));
    assert_no_survivors(&m);
}

#[test]
fn sigkill_of_the_launcher_leaves_no_orphans() {
    let m = marker("sigkill");
    let (mut child, _rx) = start_sleeping_job(&m, 2);
    child.kill().unwrap();
    child.wait().unwrap();
    assert_no_survivors(&m);
}

#[test]
fn max_restarts_restarts_every_rank() {
    let m = marker("restart");
    let (out, stdout, stderr, _) = run(oxccl(&m)
        .args(["launch", "-n", "2", "--max-restarts", "2", "--", "sh", "-c"])
        .arg(
            "echo attempt=$OXCCL_RESTART_COUNT job=$OXCCL_JOB_ID; \
             if [ \"$OXCCL_RANK\" = 1 ] && [ \"$OXCCL_RESTART_COUNT\" -lt 2 ]; then exit 5; fi",
        ));
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    // Rank 1 runs on every attempt; rank 0 may be stopped before it prints on a failed attempt,
    // but must have run on the last one.
    for (attempt, rank) in [(0, 1), (1, 1), (2, 0), (2, 1)] {
        let want = format!("[{rank}] attempt={attempt} job=");
        let line = stdout.lines().find(|l| l.starts_with(&want));
        let line = line.unwrap_or_else(|| panic!("missing {want:?} in:\n{stdout}"));
        assert!(line.ends_with(&format!("-r{attempt}")), "{line}");
    }
    assert!(!stdout.contains("attempt=3"), "{stdout}");
    let failures = stderr
        .lines()
        .filter(|l| l.starts_with("oxccl launch: rank 1 (pid "))
        .count();
    assert_eq!(failures, 2, "{stderr}");
    assert_eq!(
        stderr.matches("restarting all 2 local ranks").count(),
        2,
        "{stderr}"
    );
    assert_no_survivors(&m);
}

#[test]
fn restarts_exhausted_report_the_failure() {
    let m = marker("restart-fail");
    let (out, _, stderr, _) = run(oxccl(&m).args([
        "launch",
        "-n",
        "2",
        "--max-restarts",
        "1",
        "--",
        "sh",
        "-c",
        "exit 4",
    ]));
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(stderr.contains("restart 1 of 1"), "{stderr}");
}

#[test]
fn missing_command_is_a_clear_error() {
    let m = marker("missing");
    let (out, _, stderr, _) = run(oxccl(&m).args([
        "launch",
        "-n",
        "2",
        "--",
        "/nonexistent/oxccl-no-such-cmd",
        "x",
    ]));
    assert_eq!(out.status.code(), Some(127), "{stderr}");
    assert!(
        stderr.contains("command not found") && stderr.contains("/nonexistent/oxccl-no-such-cmd"),
        "{stderr}"
    );
    assert_no_survivors(&m);
}

#[test]
fn bad_arguments_are_rejected() {
    let m = marker("badargs");
    let (out, _, stderr, _) =
        run(oxccl(&m).args(["launch", "-n", "2", "--nnodes", "2", "--", "true"]));
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--master-port is required"), "{stderr}");

    let (out, _, stderr, _) = run(oxccl(&m).args(["launch", "--", "true"]));
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--nproc-per-node"), "{stderr}");

    let (out, _, _, _) = run(oxccl(&m).args(["--version"]));
    assert!(out.status.success());
}

#[test]
fn timeout_kills_the_job() {
    let m = marker("timeout");
    let (out, _, stderr, took) = run(oxccl(&m).args([
        "launch",
        "-n",
        "2",
        "--timeout",
        "0.3",
        "--",
        "sh",
        "-c",
        "sleep 30; true",
    ]));
    assert_eq!(out.status.code(), Some(124), "{stderr}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert_no_survivors(&m);
}

#[test]
fn absurd_rank_counts_and_timeouts_are_refused() {
    let m = marker("limits");
    let (out, _, stderr, _) = run(oxccl(&m).args(["launch", "-n", "5000", "--", "true"]));
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("-n/--nproc-per-node 5000") && stderr.contains("4096"),
        "{stderr}"
    );
    let (out, _, stderr, _) =
        run(oxccl(&m).args(["launch", "-n", "1", "--timeout", "1e19", "--", "true"]));
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--timeout") && !stderr.contains("panicked"),
        "{stderr}"
    );
    assert_no_survivors(&m);
}

#[test]
fn a_signal_while_the_ranks_start_stops_the_job() {
    // Every rank sends SIGTERM to the launcher as soon as it runs, usually while later ranks are
    // still being started.
    let m = marker("sigstart");
    let (out, _, stderr, took) = run(oxccl(&m)
        .args(["launch", "-n", "32", "--", "sh", "-c"])
        .arg("kill -TERM $PPID; exec sleep 30"));
    assert_eq!(out.status.code(), Some(128 + libc::SIGTERM), "{stderr}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert_no_survivors(&m);
}

/// The launcher of node `node` of a 2-node job on loopback, `n` ranks running `sh -c script`.
fn node_launcher(marker: &str, port: u16, node: usize, n: usize, script: &str) -> Child {
    node_launcher_with(marker, port, node, n, &[], script)
}

/// [`node_launcher`] with `extra` launcher options.
fn node_launcher_with(
    marker: &str,
    port: u16,
    node: usize,
    n: usize,
    extra: &[&str],
    script: &str,
) -> Child {
    oxccl(marker)
        .args(["launch", "--nnodes", "2", "--node-rank", &node.to_string()])
        .args(["--master-port", &port.to_string(), "-n", &n.to_string()])
        .args(extra)
        .args(["--", "sh", "-c", script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The launchers of a 2-node job on loopback with one rank each, once both ranks run (and then
/// sleep for two minutes).
fn two_sleeping_nodes(marker: &str) -> (Child, Child) {
    let port = common::free_port();
    let script = "echo ready; sleep 120";
    let mut nodes = [0, 1].map(|k| node_launcher(marker, port, k, 1, script));
    for child in &mut nodes {
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert!(line.ends_with("ready\n"), "{line:?}");
    }
    let [n0, n1] = nodes;
    (n0, n1)
}

/// Waits for a launcher with a limit and returns its exit code, stdout and stderr.
fn finish_within(child: Child, limit: Duration) -> (Option<i32>, String, String) {
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let Ok(out) = rx.recv_timeout(limit) else {
        // SAFETY: kill(2) on the launcher this test started; its output thread still holds it.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        panic!("launcher {pid} did not exit within {limit:?}");
    };
    let out = out.unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A rank failing on node 1 stops the ranks of node 0 at once (they would otherwise sleep for
/// two minutes), and both launchers exit with the failed rank's code.
#[test]
fn a_failure_on_one_node_stops_every_node() {
    let m = marker("nodefail");
    let port = common::free_port();
    let script = "if [ \"$OXCCL_NODE_RANK\" = 1 ]; then sleep 1; exit 3; fi; sleep 120";
    let started = Instant::now();
    let n0 = node_launcher(&m, port, 0, 2, script);
    let n1 = node_launcher(&m, port, 1, 2, script);
    let (c1, _, e1) = finish_within(n1, Duration::from_secs(30));
    let (c0, _, e0) = finish_within(n0, Duration::from_secs(30));
    let took = started.elapsed();
    assert_eq!(c1, Some(3), "node 1:\n{e1}");
    assert_eq!(c0, Some(3), "node 0:\n{e0}");
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert!(
        e0.contains("node 1: rank ") && e0.contains("failed: exited with code 3; stopping all 2"),
        "node 0:\n{e0}"
    );
    assert!(e0.contains("job failed on another node"), "node 0:\n{e0}");
    assert_no_survivors(&m);
}

/// With `--keep-going` on both nodes, a rank failing on node 1 stops neither its node's other
/// rank nor node 0's ranks: all finish, node 0 exits 0 and node 1 with the failed rank's code.
#[test]
fn keep_going_across_nodes() {
    let m = marker("nodekeep");
    let port = common::free_port();
    let script =
        "if [ \"$OXCCL_RANK\" = 3 ]; then sleep 1; exit 3; fi; sleep 3; echo finished $OXCCL_RANK";
    let n0 = node_launcher_with(&m, port, 0, 2, &["--keep-going"], script);
    let n1 = node_launcher_with(&m, port, 1, 2, &["--keep-going"], script);
    let (c1, o1, e1) = finish_within(n1, Duration::from_secs(60));
    let (c0, o0, e0) = finish_within(n0, Duration::from_secs(60));
    assert_eq!(c1, Some(3), "node 1:\n{e1}");
    assert_eq!(c0, Some(0), "node 0:\n{e0}");
    assert!(
        o0.contains("finished 0") && o0.contains("finished 1"),
        "node 0:\n{o0}\n{e0}"
    );
    assert!(o1.contains("finished 2"), "node 1:\n{o1}\n{e1}");
    assert_no_survivors(&m);
}

/// Node 0's ranks finish at once, node 1's three seconds later: node 0's launcher (which hosts
/// the store node 1's ranks may still use) waits for node 1, and both succeed.
#[test]
fn node_0_keeps_the_store_until_every_node_is_done() {
    let m = marker("nodewait");
    let port = common::free_port();
    let script = "if [ \"$OXCCL_NODE_RANK\" = 1 ]; then sleep 3; fi; echo done";
    let started = Instant::now();
    let n0 = node_launcher(&m, port, 0, 1, script);
    let n1 = node_launcher(&m, port, 1, 1, script);
    let (c0, out0, e0) = finish_within(n0, Duration::from_secs(30));
    let node0_took = started.elapsed();
    let (c1, out1, e1) = finish_within(n1, Duration::from_secs(30));
    assert_eq!((c0, c1), (Some(0), Some(0)), "node 0:\n{e0}\nnode 1:\n{e1}");
    assert!(out0.contains("[0] done") && out1.contains("[1] done"));
    assert!(
        node0_took >= Duration::from_millis(2900),
        "node 0 exited after {node0_took:?}, before node 1's ranks were done\n{e0}"
    );
    assert!(e0.contains("waiting for nodes [1] to finish"), "{e0}");
    assert_no_survivors(&m);
}

/// Node 0's launcher killed with SIGKILL (its ranks die with it): node 1 sees its store refuse
/// connections and stops its own ranks instead of letting them sleep for two minutes.
#[test]
fn losing_node_0_stops_the_other_nodes() {
    let m = marker("node0lost");
    let (mut n0, n1) = two_sleeping_nodes(&m);
    // Let node 1's launcher reach the store before node 0 goes.
    thread::sleep(Duration::from_millis(1500));
    n0.kill().unwrap();
    n0.wait().unwrap();
    let killed = Instant::now();
    let (c1, _, e1) = finish_within(n1, Duration::from_secs(30));
    assert_eq!(c1, Some(1), "node 1:\n{e1}");
    assert!(killed.elapsed() < Duration::from_secs(20), "{e1}");
    assert!(
        e1.contains("node 0: its launcher is gone: nothing listens on its store's port"),
        "{e1}"
    );
    assert_no_survivors(&m);
}

/// SIGTERM to node 1's launcher ends the job on node 0 too, with the same code.
#[test]
fn a_signal_to_one_node_ends_the_job_everywhere() {
    let m = marker("nodesig");
    let (n0, n1) = two_sleeping_nodes(&m);
    // SAFETY: kill(2) on the launcher this test spawned and has not reaped.
    unsafe { libc::kill(n1.id() as i32, libc::SIGTERM) };
    let (c1, _, e1) = finish_within(n1, Duration::from_secs(30));
    let (c0, _, e0) = finish_within(n0, Duration::from_secs(30));
    assert_eq!(c1, Some(143), "node 1:\n{e1}");
    assert_eq!(c0, Some(143), "node 0:\n{e0}");
    assert!(
        e0.contains("node 1: its launcher received SIGTERM"),
        "node 0:\n{e0}"
    );
    assert_no_survivors(&m);
}

/// `--max-restarts 2` on both nodes and a rank of node 1 that always fails: every node runs 3
/// attempts (node 0's ranks, which would sleep for two minutes, are stopped and restarted each
/// time), then both launchers exit with the failed rank's code.
#[test]
fn restarts_across_nodes_end_together() {
    let m = marker("noderestart");
    let port = common::free_port();
    let script = "echo \"attempt $OXCCL_RESTART_COUNT\"; \
                  if [ \"$OXCCL_NODE_RANK\" = 1 ]; then sleep 0.5; exit 3; fi; sleep 120";
    let launcher = |k: usize| {
        oxccl(&m)
            .args(["launch", "--nnodes", "2", "--node-rank", &k.to_string()])
            .args(["--master-port", &port.to_string(), "--max-restarts", "2"])
            .args(["-n", "1", "--", "sh", "-c", script])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (n0, n1) = (launcher(0), launcher(1));
    let (c1, out1, e1) = finish_within(n1, Duration::from_secs(60));
    let (c0, out0, e0) = finish_within(n0, Duration::from_secs(60));
    assert_eq!((c0, c1), (Some(3), Some(3)), "node 0:\n{e0}\nnode 1:\n{e1}");
    for (k, out) in [out0, out1].iter().enumerate() {
        for a in 0..3 {
            assert!(
                out.contains(&format!("[{k}] attempt {a}")),
                "node {k}:\n{out}"
            );
        }
    }
    assert!(
        e0.contains("restarting all 1 local ranks (restart 2 of 2) after node 1: rank 1"),
        "{e0}"
    );
    assert_no_survivors(&m);
}
