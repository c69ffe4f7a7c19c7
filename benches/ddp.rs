//! DDP overhead: `Ddp::sync` of 100 MiB of f32 gradients in 25 MiB buckets against one in-place
//! all-reduce of the same 100 MiB, threaded ranks over shared memory (2 and 4 ranks).
//!
//! `cargo bench --bench ddp`. The gradients are shaped like a transformer's: 4 of 16 MiB, 16 of
//! 2 MiB and 64 of 64 KiB; `sync` reduces gradients of at least `sync_in_place_bytes` in place
//! (1 MiB, the default: all but the 64 KiB ones; 4 MiB: the 16 MiB ones) and packs the rest into
//! 25 MiB buckets. Each benchmark keeps one world of rank threads alive and times `iters`
//! back-to-back calls on rank 0 (`iter_custom`). The target: sync within 1.1x the
//! all-reduce (docs/PERF.md).
//!
//! Two more benchmarks feed the same gradients one by one, last first, with the default
//! `DdpConfig` (`Overlap::Auto`): `grad_ready_25MiB_buckets` hands over each gradient (copied
//! into its bucket) and `grad_slot_25MiB_buckets` writes each into its bucket slot
//! (`Ddp::grad_slot`, filled with 1.0 where a backward pass would write its result, then
//! `grad_ready_in_place`); both end with `finish()`.
//!
//! `sync_25MiB_buckets_uneven_inputs` is `sync_25MiB_buckets` with
//! `DdpConfig::uneven_inputs` set (every rank training): what the flag all-reduce each step
//! costs. The `ddp/1MiB` group times the same three on a small model (16 gradients of 64 KiB,
//! packed into buckets), where that flag is a larger share of the step.
//!
//! `sync_powersgd_rank1` and `_rank4` are `sync` through the PowerSGD hook (`PowerSgd`, from
//! the first step; the large gradients viewed as 2048 x 2048 and 512 x 1024 matrices, the small
//! ones as 128 x 128): what compressing costs where the wire is shared memory.

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

mod common;

use std::time::Duration;

use common::World;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use oxccl::comm::config::TransportChoice;
use oxccl::comm::ReduceOp;
use oxccl::ddp::{Ddp, DdpConfig, Param, PowerSgd, PowerSgdConfig, UnevenInputs};

/// Parameter lengths (f32 elements) of the 100 MiB model.
fn lens_100mib() -> Vec<usize> {
    let mut v = vec![4 << 20; 4];
    v.extend(std::iter::repeat_n(512 << 10, 16));
    v.extend(std::iter::repeat_n(16 << 10, 64));
    v
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    AllReduce,
    /// `Ddp::sync` with `sync_in_place_bytes` set to this many bytes.
    Sync(usize),
    /// As `Sync(1 MiB)` with `uneven_inputs` set: one more small all-reduce per step.
    SyncUneven,
    /// `grad_ready` of every gradient, then `finish`.
    GradReady,
    /// Every gradient written into its slot (`grad_slot`, `grad_ready_in_place`), then `finish`.
    GradSlot,
    /// `Ddp::sync` through the PowerSGD hook of this rank, compressing from the first step.
    PowerSgd(usize),
}

/// Shapes for the 100 MiB model's parameters, for PowerSGD: square-ish matrices.
fn shape_of(len: usize) -> Vec<usize> {
    let rows = 1usize << (len.trailing_zeros() / 2);
    vec![rows, len / rows]
}

/// Rank threads over shared memory that run `iters` calls of `op` on gradients of `lens`
/// elements on command.
fn world(n: usize, op: Op, lens: Vec<usize>) -> World {
    World::new(n, TransportChoice::Shm, move |c, runner| {
        let total: usize = lens.iter().sum();
        let mut flat = vec![1.0f32; total];
        let mut grads: Vec<Vec<f32>> = lens.iter().map(|&l| vec![1.0f32; l]).collect();
        let mut params: Vec<Vec<f32>> = lens.iter().map(|&l| vec![0.0f32; l]).collect();
        let mut list: Vec<Param> = params
            .iter_mut()
            .enumerate()
            .map(|(p, v)| Param::new(format!("p{p}"), v.as_mut_slice()))
            .collect();
        let cfg = DdpConfig {
            sync_in_place_bytes: match op {
                Op::Sync(b) => b,
                Op::SyncUneven => 1 << 20,
                Op::AllReduce | Op::GradReady | Op::GradSlot | Op::PowerSgd(_) => usize::MAX,
            },
            uneven_inputs: if op == Op::SyncUneven {
                UnevenInputs::DivideByWorldSize
            } else {
                UnevenInputs::Off
            },
            ..DdpConfig::default()
        };
        let mut ddp = Ddp::new(c, &mut list, cfg).expect("ddp");
        if let Op::PowerSgd(rank) = op {
            let cfg = PowerSgdConfig {
                rank,
                start_step: 0,
                ..PowerSgdConfig::default()
            };
            let shapes = lens.iter().map(|&l| shape_of(l)).collect();
            ddp.set_comm_hook(PowerSgd::new(cfg, shapes)).expect("hook");
        }
        let n = lens.len();
        runner.serve(|| {
            let step = |ddp: &mut Ddp<_>, grads: &[Vec<f32>]| -> oxccl::ddp::Result<()> {
                for p in (0..n).rev() {
                    if op == Op::GradReady {
                        ddp.grad_ready(p, &grads[p])?;
                    } else {
                        ddp.grad_slot::<f32>(p)?.0.fill(1.0);
                        ddp.grad_ready_in_place(p)?;
                    }
                }
                ddp.finish().map(drop)
            };
            let r = match op {
                Op::AllReduce => c.all_reduce(&mut flat, ReduceOp::Avg).map(drop),
                Op::Sync(_) | Op::SyncUneven | Op::PowerSgd(_) => {
                    ddp.sync(&mut grads).map(drop).map_err(comm_error)
                }
                Op::GradReady | Op::GradSlot => step(&mut ddp, &grads).map_err(comm_error),
            };
            r.expect("operation");
        });
    })
}

/// A DDP error that is the communicator's; anything else is a bug in the benchmark.
fn comm_error(e: oxccl::ddp::DdpError) -> oxccl::comm::Error {
    match e {
        oxccl::ddp::DdpError::Comm(e) => e,
        other => panic!("{other}"),
    }
}

fn ddp_sync(c: &mut Criterion) {
    let bytes: usize = lens_100mib().iter().sum::<usize>() * 4;
    let mut g = c.benchmark_group("ddp/100MiB");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_millis(500))
        .throughput(Throughput::Bytes(bytes as u64));
    for n in [2usize, 4] {
        for (op, name) in [
            (Op::AllReduce, "all_reduce"),
            (Op::Sync(1 << 20), "sync_25MiB_buckets"),
            (Op::Sync(4 << 20), "sync_25MiB_buckets_in_place_from_4MiB"),
            (Op::SyncUneven, "sync_25MiB_buckets_uneven_inputs"),
            (Op::GradReady, "grad_ready_25MiB_buckets"),
            (Op::GradSlot, "grad_slot_25MiB_buckets"),
            (Op::PowerSgd(1), "sync_powersgd_rank1"),
            (Op::PowerSgd(4), "sync_powersgd_rank4"),
        ] {
            let world = world(n, op, lens_100mib());
            g.bench_function(BenchmarkId::new(name, format!("{n}ranks")), |b| {
                b.iter_custom(|iters| world.run(iters))
            });
        }
    }
    g.finish();
}

/// The flag of `uneven_inputs` on a small model: 16 gradients of 64 KiB (1 MiB), packed.
fn ddp_sync_small(c: &mut Criterion) {
    let lens = vec![16 << 10; 16];
    let mut g = c.benchmark_group("ddp/1MiB");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500))
        .throughput(Throughput::Bytes(1 << 20));
    for n in [2usize, 4] {
        for (op, name) in [
            (Op::AllReduce, "all_reduce"),
            (Op::Sync(1 << 20), "sync"),
            (Op::SyncUneven, "sync_uneven_inputs"),
        ] {
            let world = world(n, op, lens.clone());
            g.bench_function(BenchmarkId::new(name, format!("{n}ranks")), |b| {
                b.iter_custom(|iters| world.run(iters))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, ddp_sync, ddp_sync_small);
criterion_main!(benches);
