//! Changing who is in a communicator: [`Communicator::shrink`] (ranks leave or were lost),
//! [`Communicator::grow`] and [`Communicator::join`] (new processes come in, e.g. a replacement
//! for a lost rank that `oxccl launch --respawn` started).
//!
//! Both go through the store only, never through the old communicator's connections, so they work
//! on a communicator a failure broke. The ranks first compare their arguments (one key per rank
//! under the new communicator's id), so ranks that disagree get `Mismatch` at once instead of
//! waiting for different communicators until their time-out.
//!
//! **Places for joining processes.** A joining process does not know its rank: the ranks that
//! grow decide it. Rank 0 of a growing communicator offers one place per new rank: it numbers
//! each with the counter `<prefix>/join/posted` and writes `<id>\n<size>\n<rank>` under
//! `<prefix>/join/offer/<n>`. A joining process reads the counter and claims the lowest open place
//! by compare-and-set of `<prefix>/join/claim/<n>`, then runs the rendezvous as that rank; with
//! no open place it waits for the next offer to be written (looking at every number again at
//! least every [`POLL`]) until its time-out. Nothing is held before a claim,
//! so a joining process that dies before claiming blocks nobody (one that dies after claiming is a
//! new rank lost during creation, and the grow fails with a time-out naming it). Rank 0 settles its
//! offers once the grow is over: `done`, or `cancelled` when it failed (a process that claimed a
//! place of a failed grow fails too; `oxccl launch --respawn` then starts another while it has
//! replacements left). Before it offers, rank 0 withdraws open places of earlier grows that nobody
//! claimed (left by a rank 0 that died mid-grow). The prefix is the job id under a launcher
//! ([`Communicator::from_env`]) and `oxccl` for [`Communicator::init`]; communicators made from
//! one keep its prefix, so their grows share one list of places: grow them one at a time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::communicator::Communicator;
use crate::base::bootstrap::{self, Store};
use crate::base::config::Config;
use crate::base::error::{Error, Result};

/// What rank 0 writes over an offer of a grow that failed.
const CANCELLED: &[u8] = b"cancelled";
/// What rank 0 writes over an offer of a grow that succeeded.
const DONE: &[u8] = b"done";
/// The longest a joining process without a place waits for the next offer before it looks at
/// every open number again.
pub(crate) const POLL: Duration = Duration::from_secs(1);
/// The most ranks a communicator may have (creating, growing or joining a larger one is refused).
pub(crate) const MAX_RANKS: usize = 1 << 20;

fn offer_key(prefix: &str, n: i64) -> String {
    format!("{prefix}/join/offer/{n}")
}

fn claim_key(prefix: &str, n: i64) -> String {
    format!("{prefix}/join/claim/{n}")
}

/// A place offered to a joining process: the communicator id, its size and the rank.
#[derive(Debug, PartialEq, Eq)]
struct Offer {
    id: String,
    size: usize,
    rank: usize,
}

impl Offer {
    fn encode(&self) -> Vec<u8> {
        format!("{}\n{}\n{}", self.id, self.size, self.rank).into_bytes()
    }

    fn decode(b: &[u8]) -> Option<Offer> {
        let s = std::str::from_utf8(b).ok()?;
        let mut it = s.split('\n');
        let (id, size, rank) = (it.next()?, it.next()?, it.next()?);
        if it.next().is_some() || id.is_empty() {
            return None;
        }
        let (size, rank): (usize, usize) = (size.parse().ok()?, rank.parse().ok()?);
        (rank < size && size <= MAX_RANKS).then(|| Offer {
            id: id.to_string(),
            size,
            rank,
        })
    }
}

/// A `Timeout` of creating a communicator, as one of `op`, with its detail rewritten by `detail`
/// (given the rank and the old detail); other errors as they are.
fn retitle_timeout(e: Error, op: &str, detail: impl FnOnce(usize, &str) -> String) -> Error {
    match e {
        Error::Timeout {
            rank,
            timeout,
            detail: old,
            ..
        } => Error::Timeout {
            rank,
            op: op.into(),
            timeout,
            detail: detail(rank, &old),
        },
        other => other,
    }
}

impl Communicator {
    /// Makes a communicator of this one's ranks without `exclude`, like NCCL's `ncclCommShrink`:
    /// the ranks a `PeerLost` named (dead processes), or ranks that leave. It does not use this
    /// communicator's connections, so it works after a failure broke it: survivors of a lost rank
    /// go on with one rank less instead of restarting the job. The ranks keep their order and are
    /// numbered again from 0; this communicator stays as it is (broken, if it was).
    ///
    /// Every rank not in `exclude` must call it with the same list (in any order), and the
    /// excluded ranks must not; after a failed `shrink` every survivor calls it again (each call
    /// counts, on every rank, so attempts stay paired). The rendezvous goes through the store, so
    /// the store must outlive the lost ranks: `oxccl launch` hosts it in the launcher (with
    /// `--keep-going` it also leaves the survivors running); under torchrun, Slurm, mpirun or by
    /// hand rank 0 hosts it, and losing rank 0 loses the store.
    ///
    /// ```no_run
    /// # use oxccl_comm::{Communicator, ReduceOp};
    /// # fn f(comm: Communicator, grads: &mut [f32]) -> oxccl_comm::Result<()> {
    /// let comm = match comm.all_reduce(grads, ReduceOp::Sum) {
    ///     Err(e) if e.lost_peer().is_some() => {
    ///         let fewer = comm.shrink(&[e.lost_peer().unwrap()])?;
    ///         // ... redo the step with fewer.size() ranks ...
    ///         fewer
    ///     }
    ///     other => { other?; comm }
    /// };
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// `InvalidArgument` when `exclude` holds a rank outside the communicator or this rank;
    /// `Mismatch` (on every rank that compares) when another rank passed a
    /// different list; `Timeout` naming a rank that did not call `shrink` within the time-out
    /// (lost too?); errors of creating the new communicator.
    pub fn shrink(&self, exclude: &[usize]) -> Result<Communicator> {
        // Counted before anything can fail, so every call of every rank takes a number.
        let k = self.shrinks.fetch_add(1, Ordering::Relaxed);
        let mut ex = exclude.to_vec();
        ex.sort_unstable();
        ex.dedup();
        if let Some(&r) = ex.iter().find(|&&r| r >= self.size) {
            return Err(self.invalid(
                "shrink",
                format!(
                    "rank {r} in the exclude list is not a rank of this communicator (size {})",
                    self.size
                ),
            ));
        }
        if ex.binary_search(&self.rank).is_ok() {
            return Err(self.invalid(
                "shrink",
                format!(
                    "this rank ({}) is in the exclude list: excluded ranks do not call shrink",
                    self.rank
                ),
            ));
        }
        let kept: Vec<usize> = (0..self.size)
            .filter(|r| ex.binary_search(r).is_err())
            .collect();
        let id = format!("{}/shrink{k}", self.id);
        // Agree on the list first: ranks with different lists would otherwise wait for
        // different communicators until their time-out.
        let list = format!("{ex:?}");
        self.agree(
            "shrink",
            k,
            &id,
            &format!("exclude={list}"),
            &kept,
            "every rank not excluded must call it",
        )
        .map_err(|e| self.shared.named(e))?;
        tracing::info!(rank = self.rank, size = kept.len(), exclude = %list, "shrink");
        let c = self.child(&kept, id)?;
        self.forget_args(&c, &kept);
        Ok(c)
    }

    /// Makes a communicator of this one's ranks and `new_size - size()` new ones, like NCCL's
    /// `ncclCommGrow`: the ranks keep their numbers and the new ranks get `size()..new_size`, one
    /// per process that claims a place ([`Communicator::join`], or [`Communicator::from_env`]
    /// with `OXCCL_JOIN=1`; see the module docs). Used to bring a job back to its size after
    /// [`Communicator::shrink`], with a process `oxccl launch --respawn` started in place of the
    /// lost one, or to add ranks.
    ///
    /// Every rank must call it with the same `new_size`; it returns once the joining processes
    /// have come and every connection is made, or fails after the time-out (`OXCCL_TIMEOUT`)
    /// when too few came. After a failed `grow` every rank calls it again (each call counts, on
    /// every rank). This communicator stays as it is. Like `shrink`, it works on a communicator
    /// a failure broke, and the store must outlive lost ranks (see [`Communicator::shrink`]).
    ///
    /// A joining process has none of the job's state ([`Communicator::joined`] tells it so):
    /// broadcast it from a rank that has it (examples/04_survive_a_lost_rank.rs does).
    ///
    /// # Errors
    /// `InvalidArgument` when `new_size` is not larger than `size()` or above 2^20; `Mismatch`
    /// when another rank passed a different size; `Timeout` naming a rank that did not call
    /// `grow`, or a new rank whose process did not join in time; errors of creating the new
    /// communicator.
    pub fn grow(&self, new_size: usize) -> Result<Communicator> {
        // Counted before anything can fail, so every call of every rank takes a number.
        let k = self.grows.fetch_add(1, Ordering::Relaxed);
        if new_size <= self.size || new_size > MAX_RANKS {
            return Err(self.invalid(
                "grow",
                format!(
                    "the new size {new_size} is not larger than this communicator's {} (shrink \
                     removes ranks), or above {MAX_RANKS}",
                    self.size
                ),
            ));
        }
        let id = format!("{}/grow{k}", self.id);
        let all: Vec<usize> = (0..self.size).collect();
        self.agree(
            "grow",
            k,
            &id,
            &format!("new_size={new_size}"),
            &all,
            "every rank must call it",
        )
        .map_err(|e| self.shared.named(e))?;
        let mut offered = Vec::new();
        if self.rank == 0 {
            if let Err(e) = self.offer_places(&id, new_size, &mut offered) {
                self.settle(&offered, CANCELLED);
                return Err(e);
            }
        }
        tracing::info!(rank = self.rank, from = self.size, to = new_size, "grow");
        // A root of its own for stall reports: its new ranks have no place in the old root.
        match self.derive(self.rank, new_size, id, None) {
            Ok(c) => {
                self.settle(&offered, DONE);
                self.forget_args(&c, &all);
                Ok(c)
            }
            Err(e) => {
                // Withdraw the places, so a process joining later does not wait for a
                // communicator that no longer forms.
                self.settle(&offered, CANCELLED);
                Err(retitle_timeout(e, "grow", |_, detail| {
                    format!(
                        "{detail}; ranks {}..{new_size} are new: each needs a process that \
                         calls Communicator::join (or starts with OXCCL_JOIN=1)",
                        self.size
                    )
                }))
            }
        }
    }

    /// Joins a communicator that is growing ([`Communicator::grow`]) as one of its new ranks,
    /// meeting it through `store`, with configuration from the environment. Waits up to the
    /// time-out for a place, then up to the time-out again for the communicator to form; the
    /// rank and size are the communicator's (`rank()`, `size()`), and
    /// [`Communicator::joined`] is true. It finds the places of communicators made by
    /// [`Communicator::init`] (and those made from them); a process of a job started by a
    /// launcher joins through [`Communicator::from_env`] with `OXCCL_JOIN=1` instead.
    ///
    /// # Errors
    /// `Config` for a bad `OXCCL_*` variable; `Store` when no place was offered within the
    /// time-out (no rank called `grow`, or it wanted fewer ranks than came); errors of creating
    /// the communicator (`Timeout` with op `join` naming the grown communicator).
    pub fn join(store: Arc<dyn Store>) -> Result<Communicator> {
        Self::join_with_config(store, Config::from_env()?)
    }

    /// [`Communicator::join`] with an explicit configuration.
    ///
    /// # Errors
    /// As [`Communicator::join`]; `Config` for a configuration out of range.
    pub fn join_with_config(store: Arc<dyn Store>, cfg: Config) -> Result<Communicator> {
        crate::base::logging::hint_if_unseen();
        Self::join_inner(store, cfg, "oxccl", None, None)
    }

    /// Takes a place offered under `prefix` and makes the communicator. `launched_as` is the
    /// rank a launcher gave this process, for messages only.
    pub(crate) fn join_inner(
        store: Arc<dyn Store>,
        cfg: Config,
        prefix: &str,
        store_host: Option<std::net::IpAddr>,
        launched_as: Option<usize>,
    ) -> Result<Communicator> {
        let who = match launched_as {
            Some(r) => format!(
                "joining process {} (launched as rank {r})",
                std::process::id()
            ),
            None => format!("joining process {}", std::process::id()),
        };
        cfg.check()
            .map_err(|msg| Error::Config(format!("{who}: {msg}")))?;
        let store_err = |what: &str, e: Error| Error::Store(format!("{who}: join: {what}: {e}"));
        let deadline = Instant::now() + cfg.timeout;
        // Unique across processes, hosts and calls: whoever reads it back from a claim key won.
        static JOINS: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let token = format!(
            "{who} on {} #{} at {nanos}",
            gethostname::gethostname().to_string_lossy(),
            JOINS.fetch_add(1, Ordering::Relaxed)
        )
        .into_bytes();
        let Some((n, offer)) = Self::claim_place(&*store, prefix, &token, deadline)
            .map_err(|e| store_err("looking for a place", e))?
        else {
            return Err(Error::Store(format!(
                "{who}: join: no place was offered within {:?} (store keys '{prefix}/join/...'): \
                 no rank called Communicator::grow, or it wanted fewer new ranks than came",
                cfg.timeout
            )));
        };
        tracing::info!(rank = offer.rank, size = offer.size, comm = %offer.id, "{who}: joining");
        let made = Self::init_inner(
            offer.rank,
            offer.size,
            store.clone(),
            cfg,
            offer.id.clone(),
            store_host,
            None,
        );
        match made {
            Ok(mut c) => {
                c.join_prefix = prefix.to_string();
                c.joined = true;
                Ok(c)
            }
            Err(e) => {
                let withdrawn = store
                    .try_get(&offer_key(prefix, n))
                    .ok()
                    .flatten()
                    .as_deref()
                    == Some(CANCELLED);
                Err(retitle_timeout(e, "join", |rank, detail| {
                    format!(
                        "{who}, rank {rank} of {}{}: {detail}",
                        offer.id,
                        if withdrawn {
                            " (the grow failed: rank 0 withdrew the place)"
                        } else {
                            ""
                        }
                    )
                }))
            }
        }
    }

    /// Claims the lowest open place under `prefix`, waiting for offers until `deadline`; `None`
    /// when none came. Numbers whose offer is not written yet are looked at again.
    fn claim_place(
        store: &dyn Store,
        prefix: &str,
        token: &[u8],
        deadline: Instant,
    ) -> Result<Option<(i64, Offer)>> {
        let posted = format!("{prefix}/join/posted");
        // Numbers below `next` were seen; `pending` ones had no value yet (rank 0 numbers an
        // offer before it writes it).
        let mut next: i64 = 1;
        let mut pending: Vec<i64> = Vec::new();
        loop {
            let last = store.add(&posted, 0)?;
            pending.extend(next..=last);
            next = next.max(last + 1);
            let mut still = Vec::new();
            for n in std::mem::take(&mut pending) {
                let Some(value) = store.try_get(&offer_key(prefix, n))? else {
                    still.push(n);
                    continue;
                };
                let Some(offer) = Offer::decode(&value) else {
                    continue; // settled (done, cancelled) or not an offer
                };
                if store.compare_set(&claim_key(prefix, n), None, token)? == token {
                    // Rank 0 settles an offer before it removes the claim, so a claim won after
                    // the grow was over finds the offer settled here.
                    if store.try_get(&offer_key(prefix, n))?.as_deref() == Some(&value[..]) {
                        return Ok(Some((n, offer)));
                    }
                }
            }
            pending = still;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            // Wake as soon as the next offer is written; look at everything again at least
            // every POLL (numbers taken but not written yet, several offers at once).
            match store.get(&offer_key(prefix, next), POLL.min(left)) {
                Ok(_) => {}
                Err(Error::Store(msg)) if bootstrap::is_wait_timeout(&msg) => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Rank 0 of a grow: writes `status` over its offers (over what it offered, or where the
    /// value was never written), and removes their claims.
    fn settle(&self, offered: &[(i64, Vec<u8>)], status: &[u8]) {
        for (n, offer) in offered {
            let key = offer_key(&self.join_prefix, *n);
            let settled = self
                .store
                .compare_set(&key, None, status)
                .and_then(|_| self.store.compare_set(&key, Some(offer), status));
            match settled {
                // Only once the offer is settled: a claim made after that must find it so.
                Ok(_) => {
                    let _ = self.store.delete(&claim_key(&self.join_prefix, *n));
                }
                Err(e) => tracing::debug!(rank = self.rank, "grow: settling offer {key}: {e}"),
            }
        }
    }

    /// Rank 0 of a grow: withdraws the open places of earlier grows under this prefix that
    /// nobody claimed (their rank 0 died before settling them), so joining processes do not
    /// take them instead of this grow's.
    fn withdraw_stale_offers(&self) -> Result<()> {
        let prefix = &self.join_prefix;
        let last = self.store.add(&format!("{prefix}/join/posted"), 0)?;
        for n in 1..=last {
            let key = offer_key(prefix, n);
            let Some(value) = self.store.try_get(&key)? else {
                let _ = self.store.compare_set(&key, None, CANCELLED)?;
                continue;
            };
            if Offer::decode(&value).is_none() {
                continue;
            }
            // Claim it ourselves: a process that claimed it first keeps it (it is joining a
            // communicator that may still form).
            let mine = format!("rank 0 of a grow, withdrawing stale offer {n}").into_bytes();
            if self.store.compare_set(&claim_key(prefix, n), None, &mine)? == mine {
                self.store.compare_set(&key, Some(&value), CANCELLED)?;
                tracing::info!(rank = self.rank, "grow: withdrew stale offer {key}");
            }
        }
        Ok(())
    }

    /// Rank 0 of a growing communicator: offers the places of ranks `size()..new_size` of `id`,
    /// in order, adding each offer's number and value to `offered` as it goes.
    fn offer_places(
        &self,
        id: &str,
        new_size: usize,
        offered: &mut Vec<(i64, Vec<u8>)>,
    ) -> Result<()> {
        self.withdraw_stale_offers().map_err(|e| {
            Error::Store(format!(
                "rank {}: grow: withdrawing stale offers: {e}",
                self.rank
            ))
        })?;
        let posted = format!("{}/join/posted", self.join_prefix);
        for rank in self.size..new_size {
            let store_err = |e: Error| {
                Error::Store(format!(
                    "rank {}: grow: offering rank {rank}'s place: {e}",
                    self.rank
                ))
            };
            let offer = Offer {
                id: id.to_string(),
                size: new_size,
                rank,
            }
            .encode();
            let n = self.store.add(&posted, 1).map_err(store_err)?;
            offered.push((n, offer.clone()));
            self.store
                .set(&offer_key(&self.join_prefix, n), &offer)
                .map_err(store_err)?;
        }
        Ok(())
    }

    /// Rank 0 of the new communicator `c` removes the argument keys of `ranks` (ranks of this
    /// one): every rank compared them before it joined the rendezvous that made `c`.
    fn forget_args(&self, c: &Communicator, ranks: &[usize]) {
        if c.rank == 0 {
            for &r in ranks {
                let _ = self.store.delete(&format!("{}/args/{r}", c.id));
            }
        }
    }

    /// Publishes this rank's arguments `args` of call `k` of `op` (new communicator `id`) and
    /// compares them with those of `ranks` (ranks of this communicator). Callers note its
    /// errors with this communicator's world ranks (`Shared::named`).
    fn agree(
        &self,
        op: &str,
        k: u64,
        id: &str,
        args: &str,
        ranks: &[usize],
        who_calls: &str,
    ) -> Result<()> {
        let key = |r: usize| format!("{id}/args/{r}");
        self.store
            .set(&key(self.rank), args.as_bytes())
            .map_err(|e| {
                Error::Store(format!(
                    "rank {}: {op}: publishing its arguments: {e} (unless oxccl launch hosts \
                     the store, it lives in rank 0's process and goes with it)",
                    self.rank
                ))
            })?;
        let deadline = Instant::now() + self.cfg.timeout;
        for &r in ranks.iter().filter(|&&r| r != self.rank) {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            let theirs = self.store.get(&key(r), left).map_err(|e| match e {
                Error::Store(msg) if bootstrap::is_wait_timeout(&msg) => Error::Timeout {
                    rank: self.rank,
                    op: op.into(),
                    timeout: self.cfg.timeout,
                    detail: format!("rank {r} did not call {op} (lost too? {who_calls}): {msg}"),
                },
                Error::Store(msg) => Error::Store(format!(
                    "rank {}: {op}: reading rank {r}'s arguments: {msg}",
                    self.rank
                )),
                other => other,
            })?;
            if theirs != args.as_bytes() {
                return Err(Error::Mismatch {
                    rank: self.rank,
                    peer: r,
                    seq: k,
                    local: format!("{op}({args})"),
                    remote: format!("{op}({})", String::from_utf8_lossy(&theirs)),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offers_round_trip_and_bad_ones_are_refused() {
        let o = Offer {
            id: "job/world0/grow1".into(),
            size: 4,
            rank: 3,
        };
        assert_eq!(Offer::decode(&o.encode()), Some(o));
        for bad in [
            &b"cancelled"[..],
            b"id\n4",
            b"id\n4\n4",
            b"\n4\n3",
            b"id\nx\n3",
            b"id\n4\n3\nmore",
            b"\xff\n4\n3",
        ] {
            assert_eq!(
                Offer::decode(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
