//! `DeviceZero` on a GPU (feature `cuda`; ignored without one): ranks as threads sharing GPU 0,
//! each with a stream of its own, against the same reference as the host tests (DDP + the same
//! optimizer on whole parameters). Run with:
//!
//! ```text
//! cargo test -p oxccl-zero --features cuda --test zero -- device --ignored --test-threads 1
//! ```
//!
//! Without a GPU, the kernels' arithmetic is tested against the host optimizers (`kernel.rs`).

use std::sync::Arc;

use half::bf16;
use oxccl_comm::cuda::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use oxccl_comm::harness::spawn_world_on_nodes;
use oxccl_kernels::cuda::gpu_or_skip;
use oxccl_zero::{
    AdamW, DeviceOptimizer, DeviceParam, DeviceZero, Sgd, ShardGroup, Stage, ZeroConfig,
};

use crate::{adamw, assert_close, grad, hypers, init, reference, sgd, test_config, Feed, LENS};

fn stream() -> Arc<CudaStream> {
    let ctx = CudaContext::new(0).expect("a CUDA context on device 0");
    ctx.new_stream().expect("a stream")
}

const STEPS: usize = 10;

/// `world` ranks in nodes of `per_node`, `STEPS` steps of `feed.micro` micro-batches.
fn check<T: DeviceParam>(
    world: usize,
    per_node: usize,
    stage: Stage,
    feed: Feed,
    opt: DeviceOptimizer,
) {
    let want = match opt {
        DeviceOptimizer::AdamW(_) => reference(world, feed, adamw().as_mut()),
        DeviceOptimizer::Sgd(_) => reference(world, feed, sgd().as_mut()),
    };
    let out = spawn_world_on_nodes(world, per_node, test_config(), |comm| {
        let rank = comm.rank();
        let s = stream();
        let mut params: Vec<CudaSlice<T>> = (0..LENS.len())
            .map(|p| {
                let h: Vec<T> = init(rank, p).into_iter().map(T::from_f32).collect();
                s.clone_htod(&h).expect("upload")
            })
            .collect();
        let cfg = ZeroConfig {
            group: ShardGroup::Node,
            stage,
            bucket_elems: 40,
            align: 4,
            ..ZeroConfig::default()
        };
        let mut views: Vec<_> = params.iter_mut().map(|p| p.slice_mut(..)).collect();
        let mut zero = DeviceZero::new(&comm, &s, &mut views, hypers(), opt, cfg).unwrap();
        drop(views);
        zero.accumulate(feed.micro).unwrap();
        for t in 0..STEPS {
            for m in t * feed.micro..(t + 1) * feed.micro {
                for p in (0..LENS.len()).rev() {
                    let h: Vec<T> = grad(rank, m, p).into_iter().map(T::from_f32).collect();
                    let g = s.clone_htod(&h).expect("upload");
                    zero.grad_ready(p, &g.slice(..)).unwrap();
                }
                let mut views: Vec<_> = params.iter_mut().map(|p| p.slice_mut(..)).collect();
                zero.step(&mut views).unwrap();
            }
        }
        let host: Vec<Vec<T>> = params
            .iter()
            .map(|p| s.clone_dtoh(p).expect("download"))
            .collect();
        Ok(host)
    });
    for (rank, r) in out.into_iter().enumerate() {
        let what = format!("device {world} x {per_node} {stage:?} {feed:?} rank {rank}");
        assert_close(&r.unwrap(), &want, &what);
    }
}

const PLAIN: Feed = crate::PLAIN;

#[test]
#[ignore = "needs a GPU: cargo test -p oxccl-zero --features cuda --test zero -- device --ignored --test-threads 1"]
fn device_zero_equals_ddp_and_the_same_optimizer() {
    if !gpu_or_skip() {
        return;
    }
    let adam = DeviceOptimizer::AdamW(AdamW::default());
    let sgd = DeviceOptimizer::Sgd(Sgd {
        momentum: 0.9,
        dampening: 0.0,
        nesterov: true,
    });
    check::<f32>(4, 2, Stage::Two, PLAIN, adam);
    check::<f32>(2, 2, Stage::One, Feed { micro: 2, ..PLAIN }, sgd);
    check::<bf16>(2, 2, Stage::Two, PLAIN, adam);
}
