//! The pipeline on device tensors (feature `cuda`; ignored without a GPU): ranks as threads
//! sharing GPU 0, each stage receiving device tensors, computing the MLP on the host and
//! handing its outputs over in device memory, against one process running every layer; two
//! tensors of two dtypes per output; shapes that change between steps (stale and new shapes
//! on the device); a host tensor handed to a device pipeline, named. Run with:
//!
//! ```text
//! cargo test -p oxccl-pipeline --features cuda --test pipeline -- device --ignored --test-threads 1
//! ```
//!
//! The processes' form: `oxccl launch -n 4 -- 08_pipeline_mlp --device --check` (a build with
//! `--features cuda`; `scripts/gpu_pipeline.sh`).

use std::sync::Arc;

use oxccl_comm::cuda::cudarc::driver::{CudaContext, CudaStream};
use oxccl_comm::harness::spawn_world;
use oxccl_comm::Communicator;
use oxccl_kernels::cuda::gpu_or_skip;
use oxccl_pipeline::{BoxError, Pipeline, PipelineConfig, ScheduleKind, Stage, Step, Tensor};

use super::model::{max_rel_diff, reference, sgd, Layers, MlpStage, Shape};
use super::run::{self, OnDevice, Trained};
use super::{cfg, changing_batch_reference, check, pick, shape};

fn stream() -> Arc<CudaStream> {
    let ctx = CudaContext::new(0).expect("a CUDA context on device 0");
    ctx.new_stream().expect("a stream")
}

fn train_on_device(
    comm: &Communicator,
    sh: &Shape,
    kind: ScheduleKind,
    v: usize,
    steps: usize,
    split: bool,
) -> oxccl_comm::Result<Trained> {
    let o = run::Opts {
        shape: sh.clone(),
        kind,
        chunks: v,
        pipe: comm.size(),
        steps,
        split,
        check: false,
        die: None,
        device: true,
        zero: false,
    };
    let t = run::train(comm, &o).map_err(|e| oxccl_comm::Error::Config(e.to_string()))?;
    // Stages that are threads of one process on one GPU: activations over CUDA IPC.
    assert_eq!(t.device_path, Some("cuda_ipc"), "rank {}", comm.rank());
    Ok(t)
}

#[test]
#[ignore = "needs a GPU: cargo test -p oxccl-pipeline --features cuda --test pipeline -- device --ignored --test-threads 1"]
fn device_every_schedule_at_depths_2_and_4_equals_one_process() {
    if !gpu_or_skip() {
        return;
    }
    for (p, m) in [(2, 1), (2, 4), (4, 3), (4, 6)] {
        let sh = shape(m);
        let want = reference(&sh, 5, 1);
        for (kind, v) in [
            (ScheduleKind::GPipe, 1),
            (ScheduleKind::OneFOneB, 1),
            (ScheduleKind::Interleaved, 2),
            (ScheduleKind::ZeroBubbleH1, 1),
        ] {
            let got: Vec<Trained> = spawn_world(p, cfg(), |comm| {
                train_on_device(&comm, &sh, kind, v, 5, false)
            })
            .into_iter()
            .collect::<Result<_, _>>()
            .unwrap_or_else(|e| panic!("device {kind} p {p} m {m}: {e}"));
            check(&format!("device {kind} p {p} m {m} v {v}"), &got, &want, 1);
        }
    }
}

#[test]
#[ignore = "needs a GPU: cargo test -p oxccl-pipeline --features cuda --test pipeline -- device --ignored --test-threads 1"]
fn device_two_tensors_of_two_dtypes_per_output() {
    if !gpu_or_skip() {
        return;
    }
    let sh = shape(4);
    let want = reference(&sh, 3, 1);
    let got: Vec<Trained> = spawn_world(3, cfg(), |comm| {
        train_on_device(&comm, &sh, ScheduleKind::OneFOneB, 1, 3, true)
    })
    .into_iter()
    .collect::<Result<_, _>>()
    .unwrap();
    check("device 1f1b p 3, f32 + f64 outputs", &got, &want, 1);
}

#[test]
#[ignore = "needs a GPU: cargo test -p oxccl-pipeline --features cuda --test pipeline -- device --ignored --test-threads 1"]
fn device_shapes_that_change_between_steps_are_sent_again() {
    if !gpu_or_skip() {
        return;
    }
    let batches = [3usize, 5, 5, 3];
    let got = spawn_world(3, cfg(), |comm| {
        let play = || -> Result<(Vec<Layers>, Vec<usize>), BoxError> {
            let (p, rank) = (comm.size(), comm.rank());
            let sh = shape(4);
            let s = stream();
            let cfg = PipelineConfig::new(ScheduleKind::OneFOneB, 4);
            let mut pipe = Pipeline::new_on_device(&comm, cfg, &s)?;
            let mut stage = MlpStage::new(&sh, p, 1, rank, 7);
            let mut grads = Vec::new();
            let mut first = 0;
            for &b in &batches {
                stage.sh.batch = b;
                stage.norm = (b * 4) as f32;
                stage.begin_step(first);
                first += b * 4;
                pipe.step(&mut OnDevice {
                    inner: &mut stage,
                    stream: s.clone(),
                })?;
                grads.push(stage.grads.clone());
                let g = stage.grads.clone();
                sgd(&mut stage.params, &g, sh.lr);
            }
            Ok((grads, stage.my_layers()))
        };
        play().map_err(|e| oxccl_comm::Error::Config(e.to_string()))
    });
    for (step, g) in changing_batch_reference(&batches).iter().enumerate() {
        for (r, res) in got.iter().enumerate() {
            let (grads, layers) = res.as_ref().unwrap();
            let d = max_rel_diff(&pick(&grads[step], layers), &pick(g, layers));
            assert!(d <= 1e-5, "device: rank {r} step {step}: {d:e}");
        }
    }
}

/// A stage that hands host tensors to a device pipeline.
struct HostOut;

impl Stage for HostOut {
    fn forward(&mut self, _: Step, _: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        Ok(vec![Tensor::from_slice(&[1.0f32; 4])])
    }
    fn backward(&mut self, _: Step, _: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        Ok(vec![Tensor::from_slice(&[1.0f32; 4])])
    }
}

#[test]
#[ignore = "needs a GPU: cargo test -p oxccl-pipeline --features cuda --test pipeline -- device --ignored --test-threads 1"]
fn device_pipeline_names_a_host_tensor_handed_to_it() {
    if !gpu_or_skip() {
        return;
    }
    let res = spawn_world(2, cfg(), |comm| {
        let s = stream();
        let cfg = PipelineConfig::new(ScheduleKind::OneFOneB, 2);
        let r = Pipeline::new_on_device(&comm, cfg, &s).and_then(|mut p| p.step(&mut HostOut));
        Ok(r.map(|_| ()).map_err(|e| e.to_string()))
    });
    let msg: Vec<String> = res.into_iter().map(|r| r.unwrap().unwrap_err()).collect();
    assert!(
        msg[0].contains("rank 0")
            && msg[0].contains("is in host memory, but this pipeline moves device tensors"),
        "{}",
        msg[0]
    );
    assert!(msg[1].contains("rank 1"), "{}", msg[1]);
}
