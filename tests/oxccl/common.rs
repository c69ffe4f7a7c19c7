//! Shared by the multi-process tests (`multiprocess`, `multinode`, `trace`, `ddp_mlp`,
//! `moe_example`, `survive_example`, `replace_example`, `launch`): the rank side of the
//! scenarios of `multiprocess`, `multinode` and `trace`, and helpers to start ranks and read what
//! they printed.
//!
//! The test binary is its own rank program: its one `#[test] fn rank_entry()` (in `main.rs`)
//! does nothing in a normal test run and plays a rank when one of the tests' variables is set;
//! with `OXCCL_TEST_SCENARIO` it calls [`play_scenario`]. The launcher runs [`rank_cmd`], i.e.
//! `<this binary> rank_entry --exact --nocapture ...`. Every scenario ends with one line
//! `RESULT rank=R ok` or `RESULT rank=R err=KIND peer=P ms=T msg=...` on stdout (see
//! [`report`]), read back by [`results`].

use std::collections::HashMap;
use std::io::Write;
use std::process::Output;
use std::time::{Duration, Instant};

use oxccl::comm::{Communicator, Error, ReduceOp};

/// The variable naming the scenario a rank plays.
pub const SCENARIO: &str = "OXCCL_TEST_SCENARIO";

/// Every collective with a few dtypes and counts; panics (so the rank exits non-zero) on a
/// wrong result.
pub fn scenario_all(c: &Communicator) -> Result<(), Error> {
    let (n, me) = (c.size(), c.rank());
    for count in [0usize, 1, 7, 1000, 100_003] {
        let mut v: Vec<f32> = (0..count).map(|i| (i % 13 + me) as f32).collect();
        c.all_reduce(&mut v, ReduceOp::Sum)?;
        let sum_ranks = (n * (n - 1) / 2) as f32;
        assert!(
            v.iter()
                .enumerate()
                .all(|(i, &x)| x == (n * (i % 13)) as f32 + sum_ranks),
            "all_reduce"
        );
        let mut v = vec![me as i64; count];
        c.all_reduce(&mut v, ReduceOp::Max)?;
        assert!(v.iter().all(|&x| x == n as i64 - 1), "all_reduce max");
        let mut out = vec![0u32; count];
        c.reduce_scatter_into(&vec![1u32; count * n], &mut out, ReduceOp::Sum)?;
        assert!(out.iter().all(|&x| x == n as u32), "reduce_scatter");
        let mut out = vec![0u8; count * n];
        c.all_gather_into(&vec![me as u8; count], &mut out)?;
        assert!(
            out.iter()
                .enumerate()
                .all(|(k, &x)| x as usize == k / count.max(1)),
            "all_gather"
        );
        let root = count % n;
        let mut b = vec![me as f64; count];
        c.broadcast(&mut b, root)?;
        assert!(b.iter().all(|&x| x == root as f64), "broadcast");
        let mut out = vec![0i32; if me == root { count } else { 0 }];
        c.reduce_into(&vec![1i32; count], &mut out, ReduceOp::Sum, root)?;
        assert!(out.iter().all(|&x| x == n as i32), "reduce");
        let mut out = vec![0u64; if me == root { count * n } else { 0 }];
        c.gather_into(&vec![me as u64; count], &mut out, root)?;
        assert!(
            out.iter()
                .enumerate()
                .all(|(k, &x)| x as usize == k / count.max(1)),
            "gather"
        );
        let inp: Vec<u64> = if me == root {
            (0..count * n).map(|k| (k / count.max(1)) as u64).collect()
        } else {
            vec![]
        };
        let mut out = vec![99u64; count];
        c.scatter_into(&inp, &mut out, root)?;
        assert!(out.iter().all(|&x| x == me as u64), "scatter");
        let inp: Vec<u32> = (0..count * n)
            .map(|k| (me * 1000 + k / count.max(1)) as u32)
            .collect();
        let mut out = vec![0u32; count * n];
        c.all_to_all_into(&inp, &mut out)?;
        assert!(
            out.iter()
                .enumerate()
                .all(|(k, &x)| x as usize == (k / count.max(1)) * 1000 + me),
            "all_to_all"
        );
        let mut r = vec![0u8; count];
        c.send_recv(
            &vec![me as u8; count],
            (me + 1) % n,
            &mut r,
            (me + n - 1) % n,
        )?;
        assert!(
            r.iter().all(|&x| x as usize == (me + n - 1) % n),
            "send_recv"
        );
        c.barrier()?;
    }
    let sub = c.split(Some((me % 2) as u32), me as i64)?.expect("member");
    let mut x = [1u32];
    sub.all_reduce(&mut x, ReduceOp::Sum)?;
    assert_eq!(x[0] as usize, (n + 1 - me % 2) / 2);
    // Rank 0 may host the store (started by hand): it must not leave while the other group is
    // still meeting through it.
    c.barrier()?;
    Ok(())
}

/// One small all-reduce and a barrier: connects every pair and does little else (for checking
/// the `connected` log lines).
fn scenario_hello(c: &Communicator) -> Result<(), Error> {
    let mut x = [1u64];
    c.all_reduce(&mut x, ReduceOp::Sum)?;
    assert_eq!(x[0], c.size() as u64, "all_reduce");
    c.barrier()
}

/// All-reduces large enough to be cut across channels (`OXCCL_SOCKET_CHANNELS`): 3 MiB and a
/// little of f32, in place, out of place and async, and of i64, a broadcast and a reduce of
/// the f32 size; panics on a wrong result.
fn scenario_big(c: &Communicator) -> Result<(), Error> {
    let (n, me) = (c.size(), c.rank());
    let len = (3 << 18) + 7;
    let val = |r: usize, i: usize| ((r * 31 + i * 17) % 11) as f32;
    let sum = |i: usize| (0..n).map(|r| val(r, i)).sum::<f32>();
    let mine: Vec<f32> = (0..len).map(|i| val(me, i)).collect();
    let ok = |v: &[f32]| v.iter().enumerate().all(|(i, &x)| x == sum(i));
    let mut v = mine.clone();
    c.all_reduce(&mut v, ReduceOp::Sum)?;
    assert!(ok(&v), "big all_reduce");
    let mut out = vec![0f32; len];
    c.all_reduce_into(&mine, &mut out, ReduceOp::Sum)?;
    assert!(ok(&out), "big all_reduce_into");
    let v = c.all_reduce_async(mine.clone(), ReduceOp::Sum).wait()?;
    assert!(ok(&v), "big all_reduce_async");
    let mut b = if me == 0 {
        mine.clone()
    } else {
        vec![0f32; len]
    };
    c.broadcast(&mut b, 0)?;
    assert!(
        b.iter().enumerate().all(|(i, &x)| x == val(0, i)),
        "big broadcast"
    );
    let mut r = vec![0f32; len];
    c.reduce_into(&mine, &mut r, ReduceOp::Sum, n - 1)?;
    assert!(me != n - 1 || ok(&r), "big reduce");
    let mut b: Vec<i64> = (0..len).map(|i| val(me, i) as i64 - 5).collect();
    c.all_reduce(&mut b, ReduceOp::Sum)?;
    assert!(
        b.iter()
            .enumerate()
            .all(|(i, &x)| x == sum(i) as i64 - 5 * n as i64),
        "big i64 all_reduce"
    );
    if let Some(cut) = c.stats().channel_ops {
        println!("CUT rank={me} ops={cut}");
    }
    Ok(())
}

/// All-reduces of 1 MiB of f32 in a loop until one fails, or until `OXCCL_TEST_LOOP_SECS`
/// (default 60) have passed, which is reported as `ok`. After the first successful all-reduce
/// the rank prints `LOOPING rank=R` (the cue for the test to break something).
fn scenario_loop(c: &Communicator) -> Result<(), Error> {
    let secs: u64 = std::env::var("OXCCL_TEST_LOOP_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let end = Instant::now() + Duration::from_secs(secs);
    let mut v = vec![1.0f32; 1 << 18];
    let mut first = true;
    while Instant::now() < end {
        c.all_reduce(&mut v, ReduceOp::Sum)?;
        v.fill(1.0);
        if first {
            first = false;
            println!("LOOPING rank={}", c.rank());
            let _ = std::io::stdout().flush();
        }
    }
    Ok(())
}

/// Prints the `RESULT` line of this rank.
pub fn report(c: &Communicator, r: Result<(), Error>, t0: Instant) {
    match r {
        Ok(()) => println!("RESULT rank={} ok", c.rank()),
        Err(e) => println!(
            "RESULT rank={} err={} peer={} ms={} msg={}",
            c.rank(),
            e.kind(),
            e.lost_peer().map_or(-1, |p| p as i64),
            t0.elapsed().as_millis(),
            e
        ),
    }
    let _ = std::io::stdout().flush();
}

/// The rank program of `multiprocess`, `multinode` and `trace`: plays the scenario named by
/// `OXCCL_TEST_SCENARIO`, or does nothing if it is unset (a normal test run).
///
/// Scenarios: `all` ([`scenario_all`]), `big` ([`scenario_big`]), `hello` (one all-reduce and a
/// barrier), `loop` (1 MiB
/// all-reduces until one fails), `kill` (rank 2 SIGKILLs itself in the 4th of a series of
/// 4 MiB all-reduces), `group-kill` (groups of the even and of the odd ranks, in reverse order;
/// world rank 3 SIGKILLs itself in the 4th of its group's all-reduces), `mismatch` (rank 1
/// all-reduces 10 elements, the others 20),
/// `fail-once` (first attempt, `OXCCL_RESTART_COUNT=0`: one all-reduce, then rank 2 exits with
/// code 3 while the others go on all-reducing until they fail; later attempts: `hello`),
/// `shrink` (rank 2 SIGKILLs itself in the 3rd of a series of 1 MiB all-reduces; the others
/// shrink it away and check the 3-rank communicator), `stall` (rank 1 sleeps 7 s before an all-reduce the others wait in: past a short
/// `OXCCL_TIMEOUT`), `trace-hang` (three all-reduces, then rank 1 waits for a message rank 2
/// never sends while the others enter a fourth; every rank reports, then rank 1 exits with code
/// 3, for the flight-record tests), `spins` (each rank prints whether it and a group of its own
/// busy-poll).
pub fn play_scenario() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    let c = Communicator::from_env().expect("communicator from the environment");
    let t0 = Instant::now();
    let r = match scenario.as_str() {
        "all" => scenario_all(&c),
        "hello" => scenario_hello(&c),
        "loop" => scenario_loop(&c),
        "big" => scenario_big(&c),
        "kill" => {
            // Survivors must outlive the launcher's SIGTERM long enough to report.
            // SAFETY: setting a signal disposition to SIG_IGN has no memory-safety preconditions.
            unsafe {
                libc::signal(libc::SIGTERM, libc::SIG_IGN);
            }
            let mut v = vec![1.0f32; 1 << 20];
            let mut result = Ok(());
            for i in 0..1000 {
                if i == 3 && c.rank() == 2 {
                    // SAFETY: sending SIGKILL to our own pid; no memory is involved.
                    unsafe {
                        libc::kill(libc::getpid(), libc::SIGKILL);
                    }
                }
                if let Err(e) = c.all_reduce(&mut v, ReduceOp::Sum) {
                    result = Err(e);
                    break;
                }
                v.fill(1.0);
            }
            if let Some(cut) = c.stats().channel_ops {
                println!("CUT rank={} ops={cut}", c.rank());
            }
            result
        }
        "group-kill" => {
            // SAFETY: setting a signal disposition to SIG_IGN has no memory-safety preconditions.
            unsafe {
                libc::signal(libc::SIGTERM, libc::SIG_IGN);
            }
            // Groups [2, 0] and [3, 1] (reverse order); world rank 3 dies in its group's 4th
            // all-reduce.
            let rank = c.rank();
            let g = c
                .split(Some((rank % 2) as u32), -(rank as i64))
                .map(|g| g.expect("a group"));
            g.and_then(|g| {
                let mut v = vec![1.0f32; 1 << 16];
                for i in 0..20 {
                    if i == 3 && rank == 3 {
                        // SAFETY: sending SIGKILL to our own pid; no memory is involved.
                        unsafe {
                            libc::kill(libc::getpid(), libc::SIGKILL);
                        }
                    }
                    g.all_reduce(&mut v, ReduceOp::Sum)?;
                    v.fill(1.0);
                }
                Ok(())
            })
        }
        "mismatch" => {
            let mut v = vec![0.5f32; if c.rank() == 1 { 10 } else { 20 }];
            c.all_reduce(&mut v, ReduceOp::Sum)
        }
        "fail-once" if std::env::var("OXCCL_RESTART_COUNT").as_deref() == Ok("0") => {
            let mut v = vec![1.0f32; 1024];
            let mut result = c.all_reduce(&mut v, ReduceOp::Sum);
            if c.rank() == 2 {
                std::process::exit(3);
            }
            for _ in 0..1000 {
                if result.is_err() {
                    break;
                }
                result = c.all_reduce(&mut v, ReduceOp::Sum);
            }
            result
        }
        "fail-once" => scenario_hello(&c),
        "shrink" => scenario_shrink(&c),
        "trace-hang" => scenario_trace_hang(&c),
        "spins" => scenario_spins(&c),
        "stall" => {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_secs(7));
            }
            let mut v = vec![1.0f32; 4096];
            c.all_reduce(&mut v, ReduceOp::Sum)
        }
        other => panic!("unknown scenario {other}"),
    };
    report(&c, r, t0);
}

/// The `spins` scenario: every rank makes a group of its own (`split` by rank) and prints
/// `SPINS rank=R world=W group=G`, whether each busy-polls (`Stats::spins`).
fn scenario_spins(c: &Communicator) -> Result<(), Error> {
    let g = c.split(Some(c.rank() as u32), 0)?;
    let group = g.as_ref().is_some_and(|g| g.stats().spins);
    println!(
        "SPINS rank={} world={} group={group}",
        c.rank(),
        c.stats().spins
    );
    Ok(())
}

/// The `trace-hang` scenario: see [`play_scenario`].
fn scenario_trace_hang(c: &Communicator) -> Result<(), Error> {
    let mut v = vec![1.0f32; 1024];
    for _ in 0..3 {
        c.all_reduce(&mut v, ReduceOp::Sum)?;
    }
    let r = if c.rank() == 1 {
        let mut x = [0u8; 16];
        c.recv(&mut x, 2)
    } else {
        c.all_reduce(&mut v, ReduceOp::Sum)
    };
    report(c, r, Instant::now());
    // Every rank has failed (and written its record) before rank 1 exits and the launcher stops
    // the others.
    std::thread::sleep(Duration::from_millis(500));
    if c.rank() == 1 {
        std::process::exit(3);
    }
    Ok(())
}

/// The `shrink` scenario: see [`play_scenario`].
fn scenario_shrink(c: &Communicator) -> Result<(), Error> {
    let me = c.rank();
    let mut v = vec![1.0f32; 1 << 18];
    for i in 0..100 {
        if i == 2 && me == 2 {
            // SAFETY: sending SIGKILL to our own pid; no memory is involved.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
        if let Err(e) = c.all_reduce(&mut v, ReduceOp::Sum) {
            if e.lost_peer() != Some(2) {
                return Err(e);
            }
            let fewer = c.shrink(&[2])?;
            let want = [0usize, 1, 3];
            if (fewer.size(), want[fewer.rank()]) != (3, me) {
                panic!(
                    "old rank {me}: new rank {} of {}",
                    fewer.rank(),
                    fewer.size()
                );
            }
            for _ in 0..3 {
                v.fill(1.0);
                fewer.all_reduce(&mut v, ReduceOp::Sum)?;
                assert!(v.iter().all(|&x| x == 3.0), "old rank {me}");
            }
            let mut all = vec![0u32; 3];
            fewer.all_gather_into(&[me as u32], &mut all)?;
            assert_eq!(all, [0, 1, 3], "old rank {me}");
            return Ok(());
        }
        v.fill(1.0);
    }
    panic!("old rank {me}: the all-reduces went on without rank 2");
}

/// The command line that makes this test binary play a rank (with `OXCCL_TEST_SCENARIO` or
/// another variable of the tests set: see `rank_entry` in `main.rs`).
pub fn rank_cmd() -> Vec<String> {
    let me = std::env::current_exe()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    vec![
        me,
        "rank_entry".into(),
        "--exact".into(),
        "--nocapture".into(),
        "--test-threads=1".into(),
        "-q".into(),
    ]
}

/// This test binary as a rank started by hand: [`rank_cmd`] with its output captured and no
/// launcher variable of this environment (`OXCCL_*`, torchrun's, Slurm's, Open MPI's), so that
/// only what the test sets reaches it.
pub fn bare_rank_command() -> std::process::Command {
    let cmdline = rank_cmd();
    let mut cmd = std::process::Command::new(&cmdline[0]);
    cmd.args(&cmdline[1..])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let launcher = [
        "OXCCL_",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_",
        "MASTER_",
        "SLURM_",
        "OMPI_",
        "TORCHELASTIC",
    ];
    for (k, _) in std::env::vars() {
        if launcher.iter().any(|p| k.starts_with(p)) {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// A free TCP port on loopback (released again: whoever binds it next races other programs,
/// which is fine for tests).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs this test binary as `n` ranks through `oxccl launch -n n --timeout 120` with `env` set
/// for them (`OXCCL_TIMEOUT=60`, no `OXCCL_DEBUG`), and returns once every rank is gone.
pub fn launch_self(n: usize, env: &[(&str, &str)]) -> Output {
    launch_self_with(n, &[], env)
}

/// [`launch_self`] with more `oxccl launch` flags (`--keep-going`, ...).
pub fn launch_self_with(n: usize, flags: &[&str], env: &[(&str, &str)]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .args(["launch", "-n", &n.to_string(), "--timeout", "120"])
        .args(flags)
        .arg("--")
        .args(rank_cmd())
        .envs(env.iter().copied())
        .env("OXCCL_TIMEOUT", "60")
        .env_remove("OXCCL_DEBUG")
        .output()
        .expect("running oxccl launch")
}

/// Asserts that `out` succeeded and that ranks `0..n` each printed `RESULT rank=R ok`.
pub fn assert_all_ok(out: &Output, n: usize) {
    assert!(out.status.success(), "{}", show(out));
    let res = results(out);
    for rank in 0..n {
        assert!(
            res.get(&rank)
                .is_some_and(|l| l.starts_with(&format!("{rank} ok"))),
            "rank {rank} did not report success\n{}",
            show(out)
        );
    }
}

/// `RESULT` lines of `stdout` by rank: what follows `RESULT rank=` (`"3 ok"`, `"1 err=..."`).
/// Lines may carry prefixes (`[node 1] [3] RESULT ...`).
pub fn results_of(stdout: &str) -> HashMap<usize, String> {
    let mut m = HashMap::new();
    for line in stdout.lines() {
        if let Some(i) = line.find("RESULT rank=") {
            let rest = &line[i + "RESULT rank=".len()..];
            let rank: usize = rest.split_whitespace().next().unwrap().parse().unwrap();
            m.insert(rank, rest.to_string());
        }
    }
    m
}

/// `RESULT` lines of a finished process, by rank.
pub fn results(out: &Output) -> HashMap<usize, String> {
    results_of(&String::from_utf8_lossy(&out.stdout))
}

/// Status, stdout and stderr, for assertion messages.
pub fn show(out: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Whether `history` (the members of each step) is that of 8 steps of examples 04 and 05 where
/// member 2 of 4 stopped at step 3, and the steps from the loss on ran on `after`. Member 2 stops
/// at the start of step 3, but it may have finished step 2's all-reduce while the others still
/// wait for its last data (in a socket it closes): they then lose it in step 2 and redo that
/// step.
pub fn lost_member_2_at_step_3(history: &[Vec<usize>], after: &[usize]) -> bool {
    let lost_at = history.iter().position(|m| m != &[0, 1, 2, 3]);
    history.len() == 8
        && matches!(lost_at, Some(2 | 3))
        && history[lost_at.unwrap_or(0)..].iter().all(|m| m == after)
}
