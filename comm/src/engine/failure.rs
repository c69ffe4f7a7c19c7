//! Failure: breaking a communicator after a failed operation, publishing the first cause in
//! the store so every rank reports the same one, and `abort()`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::{lock, ExecState, Failures, Shared, PUBLISH_BUDGET};
use crate::base::error::Error;

impl Shared {
    /// Marks the communicator broken after `e`, publishes the first cause, drops every connection,
    /// and returns the error this rank reports.
    pub(crate) fn fail(&self, st: &mut ExecState, e: Error) -> Error {
        if matches!(e, Error::InvalidArgument { .. }) {
            return e;
        }
        if let Some(b) = &st.broken {
            return b.clone();
        }
        let cause = self.publish_error_as(e, st.current.as_ref());
        // The caller receives the error as a `Result`: a debug line, not a warning.
        tracing::debug!(rank = self.rank, error = %self.named(cause.clone()), "communicator failed; closing its connections");
        // Peers blocked on this rank learn at once: sockets close, shared-memory rings are
        // flagged closed and their doorbells rung.
        st.links.close(Instant::now());
        st.broken = Some(cause.clone());
        // The channels are of no use any more: close theirs too (they publish under this
        // communicator's key, where the cause stands already).
        if let Some(ch) = self.channels.get() {
            ch.abort();
        }
        // After closing: peers learn first, the file can wait.
        self.trace.dump_if_set("failed", Some(&cause));
        cause
    }

    /// Publishes `e` as the communicator's failure unless a rank published one first; returns
    /// the one that stands (every rank then reports the same cause). Peers learn of a failure by
    /// their connections closing, so this comes first.
    pub(crate) fn publish_error(&self, e: Error) -> Error {
        self.publish_error_as(e, None)
    }

    /// [`Shared::publish_error`], telling a mismatch another rank published from this rank's
    /// point of view with the tag of its current collective (`own`).
    fn publish_error_as(&self, e: Error, own: Option<&crate::base::op::Tag>) -> Error {
        let mut published = lock(&self.published);
        if let Some(cause) = &*published {
            return cause.clone();
        }
        let e = match lock(&self.cut_call).clone() {
            Some((channel, seq, call)) => {
                crate::engine::channels::as_the_callers(e, channel, seq, call)
            }
            None => e,
        };
        let mine = encode_error(&e);
        // A store that cannot be reached (the store host's node cut off) must not delay closing
        // the connections, which is how peers learn: a few seconds at most.
        let budget = self.timeout.min(PUBLISH_BUDGET);
        match self
            .store
            .compare_set_within(&self.error_key, None, &mine, budget)
        {
            Ok(cur) => {
                let cause = if cur == mine {
                    e
                } else {
                    decode_error(&cur, self.rank, own).unwrap_or(e)
                };
                *published = Some(cause.clone());
                cause
            }
            // Not published: a later caller tries again.
            Err(_) => e,
        }
    }

    /// Where failures are published, and the cause once there is one: a channel takes its
    /// parent's ([`Shared::share_failures`]).
    pub(crate) fn failures(&self) -> Failures {
        (self.error_key.clone(), Arc::clone(&self.published))
    }

    /// Publishes failures where `of` (a parent's [`Shared::failures`]) says, sharing its cause;
    /// its stall reports look there for a published error too.
    pub(crate) fn share_failures(&mut self, of: Failures) {
        (self.error_key, self.published) = of;
        self.stalls.set_error_key(self.error_key.clone());
    }

    /// `abort()`: fails the running operation (it polls the flag) and every later one.
    pub(crate) fn abort(&self) {
        self.abort.store(true, Ordering::Relaxed);
        if let Some(ch) = self.channels.get() {
            ch.abort();
        }
        if let Ok(mut st) = self.exec.try_lock() {
            let e = Error::Aborted {
                rank: self.rank,
                reason: "abort() was called on this rank".into(),
            };
            self.fail(&mut st, e);
        }
    }
}

/// Encodes an error for the store: `kind \n rank \n peer \n seq \n local \n remote \n message`.
pub(super) fn encode_error(e: &Error) -> Vec<u8> {
    let (rank, peer, seq, local, remote) = match e {
        Error::Mismatch {
            rank,
            peer,
            seq,
            local,
            remote,
        } => (*rank, *peer, *seq, local.clone(), remote.clone()),
        Error::PeerLost {
            rank, peer, detail, ..
        } => (*rank, *peer, 0, String::new(), detail.clone()),
        _ => (0, 0, 0, String::new(), String::new()),
    };
    let clean = |s: String| s.replace('\n', " ");
    format!(
        "{}\n{rank}\n{peer}\n{seq}\n{}\n{}\n{}",
        e.kind(),
        clean(local),
        clean(remote),
        clean(e.to_string())
    )
    .into_bytes()
}

/// A mismatch that rank `d` found between its call (`local`) and rank `p`'s (`remote`) at op
/// `seq`, as rank `me` reports it: "this rank called (its own call), rank R called (a call that
/// differs from it)", the same facts on every rank. `mine` is `me`'s current collective.
fn mismatch_as(
    me: usize,
    (d, p, seq): (usize, usize, u64),
    local: &str,
    remote: &str,
    mine: Option<&crate::base::op::Tag>,
) -> Error {
    let told = |peer: usize, local: String, remote: &str| Error::Mismatch {
        rank: me,
        peer,
        seq,
        local,
        remote: remote.to_string(),
    };
    if me == d {
        return told(p, local.into(), remote);
    }
    if me == p {
        // `remote` may carry a note on how `p` runs it: "... (it runs ...)".
        let own = remote.split(" (it ").next().unwrap_or(remote);
        return told(d, own.into(), local);
    }
    match mine
        .filter(|t| t.seq == seq)
        .map(crate::base::op::OpDesc::describe_tag)
    {
        Some(own) if own == local => told(p, own, remote),
        Some(own) => told(d, own, local),
        None => told(d, format!("nothing yet at op #{seq}"), local),
    }
}

/// Rebuilds a published error as seen from `me` (whose current collective is `mine`).
pub(super) fn decode_error(
    b: &[u8],
    me: usize,
    mine: Option<&crate::base::op::Tag>,
) -> Option<Error> {
    let s = std::str::from_utf8(b).ok()?;
    let f: Vec<&str> = s.splitn(7, '\n').collect();
    if f.len() != 7 {
        return None;
    }
    let (rank, peer, seq) = (f[1].parse().ok()?, f[2].parse().ok()?, f[3].parse().ok()?);
    Some(match f[0] {
        "mismatch" => mismatch_as(me, (rank, peer, seq), f[4], f[5], mine),
        "peer-lost" => Error::PeerLost {
            rank: me,
            peer,
            op: "collective".into(),
            detail: format!("reported by rank {rank}: {}", f[5]),
        },
        _ => Error::Aborted {
            rank: me,
            reason: format!("another rank failed first: {}", f[6]),
        },
    })
}
