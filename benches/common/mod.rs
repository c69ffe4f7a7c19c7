//! What the criterion benches share: a world of rank threads kept alive across measurements.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use oxccl::comm::bootstrap::{MemStore, Store};
use oxccl::comm::config::TransportChoice;
use oxccl::comm::{Communicator, Config};

/// A rank thread's side of [`World`]: runs the benchmarked operation on command.
pub struct Runner {
    rank: usize,
    cmds: Receiver<u64>,
    done: Sender<Duration>,
}

impl Runner {
    /// Until the world is dropped: on each command runs `op` that many times back to back;
    /// rank 0 reports how long they took.
    pub fn serve(self, mut op: impl FnMut()) {
        for iters in self.cmds {
            let t0 = Instant::now();
            for _ in 0..iters {
                op();
            }
            if self.rank == 0 {
                let _ = self.done.send(t0.elapsed());
            }
        }
    }
}

/// `n` rank threads, each with its own communicator over `transport`, running `body` (which sets
/// up its buffers and calls [`Runner::serve`]); [`World::run`] times `iters` calls on rank 0.
pub struct World {
    cmds: Vec<Sender<u64>>,
    done: Receiver<Duration>,
    threads: Vec<JoinHandle<()>>,
}

impl World {
    pub fn new<F>(n: usize, transport: TransportChoice, body: F) -> World
    where
        F: Fn(&Communicator, Runner) + Send + Sync + 'static,
    {
        World::with_config(
            n,
            move |_| Config {
                transport,
                ..Config::default()
            },
            body,
        )
    }

    /// [`World::new`] with rank `r`'s configuration `cfg_of(r)` (its time-out raised).
    pub fn with_config<F>(
        n: usize,
        cfg_of: impl Fn(usize) -> Config + Send + Sync + 'static,
        body: F,
    ) -> World
    where
        F: Fn(&Communicator, Runner) + Send + Sync + 'static,
    {
        let cfg_of = Arc::new(cfg_of);
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        let body = Arc::new(body);
        let (done_tx, done) = channel();
        let mut cmds = Vec::new();
        let mut threads = Vec::new();
        for rank in 0..n {
            let (tx, rx) = channel::<u64>();
            cmds.push(tx);
            let (store, body, cfg_of) = (store.clone(), body.clone(), cfg_of.clone());
            let runner = Runner {
                rank,
                cmds: rx,
                done: done_tx.clone(),
            };
            threads.push(std::thread::spawn(move || {
                let cfg = Config {
                    timeout: Duration::from_secs(120),
                    ..cfg_of(rank)
                };
                let c = Communicator::init_with_config(rank, n, store, cfg).expect("init");
                body(&c, runner);
            }));
        }
        World {
            cmds,
            done,
            threads,
        }
    }

    /// Time of `iters` back-to-back calls on rank 0.
    pub fn run(&self, iters: u64) -> Duration {
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
