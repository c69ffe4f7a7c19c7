//! The rendezvous: offers of registered receive buffers, frames that land in them, and how
//! they meet the frames that came through slots.

use std::sync::atomic::Ordering;
use std::time::Duration;

use proptest::prelude::*;

use super::super::conn::{RdmaRecv, RdmaSend};
use super::super::sim::SimQp;
use super::{conn, conn_counted, moves, play, tag, Move};
use crate::base::op::Tag;
use crate::transport::{RecvConn, SendConn};
use crate::Registered;

#[test]
fn an_offer_names_one_message_from_where_the_sender_is() {
    use super::super::proto::Offer;
    let o = Offer {
        tag: tag(4),
        start: 1000,
        end: 5000,
        addr: 0x10_0000,
        rkey: 77,
    };
    assert_eq!(Offer::decode(&o.encode()), o);
    assert_eq!(o.target(1000, 4000, tag(4)), Some(0x10_0000));
    assert_eq!(
        o.target(3000, 2000, tag(4)),
        Some(0x10_0000 + 2000),
        "the sender sent the first 2000 bytes through slots"
    );
    assert_eq!(o.target(3000, 2000, tag(5)), None, "another message");
    assert_eq!(
        o.target(3000, 2500, tag(4)),
        None,
        "a message that ends elsewhere"
    );
    assert_eq!(o.target(5000, 10, tag(4)), None, "past its range");
    assert!(o.stale(5000) && !o.stale(4999));
}

/// Finishes the message tagged `t`: the sender sends `data` from byte `sent` as the algorithms
/// do (`send_direct`, slots when it declines), the receiver takes it into `buf` from byte `got`
/// (offered when `offer`: landed frames and slots in turn), interleaved until both are done;
/// the bytes that landed.
fn pump(
    (tx, data, mut sent): (&mut RdmaSend<SimQp>, &[u8], usize),
    (rx, buf, mut got): (&mut RdmaRecv<SimQp>, &mut [u8], usize),
    t: Tag,
    offer: bool,
) -> usize {
    let mut landed = 0;
    for _ in 0..10_000 {
        if got == buf.len() && sent == data.len() {
            return landed;
        }
        if sent < data.len() {
            sent += send_step(tx, &data[sent..], t, 4096);
        }
        if offer {
            if let Some(n @ 1..) = rx.recv_direct(&mut buf[got..], t).unwrap() {
                (got, landed) = (got + n, landed + n);
                continue;
            }
        }
        if let Some((tag, d)) = rx.try_recv().unwrap() {
            assert_eq!(tag, t);
            buf[got..got + d.len()].copy_from_slice(d);
            got += d.len();
            rx.release().unwrap();
        }
        tx.progress().unwrap();
    }
    panic!("the message never arrived: {got} of {} bytes", buf.len());
}

/// One step of sending `rest` (the rest of the message tagged `t`) as the algorithms do:
/// `send_direct` first, a slot when it declines; the bytes taken.
fn send_step(tx: &mut RdmaSend<SimQp>, rest: &[u8], t: Tag, frame: usize) -> usize {
    if let Some(n) = tx.send_direct(rest, t, frame).unwrap() {
        return n;
    }
    let Some(slot) = tx.try_slot().unwrap() else {
        return 0;
    };
    let n = slot.len().min(rest.len());
    slot[..n].copy_from_slice(&rest[..n]);
    tx.post(n, t).unwrap();
    n
}

/// Sends all of `data` tagged `t` while the receiver does not run; whether all of it went
/// before the sender ran out of slots.
fn send_message(tx: &mut RdmaSend<SimQp>, data: &[u8], t: Tag, frame: usize) -> bool {
    let mut sent = 0;
    while sent < data.len() {
        match send_step(tx, &data[sent..], t, frame) {
            0 => return false,
            n => sent += n,
        }
    }
    true
}

#[test]
fn an_offered_buffer_takes_the_message_straight_from_the_senders_memory() {
    let (mut tx, mut rx, _, counted) = conn_counted(4, 4096);
    tx.hold_for(Duration::from_secs(60)); // the hold below, whatever the timing
    let data = Registered::new((0..50_000).map(|i| (i % 241) as u8).collect()).unwrap();
    let mut out = Registered::new(vec![0u8; 50_000]).unwrap();
    // The receiver offers first; nothing has arrived, nothing landed.
    assert_eq!(rx.recv_direct(&mut out, tag(3)).unwrap(), Some(0));
    // The sender reads the offer and writes every frame into the buffer, none into a slot.
    let mut sent = 0;
    let mut got = 0;
    for _ in 0..100 {
        if sent < data.len() {
            sent += tx
                .send_direct(&data[sent..], tag(3), 3000)
                .unwrap()
                .unwrap();
        }
        if got < out.len() {
            let n = rx.recv_direct(&mut out[got..], tag(3)).unwrap().unwrap();
            got += n;
        }
        assert!(
            rx.try_recv().unwrap().is_none(),
            "nothing came through a slot"
        );
    }
    assert_eq!((sent, got), (data.len(), out.len()));
    assert_eq!(&out[..], &data[..]);
    assert_eq!(counted.landed.load(Ordering::Relaxed), 50_000);
    assert_eq!(counted.bytes.load(Ordering::Relaxed), 50_000);
    // The next message, from plain memory to a buffer never registered: the receiver offered
    // the last one, so the sender sends a first frame and waits for an offer until the
    // receiver has taken that frame...
    let src = data[..9000].to_vec();
    assert!(!send_message(&mut tx, &src, tag(4), 4096));
    assert_eq!(
        tx.send_direct(&src[4096..], tag(4), 4096).unwrap(),
        Some(0),
        "held for an offer"
    );
    // ... and once it has (offering nothing), sends the rest through the slots.
    let mut plain = vec![0u8; 9000];
    let landed = pump(
        (&mut tx, &src, 4096),
        (&mut rx, &mut plain, 0),
        tag(4),
        true,
    );
    assert_eq!(landed, 0);
    assert_eq!(plain, src);
}

#[test]
fn bytes_sent_through_slots_before_the_offer_arrived_meet_the_rest_in_order() {
    let (mut tx, mut rx, ctl) = conn(2, 4096);
    let plain: Vec<u8> = (0..30_000).map(|i| (i % 239) as u8).collect();
    let mut out = Registered::new(vec![0u8; 30_000]).unwrap();
    // The sender starts before any offer: two slots of plain memory go out.
    assert!(!send_message(&mut tx, &plain, tag(1), 4096));
    // The receiver takes one slot, then offers the rest; the sender's reads of the offer come
    // once it polls, and the rest lands from its send region.
    let (t, d) = rx.try_recv().unwrap().unwrap();
    assert_eq!((t, d.len()), (tag(1), 4096));
    out[..4096].copy_from_slice(&plain[..4096]);
    rx.release().unwrap();
    assert_eq!(rx.recv_direct(&mut out[4096..], tag(1)).unwrap(), Some(0));
    ctl.hold(1, true); // the sender's frames wait on the wire
    let mut sent = 8192;
    for _ in 0..4 {
        tx.progress().unwrap();
        if let Some(n) = tx.send_direct(&plain[sent..], tag(1), 4096).unwrap() {
            sent += n;
        }
    }
    assert_eq!(
        sent,
        8192 + 4096,
        "one slot free: one frame staged into the offer"
    );
    ctl.hold(1, false);
    let landed = pump(
        (&mut tx, &plain, sent),
        (&mut rx, &mut out, 4096),
        tag(1),
        true,
    );
    assert_eq!(&out[..], &plain[..]);
    assert_eq!(
        landed,
        30_000 - 8192,
        "the second slot came through its slot, everything after the offer landed"
    );
}

#[test]
fn a_stale_or_foreign_offer_changes_nothing() {
    let (mut tx, mut rx, _) = conn(4, 4096);
    let data: Vec<u8> = (0..12_000).map(|i| (i % 233) as u8).collect();
    let mut out = Registered::new(vec![0u8; 24_000]).unwrap();
    // All of message 1 is in slots before the receiver offers: the offer is stale.
    assert!(send_message(&mut tx, &data, tag(1), 4096));
    let (a, b) = out.split_at_mut(12_000);
    assert_eq!(pump((&mut tx, &[], 0), (&mut rx, a, 0), tag(1), true), 0);
    assert_eq!(a, &data[..]);
    // An offer for tag 2 while the sender sends tag 9: the slots carry it, and the receiver
    // sees the other tag (the algorithms report the mismatch).
    assert_eq!(rx.recv_direct(b, tag(2)).unwrap(), Some(0));
    tx.progress().unwrap();
    assert!(send_message(&mut tx, &data, tag(9), 4096));
    assert_eq!(rx.recv_direct(b, tag(2)).unwrap(), Some(0));
    let (t, _) = rx.try_recv().unwrap().unwrap();
    assert_eq!(t, tag(9));
}

#[test]
fn a_buffer_gone_before_its_bytes_land_fails_both_ends() {
    let (mut tx, mut rx, ctl) = conn(2, 4096);
    let mut out = Registered::new(vec![0u8; 20_000]).unwrap();
    assert_eq!(rx.recv_direct(&mut out, tag(1)).unwrap(), Some(0));
    let data = vec![5u8; 20_000];
    // The sender reads the offer and writes two frames into the buffer; they wait on the wire
    // while the buffer goes (its entry with it: the key it was offered under names nothing).
    ctl.hold(1, true);
    assert!(!send_message(&mut tx, &data, tag(1), 4096));
    drop(out);
    ctl.hold(1, false);
    let e = rx.progress().unwrap_err().to_string();
    assert!(
        e.contains("peer rank 0 lost") && e.contains("status 10"),
        "{e}"
    );
    let e = tx.progress().unwrap_err().to_string();
    assert!(e.contains("peer rank 1 lost"), "{e}");
}

proptest! {
    /// Messages from registered or plain memory, each received into an offered (registered)
    /// buffer or taken from slots alone, under any interleaving of the two ends with delivery
    /// held back either way: every message arrives whole, in order and in its place (the
    /// serial reference is the bytes sent), whatever part of it went through slots before an
    /// offer arrived; bytes that landed are counted as such, and both ends end idle. Messages
    /// share tags, as a ring's steps do.
    #[test]
    fn offered_and_slot_messages_mix_under_any_interleaving(
        slots in 1usize..5,
        msgs in prop::collection::vec((any::<bool>(), any::<bool>(), 1usize..=400), 1..24),
        frame in 1usize..200,
        hold in prop_oneof![Just(Duration::ZERO), Just(Duration::MAX)],
        script in moves(),
    ) {
        let (mut tx, mut rx, ctl, counted) = conn_counted(slots, 96);
        tx.hold_for(hold); // no hold, or one that only the receiver ends: no timing in a case
        let total: usize = msgs.iter().map(|m| m.2).sum();
        let reg = Registered::new((0..total).map(|i| (i % 253) as u8).collect()).unwrap();
        let plain = reg.to_vec();
        let mut out = Registered::new(vec![0u8; total]).unwrap();
        let starts: Vec<usize> = msgs.iter().scan(0, |o, m| { *o += m.2; Some(*o - m.2) }).collect();
        // The sender's message and bytes taken; the receiver's message, bytes got, and landed.
        let (mut k, mut taken) = (0usize, 0usize);
        let (mut m, mut got, mut landed) = (0usize, 0usize, 0usize);
        let step = |mv: &Move, tx: &mut RdmaSend<SimQp>, rx: &mut RdmaRecv<SimQp>| -> crate::Result<()> {
            match *mv {
                Move::Send if k < msgs.len() => {
                    let (registered, _, len) = msgs[k];
                    let src: &[u8] = if registered { &reg } else { &plain };
                    let rest = &src[starts[k] + taken..starts[k] + len];
                    let n = match tx.send_direct(rest, tag(k as u64 % 2), frame)? {
                        Some(n) => n,
                        None => match tx.try_slot()? {
                            Some(slot) => {
                                let n = slot.len().min(rest.len());
                                slot[..n].copy_from_slice(&rest[..n]);
                                tx.post(n, tag(k as u64 % 2))?;
                                n
                            }
                            None => 0,
                        },
                    };
                    taken += n;
                    if taken == len {
                        (k, taken) = (k + 1, 0);
                    }
                }
                Move::Recv(j) => {
                    for _ in 0..j {
                        let Some(&(_, offered, len)) = msgs.get(m) else { break };
                        let buf = &mut out[starts[m] + got..starts[m] + len];
                        let direct = if offered { rx.recv_direct(buf, tag(m as u64 % 2))? } else { None };
                        if let Some(n @ 1..) = direct {
                            (got, landed) = (got + n, landed + n);
                        } else if let Some((t, d)) = rx.try_recv()? {
                            assert_eq!(t, tag(m as u64 % 2));
                            buf[..d.len()].copy_from_slice(d);
                            got += d.len();
                            rx.release()?;
                        } else {
                            break;
                        }
                        if got == len {
                            (m, got) = (m + 1, 0);
                        }
                    }
                }
                Move::Hold(end, h) => ctl.hold(end ^ 1, h),
                _ => {
                    tx.progress()?;
                }
            }
            Ok(())
        };
        play(&ctl, &script, total, &mut tx, &mut rx, step);
        prop_assert_eq!((k, m), (msgs.len(), msgs.len()));
        prop_assert!(out[..] == reg[..], "the bytes received differ from those sent");
        prop_assert!(tx.flushed());
        let registered: usize = msgs.iter().filter(|x| x.0).map(|x| x.2).sum();
        let offered: usize = msgs.iter().filter(|x| x.1).map(|x| x.2).sum();
        prop_assert_eq!(counted.bytes.load(Ordering::Relaxed), registered as u64);
        prop_assert_eq!(counted.landed.load(Ordering::Relaxed), landed as u64);
        prop_assert!(landed <= offered, "{} landed, {} offered", landed, offered);
    }
}

#[test]
fn after_an_offered_message_the_next_waits_one_frame_for_its_offer() {
    let (mut tx, mut rx, _) = conn(4, 4096);
    tx.hold_for(Duration::from_secs(60));
    let src: Vec<u8> = (0..40_000).map(|i| (i % 211) as u8).collect();
    let mut out = Registered::new(vec![0u8; 80_000]).unwrap();
    let (a, b) = out.split_at_mut(40_000);
    // Message 1 is offered before the sender starts: all of it lands.
    assert_eq!(rx.recv_direct(a, tag(1)).unwrap(), Some(0));
    tx.progress().unwrap();
    assert_eq!(
        pump((&mut tx, &src, 0), (&mut rx, a, 0), tag(1), true),
        40_000
    );
    // Message 2: the sender starts first; it sends one frame through a slot and holds the
    // rest until the receiver offers and takes that frame; then the rest lands.
    assert!(!send_message(&mut tx, &src, tag(2), 4096));
    let landed = pump((&mut tx, &src, 4096), (&mut rx, b, 0), tag(2), true);
    assert_eq!(landed, 40_000 - 4096);
    assert_eq!(&out[..40_000], &src[..]);
    assert_eq!(&out[40_000..], &src[..]);
}

#[test]
fn a_hold_ends_in_time_so_a_send_never_waits_for_its_receiver() {
    let (mut tx, mut rx, _) = conn(4, 4096);
    tx.hold_for(Duration::MAX); // the first assert below cannot depend on scheduling
    let src: Vec<u8> = (0..12_000).map(|i| (i % 199) as u8).collect();
    let mut out = Registered::new(vec![0u8; 12_000]).unwrap();
    assert_eq!(rx.recv_direct(&mut out, tag(1)).unwrap(), Some(0));
    tx.progress().unwrap();
    assert_eq!(
        pump((&mut tx, &src, 0), (&mut rx, &mut out, 0), tag(1), true),
        12_000
    );
    // The next message would wait for an offer, but its receiver is busy sending (it does not
    // run here): after the hold the rest goes through the free slots, with no receiver step.
    assert!(!send_message(&mut tx, &src, tag(2), 4096), "held");
    tx.hold_for(Duration::from_millis(1));
    std::thread::sleep(Duration::from_millis(2));
    assert!(send_message(&mut tx, &src[4096..], tag(2), 4096));
    let mut plain = vec![0u8; 12_000];
    assert_eq!(
        pump((&mut tx, &[], 0), (&mut rx, &mut plain, 0), tag(2), false),
        0
    );
    assert_eq!(plain, src);
}

#[test]
fn offers_go_on_past_their_records_as_the_sender_reads_them() {
    // Twelve messages with one tag (a ring's steps), each offered before it is sent: each
    // lands whole, so records were read, acknowledged and written again three times over.
    let (mut tx, mut rx, _, counted) = conn_counted(4, 4096);
    let src: Vec<u8> = (0..20_000).map(|i| (i % 197) as u8).collect();
    let mut out = Registered::new(vec![0u8; 12 * 20_000]).unwrap();
    for (k, part) in out.chunks_mut(20_000).enumerate() {
        assert_eq!(
            rx.recv_direct(part, tag(7)).unwrap(),
            Some(0),
            "message {k}"
        );
        tx.progress().unwrap();
        assert_eq!(
            pump((&mut tx, &src, 0), (&mut rx, part, 0), tag(7), true),
            20_000,
            "message {k}"
        );
    }
    assert!(out.chunks(20_000).all(|p| p == &src[..]));
    assert_eq!(counted.landed.load(Ordering::Relaxed), 12 * 20_000);
}

#[test]
fn a_forwarder_writes_each_piece_into_the_offer_as_it_has_it() {
    let (mut tx, mut rx, _) = conn(4, 4096);
    let src: Vec<u8> = (0..30_000).map(|i| (i % 193) as u8).collect();
    let mut out = Registered::new(vec![0u8; 30_000]).unwrap();
    let t = tag(3);
    assert_eq!(
        tx.forward_offered(&src[..5000], 30_000, t, 4096).unwrap(),
        None,
        "no offer yet"
    );
    assert_eq!(rx.recv_direct(&mut out, t).unwrap(), Some(0));
    tx.progress().unwrap();
    // The message of another length is not this offer's.
    assert_eq!(
        tx.forward_offered(&src[..5000], 31_000, t, 4096).unwrap(),
        None
    );
    // Pieces of 5000 bytes as the forwarder has them: each lands at its place.
    let (mut fwd, mut got, mut steps) = (0, 0, 0);
    for have in (5000..=30_000).step_by(5000) {
        while fwd < have {
            fwd += tx
                .forward_offered(&src[fwd..have], 30_000 - fwd, t, 4096)
                .unwrap()
                .expect("offered");
            got += rx.recv_direct(&mut out[got..], t).unwrap().unwrap();
            steps += 1;
            assert!(steps < 1000, "stuck at {fwd} forwarded, {got} landed");
        }
    }
    while got < 30_000 {
        tx.progress().unwrap();
        got += rx.recv_direct(&mut out[got..], t).unwrap().unwrap();
        steps += 1;
        assert!(steps < 1000, "stuck at {got} landed");
    }
    assert_eq!(&out[..], &src[..]);
    assert!(
        rx.try_recv().unwrap().is_none(),
        "nothing came through a slot"
    );
}

#[test]
fn a_forward_after_slot_frames_lands_the_rest_at_its_place() {
    let (mut tx, mut rx, ctl) = conn(4, 4096);
    let src: Vec<u8> = (0..30_000).map(|i| (i % 191) as u8).collect();
    let mut out = Registered::new(vec![0u8; 30_000]).unwrap();
    let t = tag(4);
    // The first piece goes through a slot before any offer...
    assert_eq!(
        tx.forward_offered(&src[..4096], 30_000, t, 4096).unwrap(),
        None
    );
    let slot = tx.try_slot().unwrap().unwrap();
    slot[..4096].copy_from_slice(&src[..4096]);
    tx.post(4096, t).unwrap();
    let (got_tag, d) = rx.try_recv().unwrap().unwrap();
    assert_eq!((got_tag, d.len()), (t, 4096));
    out[..4096].copy_from_slice(d);
    rx.release().unwrap();
    // ... then the receiver offers the rest: the 20 000 bytes the forwarder has fill every
    // slot (4 frames into the buffer), and the next piece waits for a credit.
    assert_eq!(rx.recv_direct(&mut out[4096..], t).unwrap(), Some(0));
    tx.progress().unwrap();
    let rest = |fwd: usize| 30_000 - fwd;
    assert_eq!(
        tx.forward_offered(&src[4096..24_096], rest(4096), t, 4096)
            .unwrap(),
        Some(16_384)
    );
    assert_eq!(
        tx.forward_offered(&src[20_480..24_096], rest(20_480), t, 4096)
            .unwrap(),
        Some(0),
        "no slot free"
    );
    let (mut fwd, mut got) = (20_480, 4096);
    for _ in 0..1000 {
        if got == 30_000 {
            break;
        }
        got += rx.recv_direct(&mut out[got..], t).unwrap().unwrap();
        if fwd < 30_000 {
            fwd += tx
                .forward_offered(&src[fwd..], rest(fwd), t, 4096)
                .unwrap()
                .expect("offered");
        }
    }
    assert_eq!(&out[..], &src[..]);
    // A forward while a send from a registered buffer is in flight breaks the contract.
    let reg = Registered::new(vec![1u8; 70_000]).unwrap();
    ctl.hold(1, true);
    assert_eq!(tx.send_direct(&reg, tag(5), 4096).unwrap(), Some(0));
    let e = tx
        .forward_offered(&src, 30_000, tag(6), 4096)
        .unwrap_err()
        .to_string();
    assert!(e.contains("in flight"), "{e}");
}
