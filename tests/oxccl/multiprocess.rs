//! Multi-process tests: real processes started by `oxccl launch` (and by hand with torchrun-,
//! Slurm- and OpenMPI-style variables), one rank each, talking over TCP.
//!
//! The ranks are this test binary itself: `rank_entry` does nothing in a normal test run, and
//! plays a rank when `OXCCL_TEST_SCENARIO` is set (the launcher runs
//! `<this binary> rank_entry --exact --nocapture`). The scenarios live in `common.rs`, shared
//! with `multinode` and `trace`.

use std::process::{Command, Output, Stdio};

use crate::common::{self, bare_rank_command, free_port, rank_cmd, results, show, SCENARIO};

fn launch(scenario: &str, n: usize, transport: &str) -> Output {
    launch_job(
        scenario,
        n,
        transport,
        &format!("mp-{}-{scenario}-{transport}", std::process::id()),
    )
}

fn launch_job(scenario: &str, n: usize, transport: &str, job: &str) -> Output {
    launch_job_timeout(scenario, n, transport, job, 60)
}

/// [`launch_job`] with the ranks' `OXCCL_TIMEOUT` set to `timeout_s`.
fn launch_job_timeout(
    scenario: &str,
    n: usize,
    transport: &str,
    job: &str,
    timeout_s: u32,
) -> Output {
    launch_job_env(scenario, n, transport, job, timeout_s, &[])
}

/// [`launch_job_timeout`] with `env` added to the ranks' environment.
fn launch_job_env(
    scenario: &str,
    n: usize,
    transport: &str,
    job: &str,
    timeout_s: u32,
    env: &[(&str, &str)],
) -> Output {
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
        .env("OXCCL_TIMEOUT", timeout_s.to_string())
        .env("OXCCL_TRANSPORT", transport)
        .env_remove("OXCCL_DEBUG");
    cmd.envs(env.iter().copied());
    cmd.output().expect("running oxccl launch")
}

/// Segments of `job` still in /dev/shm.
fn leftover_segments(job: &str) -> Vec<String> {
    let prefix = oxccl::comm::internal::shm::job_prefix(job);
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
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

fn stdout_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Processes over TCP with 3 channels (`OXCCL_SOCKET_CHANNELS`): large all-reduces cut across
/// them are right on every rank; a rank killed in a series of cut 4 MiB all-reduces is
/// `PeerLost` naming it on every survivor, well inside the time-out.
#[test]
fn channels_between_processes_and_a_rank_killed_in_a_cut_all_reduce() {
    let ch = [("OXCCL_SOCKET_CHANNELS", "3")];
    let job = format!("mp-ch-big-{}", std::process::id());
    let out = launch_job_env("big", 3, "tcp", &job, 60, &ch);
    assert!(out.status.success(), "{}", show(&out));
    let res = results(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    for r in 0..3 {
        assert!(
            res.get(&r).is_some_and(|l| l.ends_with(" ok")),
            "rank {r}: {}",
            show(&out)
        );
        // Every form of the f32 all-reduce, the i64 one, the broadcast and the reduce were cut.
        assert!(
            stdout.contains(&format!("CUT rank={r} ops=6")),
            "rank {r}: {}",
            show(&out)
        );
    }

    let job = format!("mp-ch-kill-{}", std::process::id());
    let out = launch_job_env("kill", 4, "tcp", &job, 60, &ch);
    assert!(!out.status.success(), "{}", show(&out));
    let res = results(&out);
    for r in [0, 1, 3] {
        let line = res
            .get(&r)
            .unwrap_or_else(|| panic!("rank {r} reported nothing: {}", show(&out)));
        assert!(line.contains("err=peer-lost peer=2"), "rank {r}: {line}");
        // The 4 MiB all-reduces were cut (3 before rank 2 died, and the one that failed).
        let cut = stdout_of(&out)
            .lines()
            .find_map(|l| l.split(&format!("CUT rank={r} ops=")).nth(1))
            .and_then(|n| n.trim().parse::<u64>().ok());
        assert!(cut.is_some_and(|n| n >= 3), "rank {r}: cut {cut:?}");
        let ms: u64 = line
            .split("ms=")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .unwrap_or(u64::MAX);
        assert!(ms < 30_000, "rank {r} took {ms} ms (time-out 60 s)");
    }
}

/// A rank killed in a group: the survivor's `PeerLost` names the group's rank (what the group's
/// `shrink` takes) and ends with the group's ranks in the world.
#[test]
fn a_rank_killed_in_a_group_is_named_by_its_world_rank_too() {
    let job = format!("mp-group-kill-{}", std::process::id());
    let out = launch_job("group-kill", 4, "shm", &job);
    assert!(
        leftover_segments(&job).is_empty(),
        "segments left: {:?}",
        leftover_segments(&job)
    );
    assert!(!out.status.success(), "{}", show(&out));
    let res = results(&out);
    let line = res
        .get(&1)
        .unwrap_or_else(|| panic!("rank 1 reported nothing: {}", show(&out)));
    assert!(
        line.contains("err=peer-lost peer=0")
            && line.contains("(ranks named here are of communicator ")
            && line.contains("/split0/c1; its ranks 0-1 are ranks [3, 1] of "),
        "{line}"
    );
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

/// A rank that is busy elsewhere past the time-out: every other rank's `Timeout` carries the
/// stall reports (written and read through the launcher's TCP store by separate processes),
/// which name it as the one not waiting.
#[test]
fn a_hang_names_the_rank_that_never_came() {
    for transport in ["tcp", "shm"] {
        let job = format!("mp-{}-stall-{transport}", std::process::id());
        let out = launch_job_timeout("stall", 4, transport, &job, 3);
        let res = results(&out);
        for r in [0, 2, 3] {
            let line = res
                .get(&r)
                .unwrap_or_else(|| panic!("rank {r} reported nothing: {}", show(&out)));
            assert!(
                line.contains("timed out after 3s")
                    && line.contains("stall reports: ")
                    && line.contains(" in this all-reduce(count=4096")
                    && line.contains("rank 1 posted no stall"),
                "{transport}: rank {r}: {line}"
            );
        }
    }
}

/// The same under `oxccl launch --keep-going` (the launcher hosts the store and does not stop
/// the survivors): they shrink rank 2 away and finish; the launcher exits with rank 2's code
/// (137, SIGKILL) once they are done.
#[test]
fn keep_going_survivors_shrink_under_the_launcher() {
    for transport in ["tcp", "shm"] {
        let job = format!("mp-keep-{}-{transport}", std::process::id());
        let out = Command::new(env!("CARGO_BIN_EXE_oxccl"))
            .args(["launch", "-n", "4", "--keep-going", "--timeout", "120"])
            .args(["--job-id", &job, "--"])
            .args(rank_cmd())
            .env(SCENARIO, "shrink")
            .env("OXCCL_TIMEOUT", "60")
            .env("OXCCL_TRANSPORT", transport)
            .env_remove("OXCCL_DEBUG")
            .output()
            .expect("running oxccl launch");
        assert_eq!(out.status.code(), Some(137), "{transport}: {}", show(&out));
        let res = results(&out);
        for r in [0, 1, 3] {
            assert!(
                res.get(&r).is_some_and(|l| l.ends_with(" ok")),
                "{transport}: rank {r}: {}",
                show(&out)
            );
        }
        assert!(
            leftover_segments(&job).is_empty(),
            "{transport}: segments left"
        );
    }
}

/// Starts `n` ranks by hand with the variables `vars(rank)` (and no oxccl/torch/slurm/mpi ones
/// inherited from this process) and checks every one ran the "all" scenario.
fn by_hand(n: usize, vars: impl Fn(usize) -> Vec<(String, String)>) {
    for (r, out) in by_hand_outputs(n, "all", vars).into_iter().enumerate() {
        let res = results(&out);
        assert!(
            out.status.success() && res.get(&r).is_some_and(|l| l.ends_with(" ok")),
            "rank {r}: {}",
            show(&out)
        );
    }
}

/// Runs `n` ranks of `scenario` by hand (as [`by_hand`]) and returns their outputs by rank.
fn by_hand_outputs(
    n: usize,
    scenario: &str,
    vars: impl Fn(usize) -> Vec<(String, String)>,
) -> Vec<Output> {
    let children: Vec<_> = (0..n)
        .map(|r| {
            let mut cmd = bare_rank_command();
            cmd.env(SCENARIO, scenario).env("OXCCL_TIMEOUT", "60");
            for (k, v) in vars(r) {
                cmd.env(k, v);
            }
            cmd.spawn().expect("spawning a rank")
        })
        .collect();
    children
        .into_iter()
        .map(|ch| ch.wait_with_output().unwrap())
        .collect()
}

/// Ranks started by hand (rank 0 hosts the store), TCP and shared memory: rank 2 is killed
/// (SIGKILL) in the middle of a series of all-reduces; the others get `PeerLost` naming it,
/// shrink it away and run all-reduces and an all-gather as ranks 0-2 of 3.
#[test]
fn survivors_of_a_killed_rank_shrink_and_go_on() {
    for transport in ["tcp", "shm"] {
        let port = free_port();
        let job = format!("mp-shrink-{}-{transport}", std::process::id());
        let outs = by_hand_outputs(4, "shrink", |r| {
            kv(&[
                ("OXCCL_RANK", r.to_string()),
                ("OXCCL_WORLD_SIZE", "4".into()),
                ("OXCCL_STORE", format!("127.0.0.1:{port}")),
                ("OXCCL_TRANSPORT", transport.into()),
                ("OXCCL_JOB_ID", job.clone()),
            ])
        });
        assert!(
            leftover_segments(&job).is_empty(),
            "{transport}: segments left: {:?}",
            leftover_segments(&job)
        );
        assert!(!outs[2].status.success(), "rank 2 must have been killed");
        for r in [0, 1, 3] {
            let res = results(&outs[r]);
            assert!(
                outs[r].status.success() && res.get(&r).is_some_and(|l| l.ends_with(" ok")),
                "{transport}: rank {r}: {}",
                show(&outs[r])
            );
        }
    }
}

fn kv(pairs: &[(&str, String)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

/// Two launchers on loopback (nodes `node0` and `node1`, 2 ranks each, TCP between them) with
/// `--max-restarts 1`: rank 2 on node 1 exits with code 3 in the first attempt; node 0's
/// launcher learns it through the store and restarts its ranks too, and the second attempt of
/// all 4 ranks succeeds with a fresh job id.
#[test]
fn a_rank_failing_on_one_node_restarts_every_node() {
    let port = free_port().to_string();
    let job = format!("mp-restart-{}", std::process::id());
    let node = |k: usize| {
        Command::new(env!("CARGO_BIN_EXE_oxccl"))
            .args(["launch", "--nnodes", "2", "--node-rank", &k.to_string()])
            .args(["--master-port", &port, "--max-restarts", "1", "-n", "2"])
            .args(["--timeout", "120", "--job-id", &job, "--"])
            .args(rank_cmd())
            .env(SCENARIO, "fail-once")
            .env("OXCCL_NODE_ID", format!("node{k}"))
            .env("OXCCL_TIMEOUT", "30")
            .env_remove("OXCCL_DEBUG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting oxccl launch")
    };
    let nodes = [node(0), node(1)];
    let outs: Vec<Output> = nodes
        .into_iter()
        .map(|n| n.wait_with_output().expect("waiting for oxccl launch"))
        .collect();
    for (k, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "node {k}: {}", show(out));
        let res = results(out);
        for r in [2 * k, 2 * k + 1] {
            // The last report of each rank is the second attempt's.
            assert!(
                res.get(&r).is_some_and(|l| l.ends_with(" ok")),
                "node {k} rank {r}: {}",
                show(out)
            );
        }
    }
    let node0 = String::from_utf8_lossy(&outs[0].stderr);
    assert!(
        node0.contains("restarting all 2 local ranks (restart 1 of 1) after node 1: rank 2"),
        "{}",
        show(&outs[0])
    );
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
}

/// Ranks bound a core each (`oxccl launch --bind core`) busy-poll while they wait
/// (`OXCCL_SPIN=auto`: a CPU per rank of the node), and so does a group holding one of them: it
/// has one core of its own, but its node's ranks still have one each.
#[test]
fn bound_ranks_and_their_groups_spin() {
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        println!("skipped: needs 2 CPUs to bind 2 ranks a core each");
        return;
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .args([
            "launch",
            "-n",
            "2",
            "--bind",
            "core",
            "--timeout",
            "60",
            "--",
        ])
        .args(common::rank_cmd())
        .env(common::SCENARIO, "spins")
        .env("OXCCL_TIMEOUT", "30")
        .env_remove("OXCCL_DEBUG")
        .env_remove("OXCCL_SPIN")
        .output()
        .expect("running oxccl launch");
    common::assert_all_ok(&out, 2);
    let stdout = String::from_utf8_lossy(&out.stdout);
    for rank in 0..2 {
        let want = format!("SPINS rank={rank} world=true group=true");
        assert!(
            stdout.contains(&want),
            "missing {want:?}\n{}",
            common::show(&out)
        );
    }
}
