//! examples/08_pipeline_mlp.rs as processes started by `oxccl launch -n 4`: every schedule as 4
//! stages, with fewer and more micro-batches than stages, and 2 stages x 2 data replicas with
//! DDP, each rank's gradients and parameters checked against one process after every step; and
//! a stage killed in the middle of a step, which every other stage reports as an error instead
//! of hanging.
//!
//! The ranks are this test binary: `rank_entry` does nothing in a normal run and plays a rank
//! ([`play_rank`]) when `OXCCL_TEST_PIPELINE` is set (`stages`, `grid` or `die`).

#[path = "../../examples/08_pipeline_mlp/model.rs"]
mod model;
#[path = "../../examples/08_pipeline_mlp/run.rs"]
#[allow(dead_code)]
mod run;

use std::process::Command;
use std::time::{Duration, Instant};

use oxccl::comm::Communicator;
use oxccl::pipeline::ScheduleKind;

use crate::common;

fn opts(kind: ScheduleKind, chunks: usize, micro: usize, pipe: usize) -> run::Opts {
    run::Opts {
        shape: model::Shape {
            input: 8,
            width: 12,
            output: 3,
            layers: 8,
            batch: 3,
            micro,
            lr: 0.1,
        },
        kind,
        chunks,
        pipe,
        steps: 4,
        split: false,
        check: true,
        die: None,
        device: false,
        zero: false,
    }
}

/// The runs of `what`, each checked against one process.
fn plays(what: &str) -> Vec<run::Opts> {
    match what {
        "stages" => {
            let mut v = Vec::new();
            for (kind, chunks) in [
                (ScheduleKind::GPipe, 1),
                (ScheduleKind::OneFOneB, 1),
                (ScheduleKind::Interleaved, 2),
                (ScheduleKind::ZeroBubbleH1, 1),
            ] {
                for micro in [3, 6] {
                    v.push(opts(kind, chunks, micro, 4));
                }
            }
            v
        }
        "grid" => vec![
            opts(ScheduleKind::OneFOneB, 1, 3, 2),
            opts(ScheduleKind::ZeroBubbleH1, 1, 5, 2),
            run::Opts {
                zero: true,
                ..opts(ScheduleKind::OneFOneB, 1, 4, 2)
            },
        ],
        _ => vec![run::Opts {
            die: Some((2, 2)),
            check: false,
            ..opts(ScheduleKind::OneFOneB, 1, 6, 4)
        }],
    }
}

/// Plays one rank when started by `oxccl launch` (`OXCCL_TEST_PIPELINE` set; nothing
/// otherwise).
pub(crate) fn play_rank() {
    let Ok(what) = std::env::var("OXCCL_TEST_PIPELINE") else {
        return;
    };
    let comm = Communicator::from_env().expect("communicator from the environment");
    for o in plays(&what) {
        if let Err(e) = run::train(&comm, &o) {
            println!("RESULT rank={} err={e}", comm.rank());
            std::process::exit(1);
        }
    }
    println!("RESULT rank={} ok", comm.rank());
}

#[test]
fn every_schedule_as_4_processes_equals_one_process() {
    let out = common::launch_self(4, &[("OXCCL_TEST_PIPELINE", "stages")]);
    common::assert_all_ok(&out, 4);
}

#[test]
fn two_stages_by_two_replicas_as_processes_equal_one_process() {
    let out = common::launch_self(4, &[("OXCCL_TEST_PIPELINE", "grid")]);
    common::assert_all_ok(&out, 4);
}

#[test]
fn a_killed_stage_fails_the_other_processes_without_a_hang() {
    let t = Instant::now();
    let out = common::launch_self_with(4, &["--keep-going"], &[("OXCCL_TEST_PIPELINE", "die")]);
    let res = common::results(&out);
    assert!(!out.status.success(), "{}", common::show(&out));
    assert!(
        !res.contains_key(&2),
        "rank 2 exits: {}",
        common::show(&out)
    );
    for r in [0, 1, 3] {
        assert!(
            res.get(&r).is_some_and(|l| l.contains(" err=")),
            "rank {r} must report an error\n{}",
            common::show(&out)
        );
    }
    // Well before the communicator's 60 s time-out: the loss is seen, not waited out.
    assert!(
        t.elapsed() < Duration::from_secs(50),
        "took {:?}",
        t.elapsed()
    );
}

/// `oxccl pipeline ARGS`.
fn oxccl_pipeline(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .arg("pipeline")
        .args(args)
        .output()
        .expect("running oxccl pipeline")
}

#[test]
fn oxccl_pipeline_prints_and_draws_a_timeline() {
    let svg = std::env::temp_dir().join(format!("oxccl-pipeline-{}.svg", std::process::id()));
    let plot = svg.to_string_lossy().into_owned();
    let out = oxccl_pipeline(&["--schedule", "1f1b", "-p", "4", "-m", "8", "--plot", &plot]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", common::show(&out));
    assert!(
        text.contains("rank  3 |  .  .  . F0 B0 B0 F1 B1 B1"),
        "rank 3's warm-up and steady state:\n{text}"
    );
    assert!(
        text.contains("time 33 units, bubble 0.273 (theory 0.273); deadlock-free"),
        "{text}"
    );
    let drawn = std::fs::read_to_string(&svg).expect("the SVG");
    let _ = std::fs::remove_file(&svg);
    // One box per computation: 4 ranks x 8 micro-batches x (forward + backward).
    assert_eq!(drawn.matches("<rect").count(), 64);
    let bad = oxccl_pipeline(&["--schedule", "1f1b", "-p", "4", "-m", "8", "-v", "2"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("1f1b has one chunk per rank"));
}
