//! Collective bandwidth with threaded ranks over shared memory and TCP: all-reduce, reduce-scatter,
//! all-gather and broadcast of f32 at a few sizes, 2 and 4 ranks.
//!
//! `cargo bench --bench collectives`. Each benchmark keeps one world of rank threads alive and
//! times `iters` back-to-back calls on rank 0 (`iter_custom`); throughput is the full buffer size
//! (as nccl-tests' algbw). Ranks are threads of one process here; `oxccl perf` measures processes.

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

mod common;

use std::time::Duration;

use common::World;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use oxccl::comm::config::TransportChoice;
use oxccl::comm::{Collective, ReduceOp};

/// Rank threads that run `iters` calls of `coll` on `bytes` of f32 on command.
fn world(n: usize, transport: TransportChoice, coll: Collective, bytes: usize) -> World {
    World::new(n, transport, move |c, runner| {
        let count = bytes / 4;
        let mut buf = vec![1.0f32; count];
        let mut out = vec![0.0f32; count];
        runner.serve(|| {
            match coll {
                Collective::AllReduce => c.all_reduce(&mut buf, ReduceOp::Sum),
                Collective::ReduceScatter => c.reduce_scatter(&mut buf, ReduceOp::Sum),
                Collective::AllGather => c.all_gather(&mut out),
                _ => c.broadcast(&mut buf, 0),
            }
            .expect("collective");
        });
    })
}

fn collectives(c: &mut Criterion) {
    for coll in [
        Collective::AllReduce,
        Collective::ReduceScatter,
        Collective::AllGather,
        Collective::Broadcast,
    ] {
        let mut g = c.benchmark_group(format!("collectives/{coll}"));
        g.sample_size(10)
            .measurement_time(Duration::from_secs(2))
            .warm_up_time(Duration::from_millis(300));
        for (transport, tname) in [(TransportChoice::Shm, "shm"), (TransportChoice::Tcp, "tcp")] {
            for n in [2usize, 4] {
                for bytes in [8 * n, 64 << 10, 4 << 20, 64 << 20] {
                    let world = world(n, transport, coll, bytes);
                    g.throughput(Throughput::Bytes(bytes as u64));
                    g.bench_function(BenchmarkId::new(format!("{tname}/{n}ranks"), bytes), |b| {
                        b.iter_custom(|iters| world.run(iters))
                    });
                }
            }
        }
        g.finish();
    }
}

criterion_group!(benches, collectives);
criterion_main!(benches);
