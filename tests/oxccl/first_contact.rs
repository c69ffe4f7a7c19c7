//! What a trainer meets first, as separate processes started by hand with torchrun's
//! variables: its own tracing subscriber next to oxccl's events, `oxccl::logging::init()`,
//! the hint when `OXCCL_DEBUG` is set and nothing prints it, and a time-out given in code.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use oxccl::comm::config::Settings;
use oxccl::{Communicator, ReduceOp};

use crate::common::{free_port, rank_cmd, show};

/// The variable naming what a rank of these tests plays.
pub const FIRST: &str = "OXCCL_TEST_FIRST";

/// The rank program (see [`FIRST`]): `own-subscriber` (the communicator first, then the
/// trainer's own subscriber and event), `oxccl-init` (`oxccl::logging::init()`, an all-reduce,
/// an event of a crate whose name starts with `oxccl`), `no-subscriber` (an all-reduce with no
/// subscriber), `builder-timeout` (rank 0 of 2 with a 2 s time-out set in code; rank 1 never
/// comes).
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
        other => panic!("{FIRST}={other}: unknown"),
    }
}

/// One rank playing `mode` by hand: torchrun's variables for rank 0 of `world` (its store on a
/// free port), no `OXCCL_*` variable but `env`.
fn rank_by_hand(mode: &str, world: usize, env: &[(&str, &str)]) -> Output {
    let cmdline = rank_cmd();
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
        ]
        .iter()
        .any(|p| k.starts_with(p))
        {
            cmd.env_remove(k);
        }
    }
    cmd.env(FIRST, mode)
        .env("RANK", "0")
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", free_port().to_string())
        .envs(env.iter().copied());
    cmd.output().expect("running a rank")
}

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
