//! RDMA verbs between nodes (in progress): the protocol and its connections, over a
//! verbs-facing trait.
//!
//! - [`verbs`]: [`verbs::QueuePair`], the few verbs a connection uses (RDMA write with
//!   immediate, completion polling, two registered regions), so that the protocol runs the same
//!   over a NIC and over the in-process provider;
//! - [`proto`]: the protocol as counters with no I/O (a ring of slots in the receiver's
//!   registered memory, credits written back, goodbyes, offers of registered receive buffers);
//! - [`conn`]: the transport model's send and receive halves over any queue pair;
//! - [`sim`]: an in-process provider with RC semantics (ordered delivery, data visible before
//!   its immediate, completions, errors in both ends), for the tests.
//!
//! - [`address`]: what a verbs connection needs before it exists, as pure functions: the
//!   address published per queue pair (magic and version), `OXCCL_IB_HCA`'s device and port
//!   choice (NCCL's syntax), the GID choice (RoCE v2 IPv4 unless an index is named), the checks
//!   of a pair's addresses;
//! - `ibv` (feature `rdma`): the verbs provider, on the host's verbs devices;
//! - [`transport`]: the selector's row: RDMA between nodes where a provider connects the pair
//!   (`OXCCL_TRANSPORT=rdma` insists on it, `auto` takes it before TCP).
//!
//! Without the feature `rdma` the verbs provider is compiled out (`auto` goes on to TCP);
//! `OXCCL_IB_PROVIDER=sim` connects ranks that are threads of one process either way. Large
//! messages from [`crate::Registered`] buffers are written straight from them
//! ([`crate::transport::registry`], `conn`'s `send_direct`), and into them where the receiver
//! offers one (the rendezvous of [`proto`]). Not yet: device buffers (staged
//! through host memory by the device collectives, as over TCP). The verbs provider has not run
//! on a verbs device.

// The verbs provider uses these; without it only their tests do.
#[cfg_attr(not(any(test, feature = "rdma")), allow(dead_code))]
pub(crate) mod address;
pub(crate) mod conn;
#[cfg(feature = "rdma")]
pub(crate) mod ibv;
pub(crate) mod proto;
pub(crate) mod sim;
pub(crate) mod transport;
pub(crate) mod verbs;

pub(crate) use transport::RdmaTransport;

#[cfg(test)]
mod tests;

/// This host's verbs port under `cfg`'s `OXCCL_IB_HCA` and `OXCCL_IB_GID_INDEX`, described
/// (`mlx5_0:1, InfiniBand, LID 3, GID index 0, MTU 4096`), or why there is none (no device, no
/// active port, a build without the feature `rdma`).
///
/// # Errors
/// As above.
pub fn verbs_port(cfg: &crate::Config) -> std::result::Result<String, String> {
    #[cfg(feature = "rdma")]
    {
        ibv::open(cfg.ib.hca.as_deref(), cfg.ib.gid_index).map(|n| {
            format!(
                "{}, {:?}, LID {}, GID index {}, MTU {}",
                n.port_name(),
                n.link,
                n.lid,
                n.gid_index,
                n.mtu
            )
        })
    }
    #[cfg(not(feature = "rdma"))]
    {
        let _ = cfg;
        Err("built without the feature `rdma`".into())
    }
}
