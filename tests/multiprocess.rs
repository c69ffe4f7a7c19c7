//! Multi-process tests: real processes started by `oxccl launch` (and by hand with torchrun-,
//! Slurm- and OpenMPI-style variables), one rank each, talking over TCP.
//!
//! The ranks are this test binary itself: `rank_entry` does nothing in a normal test run, and
//! plays a rank when `OXCCL_TEST_SCENARIO` is set (the launcher runs
//! `<this binary> rank_entry --exact --nocapture`).

use std::collections::HashMap;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use oxccl::comm::{Communicator, Error, ReduceOp};

const SCENARIO: &str = "OXCCL_TEST_SCENARIO";

/// Every collective with a few dtypes and counts; exits non-zero on a wrong result.
fn scenario_all(c: &Communicator) -> Result<(), Error> {
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
        c.reduce_scatter(&vec![1u32; count * n], &mut out, ReduceOp::Sum)?;
        assert!(out.iter().all(|&x| x == n as u32), "reduce_scatter");
        let mut out = vec![0u8; count * n];
        c.all_gather(&vec![me as u8; count], &mut out)?;
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
        c.reduce(&vec![1i32; count], &mut out, ReduceOp::Sum, root)?;
        assert!(out.iter().all(|&x| x == n as i32), "reduce");
        let mut out = vec![0u64; if me == root { count * n } else { 0 }];
        c.gather(&vec![me as u64; count], &mut out, root)?;
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
        c.scatter(&inp, &mut out, root)?;
        assert!(out.iter().all(|&x| x == me as u64), "scatter");
        let inp: Vec<u32> = (0..count * n)
            .map(|k| (me * 1000 + k / count.max(1)) as u32)
            .collect();
        let mut out = vec![0u32; count * n];
        c.all_to_all(&inp, &mut out)?;
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
    Ok(())
}

fn report(c: &Communicator, r: Result<(), Error>, t0: Instant) {
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
}

/// The rank program. A no-op in normal test runs.
#[test]
fn rank_entry() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    let c = Communicator::from_env().expect("communicator from the environment");
    let t0 = Instant::now();
    match scenario.as_str() {
        "all" => {
            let r = scenario_all(&c);
            report(&c, r, t0);
        }
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
            report(&c, result, t0);
        }
        "mismatch" => {
            let mut v = vec![0.5f32; if c.rank() == 1 { 10 } else { 20 }];
            let r = c.all_reduce(&mut v, ReduceOp::Sum);
            report(&c, r, t0);
        }
        other => panic!("unknown scenario {other}"),
    }
}

fn rank_cmd() -> Vec<String> {
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

fn launch(scenario: &str, n: usize, transport: &str) -> Output {
    launch_job(
        scenario,
        n,
        transport,
        &format!("mp-{}-{scenario}-{transport}", std::process::id()),
    )
}

fn launch_job(scenario: &str, n: usize, transport: &str, job: &str) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_oxccl"));
    cmd.args([
        "launch",
        "-n",
        &n.to_string(),
        "--timeout",
        "120",
        "--job-id",
        job,
        "--",
    ])
    .args(rank_cmd());
    cmd.env(SCENARIO, scenario)
        .env("OXCCL_TIMEOUT", "60")
        .env("OXCCL_TRANSPORT", transport)
        .env_remove("OXCCL_DEBUG");
    cmd.output().expect("running oxccl launch")
}

/// Segments of `job` still in /dev/shm.
fn leftover_segments(job: &str) -> Vec<String> {
    let prefix = oxccl::comm::transport::shm::job_prefix(job);
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

/// `RESULT` lines by rank.
fn results(out: &Output) -> HashMap<usize, String> {
    let text = String::from_utf8_lossy(&out.stdout);
    let mut m = HashMap::new();
    for line in text.lines() {
        if let Some(i) = line.find("RESULT rank=") {
            let rest = &line[i + "RESULT rank=".len()..];
            let rank: usize = rest.split_whitespace().next().unwrap().parse().unwrap();
            m.insert(rank, rest.to_string());
        }
    }
    m
}

fn show(out: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn launch_four_processes_all_collectives() {
    for transport in ["tcp", "shm"] {
        launch_all(transport);
    }
}

fn launch_all(transport: &str) {
    let out = launch("all", 4, transport);
    let res = results(&out);
    assert!(out.status.success(), "{}", show(&out));
    for r in 0..4 {
        assert!(
            res.get(&r).is_some_and(|l| l.ends_with(" ok")),
            "rank {r}: {}",
            show(&out)
        );
    }
}

#[test]
fn killed_rank_gives_peer_lost_everywhere_and_the_launcher_names_it() {
    for transport in ["tcp", "shm"] {
        killed_rank(transport);
    }
}

fn killed_rank(transport: &str) {
    let job = format!("mp-kill-{}-{transport}", std::process::id());
    let out = launch_job("kill", 4, transport, &job);
    assert!(
        leftover_segments(&job).is_empty(),
        "{transport}: segments left: {:?}",
        leftover_segments(&job)
    );
    assert!(!out.status.success(), "{}", show(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rank 2") && stderr.contains("signal 9"),
        "{}",
        show(&out)
    );
    let res = results(&out);
    for r in [0, 1, 3] {
        let line = res
            .get(&r)
            .unwrap_or_else(|| panic!("rank {r} reported nothing: {}", show(&out)));
        assert!(
            line.contains("err=peer-lost peer=2"),
            "{transport} rank {r}: {line}"
        );
        let ms: u64 = line
            .split("ms=")
            .nth(1)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(ms < 10_000, "rank {r} took {ms} ms");
    }
}

#[test]
fn mismatched_collectives_give_mismatch_on_all_ranks() {
    for transport in ["tcp", "shm"] {
        mismatch(transport);
    }
}

fn mismatch(transport: &str) {
    let out = launch("mismatch", 4, transport);
    let res = results(&out);
    for r in 0..4 {
        let line = res
            .get(&r)
            .unwrap_or_else(|| panic!("rank {r} reported nothing: {}", show(&out)));
        assert!(
            line.contains("err=mismatch") && line.contains("count=10") && line.contains("count=20"),
            "rank {r}: {line}"
        );
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `n` ranks by hand with the variables `vars(rank)` (and no oxccl/torch/slurm/mpi ones
/// inherited from this process) and checks every one ran the "all" scenario.
fn by_hand(n: usize, vars: impl Fn(usize) -> Vec<(String, String)>) {
    let cmdline = rank_cmd();
    let children: Vec<_> = (0..n)
        .map(|r| {
            let mut cmd = Command::new(&cmdline[0]);
            cmd.args(&cmdline[1..])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, _) in std::env::vars() {
                if [
                    "OXCCL_",
                    "RANK",
                    "WORLD_SIZE",
                    "LOCAL_",
                    "MASTER_",
                    "SLURM_",
                    "OMPI_",
                    "TORCHELASTIC",
                ]
                .iter()
                .any(|p| k.starts_with(p))
                {
                    cmd.env_remove(k);
                }
            }
            cmd.env(SCENARIO, "all").env("OXCCL_TIMEOUT", "60");
            for (k, v) in vars(r) {
                cmd.env(k, v);
            }
            cmd.spawn().expect("spawning a rank")
        })
        .collect();
    for (r, ch) in children.into_iter().enumerate() {
        let out = ch.wait_with_output().unwrap();
        let res = results(&out);
        assert!(
            out.status.success() && res.get(&r).is_some_and(|l| l.ends_with(" ok")),
            "rank {r}: {}",
            show(&out)
        );
    }
}

fn kv(pairs: &[(&str, String)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

#[test]
fn torchrun_style_variables() {
    let port = free_port();
    by_hand(3, |r| {
        kv(&[
            ("RANK", r.to_string()),
            ("WORLD_SIZE", "3".into()),
            ("LOCAL_RANK", r.to_string()),
            ("LOCAL_WORLD_SIZE", "3".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.to_string()),
        ])
    });
}

#[test]
fn slurm_style_variables() {
    let port = free_port();
    by_hand(3, |r| {
        kv(&[
            ("SLURM_PROCID", r.to_string()),
            ("SLURM_NTASKS", "3".into()),
            ("SLURM_LOCALID", r.to_string()),
            ("SLURM_NODEID", "0".into()),
            ("SLURM_TASKS_PER_NODE", "3".into()),
            ("SLURM_JOB_ID", "4242".into()),
            ("SLURM_STEP_NODELIST", "localhost,gpu[01-03]".into()),
            ("MASTER_PORT", port.to_string()),
        ])
    });
}

#[test]
fn openmpi_style_variables() {
    let port = free_port();
    by_hand(2, |r| {
        kv(&[
            ("OMPI_COMM_WORLD_RANK", r.to_string()),
            ("OMPI_COMM_WORLD_SIZE", "2".into()),
            ("OMPI_COMM_WORLD_LOCAL_RANK", r.to_string()),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2".into()),
            ("OXCCL_STORE", format!("127.0.0.1:{port}")),
        ])
    });
}

#[test]
fn no_launcher_variables_is_a_clear_error() {
    let cmdline = rank_cmd();
    let mut cmd = Command::new(&cmdline[0]);
    cmd.args(&cmdline[1..]);
    for (k, _) in std::env::vars() {
        if ["OXCCL_", "RANK", "WORLD_SIZE", "SLURM_", "OMPI_", "MASTER_"]
            .iter()
            .any(|p| k.starts_with(p))
        {
            cmd.env_remove(k);
        }
    }
    let out = cmd.env(SCENARIO, "all").output().unwrap();
    assert!(!out.status.success());
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        all.contains("OXCCL_RANK") && all.contains("SLURM_PROCID"),
        "{all}"
    );
    let _ = Duration::ZERO;
}
