//! Collective bandwidth with threaded ranks over shared memory and TCP: all-reduce, reduce-scatter,
//! all-gather and broadcast of f32 at a few sizes, 2 and 4 ranks.
//!
//! `cargo bench --bench collectives`. Each benchmark keeps one world of rank threads alive and
//! times `iters` back-to-back calls on rank 0 (`iter_custom`); throughput is the full buffer size
//! (as nccl-tests' algbw). Ranks are threads of one process here; `oxccl perf` measures processes.
//!
//! `collectives/rdma-sim`: all-gather and broadcast between 2 ranks on 2 simulated nodes over
//! the in-process RDMA provider (`OXCCL_IB_PROVIDER=sim`), from plain buffers and from
//! [`Registered`] ones (sent straight from them, and received straight into them: the
//! rendezvous). The provider copies where a NIC would move bytes, so this measures the copies
//! the registered path saves on the ranks' cores, not a network.

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

mod common;

use std::time::Duration;

use common::World;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use oxccl::comm::config::{IbProvider, TransportChoice};
use oxccl::comm::{Collective, Config, ReduceOp, Registered};

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

/// 2 ranks on 2 simulated nodes over the in-process RDMA provider, running `coll` on `bytes`
/// of f32 from plain or [`Registered`] buffers.
fn rdma_sim_world(coll: Collective, bytes: usize, registered: bool) -> World {
    let cfg_of = |rank: usize| Config {
        transport: TransportChoice::Rdma,
        ib_provider: IbProvider::Sim,
        node_id: Some(format!("node{rank}")),
        ..Config::default()
    };
    World::with_config(2, cfg_of, move |c, runner| {
        let count = bytes / 4;
        let buffer = |n: usize| {
            let v = vec![1.0f32; n];
            if registered {
                Registered::new(v).expect("register").into()
            } else {
                Buffer::Plain(v)
            }
        };
        let (mut buf, mut out) = (buffer(count), buffer(count));
        runner.serve(|| {
            match coll {
                Collective::AllGather => c.all_gather(out.as_mut()),
                _ => c.broadcast(buf.as_mut(), 0),
            }
            .expect("collective");
        });
    })
}

/// A plain or a registered buffer.
enum Buffer {
    Plain(Vec<f32>),
    Registered(Registered<f32>),
}

impl From<Registered<f32>> for Buffer {
    fn from(r: Registered<f32>) -> Buffer {
        Buffer::Registered(r)
    }
}

impl Buffer {
    fn as_mut(&mut self) -> &mut [f32] {
        match self {
            Buffer::Plain(v) => v,
            Buffer::Registered(r) => r,
        }
    }
}

fn rdma_sim(c: &mut Criterion) {
    let mut g = c.benchmark_group("collectives/rdma-sim");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    for coll in [Collective::AllGather, Collective::Broadcast] {
        for bytes in [4 << 20, 64 << 20] {
            for (registered, name) in [(false, "plain"), (true, "registered")] {
                let world = rdma_sim_world(coll, bytes, registered);
                g.throughput(Throughput::Bytes(bytes as u64));
                g.bench_function(BenchmarkId::new(format!("{coll}/{name}"), bytes), |b| {
                    b.iter_custom(|iters| world.run(iters))
                });
            }
        }
    }
    g.finish();
}

criterion_group!(benches, collectives, rdma_sim);
criterion_main!(benches);
