//! The send thread (`OXCCL_SOCKET_SEND_THREAD`): large sends to TCP peers of an exchange go
//! out on a thread of their own while the rank's thread receives and reduces.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use super::exchange::direct_frame;
use super::{copy, missing, retag, Ctx, RecvPart, SendPart};
use crate::base::error::{Error, Result};
use crate::base::stall::Stalls;
use crate::base::sys;
use crate::transport::SendConn;

/// States of an exchange split with the send thread: both threads running, the rank's thread
/// failed first, the send thread failed first.
pub(super) const RUNNING: u8 = 0;
const STOPPED_HERE: u8 = 1;
const STOPPED_BY_SENDS: u8 = 2;

/// Smallest send that goes out on the send thread ([`Ctx::exchange_split`]).
const SEND_THREAD_MIN: usize = 256 << 10;

/// The thread a rank's large sends to TCP peers go out on ([`Ctx::exchange_split`],
/// `OXCCL_SOCKET_SEND_THREAD`): a pool of one, so exchanges do not start a thread each.
pub(crate) struct SendThread {
    pool: rayon::ThreadPool,
    /// Exchanges whose sends went out on it.
    pub exchanges: AtomicU64,
}

impl SendThread {
    /// Starts the thread, named after `rank`.
    pub(crate) fn new(rank: usize) -> std::result::Result<SendThread, rayon::ThreadPoolBuildError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .thread_name(move |_| format!("oxccl-send-r{rank}"))
            .build()?;
        Ok(SendThread {
            pool,
            exchanges: AtomicU64::new(0),
        })
    }
}

impl Ctx<'_> {
    /// Whether `s` may go out on the send thread: a large plain send to a peer whose connection
    /// writes straight from the caller's memory (TCP), the only send to that peer here.
    pub(super) fn threadable(&self, s: &SendPart<'_>, all: &[SendPart<'_>]) -> bool {
        s.data.len() >= SEND_THREAD_MIN
            && s.scale.is_none()
            && all.iter().filter(|o| o.peer == s.peer).count() == 1
            && self
                .links
                .send
                .get(s.peer)
                .and_then(|c| c.as_ref())
                .is_some_and(|c| c.sends_direct())
    }

    /// [`Ctx::exchange_many`] with its large TCP sends ([`Ctx::threadable`]) on a thread of their
    /// own, so the kernel's copies into the sockets run beside this thread's receives and
    /// reductions on another core ([`crate::Config::socket_send_thread`]).
    pub(super) fn exchange_split(
        &mut self,
        thread: &SendThread,
        sends: &mut [SendPart<'_>],
        recvs: &mut [RecvPart<'_>],
    ) -> Result<()> {
        // The threaded sends go last; their connections leave `links` for the exchange.
        let mut flags: Vec<bool> = sends.iter().map(|s| self.threadable(s, sends)).collect();
        let (mut i, mut k) = (0, sends.len());
        while i < k {
            if flags[i] {
                k -= 1;
                sends.swap(i, k);
                flags.swap(i, k);
            } else {
                i += 1;
            }
        }
        let (mine, theirs) = sends.split_at_mut(k);
        let me = self.me();
        let mut conns = Vec::with_capacity(theirs.len());
        for s in theirs.iter() {
            match self.links.send.get_mut(s.peer).and_then(|c| c.take()) {
                Some(c) => conns.push(c),
                None => {
                    for (s, c) in theirs.iter().zip(conns) {
                        self.links.send[s.peer] = Some(c);
                    }
                    return Err(missing(me, self.op, s.peer, "send"));
                }
            }
        }
        let stop = AtomicU8::new(RUNNING);
        let sent = AtomicBool::new(false);
        let label = self.stall_label();
        let job = SendJob {
            deadline: self.deadline(Instant::now()),
            abort: self.abort,
            stop: &stop,
            op: self.op,
            me,
            stream: self.stream,
            timeout: self.timeout,
            stalls: self.stalls,
            trace: self.trace,
            label: label.clone(),
        };
        let first_peer = theirs.first().map_or(me, |s| s.peer);
        let mut theirs_r: Result<()> = Ok(());
        thread.exchanges.fetch_add(1, Ordering::Relaxed);
        let mine_r = thread.pool.in_place_scope(|sc| {
            let (conns, theirs, job, theirs_r, sent) =
                (&mut conns, &mut *theirs, &job, &mut theirs_r, &sent);
            sc.spawn(move |_| {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    send_loop(conns, theirs, job)
                }))
                .unwrap_or_else(|_| {
                    Err(Error::Transport {
                        rank: me,
                        peer: first_peer,
                        transport: "tcp",
                        msg: format!("{}: the send thread panicked", job.op),
                    })
                });
                if r.is_err() {
                    let _ = job.stop.compare_exchange(
                        RUNNING,
                        STOPPED_BY_SENDS,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    );
                }
                *theirs_r = r;
                sent.store(true, Ordering::Release);
            });
            // A panic here must still stop the send thread (and give the connections back
            // below) before it goes on unwinding.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.exchange_loop(mine, recvs, Some(&stop))?;
                // Keep this thread's own connections going while the sends finish: a peer
                // may need frames still queued here to drain what the send thread writes.
                while !sent.load(Ordering::Acquire) && !self.links.all_flushed() {
                    if stop.load(Ordering::Acquire) != RUNNING {
                        break;
                    }
                    if !self.links.progress_all().map_err(|e| retag(self.op, e))? {
                        self.links.poll_fds(&mut self.fds);
                        sys::poll(&self.fds, 1);
                    }
                }
                Ok(())
            }));
            if !matches!(r, Ok(Ok(()))) {
                let _ = stop.compare_exchange(
                    RUNNING,
                    STOPPED_HERE,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
            r
        });
        for (s, c) in theirs.iter().zip(conns) {
            self.links.send[s.peer] = Some(c);
        }
        let mine_r = match mine_r {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        // Whose failure stopped the exchange decides the error; when both threads reached the
        // deadline, one time-out names both waits.
        let with_report = |mut e: Error| {
            if let Error::Timeout { detail, .. } = &mut e {
                if let Some(r) = self.stalls.and_then(|s| s.report(&label.0, label.1)) {
                    *detail = format!("{detail}; {r}");
                }
            }
            e
        };
        match (mine_r, theirs_r) {
            (Ok(()), Ok(())) => Ok(()),
            (Err(m), Ok(())) => Err(m),
            (Ok(()), Err(t)) => Err(with_report(t)),
            (
                Err(Error::Timeout {
                    rank,
                    op,
                    timeout,
                    detail,
                }),
                Err(Error::Timeout {
                    detail: sending, ..
                }),
            ) => Err(Error::Timeout {
                rank,
                op,
                timeout,
                detail: format!("{sending}, {detail}"),
            }),
            (Err(m), Err(t)) => {
                if stop.load(Ordering::Acquire) == STOPPED_BY_SENDS {
                    Err(with_report(t))
                } else {
                    Err(m)
                }
            }
        }
    }
}

/// What the send thread of [`Ctx::exchange_split`] needs to know of the operation.
struct SendJob<'s> {
    deadline: Instant,
    abort: &'s AtomicBool,
    /// Set by the first thread to fail ([`STOPPED_HERE`], [`STOPPED_BY_SENDS`]): the other stops.
    stop: &'s AtomicU8,
    op: &'static str,
    me: usize,
    stream: bool,
    timeout: Duration,
    stalls: Option<&'s Stalls>,
    trace: Option<&'s crate::base::trace::Recorder>,
    /// The operation as stall reports name it, and its collective sequence number.
    label: (String, Option<u64>),
}

/// The send thread of [`Ctx::exchange_split`]: writes `parts` through their `conns` (in the same
/// order), waiting in `poll(2)` for room in the sockets, until every byte of every frame is
/// written (a frame's padding and frames queued before the exchange included: the receiver
/// needs them, and nobody else writes on these connections until they are back in `Links`),
/// `stop` is set or the operation's deadline passes. A wait that stalls is posted like the rank
/// thread's (see [`Ctx::idle`]), so a hang in a send names this rank's wait; a time-out's detail
/// says what was left to send (the caller adds the stall reports).
fn send_loop(
    conns: &mut [Box<dyn SendConn>],
    parts: &mut [SendPart<'_>],
    job: &SendJob<'_>,
) -> Result<()> {
    let waiting = |parts: &[SendPart<'_>], conns: &[Box<dyn SendConn>]| {
        parts
            .iter()
            .zip(conns)
            .filter(|(p, c)| !p.done || !c.flushed())
            .map(|(p, _)| {
                format!(
                    "sending to rank {}: {}/{} bytes (send thread)",
                    p.peer,
                    p.sent,
                    p.data.len()
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut fds = Vec::new();
    let mut idle_since: Option<Instant> = None;
    loop {
        if parts.iter().all(|p| p.done) && conns.iter().all(|c| c.flushed()) {
            return Ok(());
        }
        if job.stop.load(Ordering::Relaxed) != RUNNING {
            return Ok(()); // the exchange's own thread failed and reports why
        }
        if job.abort.load(Ordering::Relaxed) {
            return Err(Error::Aborted {
                rank: job.me,
                reason: format!("abort() called during {}", job.op),
            });
        }
        let mut moved = false;
        for (c, p) in conns.iter_mut().zip(parts.iter_mut()) {
            if p.done {
                // Only the rest of its last frame (or nothing) is left.
                moved |= c.progress().map_err(|e| retag(job.op, e))?;
                continue;
            }
            let n = c
                .send_direct(&p.data[p.sent..], p.tag, direct_frame(p.data.len()))
                .map_err(|e| retag(job.op, e))?
                .unwrap_or(0);
            if n > 0 {
                if let Some(m) = p.mirror.as_mut() {
                    copy(
                        job.stream,
                        &mut m[p.sent..p.sent + n],
                        &p.data[p.sent..p.sent + n],
                    );
                }
                p.sent += n;
                p.done = p.sent == p.data.len();
                moved = true;
            }
        }
        if moved {
            idle_since = None;
            continue;
        }
        let now = Instant::now();
        let since = *idle_since.get_or_insert(now);
        if now >= job.deadline {
            return Err(Error::Timeout {
                rank: job.me,
                op: job.op.to_string(),
                timeout: job.timeout,
                detail: waiting(parts, conns),
            });
        }
        if let Some(s) = job.stalls.filter(|s| now - since >= s.after && !s.posted()) {
            s.post(
                job.label.0.clone(),
                job.label.1,
                now - since,
                waiting(parts, conns),
            );
            if let Some(t) = job.trace {
                t.dump_in_background("stalled");
            }
        }
        fds.clear();
        for c in conns.iter() {
            c.poll_fds(&mut fds);
        }
        sys::poll(&fds, 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::op::Tag;

    #[test]
    fn the_send_thread_writes_a_frames_padding_before_it_returns() {
        use crate::transport::tcp::{padding_candidates, small_sender};
        use std::io::Read;
        let big = vec![7u8; 128 << 10];
        let mut cases = 0;
        for len in padding_candidates() {
            let (mut check, _rx) = small_sender();
            let took = check
                .send_direct(&big[..len], Tag::default(), len)
                .unwrap()
                .unwrap();
            if took != len || check.flushed() {
                continue; // not stopped in the padding: another length
            }
            // Stopped in the padding on a fresh pair: do it again through the send thread's loop,
            // with the receiver reading only after a while.
            let (tx, mut rx) = small_sender();
            let mut conns: Vec<Box<dyn SendConn>> = vec![Box::new(tx)];
            let mut parts = [SendPart::new(1, &big[..len], Tag::default())];
            let (stop, abort) = (AtomicU8::new(RUNNING), AtomicBool::new(false));
            let job = SendJob {
                deadline: Instant::now() + Duration::from_secs(10),
                abort: &abort,
                stop: &stop,
                op: "test",
                me: 0,
                stream: false,
                timeout: Duration::from_secs(10),
                stalls: None,
                trace: None,
                label: ("test".into(), None),
            };
            let got = std::thread::scope(|s| {
                let reader = s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(50));
                    let (mut got, end) = (Vec::new(), Instant::now() + Duration::from_secs(10));
                    let mut buf = vec![0u8; 1 << 16];
                    while got.len() < 64 + len.next_multiple_of(64) && Instant::now() < end {
                        match rx.read(&mut buf) {
                            Ok(0) => break,
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                            Err(_) => std::thread::sleep(Duration::from_millis(1)),
                        }
                    }
                    got.len()
                });
                send_loop(&mut conns, &mut parts, &job).unwrap();
                assert!(
                    conns[0].flushed(),
                    "frame of {len} bytes: send_loop returned with its padding unwritten"
                );
                reader.join().unwrap()
            });
            assert_eq!(got, 64 + len.next_multiple_of(64), "frame of {len} bytes");
            cases += 1;
            if cases == 2 {
                break;
            }
        }
        assert!(cases > 0, "no candidate length stopped inside the padding");
    }
}
