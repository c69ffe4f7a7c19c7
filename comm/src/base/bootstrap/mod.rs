//! Rendezvous: the `Store` trait and its backends, and launcher environment detection.
//!
//! * [`Store`]: a small key/value store with blocking `get`, atomic `add` and `compare_set`,
//!   used by ranks to exchange addresses and agree on things before any transport exists.
//! * Backends: [`MemStore`] (in-process, for threaded tests), [`TcpStore`] + [`TcpStoreServer`]
//!   (the usual case; rank 0 or the launcher hosts the server), [`FileStore`] (a directory on a
//!   shared filesystem), and [`PrefixStore`] to namespace keys inside any of them. The TCP wire
//!   protocol is described in [`protocol`].
//! * [`detect`] / [`detect_from_env`]: rank, world size, local rank/size, store address and job
//!   id from `oxccl launch`, torchrun, Slurm or Open MPI variables; [`expand_nodelist`] expands
//!   Slurm host lists.

mod env;
mod file_store;
mod nodelist;
pub mod protocol;
mod store;
mod tcp_server;
mod tcp_store;

pub use env::{detect, detect_from_env, LaunchInfo, Launcher, StoreAddr};
pub use file_store::FileStore;
pub use nodelist::{expand_nodelist, expand_tasks_per_node};
pub use protocol::MAX_FRAME;
pub(crate) use store::is_wait_timeout;
pub use store::{MemStore, PrefixStore, Store};
pub use tcp_server::TcpStoreServer;
pub use tcp_store::TcpStore;

use std::time::{Duration, Instant};

use crate::base::error::Error;

/// FNV-1a (64 bits) of the communicator id: compared between processes (the TCP hello, shared
/// memory names), so it must not depend on the Rust release or the build, as `DefaultHasher`
/// may.
pub(crate) fn hash_id(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// An error of store operation `what` on `key` while creating the communicator, for rank
/// `rank`. For a wait (`waiting_for` is `Some`, saying what for), running out of time (the
/// store's own time-out, or the init deadline passed) becomes `Timeout`; any other failure (store
/// unreachable, shut down) stays a store error, with its cause, the rank, `init` and the key.
pub(crate) fn init_store_error(
    rank: usize,
    e: Error,
    what: &str,
    key: &str,
    waiting_for: Option<&str>,
    timeout: Duration,
    deadline: Instant,
) -> Error {
    match (e, waiting_for) {
        (Error::Store(msg), Some(waiting_for))
            if is_wait_timeout(&msg) || Instant::now() >= deadline =>
        {
            Error::Timeout {
                rank,
                op: "init".into(),
                timeout,
                detail: format!("{waiting_for} ({msg})"),
            }
        }
        (Error::Store(msg), _) => Error::Store(format!(
            "rank {rank}: init: {what} on key '{key}' failed: {msg}"
        )),
        (other, _) => other,
    }
}
