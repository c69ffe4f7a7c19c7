//! Collective bandwidth with threaded ranks over shared memory and TCP: all-reduce, reduce-scatter,
//! all-gather and broadcast of f32 at a few sizes, 2 and 4 ranks.
//!
//! `cargo bench --bench collectives`. Each benchmark keeps one world of rank threads alive and
//! times `iters` back-to-back calls on rank 0 (`iter_custom`); throughput is the full buffer size
//! (as nccl-tests' algbw). Ranks are threads of one process here; `oxccl perf` measures processes.

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use oxccl::comm::bootstrap::{MemStore, Store};
use oxccl::comm::config::TransportChoice;
use oxccl::comm::{Collective, Communicator, Config, ReduceOp};

/// Rank threads that run `iters` calls of one collective on command.
struct World {
    cmds: Vec<Sender<u64>>,
    done: Receiver<Duration>,
    threads: Vec<JoinHandle<()>>,
}

impl World {
    fn new(n: usize, transport: TransportChoice, coll: Collective, bytes: usize) -> World {
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        let (done_tx, done) = channel();
        let mut cmds = Vec::new();
        let mut threads = Vec::new();
        for rank in 0..n {
            let (tx, rx) = channel::<u64>();
            cmds.push(tx);
            let store = store.clone();
            let done_tx = done_tx.clone();
            threads.push(std::thread::spawn(move || {
                let cfg = Config {
                    transport,
                    timeout: Duration::from_secs(120),
                    ..Config::default()
                };
                let c = Communicator::init_with_config(rank, n, store, cfg).expect("init");
                let count = bytes / 4;
                let mut buf = vec![1.0f32; count];
                let mut out = vec![0.0f32; count];
                for iters in rx {
                    let t0 = Instant::now();
                    for _ in 0..iters {
                        match coll {
                            Collective::AllReduce => c.all_reduce(&mut buf, ReduceOp::Sum),
                            Collective::ReduceScatter => {
                                c.reduce_scatter_in_place(&mut buf, ReduceOp::Sum)
                            }
                            Collective::AllGather => c.all_gather_in_place(&mut out),
                            _ => c.broadcast(&mut buf, 0),
                        }
                        .expect("collective");
                    }
                    if rank == 0 {
                        let _ = done_tx.send(t0.elapsed());
                    }
                }
            }));
        }
        World {
            cmds,
            done,
            threads,
        }
    }

    fn run(&self, iters: u64) -> Duration {
        for c in &self.cmds {
            c.send(iters).expect("rank thread alive");
        }
        self.done.recv().expect("rank 0 reports")
    }
}

impl Drop for World {
    fn drop(&mut self) {
        self.cmds.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
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
                    let world = World::new(n, transport, coll, bytes);
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
