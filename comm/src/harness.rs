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

use crate::bootstrap::{MemStore, Store};
use crate::communicator::Communicator;
use crate::config::Config;
use crate::error::Result;

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
    let store: Arc<dyn Store> = Arc::new(MemStore::new());
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let store = Arc::clone(&store);
                let cfg = cfg_of(rank);
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("rank{rank}"))
                    .spawn_scoped(s, move || {
                        Communicator::init_with_config(rank, n, store, cfg).and_then(f)
                    })
                    .expect("spawning a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(crate::Error::Aborted {
                        rank,
                        reason: "rank thread panicked".into(),
                    })
                })
            })
            .collect()
    })
}
