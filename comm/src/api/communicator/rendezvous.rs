//! Meeting the other ranks when a communicator is created, so that it cannot be joined by
//! mistake:
//!
//! - every rank writes the world size it was started with under `{id}/size` (the first one
//!   stays): a rank started with another size fails at once, naming both;
//! - every rank claims its rank once under `{id}/claim/{rank}`: a second process with the same
//!   rank fails at once, naming both processes;
//! - then the records are exchanged (`{id}/peer/{rank}`);
//! - one decision ends it, under `{id}/abort`, first writer wins: a rank that finds a conflict
//!   writes it there, and the first rank to hold every record writes `sealed` (every rank has
//!   claimed its place by then). Each rank, once it holds every record, reads the decision:
//!   all go on to connect, or all fail with the same text. A conflicting process that comes
//!   after the seal fails alone (the communicator is complete without it);
//! - a wait that lasts says what it waits for every [`NOTE_EVERY`].
//!
//! Jobs are kept apart by their ids (every key is under the job's) and, where the job has one,
//! by its token (`OXCCL_JOB_TOKEN`), which the store requires of every client.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::base::bootstrap::{init_store_error, is_wait_timeout, Store};
use crate::base::error::{Error, Result};
use crate::transport::PeerInfo;

/// How often a rank that waits at init says what for.
pub(super) const NOTE_EVERY: Duration = Duration::from_secs(10);

/// How often a waiting rank looks for a published conflict.
const ABORT_POLL: Duration = Duration::from_millis(200);

/// How long a rank hosting the store keeps it up after a conflict, for the others to read it.
pub(super) const LINGER: Duration = Duration::from_secs(1);

fn abort_key(id: &str) -> String {
    format!("{id}/abort")
}

/// This process, as claims name it: its process id and node, after a number unique to this
/// claim (threads of one process are ranks of their own).
fn claimant(me: &PeerInfo) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}|process {} on node {:?}",
        NEXT.fetch_add(1, Ordering::Relaxed),
        me.pid,
        me.node_id
    )
}

/// A claim as its message shows it (without the unique number).
fn shown(claim: &str) -> &str {
    claim.split_once('|').map_or(claim, |(_, who)| who)
}

/// The decision that lets every rank go on.
const SEALED: &[u8] = b"sealed";

/// Publishes `msg` as the communicator's conflict unless it is sealed already, and returns this
/// rank's error for it.
fn conflict(store: &dyn Store, id: &str, rank: usize, msg: String) -> Error {
    let _ = store.compare_set(&abort_key(id), None, msg.as_bytes());
    Error::Config(format!("rank {rank}: init: {msg}"))
}

/// A conflict another rank published, as this rank's error (`Ok` while there is none, or once
/// the communicator is sealed).
fn check_abort(store: &dyn Store, id: &str, rank: usize) -> Result<()> {
    match store.try_get(&abort_key(id))? {
        Some(v) if v != SEALED => Err(Error::Config(format!(
            "rank {rank}: init: {}",
            String::from_utf8_lossy(&v)
        ))),
        _ => Ok(()),
    }
}

/// This rank holds every record: the decision (see the module docs).
fn seal(store: &dyn Store, id: &str, rank: usize) -> Result<()> {
    let decided = store.compare_set(&abort_key(id), None, SEALED)?;
    if decided == SEALED {
        return Ok(());
    }
    Err(Error::Config(format!(
        "rank {rank}: init: {}",
        String::from_utf8_lossy(&decided)
    )))
}

/// The world size and the rank claim (see the module docs).
fn claim(me: &PeerInfo, size: usize, store: &dyn Store, id: &str) -> Result<()> {
    let rank = me.rank;
    let who = claimant(me);
    let mine = format!("{size} {rank} {who}");
    let cur = store.compare_set(&format!("{id}/size"), None, mine.as_bytes())?;
    let cur = String::from_utf8_lossy(&cur).into_owned();
    let mut parts = cur.splitn(3, ' ');
    let (their_size, their_rank, their_who) = (
        parts.next().unwrap_or(""),
        parts.next().unwrap_or("?"),
        parts.next().unwrap_or(""),
    );
    if their_size != size.to_string() {
        return Err(conflict(
            store,
            id,
            rank,
            format!(
                "the ranks disagree on the world size: rank {rank} ({}) was started with \
                 {size}, rank {their_rank} ({}) with {their_size}",
                shown(&who),
                shown(their_who)
            ),
        ));
    }
    let cur = store.compare_set(&format!("{id}/claim/{rank}"), None, who.as_bytes())?;
    if cur != who.as_bytes() {
        let theirs = String::from_utf8_lossy(&cur).into_owned();
        return Err(conflict(
            store,
            id,
            rank,
            format!(
                "rank {rank} was claimed by two processes, {} and {}: two processes were \
                 started with the same rank (RANK, OXCCL_RANK, SLURM_PROCID or \
                 OMPI_COMM_WORLD_RANK)",
                shown(&theirs),
                shown(&who)
            ),
        ));
    }
    Ok(())
}

/// Waits for `key` until `deadline`, looking for a published conflict meanwhile and saying
/// every [`NOTE_EVERY`] what it waits for.
fn wait_key(
    store: &dyn Store,
    id: &str,
    rank: usize,
    key: &str,
    what: &str,
    deadline: Instant,
) -> Result<Vec<u8>> {
    let start = Instant::now();
    let mut next_note = start + NOTE_EVERY;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let chunk = left.clamp(Duration::from_millis(1), ABORT_POLL);
        match store.get(key, chunk) {
            Ok(v) => return Ok(v),
            Err(Error::Store(msg)) if is_wait_timeout(&msg) && !left.is_zero() => {}
            Err(e) => return Err(e),
        }
        check_abort(store, id, rank)?;
        if Instant::now() >= next_note {
            next_note += NOTE_EVERY;
            crate::base::logging::notice(&format!(
                "rank {rank}: init: still waiting for {what} after {} s (key '{key}')",
                start.elapsed().as_secs()
            ));
        }
    }
}

/// Claims this rank, checks the world size, publishes this rank's record and reads every
/// rank's (see the module docs).
///
/// # Errors
/// `Config` for a conflict (this rank's or one another rank published); `Timeout` naming the
/// rank that never published its record; store errors.
pub(super) fn exchange_records(
    me: &PeerInfo,
    size: usize,
    store: &dyn Store,
    id: &str,
    timeout: Duration,
    deadline: Instant,
) -> Result<Vec<PeerInfo>> {
    let rank = me.rank;
    let failed = |e, what: &str, key: &str, waiting: Option<&str>| {
        init_store_error(rank, e, what, key, waiting, timeout, deadline)
    };
    claim(me, size, store, id).map_err(|e| failed(e, "claiming this rank", id, None))?;
    let key = format!("{id}/peer/{rank}");
    store
        .set(&key, &me.encode())
        .map_err(|e| failed(e, "publishing this rank's address", &key, None))?;
    let mut peers = Vec::with_capacity(size);
    for r in 0..size {
        let key = format!("{id}/peer/{r}");
        let what = format!("rank {r}'s address");
        let rec = wait_key(store, id, rank, &key, &what, deadline).map_err(|e| {
            let waiting = format!("rank {r} never published its address");
            failed(e, &format!("reading {what}"), &key, Some(&waiting))
        })?;
        let p = PeerInfo::decode(&rec).map_err(|e| {
            let why = match e {
                Error::Store(msg) => msg,
                other => other.to_string(),
            };
            Error::Store(format!(
                "rank {rank}: init: the record under key '{key}' (rank {r}'s address): {why}"
            ))
        })?;
        if p.rank != r {
            return Err(Error::Store(format!(
                "rank {rank}: init: the record under key '{key}' should be rank {r}'s \
                 address but names rank {}",
                p.rank
            )));
        }
        peers.push(p);
    }
    seal(store, id, rank).map_err(|e| failed(e, "sealing the rendezvous", id, None))?;
    Ok(peers)
}
