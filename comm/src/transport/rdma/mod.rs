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
//! Not yet: the ibverbs provider (feature `rdma`), the registration cache, addresses through
//! the store and the selector's row; until then nothing selects this backend.

// The selector's row and the ibverbs provider come next; until then only the tests use these.
#![cfg_attr(not(test), allow(dead_code))]

pub(crate) mod conn;
pub(crate) mod proto;
pub(crate) mod sim;
pub(crate) mod verbs;

#[cfg(test)]
mod tests;
