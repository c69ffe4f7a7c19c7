//! DDP end to end on the MLP of examples/02_ddp_mlp.rs: 4 ranks x 10 steps must match one
//! process trained on the concatenated batch (parameters within 1e-5 relative) and keep every
//! rank's parameters bit-identical after every step. Once with ranks as threads (every way of
//! feeding gradients: `grad_ready`, computed in the bucket slots, each with overlap on and off,
//! and `sync`), once with ranks as processes started by `oxccl launch` (each rank a different one
//! of the four `grad_ready` and slot ways, two of them waiting in backward as
//! `--idle-backward-ms` does: ranks may differ).
//!
//! With uneven data (`UnevenInputs::DivideByActiveRanks`, rank r having `UNEVEN[r]` steps, the
//! ranks out of data standing in with `join_step`), the reference is one process on the
//! concatenated batches of the ranks still training, threads and processes alike.
//!
//! With the PowerSGD hook (rank 2, from step 2), the model must match the reference until
//! compression starts, then leave it, with the held-out loss after the last step at least halfway
//! from the start to the exact model's, the replicas identical
//! throughout: threads (every rank through `sync`, and ranks feeding in different ways) and
//! processes.
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
use oxccl::ddp::{CommHook, DdpConfig, Overlap, PowerSgd, PowerSgdConfig, UnevenInputs};

const STEPS: usize = 10;
const WORLD: usize = 4;
/// Steps of data per rank in the uneven runs: rank 0 is not the last to run out.
const UNEVEN: [usize; WORLD] = [7, 10, 3, 10];

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

/// Steps before PowerSGD starts compressing in the PowerSGD runs.
const PSGD_START: u64 = 2;

/// The PowerSGD hook of those runs: rank 2, compressing the MLP's three weights of 64 rows
/// (64 x 32 and twice 64 x 64; the 4 x 64 output weight would not shrink enough) from
/// step `PSGD_START`.
fn powersgd() -> Box<dyn CommHook> {
    let shapes = mlp::Mlp::new(&Shape::default(), 0).shapes();
    Box::new(PowerSgd::new(
        PowerSgdConfig {
            rank: 2,
            start_step: PSGD_START,
            ..PowerSgdConfig::default()
        },
        shapes,
    ))
}

/// Trains with DDP on `comm`; after every step checks the model against the reference and the
/// replicas against each other. Returns the worst relative difference. `idle` is
/// `Shape::idle_backward`: backward's waits, which change when gradients arrive, not what they
/// are. `steps`: this rank's steps of data, every rank's `STEPS` when `None`; else the rank
/// stands in for the others' steps after its own (`join_step`). With `psgd` (the PowerSGD
/// hook), the model must match the reference only before compression starts, and must then
/// leave it while its loss still falls; the replicas must stay identical throughout.
fn train_and_check(
    comm: &Communicator,
    mode: Mode,
    overlap: Overlap,
    idle: Duration,
    reference: &[mlp::Mlp],
    steps: Option<usize>,
    psgd: bool,
) -> Result<f32, String> {
    let shape = Shape {
        idle_backward: idle,
        ..Shape::default()
    };
    let cfg = DdpConfig {
        uneven_inputs: match steps {
            Some(_) => UnevenInputs::DivideByActiveRanks,
            None => UnevenInputs::Off,
        },
        ..cfg(overlap)
    };
    let mut worst = 0.0f32;
    let mut done = 0;
    let mut last = None;
    let run = mlp::Run {
        steps: steps.unwrap_or(STEPS),
        join: steps.is_some(),
        mode,
        cfg,
        hook: psgd.then(powersgd),
    };
    mlp::train_ddp_run(comm, &shape, run, |step, model, ddp, r| {
        done += 1;
        if r.joined != (step >= steps.unwrap_or(STEPS)) {
            return Err(format!("step {step}: joined is {}", r.joined).into());
        }
        let want = match overlap {
            Overlap::On => Some(true),
            Overlap::Off => Some(false),
            Overlap::Auto => None,
        };
        if want.is_some_and(|w| w != ddp.overlaps()) {
            return Err(format!("asked for {overlap:?}, overlaps() is {}", ddp.overlaps()).into());
        }
        let diff = mlp::max_rel_diff(model, &reference[step]);
        if psgd && step as u64 >= PSGD_START {
            last = Some(model.clone());
            if step == STEPS - 1 && diff < 1e-4 {
                return Err(format!(
                    "step {step}: still {diff:e} from the uncompressed reference: was \
                         anything compressed?"
                )
                .into());
            }
        } else {
            worst = worst.max(diff);
            if diff > 1e-5 {
                return Err(format!("step {step}: max relative difference {diff:e}").into());
            }
        }
        if !mlp::replicas_identical(ddp.comm(), model)? {
            return Err(format!("step {step}: replicas differ").into());
        }
        Ok(())
    })
    .map_err(|e| format!("rank {}: {mode:?}, {overlap:?}: {e}", comm.rank()))?;
    if psgd {
        let shape = Shape::default();
        let (start, exact) = (
            mlp::Mlp::new(&shape, 0).held_out_loss(&shape),
            reference[STEPS - 1].held_out_loss(&shape),
        );
        let got = mlp::Mlp::held_out_loss(&last.ok_or("no step")?, &shape);
        // Compressed, the model must still learn: at least half of what the exact one does
        // (measured: 0.2054 at the start, 0.1577 uncompressed, 0.1600 with PowerSGD).
        if got > start - 0.5 * (start - exact) {
            return Err(format!(
                "rank {}: PowerSGD: held-out loss {got} after {STEPS} steps, from {start}; \
                 uncompressed {exact}",
                comm.rank()
            ));
        }
    }
    if done != reference.len() {
        return Err(format!(
            "rank {}: {done} steps, the reference has {}",
            comm.rank(),
            reference.len()
        ));
    }
    Ok(worst)
}

/// `train_and_check` on `WORLD` threaded ranks for each (mode, overlap); `steps`: every rank's
/// steps of data when uneven.
fn threads(runs: &[(Mode, Overlap)], reference: &[mlp::Mlp], steps: Option<&[usize; WORLD]>) {
    for &(mode, overlap) in runs {
        let out = spawn_world(WORLD, Config::default(), |comm| {
            let own = steps.map(|s| s[comm.rank()]);
            Ok(train_and_check(
                &comm,
                mode,
                overlap,
                Duration::ZERO,
                reference,
                own,
                false,
            ))
        });
        for r in out {
            let worst = r.unwrap().unwrap();
            assert!(worst <= 1e-5);
        }
    }
}

#[test]
fn uneven_ddp_matches_one_process_on_the_batches_of_the_ranks_training_threads() {
    let reference = mlp::train_reference(&Shape::default(), &UNEVEN);
    // Once ranks run out, the reference's steps are smaller than the full one's.
    let full = mlp::train_reference(&Shape::default(), &[STEPS; WORLD]);
    assert!(mlp::max_rel_diff(&reference[STEPS - 1], &full[STEPS - 1]) > 1e-4);
    threads(
        &[
            (Mode::Overlap, Overlap::On),
            (Mode::InPlace, Overlap::Off),
            (Mode::After, Overlap::Auto),
        ],
        &reference,
        Some(&UNEVEN),
    );
}

#[test]
fn ddp_matches_one_process_on_the_concatenated_batch_threads() {
    let reference = mlp::train_reference(&Shape::default(), &[STEPS; WORLD]);
    // The reference moves: a test that compares against the initial model would pass trivially.
    assert!(mlp::max_rel_diff(&reference[STEPS - 1], &mlp::Mlp::new(&Shape::default(), 0)) > 1e-3);
    threads(
        &[
            (Mode::Overlap, Overlap::On),
            (Mode::Overlap, Overlap::Off),
            (Mode::InPlace, Overlap::On),
            (Mode::InPlace, Overlap::Off),
            (Mode::After, Overlap::Auto),
        ],
        &reference,
        None,
    );
}

/// Plays one rank when started by `oxccl launch` from the test below.
#[test]
fn rank_entry() {
    if std::env::var("OXCCL_TEST_DDP").is_err() {
        return;
    }
    let comm = Communicator::from_env().expect("communicator from the environment");
    // OXCCL_TEST_DDP=uneven: rank r has UNEVEN[r] steps of data; =powersgd: the PowerSGD hook.
    let uneven = std::env::var("OXCCL_TEST_DDP").is_ok_and(|v| v == "uneven");
    let psgd = std::env::var("OXCCL_TEST_DDP").is_ok_and(|v| v == "powersgd");
    let steps = uneven.then(|| UNEVEN[comm.rank() % WORLD]);
    let reference = if uneven {
        mlp::train_reference(&Shape::default(), &UNEVEN[..comm.size()])
    } else {
        mlp::train_reference(&Shape::default(), &vec![STEPS; comm.size()])
    };
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
    match train_and_check(&comm, mode, overlap, idle, &reference, steps, psgd) {
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

#[test]
fn uneven_ddp_matches_one_process_on_the_batches_of_the_ranks_training_processes() {
    let out = common::launch_self(WORLD, &[("OXCCL_TEST_DDP", "uneven")]);
    common::assert_all_ok(&out, WORLD);
}

#[test]
fn powersgd_ddp_keeps_replicas_identical_and_learns_threads() {
    let reference = mlp::train_reference(&Shape::default(), &[STEPS; WORLD]);
    // Ranks feed gradients in different ways, as in the process test: the hook's two rounds
    // must line up whatever each rank's mode and overlap. Then every rank through `sync`.
    let mixed = |r: usize| {
        (
            [Mode::Overlap, Mode::InPlace, Mode::Overlap, Mode::InPlace][r],
            [Overlap::On, Overlap::On, Overlap::Off, Overlap::Off][r],
        )
    };
    let by_sync = |_: usize| (Mode::After, Overlap::Auto);
    for how in [
        &mixed as &(dyn Fn(usize) -> (Mode, Overlap) + Sync),
        &by_sync,
    ] {
        let out = spawn_world(WORLD, Config::default(), |comm| {
            let (mode, overlap) = how(comm.rank());
            let none = Duration::ZERO;
            Ok(train_and_check(
                &comm, mode, overlap, none, &reference, None, true,
            ))
        });
        for r in out {
            r.unwrap().unwrap();
        }
    }
}

#[test]
fn powersgd_ddp_keeps_replicas_identical_and_learns_processes() {
    let out = common::launch_self(WORLD, &[("OXCCL_TEST_DDP", "powersgd")]);
    common::assert_all_ok(&out, WORLD);
}
