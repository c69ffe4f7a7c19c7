//! RDMA verbs between nodes (in progress): the protocol and its connections, over a
//! verbs-facing trait.
//!
//! - [`verbs`]: [`verbs::QueuePair`], the few verbs a connection uses (RDMA write with
//!   immediate, completion polling, two registered regions), so that the protocol runs the same
//!   over a NIC and over the in-process provider;
//! - [`proto`]: the protocol as counters with no I/O (a ring of slots in the receiver's
//!   registered memory, credits written back, goodbyes);
//! - [`conn`]: the transport model's send and receive halves over any queue pair;
//! - [`sim`]: an in-process provider with RC semantics (ordered delivery, data visible before
//!   its immediate, completions, errors in both ends), for the tests.
//!
//! - [`address`]: what a verbs connection needs before it exists, as pure functions: the
//!   address published per queue pair (magic and version), `OXCCL_IB_HCA`'s device and port
//!   choice (NCCL's syntax), the GID choice (RoCE v2 IPv4 unless an index is named), the checks
//!   of a pair's addresses;
//! - [`transport`]: the selector's row: RDMA between nodes where a provider connects the pair
//!   (`OXCCL_TRANSPORT=rdma` insists on it, `auto` takes it before TCP).
//!
//! Not yet: the ibverbs provider (feature `rdma`; without it `auto` goes on to TCP, and
//! `OXCCL_IB_PROVIDER=sim` connects ranks that are threads of one process), a registration
//! cache for sending straight from user buffers, device buffers.

// The verbs provider (next) uses these; until then only their tests do.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) mod address;
pub(crate) mod conn;
pub(crate) mod proto;
pub(crate) mod sim;
pub(crate) mod transport;
pub(crate) mod verbs;

pub(crate) use transport::RdmaTransport;

#[cfg(test)]
mod tests;
