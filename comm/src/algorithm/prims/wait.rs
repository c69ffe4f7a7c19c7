//! Waiting: the one policy every primitive waits with (spin briefly, then yield, then sleep in
//! `poll(2)` or on the shared-memory doorbell), with the abort flag, the operation's deadline,
//! stall reports, and the window's step counters of the direct algorithms.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{missing, retag, Ctx};
use crate::base::error::{Error, Result};
use crate::base::op::OpDesc;
use crate::base::sys;
use crate::transport::Tag;

/// How long a waiting rank busy-polls before it yields the core.
const SPIN: Duration = Duration::from_micros(20);
/// Polls of the window's step counters before a waiting rank starts reading the clock.
const FAST_SPINS: u32 = 256;
/// How long it then yields between polls before it sleeps in `poll(2)`.
const YIELD: Duration = Duration::from_micros(200);

impl Ctx<'_> {
    /// Waits until every other rank has published `step` (or a later one) in the window; with
    /// `half`, also checks that each published this operation's tag (else `Mismatch`).
    pub(crate) fn wait_step(&mut self, step: u64, half: Option<usize>) -> Result<()> {
        self.direct = true;
        let mut next = 0;
        let mut spins = 0u32;
        loop {
            // While polling fast this call cannot sleep, so the doorbell (a call through the
            // transport) is armed only on the turns that may end in `idle`.
            let fast = self.spin && self.idle_since.is_none() && spins < FAST_SPINS;
            if !fast {
                self.arm();
            }
            let before = next;
            let (rank, size, tag) = (self.rank, self.size, self.tag);
            let w = self
                .links
                .window
                .as_deref_mut()
                .ok_or_else(|| missing(rank, self.op, rank, "window"))?;
            while next < size {
                if next == rank {
                    next += 1;
                    continue;
                }
                if w.step(next, half) < step {
                    break;
                }
                if let Some(h) = half {
                    let theirs = w.peer_tag(next, h);
                    if theirs != Some(tag) {
                        return Err(Error::Mismatch {
                            rank,
                            peer: next,
                            seq: tag.seq,
                            local: OpDesc::describe_tag(&tag),
                            remote: theirs.map_or("nothing".into(), |t| OpDesc::describe_tag(&t)),
                        });
                    }
                }
                next += 1;
            }
            if next == size {
                self.moved();
                return Ok(());
            }
            if next != before {
                self.idle_since = None; // still announced, if it was: it quiets when done
            }
            let p = next;
            // A peer usually arrives within a microsecond or two: poll its counter without
            // reading the clock first, then fall back to the full wait (liveness, deadline, sleep).
            if fast {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            if let Err(e) = w.check(p) {
                // The peer may have published its last step and left after the load above: its
                // step store comes before its goodbye (or exit), so an acquire reload sees it.
                if w.step(p, half) < step {
                    return Err(retag(self.op, e));
                }
                continue;
            }
            self.idle(&|| format!("waiting for rank {p} to reach direct step {step}"))?;
        }
    }

    /// A peer runs this collective (same sequence number) through the other path: through the
    /// window while this rank uses slots, or the reverse. Both would wait forever; say so.
    pub(super) fn cross_check(&mut self) -> Result<()> {
        if !self.collective || self.left_window {
            return Ok(());
        }
        let (rank, size, tag, direct) = (self.rank, self.size, self.tag, self.direct);
        if self.map.is_some() {
            return Ok(()); // sub-contexts run on communicators spanning nodes: no window
        }
        let Some(w) = self.links.window.as_deref() else {
            return Ok(());
        };
        let is_coll = |t: &Tag| {
            OpDesc::from_tag(t).is_some_and(|d| d.coll != crate::base::op::Collective::SendRecv)
        };
        for p in (0..size).filter(|&p| p != rank) {
            let other = if direct {
                match self.links.recv.get_mut(p).and_then(|c| c.as_mut()) {
                    Some(c) => match c.try_recv() {
                        Ok(Some((t, _))) => Some(t),
                        _ => None,
                    },
                    None => None,
                }
                .filter(|t| t.seq == tag.seq && is_coll(t))
                // A peer that published this operation in the window too has left it for the
                // slots, as this rank will (a mapped algorithm's fallback), not the reverse.
                .filter(|_| !(0..2).any(|h| w.peer_tag(p, h).is_some_and(|t| t.seq == tag.seq)))
                .map(|t| (t, "runs a slot-based algorithm"))
            } else {
                (0..2)
                    .filter_map(|h| w.peer_tag(p, h))
                    .find(|t| t.seq == tag.seq)
                    .map(|t| (t, "runs a direct shared-memory algorithm"))
            };
            if let Some((t, how)) = other {
                return Err(Error::Mismatch {
                    rank,
                    peer: p,
                    seq: tag.seq,
                    local: OpDesc::describe_tag(&tag),
                    remote: format!("{} (it {how})", OpDesc::describe_tag(&t)),
                });
            }
        }
        Ok(())
    }

    /// Something moved: the next wait starts with a spin again, and peers' posts need not ring
    /// this rank's doorbell until it sleeps again.
    pub(super) fn moved(&mut self) {
        self.idle_since = None;
        self.links.quiet();
    }

    /// Starts a round of checks: remembers the doorbell counter so a post that lands during the
    /// round ends the next sleep at once.
    pub(super) fn arm(&mut self) {
        if let Some(b) = &self.links.bell {
            self.bell_seen = b.seq();
        }
    }

    /// The operation as stall reports name it, and its collective sequence number.
    pub(super) fn stall_label(&self) -> (String, Option<u64>) {
        match OpDesc::from_tag(&self.tag).filter(|_| self.collective) {
            Some(d) => (d.to_string(), Some(self.tag.seq)),
            None => (self.op.to_string(), None),
        }
    }

    /// Nothing moved: keep every connection going, then wait a little.
    pub(super) fn idle(&mut self, waiting: &dyn Fn() -> String) -> Result<()> {
        if self.abort.load(Ordering::Relaxed) {
            return Err(Error::Aborted {
                rank: self.me(),
                reason: format!("abort() called during {}", self.op),
            });
        }
        if self.links.progress_all().map_err(|e| retag(self.op, e))? {
            self.moved();
            return Ok(());
        }
        let now = Instant::now();
        if now >= self.deadline(now) {
            let mut detail = waiting();
            if let Some(s) = self.stalls {
                let (op, seq) = self.stall_label();
                if let Some(report) = s.report(&op, seq) {
                    detail = format!("{detail}; {report}");
                }
            }
            return Err(Error::Timeout {
                rank: self.me(),
                op: self.op.to_string(),
                timeout: self.timeout,
                detail,
            });
        }
        // Busy-poll briefly (a peer's reply usually lands within microseconds), then yield the
        // core to other ranks, then sleep in poll(2) until a socket is ready.
        let since = *self.idle_since.get_or_insert(now);
        let waited = now - since;
        if let Some(s) = self.stalls.filter(|s| waited >= s.after && !s.posted()) {
            let (op, seq) = self.stall_label();
            s.post(op, seq, waited, waiting());
            // The hang may last until the time-out: its record is on disk from now on.
            if let Some(t) = self.trace {
                t.dump_in_background("stalled");
            }
        }
        let spin = if self.spin { SPIN } else { Duration::ZERO };
        if waited < spin {
            std::hint::spin_loop();
            return Ok(());
        }
        self.cross_check()?;
        if waited < spin + YIELD {
            std::thread::yield_now();
        } else {
            self.links.poll_fds(&mut self.fds);
            if self.links.announce() {
                // Posts ring the doorbell from now on; one that landed before the announcement is
                // seen by the next round of checks (which re-reads the counter first).
                return Ok(());
            }
            match self.links.bell.as_ref() {
                // Shared-memory peers ring our doorbell; sleep on it (briefly, if sockets must be
                // watched too) unless it rang since this round of checks began.
                Some(bell) => {
                    let nap = if self.fds.is_empty() {
                        Duration::from_millis(1)
                    } else {
                        Duration::from_micros(50)
                    };
                    bell.sleep_since(self.bell_seen, nap);
                    if !self.fds.is_empty() {
                        sys::poll(&self.fds, 0);
                    }
                }
                None => sys::poll(&self.fds, 1),
            }
        }
        Ok(())
    }

    /// Waits until everything posted has left this rank, so no data is stranded in a staging slot
    /// when the operation returns.
    pub(crate) fn flush(&mut self) -> Result<()> {
        while !self.links.all_flushed() {
            self.arm();
            self.idle(&|| "flushing sends".to_string())?;
        }
        Ok(())
    }
}
