//! `Communicator::grow` and `Communicator::join`: new processes come into a communicator (as
//! threads here, over shared memory, TCP and two simulated nodes); survivors of a lost rank
//! shrink it away and grow back with a replacement; bad sizes, sizes that differ between ranks,
//! joining processes nobody asked for and a grow that times out are named, and what is left of
//! them does not disturb the next grow.

use std::sync::Arc;
use std::time::Duration;

use oxccl_comm::bootstrap::{MemStore, Store};
use oxccl_comm::config::TransportChoice;
use oxccl_comm::harness::spawn_world_and_joiners as run;
use oxccl_comm::{Communicator, Config, Error, ReduceOp, Result};

fn cfg(t: TransportChoice, timeout_s: u64) -> Config {
    Config {
        transport: t,
        timeout: Duration::from_secs(timeout_s),
        ..Config::default()
    }
}

/// Checks that `c` works with every rank: an all-reduce and an all-gather of each rank's `tag`,
/// which must come back as `tags` (in rank order).
fn check_works(c: &Communicator, tag: u64, tags: &[u64]) -> Result<()> {
    assert_eq!(c.size(), tags.len(), "tag {tag}");
    assert_eq!(tags[c.rank()], tag, "tag {tag} is rank {}", c.rank());
    let mut x = vec![1u32; 150_000];
    c.all_reduce(&mut x, ReduceOp::Sum)?;
    assert!(x.iter().all(|&v| v as usize == tags.len()), "tag {tag}");
    let mut all = vec![0u64; tags.len()];
    c.all_gather_into(&[tag], &mut all)?;
    assert_eq!(all, tags, "tag {tag}");
    Ok(())
}

/// Two ranks grow to four; two processes join (they get ranks 2 and 3, in the order they took
/// their places); the grown communicator works, and so does the old one.
#[test]
fn a_communicator_grows_by_joining_processes() {
    // (transport, ranks per simulated node: old ranks on node0, joiners on node1)
    for (t, nodes) in [
        (TransportChoice::Auto, false),
        (TransportChoice::Tcp, false),
        (TransportChoice::Auto, true),
    ] {
        let cfg_of = |rank: usize| {
            let mut c = cfg(t, 30);
            if nodes {
                c.node_id = Some(format!("node{}", rank / 2));
            }
            c
        };
        let results = run(
            2,
            2,
            cfg_of,
            |c| {
                let me = c.rank() as u64;
                let big = c.grow(4)?;
                assert_eq!((big.rank(), big.size()), (c.rank(), 4));
                // Tags: old ranks their rank, joiners 100 + their rank in the grown one.
                check_works(&big, me, &[0, 1, 102, 103])?;
                if nodes {
                    assert_eq!(big.stats().transports.get(2).copied(), Some("tcp"));
                    assert_eq!(
                        big.stats().transports.get(1 - c.rank()).copied(),
                        Some("shm")
                    );
                }
                check_works(&c, me, &[0, 1])?;
                Ok(big.rank())
            },
            |_, store, cfg| {
                let c = Communicator::join_with_config(store, cfg)?;
                assert_eq!(c.size(), 4);
                assert!(c.rank() >= 2, "a joiner got rank {}", c.rank());
                check_works(&c, 100 + c.rank() as u64, &[0, 1, 102, 103])?;
                Ok(c.rank())
            },
        );
        let mut ranks: Vec<usize> = results
            .into_iter()
            .map(|r| r.unwrap_or_else(|e| panic!("{t:?}, nodes {nodes}: {e}")))
            .collect();
        ranks[2..].sort_unstable();
        assert_eq!(ranks, [0, 1, 2, 3], "{t:?}, nodes {nodes}");
    }
}

/// Rank 1 of 3 leaves mid-series; the survivors shrink it away, grow back to 3 with a
/// replacement that joins, broadcast their state to it and go on: the series ends with the
/// values a run without the loss gives.
#[test]
fn survivors_grow_back_with_a_replacement() {
    let steps = 6u32;
    // Each step adds every rank's 1.0 to the running value (all-reduce of ones, plus the value).
    let results = run(
        3,
        1,
        |_| cfg(TransportChoice::Auto, 30),
        |c| {
            let mut value = vec![0f32; 50_000];
            let mut comm = c;
            let mut step = 0u32;
            let mut grown = false;
            while step < steps {
                if step == 2 && comm.rank() == 1 && !grown {
                    return Ok(None); // this rank is lost
                }
                let mut ones = vec![1f32; value.len()];
                match comm.all_reduce(&mut ones, ReduceOp::Sum) {
                    Ok(()) => {
                        value.iter_mut().zip(&ones).for_each(|(v, o)| *v += o);
                        step += 1;
                    }
                    Err(e) => {
                        let lost = e.lost_peer().unwrap_or_else(|| panic!("{e}"));
                        assert_eq!(lost, 1, "{e}");
                        let fewer = comm.shrink(&[lost])?;
                        comm = fewer.grow(3)?;
                        grown = true;
                        // Hand the state to the newcomer: the step, then the value.
                        let mut s = [step];
                        comm.broadcast(&mut s, 0)?;
                        comm.broadcast(&mut value, 0)?;
                    }
                }
            }
            assert!(grown, "rank {}: never lost anyone", comm.rank());
            Ok(Some(value))
        },
        |_, store, cfg| {
            let comm = Communicator::join_with_config(store, cfg)?;
            assert_eq!((comm.rank(), comm.size()), (2, 3));
            let mut s = [0u32];
            comm.broadcast(&mut s, 0)?;
            let mut value = vec![0f32; 50_000];
            comm.broadcast(&mut value, 0)?;
            for _ in s[0]..steps {
                let mut ones = vec![1f32; value.len()];
                comm.all_reduce(&mut ones, ReduceOp::Sum)?;
                value.iter_mut().zip(&ones).for_each(|(v, o)| *v += o);
            }
            Ok(Some(value))
        },
    );
    let want = 3.0 * steps as f32;
    for (i, r) in results.into_iter().enumerate() {
        match r.unwrap_or_else(|e| panic!("thread {i}: {e}")) {
            Some(v) => assert!(v.iter().all(|&x| x == want), "thread {i}: {}", v[0]),
            None => assert_eq!(i, 1),
        }
    }
}

/// A size not above the current one is refused on the calling rank; ranks that pass different
/// sizes get `Mismatch` naming both calls, and the next (agreeing) grow works.
#[test]
fn bad_and_mismatched_sizes_are_named() {
    let results = run(
        2,
        1,
        |_| cfg(TransportChoice::Auto, 30),
        |c| {
            for n in [0, 1, 2, 1 << 21, usize::MAX] {
                match c.grow(n) {
                    Err(e @ Error::InvalidArgument { .. }) => {
                        let msg = e.to_string();
                        assert!(msg.contains("grow") && msg.contains("not larger"), "{msg}");
                    }
                    other => panic!("grow({n}): expected InvalidArgument, got {other:?}"),
                }
            }
            // The refused calls counted on both ranks alike; now rank 0 wants 3, rank 1 wants 4.
            match c.grow(3 + c.rank()) {
                Err(e @ Error::Mismatch { .. }) => {
                    let msg = e.to_string();
                    assert!(
                        msg.contains("grow(new_size=3)") && msg.contains("grow(new_size=4)"),
                        "{msg}"
                    );
                }
                other => panic!("rank {}: expected Mismatch, got {other:?}", c.rank()),
            }
            let big = c.grow(3)?;
            check_works(&big, c.rank() as u64, &[0, 1, 7])
        },
        |_, store, cfg| {
            let c = Communicator::join_with_config(store, cfg)?;
            check_works(&c, 7, &[0, 1, 7])
        },
    );
    for (i, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("thread {i}: {e}"));
    }
}

/// A process joins while nobody grows: it gives up after its time-out with an error that says
/// so. Then a grow whose second new rank never comes times out on every rank, naming the missing
/// rank as a new one; the joiner that did come (it was waiting before the grow began) fails too.
/// Neither leaves anything that disturbs the next grow: the withdrawn places are skipped, and a
/// later joiner gets the new one.
#[test]
fn joiners_nobody_wanted_and_failed_grows_leave_nothing_behind() {
    let store: Arc<dyn Store> = Arc::new(MemStore::new());
    let short = cfg(TransportChoice::Auto, 2);
    let e = Communicator::join_with_config(store.clone(), short.clone()).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(e, Error::Store(_)) && msg.contains("no place was offered"),
        "{msg}"
    );

    let (failed_tx, failed_rx) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        // Waiting for a place before the grow starts: it claims the first one offered.
        let (st, c) = (store.clone(), short.clone());
        let first = s.spawn(move || Communicator::join_with_config(st, c).map(|_| ()));
        let old: Vec<_> = (0..2)
            .map(|rank| {
                let (store, failed_tx) = (store.clone(), failed_tx.clone());
                s.spawn(move || -> Result<()> {
                    let c = cfg(TransportChoice::Auto, 3);
                    let comm = Communicator::init_with_config(rank, 2, store, c)?;
                    // Only one of the two new ranks comes.
                    match comm.grow(4) {
                        Err(e @ Error::Timeout { .. }) => {
                            let msg = e.to_string();
                            assert!(
                                msg.contains("grow") && msg.contains("ranks 2..4 are new"),
                                "{msg}"
                            );
                        }
                        other => panic!("rank {rank}: expected Timeout, got {other:?}"),
                    }
                    // Rank 0 has withdrawn the offer nobody took.
                    if rank == 0 {
                        failed_tx.send(()).expect("the test thread waits");
                    }
                    let big = comm.grow(3)?;
                    check_works(&big, rank as u64, &[0, 1, 9])
                })
            })
            .collect();
        drop(failed_tx);
        failed_rx.recv().expect("rank 0 reports its failed grow");
        assert!(
            first.join().unwrap().is_err(),
            "the joiner of the failed grow"
        );
        let comm = Communicator::join_with_config(store.clone(), cfg(TransportChoice::Auto, 30))
            .expect("the late joiner");
        assert_eq!((comm.rank(), comm.size()), (2, 3));
        check_works(&comm, 9, &[0, 1, 9]).expect("the late joiner");
        for h in old {
            h.join().unwrap().unwrap();
        }
    });
}

/// Sizes beyond what a communicator may have are refused by name, not by a failed allocation.
#[test]
fn absurd_sizes_are_refused() {
    for size in [1 << 21, usize::MAX] {
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        match Communicator::init_with_config(0, size, store, Config::default()) {
            Err(e @ Error::InvalidArgument { .. }) => {
                assert!(e.to_string().contains("above 1048576"), "{e}");
            }
            other => panic!("size {size}: expected InvalidArgument, got {other:?}"),
        }
    }
}

/// What a rank 0 that died in the middle of a grow leaves in the store (an open place nobody
/// will settle, and a number it took but never wrote an offer under) does not catch a process
/// that joins once the next grow has offered its place: that grow withdrew the dead one's place
/// first, and the joining process does not wait on the missing number. (A process already
/// waiting when the dead grow's place was open may take it, and fails after its time-out.)
#[test]
fn places_left_by_a_dead_grow_are_withdrawn() {
    let results = spawn_world_and_joiners_with_leftovers();
    for (i, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("thread {i}: {e}"));
    }
}

fn spawn_world_and_joiners_with_leftovers() -> Vec<Result<()>> {
    let store: Arc<dyn Store> = Arc::new(MemStore::new());
    // A dead grow's leftovers under the prefix of `init` communicators.
    store.add("oxccl/join/posted", 2).unwrap();
    store
        .set("oxccl/join/offer/1", b"oxccl/world9/grow0\n3\n2")
        .unwrap();
    std::thread::scope(|s| {
        let mut handles = Vec::new();
        // The joining process comes once the grow has offered its place (number 3).
        let st = store.clone();
        handles.push(s.spawn(move || -> Result<()> {
            let t0 = std::time::Instant::now();
            while st.try_get("oxccl/join/offer/3")?.is_none() {
                assert!(
                    t0.elapsed() < Duration::from_secs(30),
                    "the grow never offered"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            let c = Communicator::join_with_config(st, cfg(TransportChoice::Auto, 30))?;
            assert_eq!((c.rank(), c.size()), (2, 3));
            check_works(&c, 5, &[0, 1, 5])
        }));
        for rank in 0..2 {
            let st = store.clone();
            handles.push(s.spawn(move || -> Result<()> {
                let c =
                    Communicator::init_with_config(rank, 2, st, cfg(TransportChoice::Auto, 30))?;
                let big = c.grow(3)?;
                check_works(&big, rank as u64, &[0, 1, 5])
            }));
        }
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
