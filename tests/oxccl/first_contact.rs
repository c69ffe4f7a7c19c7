//! What a trainer meets first, as separate processes started by hand with torchrun's
//! variables: its own tracing subscriber next to oxccl's events, `oxccl::logging::init()`,
//! the hint when `OXCCL_DEBUG` is set and nothing prints it, a time-out given in code, and a
//! rendezvous that cannot be joined by mistake (a duplicate rank, world sizes that differ, two
//! jobs on one port, a wrong job token: a clear error on every process involved, never a hang
//! and never a run finished with another job's process).

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use oxccl::comm::config::Settings;
use oxccl::{Communicator, ReduceOp};

use crate::common::{bare_rank_command, free_port, show};

/// The variable naming what a rank of these tests plays.
pub const FIRST: &str = "OXCCL_TEST_FIRST";

/// The rank program (see [`FIRST`]): `own-subscriber` (the communicator first, then the
/// trainer's own subscriber and event), `oxccl-init` (`oxccl::logging::init()`, an all-reduce,
/// an event of a crate whose name starts with `oxccl`), `no-subscriber` (an all-reduce with no
/// subscriber), `builder-timeout` (rank 0 of 2 with a 2 s time-out set in code; rank 1 never
/// comes), `job` (an all-reduce of `OXCCL_TEST_JOB_TAG` by max and by min: `MIXED` when the
/// ranks are not all of one job; `INITERR` with the error when the communicator fails).
pub fn play_rank() {
    let Ok(mode) = std::env::var(FIRST) else {
        return;
    };
    match mode.as_str() {
        "own-subscriber" => {
            let c = Communicator::from_env().expect("communicator from the environment");
            let ok = tracing_subscriber::fmt()
                .with_writer(std::io::stdout)
                .try_init()
                .is_ok();
            println!("SUBSCRIBER installed={ok}");
            tracing::warn!(target: "my_trainer", "the trainer's own event");
            c.barrier().expect("barrier");
        }
        "oxccl-init" => {
            println!("INIT installed={}", oxccl::logging::init());
            let c = Communicator::from_env().expect("communicator from the environment");
            c.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum)
                .expect("all-reduce");
            tracing::warn!(target: "oxccl_trainer", "an event of another crate");
        }
        "no-subscriber" => {
            let c = Communicator::from_env().expect("communicator from the environment");
            c.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum)
                .expect("all-reduce");
        }
        "builder-timeout" => {
            let t0 = Instant::now();
            let r = Communicator::from_env_with(Settings::new().timeout(Duration::from_secs(2)));
            println!(
                "TIMEOUT kind={} ms={}",
                r.err().map_or("none", |e| e.kind()),
                t0.elapsed().as_millis()
            );
        }
        "job" => {
            let tag: f64 = std::env::var("OXCCL_TEST_JOB_TAG")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0);
            let c = match Communicator::from_env() {
                Ok(c) => c,
                Err(e) => {
                    println!("INITERR {e}");
                    std::process::exit(1);
                }
            };
            let (mut hi, mut lo) = ([tag], [tag]);
            c.all_reduce(&mut hi, ReduceOp::Max).expect("all-reduce");
            c.all_reduce(&mut lo, ReduceOp::Min).expect("all-reduce");
            let mixed = if hi[0] == lo[0] { "" } else { " MIXED" };
            println!("FINISHED rank={} tag={tag}{mixed}", c.rank());
            // A job runs a while: a process that comes late still finds its store.
            std::thread::sleep(Duration::from_secs(1));
        }
        other => panic!("{FIRST}={other}: unknown"),
    }
}

/// A rank process playing `mode` with torchrun's variables (`RANK`, `WORLD_SIZE`, the store
/// at 127.0.0.1:`port`), no `OXCCL_*` variable but `env`.
fn rank_command(mode: &str, rank: usize, world: usize, port: u16, env: &[(&str, &str)]) -> Command {
    let mut cmd = bare_rank_command();
    cmd.env(FIRST, mode)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .envs(env.iter().copied());
    cmd
}

/// Rank 0 of `world` playing `mode` by hand (its store on a free port).
fn rank_by_hand(mode: &str, world: usize, env: &[(&str, &str)]) -> Output {
    rank_command(mode, 0, world, free_port(), env)
        .output()
        .expect("running a rank")
}

/// Starts every command at once and collects their outputs, killing any still running after
/// `limit` (a hang: the test fails naming it).
fn run_all(cmds: Vec<Command>, limit: Duration) -> Vec<Output> {
    let mut children: Vec<_> = cmds
        .into_iter()
        .map(|mut c| c.spawn().expect("spawning a rank"))
        .collect();
    let t0 = Instant::now();
    while children
        .iter_mut()
        .any(|c| c.try_wait().ok().flatten().is_none())
    {
        if t0.elapsed() > limit {
            let running: Vec<usize> = (0..children.len())
                .filter(|&i| children[i].try_wait().ok().flatten().is_none())
                .collect();
            for c in &mut children {
                let _ = c.kill();
            }
            let outs: Vec<String> = children
                .into_iter()
                .map(|c| {
                    c.wait_with_output()
                        .map_or_else(|e| e.to_string(), |o| show(&o))
                })
                .collect();
            panic!("processes {running:?} were still running after {limit:?} (a hang): {outs:#?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    children
        .into_iter()
        .map(|c| c.wait_with_output().expect("rank output"))
        .collect()
}

/// Ranks of these tests may wait this long at most; a clear error must come well before.
const RANK_TIMEOUT: &str = "20";
const HANG: Duration = Duration::from_secs(15);

#[test]
fn a_trainer_installs_its_own_subscriber_after_the_communicator() {
    let out = rank_by_hand("own-subscriber", 1, &[]);
    let all = show(&out);
    assert!(out.status.success(), "{all}");
    assert!(all.contains("SUBSCRIBER installed=true"), "{all}");
    assert!(all.contains("the trainer's own event"), "{all}");
}

#[test]
fn oxccl_logging_init_prints_oxccls_lines_and_only_those() {
    let out = rank_by_hand("oxccl-init", 1, &[("OXCCL_DEBUG", "info")]);
    let all = show(&out);
    assert!(out.status.success(), "{all}");
    assert!(all.contains("INIT installed=true"), "{all}");
    assert!(
        all.contains("communicator ready") || all.contains("collective"),
        "{all}"
    );
    assert!(!all.contains("an event of another crate"), "{all}");
}

#[test]
fn oxccl_debug_without_a_subscriber_says_how_to_see_the_logs() {
    let out = rank_by_hand("no-subscriber", 1, &[("OXCCL_DEBUG", "info")]);
    let all = show(&out);
    assert!(out.status.success(), "{all}");
    assert!(all.contains("oxccl::logging::init()"), "{all}");
    let quiet = rank_by_hand("no-subscriber", 1, &[]);
    assert!(
        !show(&quiet).contains("oxccl::logging::init()"),
        "{}",
        show(&quiet)
    );
}

#[test]
fn a_timeout_set_in_code_fires_with_the_environment_unset() {
    let out = rank_by_hand("builder-timeout", 2, &[]);
    let all = show(&out);
    let line = all
        .lines()
        .find(|l| l.starts_with("TIMEOUT"))
        .unwrap_or_else(|| panic!("no TIMEOUT line: {all}"));
    assert!(line.contains("kind=timeout"), "{all}");
    let ms: u64 = line
        .rsplit("ms=")
        .next()
        .and_then(|v| v.trim().parse().ok())
        .expect("ms");
    // The default is 600 s: the code's 2 s is what fired (loose bounds: a busy machine).
    assert!((2000..60_000).contains(&ms), "{all}");
}

/// Three processes, two of them rank 1 of 2: the one that claims rank 1 second always fails,
/// naming both processes; the others either fail with the same text (the claim came before
/// the communicator was complete) or finish together (it came after: the communicator never
/// had it). Never a hang.
#[test]
fn a_rank_started_twice_is_a_clear_error() {
    for run in 0..10 {
        let port = free_port();
        let env = [("OXCCL_TIMEOUT", RANK_TIMEOUT)];
        let cmds = [0, 1, 1]
            .iter()
            .map(|&r| rank_command("job", r, 2, port, &env))
            .collect();
        let outs = run_all(cmds, HANG);
        let claimed = |o: &Output| show(o).contains("rank 1 was claimed by two processes");
        let failed: Vec<&Output> = outs.iter().filter(|o| !o.status.success()).collect();
        assert!(!failed.is_empty(), "run {run}: nobody failed: {outs:#?}");
        for (i, out) in outs.iter().enumerate() {
            let all = show(out);
            if out.status.success() {
                assert!(all.contains("FINISHED"), "run {run}, process {i}: {all}");
            } else {
                assert!(claimed(out), "run {run}, process {i}: {all}");
            }
        }
        assert!(
            failed.len() == 1 || failed.len() == 3,
            "run {run}: the pair that met must agree: {outs:#?}"
        );
    }
}

#[test]
fn ranks_started_with_different_world_sizes_fail_at_once() {
    for run in 0..10 {
        let port = free_port();
        let env = [("OXCCL_TIMEOUT", RANK_TIMEOUT)];
        let cmds = vec![
            rank_command("job", 0, 2, port, &env),
            rank_command("job", 1, 3, port, &env),
        ];
        for (i, out) in run_all(cmds, HANG).iter().enumerate() {
            let all = show(out);
            assert!(!out.status.success(), "run {run}, process {i}: {all}");
            assert!(
                all.contains("disagree on the world size"),
                "run {run}, process {i}: {all}"
            );
        }
    }
}

/// Two jobs started by hand on one port, each with its own `OXCCL_JOB_TOKEN` (what `oxccl
/// launch` gives its ranks): one job's rank 0 hosts the store and that job finishes; every
/// process of the other is refused at once, saying why. Never a rank of one job in the other.
#[test]
fn two_jobs_started_by_hand_on_one_port_never_mix() {
    for run in 0..10 {
        let port = free_port();
        let cmds = [("1", 0), ("1", 1), ("2", 0), ("2", 1)]
            .iter()
            .map(|&(tag, r)| {
                let token = format!("job-{tag}");
                rank_command(
                    "job",
                    r,
                    2,
                    port,
                    &[
                        ("OXCCL_TIMEOUT", RANK_TIMEOUT),
                        ("OXCCL_TEST_JOB_TAG", tag),
                        ("OXCCL_JOB_TOKEN", &token),
                    ],
                )
            })
            .collect();
        let outs = run_all(cmds, HANG);
        let ok: Vec<bool> = outs.iter().map(|o| o.status.success()).collect();
        assert!(
            ok == [true, true, false, false] || ok == [false, false, true, true],
            "run {run}: one job finishes, the other is refused: {outs:#?}"
        );
        for (i, out) in outs.iter().enumerate() {
            let all = show(out);
            assert!(!all.contains("MIXED"), "run {run}, process {i}: {all}");
            if !out.status.success() {
                assert!(
                    all.contains("another job token"),
                    "run {run}, process {i}: {all}"
                );
            }
        }
    }
}

#[test]
fn a_process_with_another_jobs_token_is_refused() {
    for run in 0..10 {
        let port = free_port();
        let job = |r: usize, token: &str| {
            rank_command(
                "job",
                r,
                2,
                port,
                &[("OXCCL_TIMEOUT", RANK_TIMEOUT), ("OXCCL_JOB_TOKEN", token)],
            )
        };
        let outs = run_all(
            vec![job(0, "tok-a"), job(1, "tok-a"), job(1, "tok-b")],
            HANG,
        );
        for (i, out) in outs.iter().take(2).enumerate() {
            let all = show(out);
            assert!(
                out.status.success() && all.contains("FINISHED"),
                "run {run}, rank {i}: {all}"
            );
        }
        let all = show(&outs[2]);
        assert!(
            !outs[2].status.success() && all.contains("another job token"),
            "run {run}, the intruder: {all}"
        );
    }
}
