//! `DeviceDdp` on a GPU (feature `cuda`; ignored without one): ranks as threads sharing GPU 0,
//! each with a stream of its own, against the exact averages of integer-valued gradients, through
//! `grad_ready`, gradient slots, `sync`, accumulation, unused parameters and fp16 compression.
//! Run with:
//!
//! ```text
//! cargo test -p oxccl-ddp --features cuda --test ddp -- device --ignored --test-threads 1
//! ```
//!
//! The plan these run (stream order, buckets, every rule of a step) is tested without a GPU by
//! the unit tests in `ddp/src/device/tests.rs`.

use std::sync::Arc;

use oxccl_comm::cuda::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use oxccl_comm::harness::spawn_world;
use oxccl_comm::{Config, Result};
use oxccl_ddp::{CompressHook, DdpConfig, DevGradMut, DeviceDdp, DeviceParam, PowerSgd, Step};
use oxccl_kernels::cuda::gpu_or_skip;
use oxccl_kernels::f16;

const LENS: [usize; 4] = [1000, 7, 1, 3000];

fn stream() -> Arc<CudaStream> {
    let ctx = CudaContext::new(0).expect("a CUDA context on device 0");
    ctx.new_stream().expect("a stream")
}

/// Integer-valued gradient of `p` on `rank` at micro-batch `m` (averages over 2 or 4 ranks
/// are exact in f32, and so are the fp16 wire's values).
fn grad(rank: usize, m: usize, p: usize) -> Vec<f32> {
    (0..LENS[p])
        .map(|i| ((rank * 7 + m * 3 + p * 5 + i) % 9) as f32)
        .collect()
}

fn mean(n: usize, ms: &[usize], p: usize) -> Vec<f32> {
    let mut s = vec![0.0f32; LENS[p]];
    for r in 0..n {
        for &m in ms {
            s.iter_mut().zip(grad(r, m, p)).for_each(|(a, g)| *a += g);
        }
    }
    s.iter().map(|x| x / n as f32).collect()
}

fn cfg() -> DdpConfig {
    DdpConfig {
        bucket_cap_bytes: 8192,
        first_bucket_bytes: 2048,
        find_unused_parameters: true,
        ..DdpConfig::default()
    }
}

fn world(n: usize, compress: bool) {
    let out = spawn_world(n, Config::default(), |comm| -> Result<()> {
        let rank = comm.rank();
        let s = stream();
        let mut w: Vec<CudaSlice<f32>> = LENS
            .iter()
            .map(|&l| s.clone_htod(&vec![rank as f32; l]).unwrap())
            .collect();
        let mut params: Vec<DeviceParam<'_>> = w
            .iter_mut()
            .enumerate()
            .map(|(p, x)| DeviceParam::new(format!("w{p}"), x))
            .collect();
        let mut ddp = DeviceDdp::new(&comm, &s, &mut params, cfg()).unwrap();
        drop(params);
        for x in &w {
            assert!(
                s.clone_dtoh(x).unwrap().iter().all(|&v| v == 0.0),
                "rank 0's values"
            );
        }
        let e = ddp
            .set_comm_hook(PowerSgd::new(Default::default(), vec![]))
            .unwrap_err();
        assert!(e.to_string().contains("host buffers only"), "{e}");
        if compress {
            ddp.set_comm_hook(CompressHook::fp16()).unwrap();
        }
        let check = |ddp: &DeviceDdp<_>, ms: &[usize], what: &str| {
            for p in 0..LENS.len() {
                let got = s.clone_dtoh(&ddp.grad::<f32>(p).unwrap()).unwrap();
                assert_eq!(got, mean(n, ms, p), "rank {rank} {what} param {p}");
            }
        };
        // Step 0: grad_ready in an order that differs per rank.
        let mut order: Vec<usize> = (0..LENS.len()).collect();
        order.rotate_left(rank % LENS.len());
        for &p in &order {
            let g = s.clone_htod(&grad(rank, 0, p)).unwrap();
            ddp.grad_ready(p, &g).unwrap();
        }
        assert_eq!(ddp.finish().unwrap(), Step::Synced { step: 0 });
        check(&ddp, &[0], "grad_ready");
        // Step 1: two micro-batches through the slots (accumulated).
        ddp.accumulate(2).unwrap();
        for m in [1, 2] {
            for p in (0..LENS.len()).rev() {
                let (mut slot, fresh) = ddp.grad_slot::<f32>(p).unwrap();
                let mut v = grad(rank, m, p);
                if !fresh {
                    let old = s.clone_dtoh(&slot).unwrap();
                    v.iter_mut().zip(old).for_each(|(a, o)| *a += o);
                }
                s.memcpy_htod(&v, &mut slot).unwrap();
                ddp.grad_ready_in_place(p).unwrap();
            }
            ddp.finish().unwrap();
        }
        check(&ddp, &[1, 2], "slots, accumulated");
        ddp.accumulate(1).unwrap();
        // Step 2: sync, the averages written back; parameter 1 unused on rank 0 is not possible
        // through sync (every gradient is given), so step 3 leaves it out with grad_ready.
        let mut gs: Vec<CudaSlice<f32>> = (0..LENS.len())
            .map(|p| s.clone_htod(&grad(rank, 3, p)).unwrap())
            .collect();
        let mut views: Vec<DevGradMut<'_>> = gs.iter_mut().map(DevGradMut::from).collect();
        ddp.sync(&mut views).unwrap();
        drop(views);
        for (p, g) in gs.iter().enumerate() {
            assert_eq!(
                s.clone_dtoh(g).unwrap(),
                mean(n, &[3], p),
                "rank {rank} sync {p}"
            );
        }
        for p in (0..LENS.len()).filter(|&p| p != 1) {
            let g = s.clone_htod(&grad(rank, 4, p)).unwrap();
            ddp.grad_ready(p, &g).unwrap();
        }
        ddp.finish().unwrap();
        assert_eq!(ddp.unused_on_every_rank(), &[1]);
        let zeros = s.clone_dtoh(&ddp.grad::<f32>(1).unwrap()).unwrap();
        assert!(zeros.iter().all(|&v| v == 0.0));
        if compress {
            // Another wire dtype: the compressed copies are made again.
            ddp.set_comm_hook(CompressHook::bf16()).unwrap();
            for p in 0..LENS.len() {
                let g = s.clone_htod(&grad(rank, 5, p)).unwrap();
                ddp.grad_ready(p, &g).unwrap();
            }
            ddp.finish().unwrap();
            check(&ddp, &[5], "bf16 wire");
        }
        s.synchronize().unwrap();
        assert!(comm.device_async_error().is_none());
        Ok(())
    });
    for r in out {
        r.unwrap();
    }
}

#[test]
#[ignore = "needs a GPU: cargo test -p oxccl-ddp --features cuda --test ddp -- device --ignored --test-threads 1"]
fn device_ddp_2_and_4_ranks_equal_the_exact_averages() {
    if !gpu_or_skip() {
        return;
    }
    world(2, false);
    world(4, false);
}

#[test]
#[ignore = "needs a GPU: cargo test -p oxccl-ddp --features cuda --test ddp -- device --ignored --test-threads 1"]
fn device_ddp_fp16_compression_equals_the_exact_averages() {
    if !gpu_or_skip() {
        return;
    }
    world(4, true);
    let _ = f16::ZERO;
}
