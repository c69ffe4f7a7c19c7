//! The shared-memory backend's connect lifecycle ([`Transport`]): set-up creates this rank's
//! segment (one receive ring per shared-memory peer, and the direct window's staging when every
//! rank of the communicator shares the node) and publishes its name; connect maps every peer's
//! segment, makes a send half into this rank's ring in the peer's segment and a receive half on
//! the peer's ring in this one, waits until every peer has mapped this rank's segment, unlinks
//! its name (the mappings stay), and, when every rank is a shared-memory peer, agrees on the
//! single-copy path and opens the window.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::mapped::probe;
use super::segment::ring_slot_bytes;
use super::{
    job_prefix, probe_single_copy, Probe, Segment, ShmRecv, ShmSend, ShmWindow, UnlinkGuard,
};
use crate::base::bootstrap::{hash_id, init_store_error};
use crate::base::error::{Error, Result};
use crate::transport::{
    same_node, CanConnect, Group, Links, Memory, Transport, Window, FAILED_POLL,
};

/// The shared-memory backend of one rank of one communicator.
#[derive(Default)]
pub(crate) struct ShmTransport {
    /// This rank's segment once set up, with the guard that unlinks its name (when every peer
    /// has mapped it, or when set-up fails and this is dropped).
    own: Option<(Arc<Segment>, String, UnlinkGuard)>,
    /// The file peers map at connect to learn whether they can map this rank's registered
    /// buffers (only when the window connects every rank); dropped once every peer has.
    probe: Option<Probe>,
}

/// Ranks of one node (the selector's rule for this backend).
pub(crate) fn can_connect(
    a: &crate::transport::PeerInfo,
    b: &crate::transport::PeerInfo,
    cfg: &crate::base::config::Config,
) -> crate::transport::Reach {
    same_node(a, b, cfg)
}

/// Whether every rank of the communicator is a shared-memory peer of this one (the direct
/// window then connects them all).
fn everyone(group: &Group<'_>, peers: &[usize]) -> bool {
    peers.len() + 1 == group.size
}

/// The store error of `what` on `key` during init, for `group`'s rank (a time-out when waiting
/// ran out of time).
fn failed(group: &Group<'_>, e: Error, what: &str, key: &str, waiting_for: Option<&str>) -> Error {
    let (rank, timeout) = (group.rank, group.cfg.timeout);
    init_store_error(rank, e, what, key, waiting_for, timeout, group.deadline)
}

impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn memory(&self) -> Memory {
        Memory::Host
    }

    fn can_connect(&self) -> CanConnect {
        can_connect
    }

    fn setup(&mut self, group: &Group<'_>, peers: &[usize]) -> Result<()> {
        let (rank, id, cfg) = (group.rank, group.id, group.cfg);
        let job = id.split('/').next().unwrap_or("oxccl");
        // Unique even for ranks that are threads of one process in several tests at once.
        static SEGMENTS: AtomicU64 = AtomicU64::new(0);
        let n = SEGMENTS.fetch_add(1, Ordering::Relaxed);
        let name = format!(
            "{}{:016x}-r{rank}-p{}-{n}",
            job_prefix(job),
            hash_id(id),
            std::process::id()
        );
        let direct = if everyone(group, peers) {
            cfg.direct_bytes
        } else {
            0
        };
        let slot = ring_slot_bytes(cfg.slot_bytes, cfg.nslots, peers.len(), cfg.shm_ring_bytes);
        let (seg, path) = Segment::create(rank, &name, peers.len(), slot, cfg.nslots, direct)?;
        tracing::debug!(
            rank,
            peers = peers.len(),
            slot,
            nslots = cfg.nslots,
            direct,
            "shared-memory segment"
        );
        // The name goes at the end of `connect` (every peer has mapped the segment), or when
        // this backend is dropped after a failure: the mappings stay.
        let unlink = UnlinkGuard::new(path.clone());
        let path = path.to_string_lossy().into_owned();
        self.probe = if direct > 0 && cfg.shm_mapped {
            Probe::new()
        } else {
            None
        };
        // The segment's name, then the probe file's descriptor (-1: none).
        let fd = self.probe.as_ref().map_or(-1, Probe::fd);
        let key = format!("{id}/shm/{rank}");
        group
            .store
            .set(&key, format!("{path}\n{fd}").as_bytes())
            .map_err(|e| failed(group, e, "publishing the shared-memory segment", &key, None))?;
        self.own = Some((Arc::new(seg), path, unlink));
        Ok(())
    }

    fn connect(&mut self, group: &Group<'_>, peers: &[usize], links: &mut Links) -> Result<()> {
        let rank = group.rank;
        let (own, _, unlink) = self
            .own
            .take()
            .ok_or_else(|| Error::Config(format!("rank {rank}: shm connect before its set-up")))?;
        let mut segs: Vec<Option<Arc<Segment>>> = vec![None; group.size];
        segs[rank] = Some(own.clone());
        let all = everyone(group, peers);
        let mut can_read_all = group.cfg.single_copy;
        let mut can_map_all = self.probe.is_some();
        for (ring, &p) in peers.iter().enumerate() {
            let (peer_seg, peer_path, peer_probe) = map_peer(group, p)?;
            let pid = group.peers[p].pid;
            if can_map_all && !peer_probe.is_some_and(|fd| probe(pid, fd)) {
                tracing::info!(
                    rank,
                    peer = p,
                    "cannot map this peer's registered buffers: no mapped algorithms"
                );
                can_map_all = false;
            }
            if all && can_read_all && !probe_single_copy(pid, &peer_seg) {
                tracing::info!(
                    rank,
                    peer = p,
                    "process_vm_readv cannot read this peer: no single-copy path"
                );
                can_read_all = false;
            }
            let ring_at_p = ring_in_peer(group, p, &peer_seg, &peer_path)?;
            segs[p] = Some(peer_seg.clone());
            let send = ShmSend::new(rank, p, pid, peer_seg.clone(), ring_at_p, own.clone());
            links.send[p] = Some(Box::new(send));
            let recv = ShmRecv::new(rank, p, pid, own.clone(), ring, peer_seg);
            links.recv[p] = Some(Box::new(recv));
            let key = format!("{}/shm_mapped/{p}", group.id);
            group
                .store
                .add(&key, 1)
                .map_err(|e| failed(group, e, "counting a mapped segment", &key, None))?;
        }
        wait_mapped(group, peers.len())?;
        drop(unlink); // every peer has mapped it: the name goes, the mappings stay
        self.probe = None; // and has probed this rank's file
        links.bell = Some(own);
        if all {
            let segs = segs
                .into_iter()
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    Error::Config(format!("rank {rank}: a shared-memory peer has no segment"))
                })?;
            let window = open_window(group, segs, (can_read_all, can_map_all))?;
            links.window = Some(Box::new(window) as Box<dyn Window>);
        }
        Ok(())
    }
}

/// Maps `p`'s segment, once `p` has published its name; returns it, its path and the
/// descriptor of `p`'s probe file, if it has one.
fn map_peer(group: &Group<'_>, p: usize) -> Result<(Arc<Segment>, String, Option<i32>)> {
    let key = format!("{}/shm/{p}", group.id);
    let rec = group.wait_get(&key).map_err(|e| {
        let waiting = format!("rank {p} never published its shared-memory segment");
        let what = "reading a shared-memory segment name";
        failed(group, e, what, &key, Some(&waiting))
    })?;
    let rec = String::from_utf8_lossy(&rec);
    let (path, fd) = rec.rsplit_once('\n').unwrap_or((&rec, "-1"));
    let probe = fd.parse::<i32>().ok().filter(|&fd| fd >= 0);
    let seg = Segment::open(group.rank, p, path)?;
    tracing::info!(rank = group.rank, peer = p, transport = "shm", segment = %path, "connected");
    Ok((Arc::new(seg), path.to_owned(), probe))
}

/// This rank's ring in `p`'s segment: its position among `p`'s shared-memory peers (which the
/// selector gives every rank alike).
fn ring_in_peer(group: &Group<'_>, p: usize, peer_seg: &Segment, path: &str) -> Result<usize> {
    let ring = (0..group.size)
        .filter(|&q| group.host_route(p, q) == Some("shm"))
        .position(|q| q == group.rank)
        .unwrap_or(0);
    if ring >= peer_seg.nrings() {
        return Err(Error::Transport {
            rank: group.rank,
            peer: p,
            transport: "shm",
            msg: format!("{path} has no ring for this rank"),
        });
    }
    Ok(ring)
}

/// Waits until `peers` peers have mapped this rank's segment (its name may go then).
fn wait_mapped(group: &Group<'_>, peers: usize) -> Result<()> {
    let mut backoff = Duration::from_micros(100);
    let key = format!("{}/shm_mapped/{}", group.id, group.rank);
    let mapped = || {
        group
            .store
            .add(&key, 0)
            .map_err(|e| failed(group, e, "reading the mapped-segment count", &key, None))
    };
    let mut looked = Instant::now();
    while mapped()? < peers as i64 {
        if looked.elapsed() >= FAILED_POLL {
            group.check_failed()?;
            looked = Instant::now();
        }
        if Instant::now() >= group.deadline {
            return Err(Error::Timeout {
                rank: group.rank,
                op: "init".into(),
                timeout: group.cfg.timeout,
                detail: "shared-memory peers did not map this rank's segment".into(),
            });
        }
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(Duration::from_millis(10));
    }
    Ok(())
}

/// The direct window over every rank's segment (`segs`, indexed by rank), with the single-copy
/// path only if every rank can read every other, and mapped buffers only if every rank can map
/// every other's (all ranks decide the same, through the store).
fn open_window(
    group: &Group<'_>,
    segs: Vec<Arc<Segment>>,
    (can_read_all, can_map_all): (bool, bool),
) -> Result<ShmWindow> {
    let (rank, id) = (group.rank, group.id);
    let key = format!("{id}/single_copy/{rank}");
    let bit = |b: bool| if b { b'1' } else { b'0' };
    group
        .store
        .set(&key, &[bit(can_read_all), bit(can_map_all)])
        .map_err(|e| {
            failed(
                group,
                e,
                "publishing the single-copy capability",
                &key,
                None,
            )
        })?;
    let (mut single_copy, mut can_map) = (true, true);
    for p in 0..group.size {
        let key = format!("{id}/single_copy/{p}");
        let v = group.wait_get(&key).map_err(|e| {
            let waiting = format!("rank {p} never published its single-copy capability");
            let what = "reading a single-copy capability";
            failed(group, e, what, &key, Some(&waiting))
        })?;
        single_copy &= v.first() == Some(&b'1');
        can_map &= v.get(1) == Some(&b'1');
    }
    let pids = group.peers.iter().map(|p| p.pid).collect();
    let staging = group.cfg.direct_bytes;
    tracing::info!(rank, staging, single_copy, can_map, "shared-memory window");
    Ok(ShmWindow::new(rank, segs, pids, (single_copy, can_map)))
}
