//! One typed configuration, read from the environment once per communicator.
//!
//! Every variable is documented in `docs/ENV.md`; this module is the only place that reads them.

mod ib;

pub use super::settings::Settings;
pub use ib::{IbConfig, IbProvider};
use std::time::Duration;

use crate::base::error::{Error, Result};
use crate::base::tuning::AlgoOverride;

/// Address family for TCP sockets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketFamily {
    /// IPv4 (`AF_INET`).
    V4,
    /// IPv6 (`AF_INET6`).
    V6,
}

/// Which transport carries peers on the same node (`OXCCL_TRANSPORT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportChoice {
    /// Shared memory between ranks of one node, TCP across nodes (default).
    Auto,
    /// TCP for every peer.
    Tcp,
    /// Shared memory for every peer (an error if a peer is on another node).
    Shm,
    /// Shared memory inside a node, RDMA verbs between nodes (an error where RDMA cannot
    /// connect a pair: no verbs device, or no provider built in).
    Rdma,
}

/// Communicator configuration. `Config::from_env()` reads the `OXCCL_*` variables; tests build one
/// by hand (`Config::default()` plus field updates).
#[derive(Debug, Clone)]
pub struct Config {
    /// Deadline of every wait (`OXCCL_TIMEOUT`, seconds; default 600).
    pub timeout: Duration,
    /// Algorithm override (`OXCCL_ALGO`).
    pub algo: AlgoOverride,
    /// TCP sockets per direction per peer pair (`OXCCL_NSOCKS`, default 2, 1..=16).
    pub nsocks: usize,
    /// Interface selection in NCCL_SOCKET_IFNAME syntax (`OXCCL_SOCKET_IFNAME`).
    pub socket_ifname: Option<String>,
    /// Address family restriction (`OXCCL_SOCKET_FAMILY` = `AF_INET`/`4` or `AF_INET6`/`6`).
    pub socket_family: Option<SocketFamily>,
    /// Kernel socket buffer size in bytes, 0 = kernel default (`OXCCL_SOCKET_BUFFER`, default 4 MiB).
    pub socket_buffer: usize,
    /// Whether receiving TCP sockets delay their acknowledgements (`OXCCL_SOCKET_DELAYED_ACK`,
    /// default 1): each data socket carries one direction only, so an acknowledgement can never
    /// ride on data, and Linux's default of acknowledging small messages at once costs a whole
    /// extra packet per message. On, the receive sockets are kept in delayed-ACK ("ping-pong")
    /// mode with `TCP_QUICKACK` = 0, set again after every quiet spell since the kernel leaves
    /// that mode when a delayed acknowledgement times out.
    pub socket_delayed_ack: bool,
    /// Bytes per transport slot (`OXCCL_SLOT_BYTES`, default 512 KiB, multiple of 64).
    pub slot_bytes: usize,
    /// Slots per connection direction (`OXCCL_NSLOTS`, default 4, like NCCL_STEPS).
    pub nslots: usize,
    /// Bytes that all of a rank's shared-memory receive rings may take together
    /// (`OXCCL_SHM_RING_BYTES`, default 2 MiB; 0 = no limit): a rank with many peers on its node
    /// gets smaller slots, `min(slot_bytes, shm_ring_bytes / (peers x nslots))` in whole 4 KiB
    /// pages, at least one page, so 8 ranks need 32 MiB of `/dev/shm`, not 128.
    pub shm_ring_bytes: usize,
    /// Node id override (`OXCCL_NODE_ID`); default: the hostname.
    pub node_id: Option<String>,
    /// Transport policy (`OXCCL_TRANSPORT` = `auto`, `tcp`, `shm` or `rdma`).
    pub transport: TransportChoice,
    /// Where RDMA queue pairs come from (`OXCCL_IB_PROVIDER` = `verbs`, the default, or `sim`).
    pub ib_provider: IbProvider,
    /// The verbs port and the queue pairs' settings (`OXCCL_IB_HCA`, `OXCCL_IB_GID_INDEX`,
    /// `OXCCL_IB_TIMEOUT`, `OXCCL_IB_RETRY_CNT`, `OXCCL_IB_TC`, `OXCCL_IB_SL`).
    pub ib: IbConfig,
    /// Bytes of each of the two staging halves every rank keeps in shared memory for the direct
    /// (one-shot / two-shot) algorithms (`OXCCL_SHM_DIRECT_BYTES`, default 1 MiB; 0 turns the
    /// staging algorithms off).
    pub direct_bytes: usize,
    /// Whether ranks that share memory may read each other's buffers with `process_vm_readv`
    /// (`OXCCL_SHM_SINGLE_COPY`, default on; used only when every rank can, checked at start-up).
    pub single_copy: bool,
    /// Whether ranks that share memory map each other's [`crate::Registered`] buffers and
    /// write straight into them (the `mapped` all-gather) (`OXCCL_SHM_MAPPED`, default on; used
    /// only when every rank can map every other's, checked at start-up).
    pub shm_mapped: bool,
    /// Whether a waiting rank busy-polls before it yields the core (`OXCCL_SPIN`: `auto`, the
    /// default, spins unless this node runs more ranks than the CPUs its ranks may use together,
    /// from their affinity masks, counting the node's ranks and CPUs as [`Config::node_ranks`]
    /// says; `1` always; `0` never).
    pub spin: Option<bool>,
    /// Whether large sends to TCP peers go out on a thread of their own, so the kernel's copies
    /// into the sockets run on another core beside the receives and reductions
    /// (`OXCCL_SOCKET_SEND_THREAD`: `0`, the default, never; `1` always; `auto` when this node's
    /// ranks have at least two CPUs each, from their affinity masks).
    pub socket_send_thread: Option<bool>,
    /// Independent sets of connections ("channels", as NCCL calls them) a communicator with TCP
    /// peers keeps, each driven by a thread of its own: a large all-reduce, broadcast or reduce
    /// is cut into this many contiguous parts, one per channel, run at once, so several cores
    /// copy through the kernel's sockets in parallel (`OXCCL_SOCKET_CHANNELS`: `auto` (`None`),
    /// the default, gives each rank a channel per [`crate::base::affinity::CPUS_PER_CHANNEL`] CPUs it
    /// has on the communicator's most crowded node, 1 to [`crate::base::affinity::AUTO_CHANNELS_MAX`],
    /// with at most [`crate::base::affinity::AUTO_CHANNEL_PEERS`] TCP peers times channels per rank
    /// ([`crate::base::affinity::auto_channels`]); `1..=16` that many). Parts are at least
    /// 1 MiB, so smaller operations use fewer channels.
    /// Every rank must use the same setting.
    pub socket_channels: Option<usize>,
    /// Ranks on this process's node that share its CPUs, counted by the communicator this
    /// configuration's communicator is made from: the `auto` rules of `OXCCL_SOCKET_CHANNELS`,
    /// `OXCCL_SPIN` and `OXCCL_SOCKET_SEND_THREAD` share the node's CPUs among at least this
    /// many, also in a communicator that holds fewer of them (a group with one rank per node).
    /// Communicators made from another (split, `Topology` groups, shrink, grow) get their
    /// parent's count; set it by hand for communicators made apart from the others of the node.
    /// `None`: only the communicator's own ranks count.
    pub node_ranks: Option<usize>,
    /// CPUs on this process's node, counted like [`Config::node_ranks`]: what the parent
    /// communicator counted there (the union of its ranks' allowed CPUs, or more where its own
    /// parent counted more; ranks bound a core each in a group hold only their own cores but
    /// share the node with the others). `None`: the communicator's own ranks' CPUs.
    pub node_cpus: Option<usize>,
    /// Block of the hierarchical all-reduce per local rank, in bytes (`OXCCL_HIERARCHICAL_BLOCK`,
    /// default 512 KiB, a multiple of 64 from 4 KiB to 1 GiB): each rank's piece of a block
    /// should stay in its core's cache from the node ring to the cross ring and back. Every rank
    /// must use the same value.
    pub hierarchical_block: usize,
    /// Largest part of an element-wise device operation staged through host memory (feature
    /// `cuda`): all-reduce, broadcast and reduce run as host collectives of at most this many
    /// bytes each, so copies to and from the GPU overlap with the network
    /// (`OXCCL_CUDA_STAGE_CHUNK`, default 4 MiB; 0 = one part).
    pub cuda_stage_chunk: usize,
    /// Whether a staged device operation returns as soon as it is enqueued, with the stream
    /// waiting (in a kernel, with a deadline) on a flag in pinned memory that the progress thread
    /// sets (`OXCCL_CUDA_STREAM_WAIT`: `auto`, the default, does so unless two ranks of the
    /// communicator are threads of one process, whose streams share a context, or the calling
    /// thread may run on one CPU only, which its progress thread would then share; `1` always;
    /// `0` makes every device call wait for its host collectives before it returns).
    pub cuda_stream_wait: Option<bool>,
    /// Whether device collectives of a communicator whose ranks all share one node run over CUDA
    /// IPC (feature `cuda`; `OXCCL_CUDA_IPC`: `auto`, the default, uses it when every rank can
    /// map every other's device memory and stages through host memory otherwise; `1` requires
    /// it, so a device collective fails with the reason instead; `0` never).
    pub cuda_ipc: Option<bool>,
    /// Bytes of each of the two device slots every rank maps for CUDA IPC collectives; larger
    /// operations run in chunks of a slot (`OXCCL_CUDA_IPC_SLOT`, default 32 MiB, a multiple of
    /// 256 from 4 KiB to 1 GiB; docs/PERF.md has the sweep on an H200 that chose it).
    pub cuda_ipc_slot: usize,
    /// Largest reduction (all-reduce, reduce) that runs one-shot over CUDA IPC: every rank
    /// reduces the whole buffer from every rank's slot; larger ones run two-shot (each rank
    /// reduces its shard, then everyone gathers) (`OXCCL_CUDA_IPC_ONE_SHOT`, default 4 MiB).
    pub cuda_ipc_one_shot: usize,
    /// How ranks meet at the barriers of CUDA IPC collectives (`OXCCL_CUDA_IPC_BARRIER`: `auto`,
    /// the default, on the host when every rank is a thread of one process and on the device
    /// otherwise; `host` (`Some(true)`) the same; `device` (`Some(false)`) always the barrier
    /// kernel). On the host, each rank's thread waits until every rank has enqueued up to the
    /// barrier and its stream then waits for their CUDA events: no kernel spins on the GPU.
    pub cuda_ipc_host_barrier: Option<bool>,
    /// Operations the flight recorder keeps per communicator, the oldest dropped first
    /// (`OXCCL_TRACE_BUFFER`, default 2000, at most 2^20; 0 turns recording off). See
    /// [`crate::base::trace`].
    pub trace_buffer: usize,
    /// Directory every communicator writes its flight record to when it fails and when it is
    /// dropped (`OXCCL_TRACE_DIR`; default none: records stay in memory, see
    /// [`crate::Communicator::trace`]).
    pub trace_dir: Option<std::path::PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            timeout: Duration::from_secs(600),
            algo: AlgoOverride::default(),
            nsocks: 2,
            socket_ifname: None,
            socket_family: None,
            socket_buffer: 4 << 20,
            socket_delayed_ack: true,
            slot_bytes: 512 << 10,
            nslots: 4,
            shm_ring_bytes: 2 << 20,
            node_id: None,
            transport: TransportChoice::Auto,
            ib_provider: IbProvider::Verbs,
            ib: IbConfig::default(),
            direct_bytes: 1 << 20,
            single_copy: true,
            shm_mapped: true,
            spin: None,
            socket_send_thread: Some(false),
            socket_channels: None,
            node_ranks: None,
            node_cpus: None,
            hierarchical_block: crate::base::tuning::HIERARCHICAL_AR_BLOCK,
            cuda_stage_chunk: 4 << 20,
            cuda_stream_wait: None,
            cuda_ipc: None,
            cuda_ipc_slot: 32 << 20,
            cuda_ipc_one_shot: 4 << 20,
            cuda_ipc_host_barrier: None,
            trace_buffer: 2000,
            trace_dir: None,
        }
    }
}

impl TransportChoice {
    /// The `OXCCL_TRANSPORT` name of this choice (`auto`, `tcp`, `shm` or `rdma`).
    pub fn name(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Shm => "shm",
            TransportChoice::Rdma => "rdma",
        }
    }
}

impl Config {
    /// The settings every rank of a communicator must share, as `(variable, canonical value)`:
    /// ranks that differ would wait on different things. Compared between ranks at init.
    pub(crate) fn shared_settings(&self) -> Vec<(String, String)> {
        vec![
            ("OXCCL_TRANSPORT".into(), self.transport.name().into()),
            ("OXCCL_IB_PROVIDER".into(), self.ib_provider.name().into()),
            ("OXCCL_ALGO".into(), self.algo.canonical()),
            (
                "OXCCL_CUDA_STAGE_CHUNK".into(),
                self.cuda_stage_chunk.to_string(),
            ),
            (
                "OXCCL_HIERARCHICAL_BLOCK".into(),
                self.hierarchical_block.to_string(),
            ),
            (
                "OXCCL_SOCKET_CHANNELS".into(),
                self.socket_channels
                    .map_or_else(|| "auto".to_owned(), |k| k.to_string()),
            ),
        ]
    }
}

/// `OXCCL_CUDA_IPC_BARRIER`'s name for a [`Config::cuda_ipc_host_barrier`] setting.
pub(crate) fn ipc_barrier_name(host_barrier: Option<bool>) -> &'static str {
    match host_barrier {
        None => "auto",
        Some(true) => "host",
        Some(false) => "device",
    }
}

/// The setting an `OXCCL_CUDA_IPC_BARRIER` name stands for (`None`: not a name).
pub(crate) fn ipc_barrier_from_name(name: &str) -> Option<Option<bool>> {
    [None, Some(true), Some(false)]
        .into_iter()
        .find(|&b| ipc_barrier_name(b) == name)
}

/// Shortest timeout a communicator accepts (`OXCCL_TIMEOUT` or [`Config::timeout`]): 1 ms.
pub const MIN_TIMEOUT: Duration = Duration::from_millis(1);
/// Longest timeout a communicator accepts (`OXCCL_TIMEOUT` or [`Config::timeout`]): one year
/// (31,536,000 s). Deadlines are `now + timeout` (times a queue length in places), which must
/// not overflow.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(31_536_000);
/// Largest `OXCCL_SOCKET_BUFFER` (1 GiB): the kernel takes the size as a C `int`.
pub const MAX_SOCKET_BUFFER: usize = 1 << 30;

/// Checks that `t` is within [`MIN_TIMEOUT`]`..=`[`MAX_TIMEOUT`]; the error says the range.
pub(crate) fn check_timeout(t: Duration) -> std::result::Result<(), String> {
    if (MIN_TIMEOUT..=MAX_TIMEOUT).contains(&t) {
        Ok(())
    } else {
        Err(format!(
            "timeout {t:?} is outside 0.001..=31536000 seconds (1 ms to one year)"
        ))
    }
}

/// `OXCCL_NSOCKS` / [`Config::nsocks`].
const NSOCKS: std::ops::RangeInclusive<usize> = 1..=16;
/// `OXCCL_SOCKET_CHANNELS` / [`Config::socket_channels`].
const CHANNELS: std::ops::RangeInclusive<usize> = 1..=16;
/// What `OXCCL_SHM_RING_BYTES` accepts, in words.
const RING_BYTES_WANT: &str = "0 (no limit) or a multiple of 4096 between 64 KiB and 64 GiB";
/// `OXCCL_NSLOTS` / [`Config::nslots`].
const NSLOTS: std::ops::RangeInclusive<usize> = 1..=64;

/// `OXCCL_SLOT_BYTES` / [`Config::slot_bytes`]: a multiple of 64 from 64 B to 64 MiB.
fn slot_bytes_ok(b: usize) -> bool {
    (64..=64 << 20).contains(&b) && b.is_multiple_of(64)
}

/// `OXCCL_SHM_RING_BYTES` / [`Config::shm_ring_bytes`]: 0, or a multiple of 4 KiB from 64 KiB
/// to 64 GiB.
fn ring_bytes_ok(b: usize) -> bool {
    b == 0 || ((64 << 10..=64 << 30).contains(&b) && b.is_multiple_of(4096))
}

/// `OXCCL_SHM_DIRECT_BYTES` / [`Config::direct_bytes`]: 0, or a multiple of 64 from 4 KiB to 1 GiB.
fn direct_bytes_ok(b: usize) -> bool {
    b == 0 || ((4096..=1 << 30).contains(&b) && b.is_multiple_of(64))
}

/// `OXCCL_HIERARCHICAL_BLOCK` / [`Config::hierarchical_block`]: a multiple of 64 from 4 KiB to
/// 1 GiB.
fn hierarchical_block_ok(b: usize) -> bool {
    (4096..=1 << 30).contains(&b) && b.is_multiple_of(64)
}

/// `OXCCL_CUDA_IPC_SLOT` / [`Config::cuda_ipc_slot`]: a multiple of 256 from 4 KiB to 1 GiB.
fn ipc_slot_ok(b: usize) -> bool {
    (4096..=1 << 30).contains(&b) && b.is_multiple_of(256)
}

impl Config {
    /// Checks every numeric field against the range its variable accepts (a `Config` built by
    /// hand skips [`Config::from_env`]'s checks); the error names the first field out of range,
    /// its variable and the range. Communicator creation calls this.
    pub fn check(&self) -> std::result::Result<(), String> {
        check_timeout(self.timeout).map_err(|why| format!("Config::timeout: {why}"))?;
        let bad = |field: &str, var: &str, v: usize, want: &str| {
            Err(format!(
                "Config::{field} = {v} is out of range ({var}): it must be {want}"
            ))
        };
        if !NSOCKS.contains(&self.nsocks) {
            return bad("nsocks", "OXCCL_NSOCKS", self.nsocks, "in 1..=16");
        }
        if let Some(v) = self.socket_channels.filter(|k| !CHANNELS.contains(k)) {
            let want = "in 1..=16 (None = auto)";
            return bad("socket_channels", "OXCCL_SOCKET_CHANNELS", v, want);
        }
        if self.socket_buffer > MAX_SOCKET_BUFFER {
            let want = "at most 1 GiB (0 = kernel default)";
            return bad(
                "socket_buffer",
                "OXCCL_SOCKET_BUFFER",
                self.socket_buffer,
                want,
            );
        }
        if !slot_bytes_ok(self.slot_bytes) {
            let want = "a multiple of 64 between 64 and 64 MiB";
            return bad("slot_bytes", "OXCCL_SLOT_BYTES", self.slot_bytes, want);
        }
        if !NSLOTS.contains(&self.nslots) {
            return bad("nslots", "OXCCL_NSLOTS", self.nslots, "in 1..=64");
        }
        if !ring_bytes_ok(self.shm_ring_bytes) {
            let (v, want) = (self.shm_ring_bytes, RING_BYTES_WANT);
            return bad("shm_ring_bytes", "OXCCL_SHM_RING_BYTES", v, want);
        }
        if !direct_bytes_ok(self.direct_bytes) {
            let want = "0 or a multiple of 64 between 4 KiB and 1 GiB";
            return bad(
                "direct_bytes",
                "OXCCL_SHM_DIRECT_BYTES",
                self.direct_bytes,
                want,
            );
        }
        if self.trace_buffer > crate::base::trace::MAX_BUFFER {
            let want = "at most 2^20 (0 = off)";
            return bad(
                "trace_buffer",
                "OXCCL_TRACE_BUFFER",
                self.trace_buffer,
                want,
            );
        }
        if !hierarchical_block_ok(self.hierarchical_block) {
            let want = "a multiple of 64 between 4 KiB and 1 GiB";
            return bad(
                "hierarchical_block",
                "OXCCL_HIERARCHICAL_BLOCK",
                self.hierarchical_block,
                want,
            );
        }
        if !ipc_slot_ok(self.cuda_ipc_slot) {
            let want = "a multiple of 256 between 4 KiB and 1 GiB";
            return bad(
                "cuda_ipc_slot",
                "OXCCL_CUDA_IPC_SLOT",
                self.cuda_ipc_slot,
                want,
            );
        }
        Ok(())
    }
}

/// Parses `OXCCL_TIMEOUT` (seconds, fractions allowed) within [`MIN_TIMEOUT`]..=[`MAX_TIMEOUT`].
fn parse_timeout(v: &str) -> Result<Duration> {
    let secs: f64 = parse_num("OXCCL_TIMEOUT", v)?;
    let out_of_range = || {
        Error::Config(format!(
            "OXCCL_TIMEOUT={v:?} must be between 0.001 and 31536000 seconds (1 ms to one year)"
        ))
    };
    if !(secs >= MIN_TIMEOUT.as_secs_f64() && secs <= MAX_TIMEOUT.as_secs_f64()) {
        return Err(out_of_range());
    }
    // Within the range, so the conversion cannot fail; rounding may not leave it either.
    let t = Duration::try_from_secs_f64(secs).map_err(|_| out_of_range())?;
    Ok(t.clamp(MIN_TIMEOUT, MAX_TIMEOUT))
}

/// Parses a boolean variable (`1/on/yes/true`, `0/off/no/false`).
pub(crate) fn parse_bool(name: &str, v: &str) -> Result<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "on" | "yes" | "true" => Ok(true),
        "0" | "off" | "no" | "false" => Ok(false),
        _ => Err(Error::Config(format!("{name}={v:?}: expected 0 or 1"))),
    }
}

/// `auto` (or empty) as `None`, else a boolean: `1`/`on`/`yes`/`true` or `0`/`off`/`no`/`false`.
fn parse_auto_bool(name: &str, v: &str) -> Result<Option<bool>> {
    match v.trim().to_ascii_lowercase().as_str() {
        "" | "auto" => Ok(None),
        _ => parse_bool(name, v)
            .map(Some)
            .map_err(|_| Error::Config(format!("{name}={v:?}: expected auto, 0 or 1"))),
    }
}

fn parse_num<T: std::str::FromStr>(name: &str, v: &str) -> Result<T> {
    v.trim()
        .parse()
        .map_err(|_| Error::Config(format!("{name}={v:?} is not a valid number")))
}

impl Config {
    /// Reads every `OXCCL_*` variable this crate knows; unset ones keep their defaults.
    ///
    /// # Errors
    /// `Error::Config` naming the variable when a value does not parse or is out of range.
    pub fn from_env() -> Result<Config> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// Like [`Config::from_env`] over any variable lookup (used by tests).
    ///
    /// # Errors
    /// `Error::Config` naming the variable when a value does not parse or is out of range.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Config> {
        let mut c = Config::default();
        if let Some(v) = get("OXCCL_TIMEOUT") {
            c.timeout = parse_timeout(&v)?;
        }
        if let Some(v) = get("OXCCL_ALGO") {
            c.algo = AlgoOverride::parse(&v)?;
        }
        if let Some(v) = get("OXCCL_NSOCKS") {
            c.nsocks = parse_num("OXCCL_NSOCKS", &v)?;
            if !NSOCKS.contains(&c.nsocks) {
                return Err(Error::Config(format!("OXCCL_NSOCKS={v} must be in 1..=16")));
            }
        }
        c.socket_ifname = get("OXCCL_SOCKET_IFNAME").filter(|s| !s.trim().is_empty());
        if let Some(v) = get("OXCCL_SOCKET_FAMILY") {
            c.socket_family = match v.trim().to_ascii_uppercase().as_str() {
                "AF_INET" | "4" | "IPV4" => Some(SocketFamily::V4),
                "AF_INET6" | "6" | "IPV6" => Some(SocketFamily::V6),
                "" => None,
                _ => {
                    return Err(Error::Config(format!(
                        "OXCCL_SOCKET_FAMILY={v:?}: expected AF_INET or AF_INET6"
                    )))
                }
            };
        }
        if let Some(v) = get("OXCCL_SOCKET_BUFFER") {
            c.socket_buffer = parse_num("OXCCL_SOCKET_BUFFER", &v)?;
            if c.socket_buffer > MAX_SOCKET_BUFFER {
                return Err(Error::Config(format!(
                    "OXCCL_SOCKET_BUFFER={v} must be at most {MAX_SOCKET_BUFFER} bytes (1 GiB; \
                     0 = kernel default)"
                )));
            }
        }
        if let Some(v) = get("OXCCL_SOCKET_DELAYED_ACK") {
            c.socket_delayed_ack = parse_bool("OXCCL_SOCKET_DELAYED_ACK", &v)?;
        }
        if let Some(v) = get("OXCCL_SLOT_BYTES") {
            c.slot_bytes = parse_num("OXCCL_SLOT_BYTES", &v)?;
            if !slot_bytes_ok(c.slot_bytes) {
                return Err(Error::Config(format!(
                    "OXCCL_SLOT_BYTES={v} must be a multiple of 64 between 64 and 64 MiB"
                )));
            }
        }
        if let Some(v) = get("OXCCL_NSLOTS") {
            c.nslots = parse_num("OXCCL_NSLOTS", &v)?;
            if !NSLOTS.contains(&c.nslots) {
                return Err(Error::Config(format!("OXCCL_NSLOTS={v} must be in 1..=64")));
            }
        }
        if let Some(v) = get("OXCCL_SHM_RING_BYTES") {
            c.shm_ring_bytes = parse_num("OXCCL_SHM_RING_BYTES", &v)?;
            if !ring_bytes_ok(c.shm_ring_bytes) {
                let want = RING_BYTES_WANT;
                return Err(Error::Config(format!(
                    "OXCCL_SHM_RING_BYTES={v} must be {want}"
                )));
            }
        }
        c.node_id = get("OXCCL_NODE_ID").filter(|s| !s.is_empty());
        if let Some(v) = get("OXCCL_TRANSPORT") {
            c.transport = match v.trim().to_ascii_lowercase().as_str() {
                "" | "auto" => TransportChoice::Auto,
                "tcp" | "socket" => TransportChoice::Tcp,
                "shm" => TransportChoice::Shm,
                "rdma" | "ib" => TransportChoice::Rdma,
                _ => {
                    return Err(Error::Config(format!(
                        "OXCCL_TRANSPORT={v:?}: expected auto, tcp, shm or rdma"
                    )))
                }
            };
        }
        if let Some(v) = get("OXCCL_IB_PROVIDER") {
            c.ib_provider = ib::provider(&v)?;
        }
        c.ib = IbConfig::read(get)?;
        if let Some(v) = get("OXCCL_SHM_DIRECT_BYTES") {
            c.direct_bytes = parse_num("OXCCL_SHM_DIRECT_BYTES", &v)?;
            if !direct_bytes_ok(c.direct_bytes) {
                return Err(Error::Config(format!(
                    "OXCCL_SHM_DIRECT_BYTES={v} must be 0 or a multiple of 64 between 4 KiB and 1 GiB"
                )));
            }
        }
        if let Some(v) = get("OXCCL_SHM_SINGLE_COPY") {
            c.single_copy = parse_bool("OXCCL_SHM_SINGLE_COPY", &v)?;
        }
        if let Some(v) = get("OXCCL_SHM_MAPPED") {
            c.shm_mapped = parse_bool("OXCCL_SHM_MAPPED", &v)?;
        }
        if let Some(v) = get("OXCCL_HIERARCHICAL_BLOCK") {
            c.hierarchical_block = parse_num("OXCCL_HIERARCHICAL_BLOCK", &v)?;
            if !hierarchical_block_ok(c.hierarchical_block) {
                return Err(Error::Config(format!(
                    "OXCCL_HIERARCHICAL_BLOCK={v} must be a multiple of 64 between 4 KiB and 1 GiB"
                )));
            }
        }
        if let Some(v) = get("OXCCL_CUDA_STAGE_CHUNK") {
            c.cuda_stage_chunk = parse_num("OXCCL_CUDA_STAGE_CHUNK", &v)?;
        }
        if let Some(v) = get("OXCCL_CUDA_STREAM_WAIT") {
            c.cuda_stream_wait = parse_auto_bool("OXCCL_CUDA_STREAM_WAIT", &v)?;
        }
        if let Some(v) = get("OXCCL_CUDA_IPC") {
            c.cuda_ipc = parse_auto_bool("OXCCL_CUDA_IPC", &v)?;
        }
        if let Some(v) = get("OXCCL_CUDA_IPC_SLOT") {
            c.cuda_ipc_slot = parse_num("OXCCL_CUDA_IPC_SLOT", &v)?;
            if !ipc_slot_ok(c.cuda_ipc_slot) {
                return Err(Error::Config(format!(
                    "OXCCL_CUDA_IPC_SLOT={v} must be a multiple of 256 between 4 KiB and 1 GiB"
                )));
            }
        }
        if let Some(v) = get("OXCCL_CUDA_IPC_ONE_SHOT") {
            c.cuda_ipc_one_shot = parse_num("OXCCL_CUDA_IPC_ONE_SHOT", &v)?;
        }
        if let Some(v) = get("OXCCL_CUDA_IPC_BARRIER") {
            let name = v.trim().to_ascii_lowercase();
            c.cuda_ipc_host_barrier = match name.as_str() {
                "" => None,
                _ => ipc_barrier_from_name(&name).ok_or_else(|| {
                    Error::Config(format!(
                        "OXCCL_CUDA_IPC_BARRIER={v:?}: expected auto, host or device"
                    ))
                })?,
            };
        }
        if let Some(v) = get("OXCCL_SPIN") {
            c.spin = parse_auto_bool("OXCCL_SPIN", &v)?;
        }
        // Empty keeps the default (off); `auto` must be asked for.
        if let Some(v) = get("OXCCL_SOCKET_SEND_THREAD").filter(|v| !v.trim().is_empty()) {
            c.socket_send_thread = parse_auto_bool("OXCCL_SOCKET_SEND_THREAD", &v)?;
        }
        if let Some(v) = get("OXCCL_SOCKET_CHANNELS").filter(|v| !v.trim().is_empty()) {
            c.socket_channels = if v.trim().eq_ignore_ascii_case("auto") {
                None
            } else {
                let k = parse_num("OXCCL_SOCKET_CHANNELS", &v)?;
                if !CHANNELS.contains(&k) {
                    return Err(Error::Config(format!(
                        "OXCCL_SOCKET_CHANNELS={v} must be auto or in 1..=16"
                    )));
                }
                Some(k)
            };
        }
        if let Some(v) = get("OXCCL_TRACE_BUFFER") {
            c.trace_buffer = parse_num("OXCCL_TRACE_BUFFER", &v)?;
            if c.trace_buffer > crate::base::trace::MAX_BUFFER {
                return Err(Error::Config(format!(
                    "OXCCL_TRACE_BUFFER={v} must be at most {} (0 turns the flight recorder off)",
                    crate::base::trace::MAX_BUFFER
                )));
            }
        }
        c.trace_dir = get("OXCCL_TRACE_DIR")
            .filter(|s| !s.trim().is_empty())
            .map(std::path::PathBuf::from);
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<Config> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(&|k| m.get(k).cloned())
    }

    #[test]
    fn defaults_and_overrides() {
        let c = cfg(&[]).unwrap();
        assert_eq!(c.timeout, Duration::from_secs(600));
        let c = cfg(&[
            ("OXCCL_TIMEOUT", "2.5"),
            ("OXCCL_NSOCKS", "3"),
            ("OXCCL_SOCKET_FAMILY", "AF_INET6"),
        ])
        .unwrap();
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert_eq!(c.nsocks, 3);
        assert_eq!(c.socket_family, Some(SocketFamily::V6));
        assert_eq!(c.cuda_ipc, None);
        assert!(c.socket_delayed_ack);
        assert_eq!(c.socket_send_thread, Some(false));
        let st = |v: &str| cfg(&[("OXCCL_SOCKET_SEND_THREAD", v)]).map(|c| c.socket_send_thread);
        assert_eq!(st("1").unwrap(), Some(true));
        assert_eq!(st("off").unwrap(), Some(false));
        assert_eq!(st("auto").unwrap(), None);
        assert_eq!(st(" ").unwrap(), Some(false));
        let e = st("2").unwrap_err().to_string();
        assert!(e.contains("OXCCL_SOCKET_SEND_THREAD"), "{e}");
        assert!(
            !cfg(&[("OXCCL_SOCKET_DELAYED_ACK", "0")])
                .unwrap()
                .socket_delayed_ack
        );
        let c = cfg(&[
            ("OXCCL_CUDA_IPC", "1"),
            ("OXCCL_CUDA_IPC_SLOT", "65536"),
            ("OXCCL_CUDA_IPC_ONE_SHOT", "0"),
        ])
        .unwrap();
        assert_eq!(
            (c.cuda_ipc, c.cuda_ipc_slot, c.cuda_ipc_one_shot),
            (Some(true), 65536, 0)
        );
        assert_eq!(
            cfg(&[("OXCCL_CUDA_IPC", "off")]).unwrap().cuda_ipc,
            Some(false)
        );
        assert_eq!(cfg(&[("OXCCL_CUDA_IPC", "auto")]).unwrap().cuda_ipc, None);
        let pair = |k: &str, v: &str| {
            let c = cfg(&[(k, v)]).unwrap();
            (c.cuda_stream_wait, c.cuda_ipc_host_barrier)
        };
        assert_eq!(pair("OXCCL_CUDA_STREAM_WAIT", "auto"), (None, None));
        assert_eq!(pair("OXCCL_CUDA_STREAM_WAIT", "0"), (Some(false), None));
        assert_eq!(pair("OXCCL_CUDA_STREAM_WAIT", "on"), (Some(true), None));
        assert_eq!(pair("OXCCL_CUDA_IPC_BARRIER", "host"), (None, Some(true)));
        assert_eq!(
            pair("OXCCL_CUDA_IPC_BARRIER", "Device"),
            (None, Some(false))
        );
        assert_eq!(pair("OXCCL_CUDA_IPC_BARRIER", "auto"), (None, None));
        let c = cfg(&[]).unwrap();
        assert_eq!((c.trace_buffer, c.trace_dir), (2000, None));
        let c = cfg(&[("OXCCL_TRACE_BUFFER", "0"), ("OXCCL_TRACE_DIR", "/tmp/t")]).unwrap();
        assert_eq!(c.trace_buffer, 0);
        assert_eq!(c.trace_dir.as_deref(), Some(std::path::Path::new("/tmp/t")));
        assert_eq!(cfg(&[("OXCCL_TRACE_DIR", " ")]).unwrap().trace_dir, None);
        let hb = |v: &str| cfg(&[("OXCCL_HIERARCHICAL_BLOCK", v)]).map(|c| c.hierarchical_block);
        assert_eq!(hb(" 2097152").unwrap(), 2 << 20);
        assert_eq!(hb("4096").unwrap(), 4096);
        assert_eq!(cfg(&[]).unwrap().hierarchical_block, 512 << 10);
        let ch = |v: &str| cfg(&[("OXCCL_SOCKET_CHANNELS", v)]).map(|c| c.socket_channels);
        assert_eq!(cfg(&[]).unwrap().socket_channels, None);
        assert_eq!(ch("4").unwrap(), Some(4));
        assert_eq!(ch("1").unwrap(), Some(1));
        assert_eq!(ch(" ").unwrap(), None);
        assert_eq!(ch("Auto").unwrap(), None);
        let c = Config {
            socket_channels: Some(0),
            ..Config::default()
        };
        assert!(c.check().unwrap_err().contains("OXCCL_SOCKET_CHANNELS"));
    }

    #[test]
    fn bad_values_name_the_variable() {
        for (k, v) in [
            ("OXCCL_TIMEOUT", "soon"),
            ("OXCCL_TIMEOUT", "-1"),
            ("OXCCL_NSOCKS", "0"),
            ("OXCCL_SOCKET_CHANNELS", "0"),
            ("OXCCL_SOCKET_CHANNELS", "17"),
            ("OXCCL_SLOT_BYTES", "100"),
            ("OXCCL_SOCKET_FAMILY", "ipx"),
            ("OXCCL_ALGO", "teleport"),
            ("OXCCL_SHM_DIRECT_BYTES", "100"),
            ("OXCCL_SHM_SINGLE_COPY", "maybe"),
            ("OXCCL_SHM_MAPPED", "perhaps"),
            ("OXCCL_SOCKET_DELAYED_ACK", "sometimes"),
            ("OXCCL_CUDA_STAGE_CHUNK", "big"),
            ("OXCCL_HIERARCHICAL_BLOCK", "100"),
            ("OXCCL_HIERARCHICAL_BLOCK", "4100"),
            ("OXCCL_HIERARCHICAL_BLOCK", "2147483648"),
            ("OXCCL_CUDA_STREAM_WAIT", "later"),
            ("OXCCL_CUDA_IPC", "sometimes"),
            ("OXCCL_CUDA_IPC_SLOT", "1000"),
            ("OXCCL_CUDA_IPC_SLOT", "2048"),
            ("OXCCL_CUDA_IPC_ONE_SHOT", "-5"),
            ("OXCCL_CUDA_IPC_BARRIER", "gpu"),
            ("OXCCL_TIMEOUT", "1e20"),
            ("OXCCL_TIMEOUT", "1e19"),
            ("OXCCL_TIMEOUT", "31536000.5"),
            ("OXCCL_TIMEOUT", "1e-12"),
            ("OXCCL_TIMEOUT", "0.0009"),
            ("OXCCL_TIMEOUT", "0"),
            ("OXCCL_TIMEOUT", "inf"),
            ("OXCCL_TIMEOUT", "NaN"),
            ("OXCCL_SOCKET_BUFFER", "4294967296"),
            ("OXCCL_SOCKET_BUFFER", "1073741825"),
            ("OXCCL_TRACE_BUFFER", "lots"),
            ("OXCCL_TRACE_BUFFER", "1048577"),
        ] {
            let e = cfg(&[(k, v)]).unwrap_err().to_string();
            assert!(e.contains(k) || k == "OXCCL_ALGO", "{e}");
        }
    }

    #[test]
    fn timeout_and_socket_buffer_limits() {
        let t = |v: &str| cfg(&[("OXCCL_TIMEOUT", v)]).map(|c| c.timeout);
        assert_eq!(t("0.001").unwrap(), MIN_TIMEOUT);
        assert_eq!(t("31536000").unwrap(), MAX_TIMEOUT);
        assert_eq!(t("1").unwrap(), Duration::from_secs(1));
        for bad in ["1e20", "1e19", "1e-12"] {
            let e = t(bad).unwrap_err().to_string();
            assert!(
                e.contains("OXCCL_TIMEOUT") && e.contains("0.001") && e.contains("31536000"),
                "{e}"
            );
        }
        assert!(check_timeout(MIN_TIMEOUT).is_ok() && check_timeout(MAX_TIMEOUT).is_ok());
        assert!(check_timeout(Duration::ZERO).is_err());
        assert!(check_timeout(MAX_TIMEOUT + Duration::from_nanos(1)).is_err());
        let b = |v: &str| cfg(&[("OXCCL_SOCKET_BUFFER", v)]).map(|c| c.socket_buffer);
        assert_eq!(b("1073741824").unwrap(), MAX_SOCKET_BUFFER);
        assert_eq!(b("0").unwrap(), 0);
        let e = b("4294967296").unwrap_err().to_string();
        assert!(
            e.contains("OXCCL_SOCKET_BUFFER") && e.contains("1 GiB"),
            "{e}"
        );
    }
}
