//! DDP end to end on the MLP of examples/02_ddp_mlp.rs: 4 ranks x 10 steps must match one
//! process trained on the concatenated batch (parameters within 1e-5 relative) and keep every
//! rank's parameters bit-identical after every step. Once with ranks as threads (every way of
//! feeding gradients: `grad_ready`, computed in the bucket slots, each with overlap on and off,
//! and `sync`), once with ranks as processes started by `oxccl launch` (each rank a different one
//! of the four `grad_ready` and slot ways, two of them waiting in backward as
//! `--idle-backward-ms` does: ranks may differ).
//!
//! The process ranks are this test binary: `rank_entry` does nothing in a normal run and trains
//! when `OXCCL_TEST_DDP` is set.

#[path = "../examples/mlp/mod.rs"]
#[allow(dead_code)]
mod mlp;

mod common;

use std::time::Duration;

use mlp::{Mode, Shape};
use oxccl::comm::harness::spawn_world;
use oxccl::comm::{Communicator, Config};
use oxccl::ddp::{DdpConfig, Overlap};

const STEPS: usize = 10;
const WORLD: usize = 4;

/// Small buckets so that the MLP's gradients span several of them.
fn cfg(overlap: Overlap) -> DdpConfig {
    DdpConfig {
        bucket_cap_bytes: 8 << 10,
        first_bucket_bytes: 1 << 10,
        sync_in_place_bytes: 4 << 10,
        overlap,
        ..DdpConfig::default()
    }
}

/// Trains with DDP on `comm`; after every step checks the model against the reference and the
/// replicas against each other. Returns the worst relative difference. `idle` is
/// `Shape::idle_backward`: backward's waits, which change when gradients arrive, not what they
/// are.
fn train_and_check(
    comm: &Communicator,
    mode: Mode,
    overlap: Overlap,
    idle: Duration,
    reference: &[mlp::Mlp],
) -> Result<f32, String> {
    let shape = Shape {
        idle_backward: idle,
        ..Shape::default()
    };
    let mut worst = 0.0f32;
    mlp::train_ddp(
        comm,
        &shape,
        STEPS,
        mode,
        cfg(overlap),
        |step, model, ddp, _| {
            let want = match overlap {
                Overlap::On => Some(true),
                Overlap::Off => Some(false),
                Overlap::Auto => None,
            };
            if want.is_some_and(|w| w != ddp.overlaps()) {
                return Err(
                    format!("asked for {overlap:?}, overlaps() is {}", ddp.overlaps()).into(),
                );
            }
            let diff = mlp::max_rel_diff(model, &reference[step]);
            worst = worst.max(diff);
            if diff > 1e-5 {
                return Err(format!("step {step}: max relative difference {diff:e}").into());
            }
            if !mlp::replicas_identical(ddp.comm(), model)? {
                return Err(format!("step {step}: replicas differ").into());
            }
            Ok(())
        },
    )
    .map_err(|e| format!("rank {}: {mode:?}, {overlap:?}: {e}", comm.rank()))?;
    Ok(worst)
}

#[test]
fn ddp_matches_one_process_on_the_concatenated_batch_threads() {
    let reference = mlp::train_reference(&Shape::default(), WORLD, STEPS);
    // The reference moves: a test that compares against the initial model would pass trivially.
    assert!(mlp::max_rel_diff(&reference[STEPS - 1], &mlp::Mlp::new(&Shape::default(), 0)) > 1e-3);
    for (mode, overlap) in [
        (Mode::Overlap, Overlap::On),
        (Mode::Overlap, Overlap::Off),
        (Mode::InPlace, Overlap::On),
        (Mode::InPlace, Overlap::Off),
        (Mode::After, Overlap::Auto),
    ] {
        let out = spawn_world(WORLD, Config::default(), |comm| {
            Ok(train_and_check(
                &comm,
                mode,
                overlap,
                Duration::ZERO,
                &reference,
            ))
        });
        for r in out {
            let worst = r.unwrap().unwrap();
            assert!(worst <= 1e-5);
        }
    }
}

/// Plays one rank when started by `oxccl launch` from the test below.
#[test]
fn rank_entry() {
    if std::env::var("OXCCL_TEST_DDP").is_err() {
        return;
    }
    let comm = Communicator::from_env().expect("communicator from the environment");
    let reference = mlp::train_reference(&Shape::default(), comm.size(), STEPS);
    // Even ranks overlap, odd ones all-reduce in finish(); ranks 0 and 1 hand their gradients to
    // grad_ready, 2 and 3 compute them in the bucket slots: the collectives are the same.
    let overlap = if comm.rank().is_multiple_of(2) {
        Overlap::On
    } else {
        Overlap::Off
    };
    let mode = if comm.rank() % 4 < 2 {
        Mode::Overlap
    } else {
        Mode::InPlace
    };
    // Ranks 2 and 3 also wait 2 ms in every backward pass (`--idle-backward-ms`), so their
    // gradients come late.
    let idle = Duration::from_millis(if comm.rank() % 4 < 2 { 0 } else { 2 });
    match train_and_check(&comm, mode, overlap, idle, &reference) {
        Ok(worst) => println!("RESULT rank={} ok worst={worst:e}", comm.rank()),
        Err(e) => {
            println!("RESULT rank={} FAILED {e}", comm.rank());
            std::process::exit(1);
        }
    }
}

#[test]
fn ddp_matches_one_process_on_the_concatenated_batch_processes() {
    let out = common::launch_self(WORLD, &[("OXCCL_TEST_DDP", "1")]);
    common::assert_all_ok(&out, WORLD);
}
