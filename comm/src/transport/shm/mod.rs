//! Shared-memory backend: ranks on one node exchange slots through `/dev/shm`.
//!
//! Each rank creates **one segment** per communicator, `/dev/shm/oxccl-<job>-<comm>-r<rank>`,
//! holding its doorbell and one receive ring per same-node peer. A ring is a single-producer,
//! single-consumer queue of `nslots` fixed slots:
//!
//! ```text
//! segment: [header 128 B][bell 128 B][ring 0][ring 1]...[direct area]
//! ring:    [head 128 B][tail 128 B][closed flags 128 B][meta: nslots x 32 B, padded][slot 0][slot 1]...
//! ```
//!
//! `head` (written by the sender only) counts posted slots, `tail` (written by the receiver only)
//! counts released ones; each sits alone in its own 128-byte block so the two sides never share
//! a cache line (nor its adjacent-line prefetch partner). The sender fills slot `head % nslots`
//! and its meta (length and [`Tag`](super::Tag)), then publishes with a release-store of
//! `head + 1`; the receiver acquire-loads `head`, reduces or copies straight out of the slot, then
//! release-stores `tail + 1`. No locks, no copies beyond the one into the slot.
//! `comm/tests/comm/loom_ring.rs` model-checks this protocol (same orderings) with loom.
//!
//! **Direct window.** When every rank of the communicator shares memory, each segment also ends
//! with a direct area: a step counter, the tag and buffer addresses published with each half, and
//! two staging halves of `OXCCL_SHM_DIRECT_BYTES`; [`ShmWindow`] maps every rank's and implements
//! [`Window`](super::Window) for the one-shot / two-shot / single-copy all-reduce. Ranks may size
//! their halves differently: the window's capacity is the smallest, the same on every rank.
//!
//! **Waiting.** Every rank has one doorbell: a sequence counter and a sleeper count. A post rings
//! the receiver's bell, a release rings the sender's; ringing bumps the counter and calls
//! `futex(FUTEX_WAKE)` only when someone sleeps. A waiting rank spins, yields, then sleeps in
//! `futex(FUTEX_WAIT)` on its own bell (see `crate::algorithm::prims`), so oversubscribed ranks sleep instead
//! of spinning. The waiter reads the counter *before* it checks its rings and sleeps only while
//! the counter still has that value (an eventcount): a post that lands after the check changes
//! the counter, so the wait returns at once; the sleeper count only saves wake-up syscalls.
//!
//! **Liveness.** A dead peer closes no socket, so each connection holds a `pidfd` of its peer
//! and checks it every few milliseconds while waiting: a killed rank is `PeerLost` at once.
//! `closed` flags tell a finished or failed peer from a dead one: the sender sets its bit when it
//! closes (the receiver then fails instead of waiting, once it has read every slot posted before),
//! the receiver sets its bit when it stops reading (the sender then fails instead of waiting for a
//! slot). A closed or dead peer is only an error after `head` is read again and still unmet.
//!
//! **Size.** A rank's rings share `OXCCL_SHM_RING_BYTES` (2 MiB): with `p` peers each ring's
//! slots are `min(OXCCL_SLOT_BYTES, budget / (p x nslots))` in whole pages, so a segment stays
//! about 4 MiB (rings and staging) however many ranks share the node. docs/ENV.md gives the formula.
//!
//! **Hygiene.** Segments are unlinked as soon as every peer has mapped them (the mappings stay
//! valid), so a rank killed after start-up leaves nothing in `/dev/shm`; `oxccl launch` also
//! removes `/dev/shm/oxccl-<job>-*` when a job ends. Space is reserved with `posix_fallocate`, so a
//! `/dev/shm` that is too small is a clear error naming the bytes needed, not a `SIGBUS` later.

mod connect;
mod liveness;
mod mapped;
mod ring;
mod segment;
mod window;

#[cfg(test)]
pub(crate) use connect::can_connect;
pub(crate) use connect::ShmTransport;
pub(crate) use mapped::Probe;
pub use ring::{ShmRecv, ShmSend};
pub(crate) use segment::UnlinkGuard;
pub use segment::{job_prefix, Segment, SHM_DIR};
pub(crate) use window::probe_single_copy;
pub use window::ShmWindow;
#[cfg(test)]
mod tests;
