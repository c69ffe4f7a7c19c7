//! A threaded test harness: every rank a thread of this process, over real transports.
//!
//! ```
//! use oxccl_comm::{harness::spawn_world, Config};
//! use oxccl_kernels::ReduceOp;
//! let results = spawn_world(3, Config::default(), |comm| {
//!     let mut v = vec![comm.rank() as f32; 4];
//!     comm.all_reduce(&mut v, ReduceOp::Sum)?;
//!     Ok(v)
//! });
//! for r in results {
//!     assert_eq!(r.unwrap(), vec![3.0; 4]);
//! }
//! ```

use std::sync::Arc;

use crate::api::communicator::Communicator;
use crate::base::bootstrap::{MemStore, Store};
use crate::base::config::Config;
use crate::base::error::Result;

/// Runs `f` on `n` ranks (threads) sharing an in-memory store, each with its own communicator
/// connected over the transports `cfg` selects; returns every rank's result in rank order.
pub fn spawn_world<R: Send>(
    n: usize,
    cfg: Config,
    f: impl Fn(Communicator) -> Result<R> + Sync,
) -> Vec<Result<R>> {
    spawn_world_with(n, |_| cfg.clone(), f)
}

/// [`spawn_world`] with the ranks on simulated nodes of `per_node` consecutive ranks (node id
/// `node<k>` for rank `r` with `k = r / per_node`): shared memory inside a node, TCP between
/// nodes, as on a cluster (`per_node` 0 counts as 1).
pub fn spawn_world_on_nodes<R: Send>(
    n: usize,
    per_node: usize,
    cfg: Config,
    f: impl Fn(Communicator) -> Result<R> + Sync,
) -> Vec<Result<R>> {
    spawn_world_with(
        n,
        |rank| {
            let mut c = cfg.clone();
            c.node_id = Some(format!("node{}", rank / per_node.max(1)));
            c
        },
        f,
    )
}

/// [`spawn_world`] with a configuration per rank.
pub fn spawn_world_with<R: Send>(
    n: usize,
    cfg_of: impl Fn(usize) -> Config + Sync,
    f: impl Fn(Communicator) -> Result<R> + Sync,
) -> Vec<Result<R>> {
    spawn_world_and_joiners(n, 0, cfg_of, f, |_, _, _| {
        Err(crate::Error::Config("no joiners in this world".into()))
    })
}

/// [`spawn_world_with`] plus `joiners` threads that each call `on_joiner(j, store, cfg)` with
/// the world's store and the configuration of rank `n + j` (`cfg_of(n + j)`), e.g. to
/// [`Communicator::join`](crate::Communicator::join) a communicator the ranks grow. Returns the
/// ranks' results in rank order, then the joiners' in order.
pub fn spawn_world_and_joiners<R: Send>(
    n: usize,
    joiners: usize,
    cfg_of: impl Fn(usize) -> Config + Sync,
    f: impl Fn(Communicator) -> Result<R> + Sync,
    on_joiner: impl Fn(usize, Arc<dyn Store>, Config) -> Result<R> + Sync,
) -> Vec<Result<R>> {
    let store: Arc<dyn Store> = Arc::new(MemStore::new());
    std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(n + joiners);
        for i in 0..n + joiners {
            let store = Arc::clone(&store);
            let cfg = cfg_of(i);
            let (f, on_joiner) = (&f, &on_joiner);
            let (name, body): (String, Box<dyn FnOnce() -> Result<R> + Send + '_>) = if i < n {
                (
                    format!("rank{i}"),
                    Box::new(move || Communicator::init_with_config(i, n, store, cfg).and_then(f)),
                )
            } else {
                (
                    format!("joiner{}", i - n),
                    Box::new(move || on_joiner(i - n, store, cfg)),
                )
            };
            let h = std::thread::Builder::new()
                .name(name)
                .spawn_scoped(s, body)
                .expect("spawning a rank thread");
            handles.push(h);
        }
        handles
            .into_iter()
            .enumerate()
            .map(|(i, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(crate::Error::Aborted {
                        rank: i,
                        reason: "rank or joiner thread panicked".into(),
                    })
                })
            })
            .collect()
    })
}
