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
