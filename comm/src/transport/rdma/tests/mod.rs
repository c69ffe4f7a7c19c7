use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use proptest::prelude::*;

use super::sim::SimControl;
use crate::transport::registry::Entry;
use crate::Registered;

use super::conn::{Ends, RdmaRecv, RdmaSend};
use super::proto::{RecvState, SendState, HEADER};
use super::sim::{pair, SimQp};
use crate::base::op::Tag;
use crate::transport::registry::{RegCache, Registry};
use crate::transport::{RecvConn, SendConn};

fn conn(
    slots: usize,
    payload: usize,
) -> (RdmaSend<SimQp>, RdmaRecv<SimQp>, super::sim::SimControl) {
    let (tx, rx, ctl, _) = conn_counted(slots, payload);
    (tx, rx, ctl)
}

/// A connection, with its sender's registrations of user buffers and its count of bytes sent
/// straight from them.
fn conn_counted(
    slots: usize,
    payload: usize,
) -> (RdmaSend<SimQp>, RdmaRecv<SimQp>, SimControl, Counted) {
    let user = Arc::new(RegCache::new(Registry::global()));
    let (a, b, ctl) = pair(slots * (HEADER + payload), &user);
    let ends = Ends { rank: 0, peer: 1 };
    let back = Ends { rank: 1, peer: 0 };
    let bytes = Arc::new(AtomicU64::new(0));
    let landed = Arc::new(AtomicU64::new(0));
    (
        RdmaSend::new(a, (slots, payload), ends, Arc::clone(&bytes)),
        RdmaRecv::new(b, (slots, payload), back, Arc::clone(&landed)),
        ctl,
        Counted {
            user,
            bytes,
            landed,
        },
    )
}

struct Counted {
    user: Arc<RegCache<Entry>>,
    /// Bytes sent straight from registered buffers.
    bytes: Arc<AtomicU64>,
    /// Bytes that landed in offered buffers.
    landed: Arc<AtomicU64>,
}

fn tag(seq: u64) -> Tag {
    Tag {
        seq,
        desc: 7,
        count: seq * 3,
    }
}

#[test]
fn the_counters_refuse_what_the_protocol_forbids() {
    let mut s = SendState::new(2);
    assert_eq!(s.post().unwrap(), (0, 0));
    assert_eq!(s.post().unwrap(), (1, 1));
    assert!(s.free().is_none(), "two slots, both in flight");
    assert!(s.post().is_err());
    assert!(s.credit(3).is_err(), "more credits than messages");
    s.credit(1).unwrap();
    assert!(
        s.free().is_none(),
        "released, but its write has not completed"
    );
    s.completed().unwrap();
    assert_eq!(s.free(), Some(0));
    let mut r = RecvState::new(2);
    assert!(r.arrived(1).is_err(), "slot out of order");
    r.arrived(0).unwrap();
    r.arrived(1).unwrap();
    assert!(
        r.arrived(0).is_err(),
        "a third message with both slots unreleased"
    );
    assert!(RecvState::new(2).release().is_err());
}

#[test]
fn messages_cross_in_order_with_their_tags() {
    let (mut tx, mut rx, _) = conn(4, 64);
    let mut got = Vec::new();
    let mut next = 0u64;
    while got.len() < 20 {
        if next < 20 {
            if let Some(slot) = tx.try_slot().unwrap() {
                let n = (next as usize * 7) % 64;
                slot[..n].fill(next as u8);
                tx.post(n, tag(next)).unwrap();
                next += 1;
            }
        }
        if let Some((t, data)) = rx.try_recv().unwrap() {
            got.push((t, data.to_vec()));
            rx.release().unwrap();
        }
        tx.progress().unwrap();
    }
    for (k, (t, d)) in got.iter().enumerate() {
        assert_eq!(*t, tag(k as u64));
        assert_eq!(d, &vec![k as u8; (k * 7) % 64]);
    }
}

#[test]
fn a_queue_pair_in_error_is_a_lost_peer_on_both_ends() {
    let (mut tx, mut rx, ctl) = conn(2, 64);
    ctl.fail(12, "transport retry counter exceeded");
    let e = tx.progress().unwrap_err().to_string();
    assert!(
        e.contains("peer rank 1 lost") && e.contains("status 12"),
        "{e}"
    );
    let e = rx.try_recv().unwrap_err().to_string();
    assert!(e.contains("peer rank 0 lost"), "{e}");
}

#[test]
fn goodbyes_fail_the_other_side_instead_of_a_wait() {
    let (mut tx, mut rx, _) = conn(2, 64);
    tx.close(std::time::Instant::now());
    let e = rx.try_recv().unwrap_err().to_string();
    assert!(e.contains("the sender closed"), "{e}");
    let (mut tx, mut rx, _) = conn(2, 64);
    rx.close();
    tx.progress().unwrap();
    let _ = tx.try_slot().unwrap().expect("a free slot");
    let e = tx.post(0, tag(0)).unwrap_err().to_string();
    assert!(e.contains("the receiver closed"), "{e}");
}

#[test]
fn a_stream_between_two_threads_arrives_whole() {
    let (mut tx, mut rx, _) = conn(8, 4096);
    let total = 2000u64;
    std::thread::scope(|s| {
        s.spawn(move || {
            for k in 0..total {
                let slot = loop {
                    if tx.try_slot().unwrap().is_some() {
                        break tx.try_slot().unwrap().unwrap();
                    }
                    std::thread::yield_now();
                };
                slot[..8].copy_from_slice(&k.to_le_bytes());
                tx.post(8, tag(k)).unwrap();
            }
            while !tx.flushed() {
                tx.progress().unwrap();
                std::thread::yield_now();
            }
        });
        let mut k = 0;
        while k < total {
            match rx.try_recv().unwrap() {
                Some((t, d)) => {
                    assert_eq!(t, tag(k));
                    assert_eq!(u64::from_le_bytes(d[..8].try_into().unwrap()), k);
                    rx.release().unwrap();
                    k += 1;
                }
                None => std::thread::yield_now(),
            }
        }
    });
}

/// Takes and releases up to `n` of the messages that have arrived, into `got`.
fn recv_up_to(
    rx: &mut RdmaRecv<SimQp>,
    n: usize,
    got: &mut Vec<(Tag, Vec<u8>)>,
) -> crate::Result<()> {
    for _ in 0..n {
        let Some((t, d)) = rx.try_recv()? else {
            break;
        };
        got.push((t, d.to_vec()));
        rx.release()?;
    }
    Ok(())
}

/// What a step of the interleaving does.
#[derive(Clone, Debug)]
enum Move {
    /// The sender posts the next message if a slot is free.
    Send,
    /// The receiver takes and releases what has arrived, up to this many.
    Recv(usize),
    /// Delivery to the receiver (0) or to the sender (1) held or let go.
    Hold(usize, bool),
    /// The sender polls.
    Poll,
}

/// Plays `script` with `step`, then lets delivery go both ways and runs sends, receives and
/// polls long enough (8 rounds per byte of `total`, and 8) for whatever was in flight to arrive.
fn play(
    ctl: &SimControl,
    script: &[Move],
    total: usize,
    tx: &mut RdmaSend<SimQp>,
    rx: &mut RdmaRecv<SimQp>,
    mut step: impl FnMut(&Move, &mut RdmaSend<SimQp>, &mut RdmaRecv<SimQp>) -> crate::Result<()>,
) {
    for m in script {
        step(m, tx, rx).unwrap();
    }
    ctl.hold(0, false);
    ctl.hold(1, false);
    for _ in 0..8 * total + 8 {
        step(&Move::Send, tx, rx).unwrap();
        step(&Move::Recv(4), tx, rx).unwrap();
        step(&Move::Poll, tx, rx).unwrap();
    }
}

fn moves() -> impl Strategy<Value = Vec<Move>> {
    prop::collection::vec(
        prop_oneof![
            3 => Just(Move::Send),
            2 => (1usize..4).prop_map(Move::Recv),
            1 => (0usize..2, any::<bool>()).prop_map(|(e, h)| Move::Hold(e, h)),
            1 => Just(Move::Poll),
        ],
        1..200,
    )
}

proptest! {
    /// Any interleaving of the two ends, with delivery held back either way at any time, and
    /// messages of any length up to a slot: the receiver gets exactly the messages sent, in
    /// order, and neither side ever breaks the protocol (no overrun slot, no lost credit).
    #[test]
    fn any_interleaving_delivers_every_message_in_order(
        slots in 1usize..5,
        lens in prop::collection::vec(0usize..=96, 1..40),
        script in moves(),
    ) {
        let (mut tx, mut rx, ctl) = conn(slots, 96);
        let (mut sent, mut got) = (0usize, Vec::new());
        let run = |m: &Move, tx: &mut RdmaSend<SimQp>, rx: &mut RdmaRecv<SimQp>, sent: &mut usize, got: &mut Vec<(Tag, Vec<u8>)>| -> crate::Result<()> {
            match *m {
                Move::Send if *sent < lens.len() => {
                    if let Some(slot) = tx.try_slot()? {
                        let n = lens[*sent];
                        slot[..n].fill(*sent as u8);
                        tx.post(n, tag(*sent as u64))?;
                        *sent += 1;
                    }
                }
                Move::Recv(k) => recv_up_to(rx, k, got)?,
                Move::Hold(end, h) => ctl.hold(end ^ 1, h),
                _ => {
                    tx.progress()?;
                }
            }
            Ok(())
        };
        for m in &script {
            run(m, &mut tx, &mut rx, &mut sent, &mut got).unwrap();
        }
        // Then let everything through and drain.
        ctl.hold(0, false);
        ctl.hold(1, false);
        for _ in 0..4 * lens.len() + 8 {
            run(&Move::Send, &mut tx, &mut rx, &mut sent, &mut got).unwrap();
            run(&Move::Recv(4), &mut tx, &mut rx, &mut sent, &mut got).unwrap();
            run(&Move::Poll, &mut tx, &mut rx, &mut sent, &mut got).unwrap();
        }
        prop_assert_eq!(got.len(), lens.len());
        for (k, (t, d)) in got.iter().enumerate() {
            prop_assert_eq!(*t, tag(k as u64));
            prop_assert_eq!(d, &vec![k as u8; lens[k]]);
        }
        prop_assert!(tx.flushed());
    }
}

#[test]
fn verbs_reach_needs_a_port_on_both_ranks_and_says_whose_is_missing() {
    use crate::transport::{PeerInfo, Reach};
    let rec = |rank: usize, rdma: &str| PeerInfo {
        rank,
        node_id: format!("n{rank}"),
        pid: 1,
        tcp_addr: String::new(),
        cpus: Vec::new(),
        node_ranks: 0,
        node_cpus: 0,
        rdma: rdma.into(),
        settings: Vec::new(),
    };
    let reach = super::transport::ports_reach;
    assert_eq!(reach(&rec(0, "mlx5_0:1"), &rec(1, "mlx5_1:1")), Reach::Yes);
    let Reach::No(why) = reach(&rec(0, "mlx5_0:1"), &rec(1, "!no verbs device")) else {
        panic!("a rank without a port connects nothing")
    };
    assert!(
        why.contains("rank 1") && why.contains("no verbs device"),
        "{why}"
    );
    let Reach::No(why) = reach(&rec(0, ""), &rec(1, "mlx5_0:1")) else {
        panic!("a rank that did not probe connects nothing")
    };
    assert!(
        why.contains("rank 0") && why.contains("feature `rdma`"),
        "{why}"
    );
}

/// Drains what has arrived into `got` as (tag, bytes) frames.
fn take_all(rx: &mut RdmaRecv<SimQp>, got: &mut Vec<(Tag, Vec<u8>)>) {
    recv_up_to(rx, usize::MAX, got).unwrap();
}

#[test]
fn a_registered_buffer_goes_out_from_its_memory_and_counts_as_sent_once_written() {
    let (mut tx, mut rx, ctl, counted) = conn_counted(4, 4096);
    let reg = Registered::new((0..6 * 4096 + 100).map(|i| (i % 251) as u8).collect()).unwrap();
    let data: &[u8] = &reg;
    // Frames of 3000 bytes; the receiver holds its deliveries back: 4 writes go out (every
    // slot), none has completed, so nothing counts as sent and the sender is not flushed.
    ctl.hold(1, true);
    assert_eq!(tx.send_direct(data, tag(5), 3000).unwrap(), Some(0));
    assert_eq!(tx.send_direct(data, tag(5), 3000).unwrap(), Some(0));
    assert!(!tx.flushed());
    assert_eq!(
        counted.bytes.load(Ordering::Relaxed),
        0,
        "counted once written"
    );
    // Another message while this one is in flight breaks the contract.
    let other = vec![0u8; 100_000];
    let e = tx
        .send_direct(&other, tag(6), 3000)
        .unwrap_err()
        .to_string();
    assert!(e.contains("in flight"), "{e}");
    ctl.hold(1, false);
    let (mut sent, mut got) = (0, Vec::new());
    for _ in 0..100 {
        if sent == data.len() {
            break;
        }
        take_all(&mut rx, &mut got);
        sent += tx
            .send_direct(&data[sent..], tag(5), 3000)
            .unwrap()
            .unwrap();
    }
    assert_eq!(sent, data.len());
    take_all(&mut rx, &mut got);
    assert!(got.iter().all(|(t, d)| *t == tag(5) && d.len() <= 3000));
    assert_eq!(got.concat_bytes(), data);
    assert_eq!(got.len(), data.len().div_ceil(3000));
    assert_eq!(counted.bytes.load(Ordering::Relaxed), data.len() as u64);
    assert_eq!(
        counted.user.counts(),
        (1, 1),
        "one registration, made at the first write"
    );
    while !tx.flushed() {
        tx.progress().unwrap();
    }
    // A part of the same buffer is found too (frames capped at a slot); plain memory is not.
    let part = &data[5000..5000 + 9000];
    assert_eq!(tx.send_direct(part, tag(7), 1 << 20).unwrap(), Some(0));
    let mut got = Vec::new();
    take_all(&mut rx, &mut got);
    assert_eq!(
        tx.send_direct(part, tag(7), 1 << 20).unwrap(),
        Some(part.len())
    );
    assert_eq!(
        got.iter().map(|(_, d)| d.len()).collect::<Vec<_>>(),
        [4096, 4096, 808]
    );
    assert_eq!(got.concat_bytes(), part);
    assert_eq!(tx.send_direct(&other, tag(8), 3000).unwrap(), None);
    assert_eq!(tx.send_direct(&data[..0], tag(8), 3000).unwrap(), None);
    assert_eq!(counted.user.counts(), (1, 1));
    // Once given back, the buffer's bytes go through slots again and its registration goes.
    let v = reg.into_inner();
    assert_eq!(tx.send_direct(&v, tag(9), 3000).unwrap(), None);
    let other_reg = Registered::new(vec![1u8; 70_000]).unwrap();
    assert_eq!(
        tx.send_direct(&other_reg, tag(9), 1 << 20).unwrap(),
        Some(0)
    );
    assert_eq!(
        counted.user.counts(),
        (2, 1),
        "the old registration was dropped"
    );
}

trait Concat {
    fn concat_bytes(&self) -> Vec<u8>;
}

impl Concat for Vec<(Tag, Vec<u8>)> {
    fn concat_bytes(&self) -> Vec<u8> {
        self.iter().flat_map(|(_, d)| d.iter().copied()).collect()
    }
}

#[test]
fn a_buffer_the_device_refuses_goes_through_the_slots() {
    let (mut tx, mut rx, ctl, counted) = conn_counted(2, 4096);
    ctl.refuse_registrations(true);
    let reg = Registered::new(vec![9u8; 70_000]).unwrap();
    assert_eq!(tx.send_direct(&reg, tag(1), 4096).unwrap(), None);
    // The caller stages it in slots instead, and it arrives whole.
    let (mut sent, mut got) = (0, Vec::new());
    while sent < reg.len() {
        if let Some(slot) = tx.try_slot().unwrap() {
            let n = slot.len().min(reg.len() - sent);
            slot[..n].copy_from_slice(&reg[sent..sent + n]);
            tx.post(n, tag(1)).unwrap();
            sent += n;
        }
        take_all(&mut rx, &mut got);
    }
    take_all(&mut rx, &mut got);
    assert_eq!(got.concat_bytes(), &reg[..]);
    assert_eq!(counted.bytes.load(Ordering::Relaxed), 0);
    assert_eq!(counted.user.counts(), (0, 0));
    ctl.refuse_registrations(false);
    assert_eq!(tx.send_direct(&reg, tag(2), 4096).unwrap(), Some(0));
}

#[test]
fn a_lost_peer_fails_a_send_from_a_registered_buffer() {
    let (mut tx, _rx, ctl, _) = conn_counted(2, 4096);
    let reg = Registered::new(vec![3u8; 50_000]).unwrap();
    assert_eq!(tx.send_direct(&reg, tag(1), 4096).unwrap(), Some(0));
    ctl.fail(12, "retry exceeded");
    let e = tx.send_direct(&reg, tag(1), 4096).unwrap_err().to_string();
    assert!(
        e.contains("peer rank 1 lost") && e.contains("status 12"),
        "{e}"
    );
}

proptest! {
    /// Messages staged in slots and messages sent straight from a registered buffer, mixed,
    /// under any interleaving of the two ends with delivery held back either way: the receiver
    /// gets every message whole and in order, a direct message as frames of at most `frame`
    /// bytes (and a slot), and bytes count as sent only once their writes completed.
    #[test]
    fn direct_and_staged_messages_mix_under_any_interleaving(
        slots in 1usize..5,
        msgs in prop::collection::vec((any::<bool>(), 1usize..=400), 1..24),
        frame in 1usize..200,
        script in moves(),
    ) {
        let (mut tx, mut rx, ctl, counted) = conn_counted(slots, 96);
        let total: usize = msgs.iter().map(|m| m.1).sum();
        let reg = Registered::new((0..total).map(|i| (i % 253) as u8).collect()).unwrap();
        let starts: Vec<usize> = msgs.iter().scan(0, |o, m| { *o += m.1; Some(*o - m.1) }).collect();
        let bytes = |k: usize| -> &[u8] { &reg[starts[k]..starts[k] + msgs[k].1] };
        // The message being sent and how much of it counts as sent.
        let (mut k, mut taken, mut got) = (0usize, 0usize, Vec::new());
        let step = |m: &Move, tx: &mut RdmaSend<SimQp>, rx: &mut RdmaRecv<SimQp>| -> crate::Result<()> {
            match *m {
                Move::Send if k < msgs.len() => {
                    let (direct, len) = msgs[k];
                    if direct {
                        let n = tx.send_direct(&bytes(k)[taken..], tag(k as u64), frame)?.expect("registered");
                        taken += n;
                        if taken == len {
                            (k, taken) = (k + 1, 0);
                        }
                    } else {
                        let n = len.min(96);
                        if let Some(slot) = tx.try_slot()? {
                            slot[..n].copy_from_slice(&bytes(k)[..n]);
                            tx.post(n, tag(k as u64))?;
                            k += 1;
                        }
                    }
                }
                Move::Recv(n) => recv_up_to(rx, n, &mut got)?,
                Move::Hold(end, h) => ctl.hold(end ^ 1, h),
                _ => {
                    tx.progress()?;
                }
            }
            Ok(())
        };
        play(&ctl, &script, total, &mut tx, &mut rx, step);
        // The serial reference: each message's frames in order.
        let mut want = Vec::new();
        for (j, &(direct, len)) in msgs.iter().enumerate() {
            if direct {
                for c in bytes(j).chunks(frame.min(96)) {
                    want.push((tag(j as u64), c.to_vec()));
                }
            } else {
                want.push((tag(j as u64), bytes(j)[..len.min(96)].to_vec()));
            }
        }
        prop_assert_eq!(got, want);
        prop_assert!(tx.flushed());
        let direct: usize = msgs.iter().filter(|m| m.0).map(|m| m.1).sum();
        prop_assert_eq!(counted.bytes.load(Ordering::Relaxed), direct as u64);
    }
}

mod offers;
