//! The user API: what a trainer calls.

pub mod buffers;
pub(crate) mod collectives;
pub mod communicator;
#[cfg(feature = "cuda-core")]
pub mod device;
pub(crate) mod elastic;
pub mod harness;
pub(crate) mod objects;
pub mod p2p;
pub(crate) mod registered;
pub mod topology;
