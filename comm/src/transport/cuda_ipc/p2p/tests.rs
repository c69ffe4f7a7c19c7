//! The p2p protocol on a host model of the device: every rank a thread running its steps in
//! order, as its stream would; flag blocks of atomics; inboxes of two halves per ordered pair.
//! Ranks run unsynchronised except by the flags, so a plan that read a half before its chunk was
//! published, overwrote one before it was acknowledged, or waited in a cycle would give wrong
//! data or time out here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;

/// The model's memory: each rank's flag block, and each (receiver, sender) inbox.
struct World {
    n: usize,
    chunk: usize,
    flags: Vec<Vec<AtomicU64>>,
    inbox: Vec<Mutex<Vec<u8>>>,
}

impl World {
    fn new(n: usize, chunk: usize) -> World {
        World {
            n,
            chunk,
            flags: (0..n)
                .map(|_| (0..FLAG_WORDS).map(|_| AtomicU64::new(0)).collect())
                .collect(),
            inbox: (0..n * n)
                .map(|_| Mutex::new(vec![0u8; 2 * chunk]))
                .collect(),
        }
    }

    fn inbox(&self, receiver: usize, sender: usize) -> std::sync::MutexGuard<'_, Vec<u8>> {
        self.inbox[receiver * self.n + sender].lock().unwrap()
    }

    /// Waits until `pred` holds for word `w` of `owner`'s block, or `limit` passes.
    fn wait(&self, owner: usize, w: usize, limit: Duration, pred: impl Fn(u64) -> bool) -> bool {
        let end = Instant::now() + limit;
        loop {
            if pred(self.flags[owner][w].load(Ordering::Acquire)) {
                return true;
            }
            if Instant::now() > end {
                return false;
            }
            std::thread::yield_now();
        }
    }

    /// Runs rank `me`'s steps on its buffers (one per message: what it sends, or where it
    /// receives).
    fn run(&self, me: usize, steps: &[P2pStep], bufs: &mut [Vec<u8>]) -> Result<(), String> {
        let limit = Duration::from_secs(10);
        let half = |k: u32| (k % 2) as usize * self.chunk;
        for s in steps {
            match s {
                P2pStep::WaitAck { peer, k } => {
                    if !self.wait(me, ack_word(*peer), limit, |v| v as u32 >= *k) {
                        return Err(format!("rank {me}: no acknowledgement {k} from {peer}"));
                    }
                }
                P2pStep::Put {
                    msg,
                    peer,
                    range,
                    k,
                } => {
                    let h = half(*k);
                    self.inbox(*peer, me)[h..h + range.len()]
                        .copy_from_slice(&bufs[*msg][range.clone()]);
                }
                P2pStep::Post { peer, k, tag } => {
                    let v = (u64::from(*tag) << 32) | u64::from(*k);
                    self.flags[*peer][ready_word(me, *k)].store(v, Ordering::Release);
                }
                P2pStep::WaitReady { peer, k, tag } => {
                    let w = ready_word(*peer, *k);
                    if !self.wait(me, w, limit, |v| v as u32 == *k) {
                        return Err(format!("rank {me}: chunk {k} from {peer} never came"));
                    }
                    let got = (self.flags[me][w].load(Ordering::Acquire) >> 32) as u32;
                    if got != *tag {
                        let show = |t: u32| {
                            let end = if t & LAST_CHUNK != 0 { ", last" } else { "" };
                            format!("{} bytes{end}", t & !LAST_CHUNK)
                        };
                        return Err(format!(
                            "rank {me}: chunk {k} from rank {peer} has {}, this receive \
                             expects {}",
                            show(got),
                            show(*tag)
                        ));
                    }
                }
                P2pStep::Take {
                    msg,
                    peer,
                    range,
                    k,
                } => {
                    let h = half(*k);
                    let src = self.inbox(me, *peer)[h..h + range.len()].to_vec();
                    bufs[*msg][range.clone()].copy_from_slice(&src);
                }
                P2pStep::Ack { peer, k } => {
                    self.flags[*peer][ack_word(me)].store(u64::from(*k), Ordering::Release);
                }
                P2pStep::Local { from, to, len } => {
                    let src = bufs[*from][..*len].to_vec();
                    bufs[*to][..*len].copy_from_slice(&src);
                }
            }
        }
        Ok(())
    }
}

/// A message of a test batch: from `src` to `dst`, `bytes` long.
type Wire = (usize, usize, usize);

/// The bytes message `i` of batch `b` carries.
fn payload(b: usize, i: usize, bytes: usize) -> Vec<u8> {
    (0..bytes)
        .map(|x| (b * 31 + i * 7 + x * 13 % 251) as u8)
        .collect()
}

/// Runs `batches` on `n` ranks (every rank posts its part of each batch in the batch's order)
/// and checks every received message; `skew` ((rank, batch, message), bytes) changes the length
/// one rank's receive expects by that many bytes.
fn play(
    n: usize,
    chunk: usize,
    batches: &[Vec<Wire>],
    skew: Option<((usize, usize, usize), i64)>,
) -> Vec<Result<(), String>> {
    let world = Arc::new(World::new(n, chunk));
    let handles: Vec<_> = (0..n)
        .map(|me| {
            let world = Arc::clone(&world);
            let batches = batches.to_vec();
            std::thread::spawn(move || -> Result<(), String> {
                let mut cur = P2pCursor::default();
                for (b, batch) in batches.iter().enumerate() {
                    let mut msgs = Vec::new();
                    let mut bufs = Vec::new();
                    let mut want = Vec::new();
                    for (i, &(src, dst, bytes)) in batch.iter().enumerate() {
                        if src == me {
                            msgs.push(Msg {
                                send: true,
                                peer: dst,
                                bytes,
                            });
                            bufs.push(payload(b, i, bytes));
                            want.push(None);
                        }
                        if dst == me {
                            let bytes = match skew {
                                Some(((r, sb, si), d)) if r == me && sb == b && si == i => {
                                    bytes.saturating_add_signed(d as isize)
                                }
                                _ => bytes,
                            };
                            msgs.push(Msg {
                                send: false,
                                peer: src,
                                bytes,
                            });
                            bufs.push(vec![0xEE; bytes]);
                            want.push(Some(payload(b, i, bytes)));
                        }
                    }
                    let steps = p2p_plan(me, n, &msgs, chunk, &mut cur)?;
                    world.run(me, &steps, &mut bufs)?;
                    for (k, w) in want.iter().enumerate() {
                        if let Some(w) = w {
                            if &bufs[k] != w {
                                return Err(format!("rank {me} batch {b}: message {k} differs"));
                            }
                        }
                    }
                }
                Ok(())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn batches(n: usize) -> impl Strategy<Value = Vec<Vec<Wire>>> {
    let msg = (
        0..n,
        0..n,
        prop_oneof![Just(0usize), 1usize..40, 40usize..400],
    );
    prop::collection::vec(prop::collection::vec(msg, 0..10), 1..5)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn cuda_ipc_p2p_any_batches_deliver_every_message(
        (n, chunk, b) in (2usize..=5, prop_oneof![Just(1usize), Just(7), Just(64)])
            .prop_flat_map(|(n, c)| (Just(n), Just(c), batches(n)))
    ) {
        for (r, res) in play(n, chunk, &b, None).into_iter().enumerate() {
            prop_assert!(res.is_ok(), "rank {r}: {res:?} ({b:?})");
        }
    }
}

#[test]
fn cuda_ipc_p2p_a_ring_both_ways_and_a_large_message_in_many_chunks() {
    let n = 4;
    let ring: Vec<Wire> = (0..n)
        .flat_map(|r| [(r, (r + 1) % n, 1000), (r, (r + n - 1) % n, 333)])
        .collect();
    let big = vec![(0, 3, 5000), (3, 0, 4999), (1, 1, 77), (2, 1, 0)];
    // Several messages on one pair both ways in one batch: each side's third send waits for
    // the other's first acknowledgement (rounds by message chunk, not by pair chunk, hung here).
    let many = vec![
        (0, 1, 10),
        (0, 1, 10),
        (0, 1, 10),
        (1, 0, 10),
        (1, 0, 10),
        (1, 0, 10),
    ];
    for res in play(n, 64, &[ring, big, many], None) {
        res.unwrap();
    }
}

#[test]
fn cuda_ipc_p2p_a_length_that_differs_is_named_by_the_receiver() {
    let batch = vec![(0, 1, 100), (1, 0, 100)];
    let out = play(2, 64, &[batch], Some(((1, 0, 0), 1)));
    let e = out[1].as_ref().unwrap_err();
    assert!(
        e.contains("chunk 2 from rank 0 has 36 bytes, last, this receive expects 37 bytes, last"),
        "{e}"
    );
}

/// Messages whose lengths differ by whole chunks: every chunk the receiver expects has the
/// length the sender's has, but the message ends at another chunk, which the last-chunk mark
/// shows (without it the pair would drift a chunk apart, each receive taking the wrong bytes).
#[test]
fn cuda_ipc_p2p_lengths_that_differ_by_whole_chunks_are_named() {
    // Rank 0 sends 128 bytes (two chunks of 64); rank 1 expects 64 (skewed by -64), then the
    // reverse (64 sent, 128 expected).
    for (sent, skew) in [(128, -64i64), (64, 64)] {
        let batch = vec![(0, 1, sent)];
        let out = play(2, 64, &[batch], Some(((1, 0, 0), skew)));
        let e = out[1].as_ref().unwrap_err();
        assert!(
            e.contains("chunk 1 from rank 0 has 64 bytes") && e.contains("this receive expects 64"),
            "{sent} sent, skew {skew}: {e}"
        );
    }
}

#[test]
fn cuda_ipc_p2p_refuses_bad_batches_before_planning() {
    let mut cur = P2pCursor::default();
    let to = |peer, bytes| Msg {
        send: true,
        peer,
        bytes,
    };
    let from = |peer, bytes| Msg {
        send: false,
        peer,
        bytes,
    };
    assert!(p2p_plan(0, 2, &[to(2, 1)], 64, &mut cur).is_err());
    assert!(p2p_plan(1, 2, &[to(1, 8), from(1, 9)], 64, &mut cur).is_err());
    assert!(p2p_plan(0, 2, &[to(1, 8)], 0, &mut cur).is_err());
    assert!(p2p_plan(0, 9, &[], 64, &mut cur).is_err());
    assert_eq!(cur, P2pCursor::default());
    // An empty message is one chunk; a message of 3 chunks takes 3 rounds.
    let steps = p2p_plan(0, 2, &[to(1, 0), from(1, 130)], 64, &mut cur).unwrap();
    assert_eq!(cur.sent[1], 1);
    assert_eq!(cur.got[1], 3);
    assert_eq!(
        steps
            .iter()
            .filter(|s| matches!(s, P2pStep::Take { .. }))
            .count(),
        3
    );
}

/// The p2p area lies after the collectives' slots, its flag words and every inbox half apart
/// and inside the allocation, the inboxes 256-byte aligned (for any slot the configuration
/// takes, and 1 to 8 ranks).
#[test]
fn cuda_ipc_p2p_layout_keeps_flags_and_inboxes_apart_inside_the_scratch() {
    for slot in [4096, 4097, 1 << 20, 32 << 20, 100 << 20] {
        for n in 1..=MAX_RANKS {
            let l = P2pLayout::new(slot, n);
            assert!(l.chunk >= 1 && l.chunk <= MAX_CHUNK && l.chunk <= slot / 2);
            assert_eq!(l.flags, FLAGS_BYTES + 2 * slot);
            assert!(FLAG_WORDS * 8 <= l.flag_bytes());
            let last_word = l.word(0, FLAG_WORDS - 1) as usize + 8;
            let mut spans: Vec<(usize, usize)> = vec![(l.flags, last_word)];
            for s in 0..n {
                for k in [1u32, 2] {
                    let at = l.inbox(0, s, k) as usize;
                    assert_eq!((at - l.flags) % 256, 0, "slot {slot}, {n} ranks");
                    spans.push((at, at + l.chunk));
                }
            }
            spans.sort_unstable();
            assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "{spans:?}");
            assert!(spans.last().is_some_and(|s| s.1 <= l.scratch_bytes()));
            // Addresses move with the base.
            assert_eq!(l.inbox(1 << 40, n - 1, 3), (1 << 40) + l.inbox(0, n - 1, 3));
        }
    }
}
