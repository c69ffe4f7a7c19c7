//! Unit tests of the shared-memory segment, ring, window and unlink guard, in one process.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::base::error::Error;
use crate::transport::{RecvConn, SendConn, Tag, Window};

#[test]
fn ring_round_trip_in_one_process() {
    let name = format!("oxccl-unittest-{}-r0", std::process::id());
    let (seg, path) = Segment::create(0, &name, 1, 64, 2, 256).unwrap();
    let own = Arc::new(seg);
    let peer = Arc::new(Segment::open(1, 0, path.to_str().unwrap()).unwrap());
    std::fs::remove_file(&path).unwrap();
    let mut tx = ShmSend::new(1, 0, std::process::id(), own.clone(), 0, peer.clone());
    let mut rx = ShmRecv::new(0, 1, std::process::id(), own.clone(), 0, peer);
    for round in 0..5u8 {
        for k in 0..2u8 {
            let s = tx.try_slot().unwrap().expect("free slot");
            s[..3].copy_from_slice(&[round, k, 7]);
            tx.post(
                3,
                Tag {
                    seq: round as u64,
                    desc: k as u64,
                    count: 3,
                },
            )
            .unwrap();
        }
        assert!(tx.try_slot().unwrap().is_none(), "both slots in flight");
        for k in 0..2u8 {
            let (tag, data) = rx.try_recv().unwrap().expect("posted");
            assert_eq!(
                (tag.seq, tag.desc, data),
                (round as u64, k as u64, &[round, k, 7][..])
            );
            rx.release().unwrap();
        }
        assert!(rx.try_recv().unwrap().is_none());
    }
    tx.close(Instant::now());
    assert!(matches!(rx.try_recv(), Err(Error::PeerLost { .. })));
}

/// A peer that posts its last slot and closes before the receiver looks: the data is there,
/// so the receiver gets it (and only then `PeerLost`).
#[test]
fn a_slot_posted_before_the_goodbye_is_delivered() {
    let name = format!("oxccl-unittest-{}-bye", std::process::id());
    let (seg, path) = Segment::create(0, &name, 1, 64, 2, 0).unwrap();
    let own = Arc::new(seg);
    let peer = Arc::new(Segment::open(1, 0, path.to_str().unwrap()).unwrap());
    std::fs::remove_file(&path).unwrap();
    let mut tx = ShmSend::new(1, 0, std::process::id(), own.clone(), 0, peer.clone());
    let mut rx = ShmRecv::new(0, 1, std::process::id(), own.clone(), 0, peer);
    tx.try_slot().unwrap().expect("free slot")[0] = 42;
    let tag = Tag {
        seq: 1,
        desc: 2,
        count: 1,
    };
    tx.post(1, tag).unwrap();
    tx.close(Instant::now());
    let (got, data) = rx.try_recv().unwrap().expect("the posted slot");
    assert_eq!((got, data), (tag, &[42u8][..]));
    rx.release().unwrap();
    assert!(matches!(rx.try_recv(), Err(Error::PeerLost { .. })));
}

/// The same with the sender on another thread, racing the receiver's checks: posting then
/// closing must never look like a goodbye with the data missing. (The window between the
/// receiver's two loads is short; 20 000 rounds hit it on every run measured, not surely.)
#[test]
fn a_goodbye_racing_the_last_post_is_not_a_loss() {
    let name = format!("oxccl-unittest-{}-race", std::process::id());
    let (seg, path) = Segment::create(0, &name, 1, 64, 2, 0).unwrap();
    let own = Arc::new(seg);
    let peer = Arc::new(Segment::open(1, 0, path.to_str().unwrap()).unwrap());
    std::fs::remove_file(&path).unwrap();
    let mut tx = ShmSend::new(1, 0, std::process::id(), own.clone(), 0, peer.clone());
    let mut rx = ShmRecv::new(0, 1, std::process::id(), own.clone(), 0, peer);
    let (go_tx, go_rx) = std::sync::mpsc::channel::<bool>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let sender = std::thread::spawn(move || {
        while go_rx.recv().unwrap_or(false) {
            let slot = loop {
                if let Some(s) = tx.try_slot().unwrap() {
                    break s;
                }
            };
            slot[0] = 7;
            tx.post(1, Tag::default()).unwrap();
            tx.close(Instant::now());
            let _ = done_tx.send(());
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    for round in 0..20_000 {
        go_tx.send(true).unwrap();
        let got = loop {
            match rx.try_recv() {
                Ok(Some((_, d))) => break d[0],
                Ok(None) => assert!(Instant::now() < deadline, "round {round}: no data"),
                Err(e) => panic!("round {round}: {e}"),
            }
        };
        assert_eq!(got, 7);
        rx.release().unwrap();
        done_rx.recv_timeout(Duration::from_secs(60)).unwrap();
        // Reopen the ring for the next round.
        own.closed(0).store(0, Ordering::Release);
    }
    go_tx.send(false).unwrap();
    sender.join().unwrap();
}

/// Segments sized from different `OXCCL_SHM_DIRECT_BYTES`: every rank's window has the
/// smallest staging half, so staging reads stay inside every segment and every rank's tuner
/// sees the same capacity.
#[test]
fn window_capacity_is_the_smallest_staging_half() {
    let pid = std::process::id();
    let sizes = [8192usize, 4096, 16384];
    let mut own = Vec::new();
    let mut paths = Vec::new();
    for (r, &d) in sizes.iter().enumerate() {
        let name = format!("oxccl-unittest-{pid}-cap-r{r}");
        let (seg, path) = Segment::create(r, &name, 2, 64, 2, d).unwrap();
        own.push(Arc::new(seg));
        paths.push(path);
    }
    let windows: Vec<ShmWindow> = (0..sizes.len())
        .map(|rank| {
            let segs = (0..sizes.len())
                .map(|r| {
                    if r == rank {
                        own[r].clone()
                    } else {
                        Arc::new(Segment::open(rank, r, paths[r].to_str().unwrap()).unwrap())
                    }
                })
                .collect();
            ShmWindow::new(rank, segs, vec![pid; sizes.len()], (false, false))
        })
        .collect();
    for p in paths {
        std::fs::remove_file(p).unwrap();
    }
    for (rank, mut w) in windows.into_iter().enumerate() {
        assert_eq!(w.capacity(), 4096, "rank {rank}");
        let mut st = w.staging(1);
        st.own(0..4096).fill(rank as u8 + 1);
        for p in 0..sizes.len() {
            assert_eq!(st.peer(p, 0..4096).len(), 4096);
        }
    }
}

/// The guard removes a file unless disarmed.
#[test]
fn unlink_guard_removes_unless_disarmed() {
    let pid = std::process::id();
    let a = PathBuf::from(SHM_DIR).join(format!("oxccl-unittest-{pid}-guard-a"));
    let b = PathBuf::from(SHM_DIR).join(format!("oxccl-unittest-{pid}-guard-b"));
    std::fs::write(&a, b"x").unwrap();
    std::fs::write(&b, b"x").unwrap();
    drop(UnlinkGuard::new(a.clone()));
    UnlinkGuard::new(b.clone()).disarm();
    let (a_left, b_left) = (a.exists(), b.exists());
    let _ = std::fs::remove_file(a);
    let _ = std::fs::remove_file(b);
    assert!(!a_left && b_left, "{a_left} {b_left}");
}

#[test]
fn too_small_is_named() {
    // 64 GiB: more than any test machine's /dev/shm.
    let name = format!("oxccl-unittest-{}-huge", std::process::id());
    let e = Segment::create(3, &name, 1, 1 << 30, 64, 0);
    assert!(!PathBuf::from(SHM_DIR).join(&name).exists(), "left behind");
    match e {
        Err(Error::Config(msg)) => {
            assert!(msg.contains("too small") && msg.contains("bytes"), "{msg}")
        }
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("2^46 bytes fit in /dev/shm?"),
    }
}

#[test]
fn ring_budget_shrinks_slots_with_the_peers() {
    use super::segment::ring_slot_bytes;
    let (slot, n, budget) = (512 << 10, 4, 2 << 20);
    // One peer keeps the full slots; more peers share the budget in whole pages.
    assert_eq!(ring_slot_bytes(slot, n, 1, budget), 512 << 10);
    assert_eq!(ring_slot_bytes(slot, n, 3, budget), 168 << 10);
    assert_eq!(ring_slot_bytes(slot, n, 7, budget), 72 << 10);
    // Never below a page; never above the slot asked for; 0 = no limit.
    assert_eq!(ring_slot_bytes(slot, n, 1000, budget), 4096);
    assert_eq!(ring_slot_bytes(1024, n, 7, budget), 1024);
    assert_eq!(ring_slot_bytes(slot, n, 7, 0), slot);
    for peers in 1..64 {
        let s = ring_slot_bytes(slot, n, peers, budget);
        assert!(s.is_multiple_of(64) && (peers * n * s <= budget || s == 4096));
    }
}
