//! The pipeline runtime on ranks that are threads of this process: the staged MLP against one
//! process running every layer, at every schedule and depth; several tensors per output; shapes
//! that change; a refused shape; a crashed stage; a pipe x data grid with DDP.

#[cfg(feature = "cuda")]
mod device;
#[path = "../../../examples/08_pipeline_mlp/model.rs"]
mod model;
#[path = "../../../examples/08_pipeline_mlp/run.rs"]
mod run;

use std::time::Duration;

use model::{max_rel_diff, reference, reference_grads, sgd, MlpStage, Shape, Wire};
use oxccl_comm::harness::spawn_world;
use oxccl_comm::{Communicator, Config};
use oxccl_pipeline::{Dir, Pipeline, PipelineConfig, PipelineError, ScheduleKind};
use run::Trained;

type Params = model::Layers;

/// A rank's gradients per step, shape rounds per step, and layers.
type Changes = (Vec<Params>, Vec<u64>, Vec<usize>);

fn cfg() -> Config {
    Config {
        timeout: Duration::from_secs(30),
        ..Config::default()
    }
}

fn shape(micro: usize) -> Shape {
    Shape {
        input: 8,
        width: 12,
        output: 3,
        layers: 16,
        batch: 3,
        micro,
        lr: 0.1,
    }
}

/// `steps` steps of the staged MLP on this rank (every rank a stage when `pipe` is the world
/// size, a pipe x data grid with DDP otherwise).
fn train(
    comm: &Communicator,
    sh: &Shape,
    kind: ScheduleKind,
    v: usize,
    pipe: usize,
    steps: usize,
    split: bool,
) -> Result<Trained, oxccl_comm::Error> {
    let o = run::Opts {
        shape: sh.clone(),
        kind,
        chunks: v,
        pipe,
        steps,
        split,
        check: false,
        die: None,
        device: false,
        zero: false,
    };
    run::train(comm, &o).map_err(|e| oxccl_comm::Error::Config(e.to_string()))
}

fn pick(p: &Params, layers: &[usize]) -> Params {
    layers.iter().map(|&l| p[l].clone()).collect()
}

/// Every rank's layers and gradients equal the reference's within 1e-5 (relative).
fn check(name: &str, reports: &[Trained], want: &(Vec<Params>, Params, Vec<f32>), replicas: usize) {
    let mut seen = Vec::new();
    for (r, rep) in reports.iter().enumerate() {
        for (step, g) in rep.grads.iter().enumerate() {
            let d = max_rel_diff(&pick(g, &rep.layers), &pick(&want.0[step], &rep.layers));
            assert!(
                d <= 1e-5,
                "{name}: rank {r} step {step}: gradients differ by {d:e}"
            );
        }
        let d = max_rel_diff(&pick(&rep.params, &rep.layers), &pick(&want.1, &rep.layers));
        assert!(d <= 1e-5, "{name}: rank {r}: parameters differ by {d:e}");
        seen.extend(rep.layers.iter().copied());
    }
    seen.sort_unstable();
    let every: Vec<usize> = (0..want.1.len() * replicas).map(|i| i / replicas).collect();
    assert_eq!(
        seen, every,
        "{name}: every layer on one stage of each replica"
    );
    if replicas > 1 {
        return; // each replica's last stage has the loss of its own samples
    }
    // The last stage's loss is the reference's.
    let last = reports
        .iter()
        .map(|r| r.losses.clone())
        .find(|l| l.iter().any(|&x| x != 0.0))
        .expect("a loss");
    for (a, b) in last.iter().zip(&want.2) {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "{name}: loss {a} vs {b}"
        );
    }
}

#[test]
fn every_schedule_at_depths_2_3_4_8_equals_one_process() {
    for p in [2, 3, 4, 8] {
        for m in [p - 1, p + 2] {
            let m = m.max(1);
            let sh = shape(m);
            let want = reference(&sh, 5, 1);
            for (kind, v) in [
                (ScheduleKind::GPipe, 1),
                (ScheduleKind::OneFOneB, 1),
                (ScheduleKind::Interleaved, 2),
                (ScheduleKind::ZeroBubbleH1, 1),
            ] {
                let got: Vec<Trained> =
                    spawn_world(p, cfg(), |comm| train(&comm, &sh, kind, v, p, 5, false))
                        .into_iter()
                        .collect::<Result<_, _>>()
                        .unwrap_or_else(|e| panic!("{kind} p {p} m {m}: {e}"));
                check(&format!("{kind} p {p} m {m} v {v}"), &got, &want, 1);
            }
        }
    }
}

#[test]
fn two_tensors_of_two_dtypes_per_output() {
    let sh = shape(4);
    let want = reference(&sh, 3, 1);
    let got: Vec<Trained> = spawn_world(3, cfg(), |comm| {
        train(&comm, &sh, ScheduleKind::OneFOneB, 1, 3, 3, true)
    })
    .into_iter()
    .collect::<Result<_, _>>()
    .unwrap();
    check("1f1b p 3, f32 + f64 outputs", &got, &want, 1);
}

#[test]
fn shapes_that_change_between_steps_are_sent_again() {
    // Micro-batches of 3, 5, 5, 3 samples: the shapes go again at steps 1 and 3 only.
    let batches = [3usize, 5, 5, 3];
    let play = |comm: Communicator| -> Result<Changes, PipelineError> {
        let (p, rank) = (comm.size(), comm.rank());
        let sh = shape(4);
        let mut pipe = Pipeline::new(&comm, PipelineConfig::new(ScheduleKind::OneFOneB, 4))?;
        let mut stage = MlpStage::new(&sh, p, 1, rank, 7);
        let (mut grads, mut sent) = (Vec::new(), Vec::new());
        let mut first = 0;
        for &b in &batches {
            stage.sh.batch = b;
            stage.norm = (b * 4) as f32;
            stage.begin_step(first);
            first += b * 4;
            pipe.step(&mut stage)?;
            grads.push(stage.grads.clone());
            sent.push(pipe.shape_exchanges());
            let g = stage.grads.clone();
            sgd(&mut stage.params, &g, sh.lr);
        }
        Ok((grads, sent, stage.my_layers()))
    };
    let got = spawn_world(3, cfg(), |comm| {
        play(comm).map_err(|e| oxccl_comm::Error::Config(e.to_string()))
    });
    for (step, g) in changing_batch_reference(&batches).iter().enumerate() {
        for (r, res) in got.iter().enumerate() {
            let (grads, sent, layers) = res.as_ref().unwrap();
            let d = max_rel_diff(&pick(&grads[step], layers), &pick(g, layers));
            assert!(d <= 1e-5, "rank {r} step {step}: {d:e}");
            // Rank 1 has two links (to 0 and 2), each way: 4 shape rounds per change.
            if r == 1 {
                let fresh = [4, 4, 0, 4][step];
                let before = if step == 0 { 0 } else { sent[step - 1] };
                assert_eq!(sent[step] - before, fresh, "rank 1 step {step}: {sent:?}");
            }
        }
    }
}

/// One process's gradients at each step of SGD on micro-batches of `batches[step]` samples (4
/// micro-batches per step).
fn changing_batch_reference(batches: &[usize]) -> Vec<Params> {
    let mut params = model::init(&shape(4), 7);
    let mut first = 0;
    let mut out = Vec::new();
    for &b in batches {
        let sh = Shape {
            batch: b,
            ..shape(4)
        };
        let (g, _) = reference_grads(&sh, &params, first, 1);
        first += b * 4;
        sgd(&mut params, &g, sh.lr);
        out.push(g);
    }
    out
}

#[test]
fn a_refused_shape_is_named_on_both_ends_and_the_rest_fail_too() {
    let res = spawn_world(3, cfg(), |comm| {
        let sh = shape(3);
        let rank = comm.rank();
        let run = || -> Result<(), PipelineError> {
            let mut pipe = Pipeline::new(&comm, PipelineConfig::new(ScheduleKind::OneFOneB, 3))?;
            if rank == 1 {
                pipe.set_check(|dir, _chunk, metas| match (dir, metas) {
                    (Dir::Act, [m]) if m.shape.len() == 2 => Ok(()),
                    (Dir::Act, _) => Err("stage 1 takes one [batch, width] tensor".into()),
                    _ => Ok(()),
                });
            }
            let mut stage = MlpStage::new(&sh, 3, 1, rank, 7);
            if rank == 0 {
                stage.wire = Wire::Split; // two tensors where stage 1 takes one
            }
            pipe.step(&mut stage).map(|_| ())
        };
        Ok(run().map_err(|e| e.to_string()))
    });
    let msg: Vec<String> = res.into_iter().map(|r| r.unwrap().unwrap_err()).collect();
    assert!(msg[0].contains("stage 1 (rank 1) refused the activations of micro-batch 0 that this stage sent, [f32 [3, 6], f64 [3, 6]]: stage 1 takes one"), "{}", msg[0]);
    assert!(msg[1].contains("stage 1 refused the activations of micro-batch 0 that stage 0 (rank 0) sent, [f32 [3, 6], f64 [3, 6]]: stage 1 takes one"), "{}", msg[1]);
    assert!(msg[2].contains("rank 2"), "{}", msg[2]);
}

#[test]
fn a_crashed_stage_fails_every_stage_without_a_hang() {
    let t = std::time::Instant::now();
    let res = spawn_world(4, cfg(), |comm| {
        let sh = shape(6);
        let rank = comm.rank();
        let run = || -> Result<(), PipelineError> {
            let mut pipe = Pipeline::new(&comm, PipelineConfig::new(ScheduleKind::OneFOneB, 6))?;
            let mut stage = MlpStage::new(&sh, 4, 1, rank, 7);
            if rank == 2 {
                stage.fail_at = Some(2);
            }
            pipe.step(&mut stage).map(|_| ())
        };
        Ok(run().map_err(|e| e.to_string()))
    });
    let msg: Vec<String> = res.into_iter().map(|r| r.unwrap().unwrap_err()).collect();
    assert!(
        msg[2].contains(
            "rank 2 (stage 2): forward of micro-batch 2 (chunk 0) failed: this stage crashed"
        ),
        "{}",
        msg[2]
    );
    for r in [0, 1, 3] {
        assert!(
            msg[r].contains(&format!("rank {r}")),
            "rank {r}: {}",
            msg[r]
        );
    }
    assert!(
        t.elapsed() < Duration::from_secs(25),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn a_pipe_by_data_grid_with_ddp_equals_one_process_on_the_whole_batch() {
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1] {
        let sh = shape(3);
        let want = reference(&sh, 4, 2);
        let got: Vec<Trained> =
            spawn_world(4, cfg(), |comm| train(&comm, &sh, kind, 1, 2, 4, false))
                .into_iter()
                .collect::<Result<_, _>>()
                .unwrap_or_else(|e| panic!("{kind}: {e}"));
        check(&format!("{kind} 2 stages x 2 replicas"), &got, &want, 2);
    }
}

#[test]
fn a_pipe_by_data_grid_with_zero_equals_one_process_on_the_whole_batch() {
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::Interleaved] {
        let sh = shape(4);
        let v = if kind == ScheduleKind::Interleaved {
            2
        } else {
            1
        };
        let want = reference(&sh, 4, 2);
        let got: Vec<Trained> = spawn_world(4, cfg(), |comm| {
            let o = run::Opts {
                shape: sh.clone(),
                kind,
                chunks: v,
                pipe: 2,
                steps: 4,
                split: false,
                check: false,
                die: None,
                device: false,
                zero: true,
            };
            run::train(&comm, &o).map_err(|e| oxccl_comm::Error::Config(e.to_string()))
        })
        .into_iter()
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("{kind}: {e}"));
        // ZeRO applies the gradients shard by shard: parameters are compared, not gradients.
        assert!(got.iter().all(|t| t.grads.is_empty()));
        check(
            &format!("{kind} 2 stages x 2 replicas, ZeRO-2"),
            &got,
            &want,
            2,
        );
    }
}
