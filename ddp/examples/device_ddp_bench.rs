//! device_ddp_bench: the GPU figures of DDP on device gradients, ranks as threads sharing GPU 0
//! (each with a stream of its own). Needs a GPU and `--features cuda`:
//!
//! ```text
//! cargo run --release -p oxccl-ddp --features cuda --example device_ddp_bench -- --ranks 2
//! ```
//!
//! 1. `sync`: `DeviceDdp::sync` of `--mib` MiB of f32 gradients (`--params` equal parameters)
//!    against one device all-reduce of the same bytes, same run; median of `--reps`.
//! 2. overlap: a synthetic backward of `--layers` layers, each `--work` scale kernels over a
//!    64 MiB scratch buffer, then that layer's gradient (`--mib / --layers`) handed to
//!    `grad_ready` (the bucket all-reduces overlap the next layers' kernels), against the same
//!    kernels followed by every `grad_ready` (backward, then the all-reduces); median of `--reps`.

use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use oxccl_comm::cuda::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use oxccl_comm::harness::spawn_world;
use oxccl_comm::{Communicator, Config, DType, ReduceOp};
use oxccl_ddp::{DdpConfig, DevGradMut, DeviceDdp, DeviceParam};
use oxccl_kernels::cuda::CudaKernels;

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Ranks (threads sharing GPU 0).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Gradient MiB per rank.
    #[arg(long, default_value_t = 100)]
    mib: usize,
    /// Parameters the gradient is split into (sync).
    #[arg(long, default_value_t = 25)]
    params: usize,
    /// Layers of the synthetic backward (overlap).
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Scale kernels per layer over the 64 MiB scratch buffer.
    #[arg(long, default_value_t = 20)]
    work: usize,
    /// Timed repetitions (after one warm-up).
    #[arg(long, default_value_t = 10)]
    reps: usize,
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Seconds of `f` (which enqueues), after a host barrier, until the stream has run it.
fn timed(comm: &Communicator, s: &Arc<CudaStream>, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    s.synchronize()?;
    comm.barrier()?;
    let t = Instant::now();
    f()?;
    s.synchronize()?;
    Ok(t.elapsed().as_secs_f64())
}

fn buffers(s: &Arc<CudaStream>, n: usize, bytes: usize) -> Res<Vec<CudaSlice<f32>>> {
    let each = bytes / 4 / n;
    Ok((0..n)
        .map(|_| s.alloc_zeros::<f32>(each))
        .collect::<Result<_, _>>()?)
}

fn reducer<'c>(
    comm: &'c Communicator,
    s: &Arc<CudaStream>,
    w: &mut [CudaSlice<f32>],
    cfg: DdpConfig,
) -> Res<DeviceDdp<&'c Communicator>> {
    let mut ps: Vec<DeviceParam<'_>> = w
        .iter_mut()
        .enumerate()
        .map(|(i, x)| DeviceParam::new(format!("p{i}"), x))
        .collect();
    Ok(DeviceDdp::new(comm, s, &mut ps, cfg)?)
}

/// `sync` of the whole gradient against one all-reduce of as many bytes: (sync, all-reduce).
fn sync_figure(a: &Args, comm: &Communicator, s: &Arc<CudaStream>) -> Res<(f64, f64)> {
    let bytes = a.mib << 20;
    let mut w = buffers(s, a.params, bytes)?;
    let mut ddp = reducer(comm, s, &mut w, DdpConfig::default())?;
    let mut g = buffers(s, a.params, bytes)?;
    let mut flat = s.alloc_zeros::<f32>(bytes / 4)?;
    let (mut t_sync, mut t_ar) = (Vec::new(), Vec::new());
    for rep in 0..=a.reps {
        let ts = timed(comm, s, || {
            let mut v: Vec<DevGradMut<'_>> = g.iter_mut().map(DevGradMut::from).collect();
            ddp.sync(&mut v)?;
            Ok(())
        })?;
        let ta = timed(comm, s, || {
            comm.on_stream(s).all_reduce(&mut flat, ReduceOp::Avg)?;
            Ok(())
        })?;
        if rep > 0 {
            t_sync.push(ts);
            t_ar.push(ta);
        }
    }
    Ok((median(t_sync), median(t_ar)))
}

/// The synthetic backward, layer by layer against backward-then-all-reduce: (overlapped,
/// serial).
fn overlap_figure(a: &Args, comm: &Communicator, s: &Arc<CudaStream>) -> Res<(f64, f64)> {
    let k = CudaKernels::new(s.context())?;
    let bytes = a.mib << 20;
    let mut w = buffers(s, a.layers, bytes)?;
    let cfg = DdpConfig {
        rebuild_buckets: false,
        ..DdpConfig::default()
    };
    let mut ddp = reducer(comm, s, &mut w, cfg)?;
    let g = buffers(s, a.layers, bytes)?;
    let mut scratch = s.alloc_zeros::<u8>(64 << 20)?;
    let layer = |scratch: &mut CudaSlice<u8>| -> Res<()> {
        for _ in 0..a.work {
            k.scale_bytes(s, DType::F32, &mut scratch.as_view_mut(), 1.0)?;
        }
        Ok(())
    };
    let (mut t_ov, mut t_ser) = (Vec::new(), Vec::new());
    for rep in 0..=a.reps {
        let to = timed(comm, s, || {
            for l in (0..a.layers).rev() {
                layer(&mut scratch)?;
                ddp.grad_ready(l, &g[l])?;
            }
            ddp.finish()?;
            Ok(())
        })?;
        let tse = timed(comm, s, || {
            for _ in 0..a.layers {
                layer(&mut scratch)?;
            }
            for l in (0..a.layers).rev() {
                ddp.grad_ready(l, &g[l])?;
            }
            ddp.finish()?;
            Ok(())
        })?;
        if rep > 0 {
            t_ov.push(to);
            t_ser.push(tse);
        }
    }
    Ok((median(t_ov), median(t_ser)))
}

fn rank_main(a: &Args, comm: &Communicator) -> Res<[f64; 4]> {
    let s = CudaContext::new(0)?.new_stream()?;
    let (ts, ta) = sync_figure(a, comm, &s)?;
    let (to, tse) = overlap_figure(a, comm, &s)?;
    if let Some(e) = comm.device_async_error() {
        return Err(e.into());
    }
    Ok([ts, ta, to, tse])
}

fn main() -> Res<()> {
    oxccl_comm::logging::init(); // OXCCL_DEBUG=info shows transports and algorithms
    let a = Args::parse();
    let out = spawn_world(a.ranks, Config::default(), |comm| {
        Ok(rank_main(&a, &comm).map_err(|e| format!("rank {}: {e}", comm.rank())))
    });
    let mut first = None;
    for r in out {
        let r = r?.map_err(|e| -> Box<dyn std::error::Error> { e.into() })?;
        first.get_or_insert(r);
    }
    let [ts, ta, to, tse] = first.ok_or("no ranks")?;
    println!(
        "{} ranks, {} MiB: sync {:.2} ms, one all-reduce {:.2} ms: {:.2}x",
        a.ranks,
        a.mib,
        ts * 1e3,
        ta * 1e3,
        ts / ta
    );
    println!(
        "{} layers x {} kernels: overlapped {:.2} ms, backward then all-reduce {:.2} ms: {:.2}x",
        a.layers,
        a.work,
        to * 1e3,
        tse * 1e3,
        to / tse
    );
    Ok(())
}
