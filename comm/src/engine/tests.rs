//! Unit tests of the engine: turns, the progress thread, failure publication.

use super::failure::{decode_error, encode_error};
use super::*;
use crate::base::bootstrap::MemStore;
use crate::base::op::{Collective, OpDesc};
use crossbeam_channel::Sender;

fn shared(timeout: Duration) -> (Arc<Shared>, Arc<MemStore>) {
    let store = Arc::new(MemStore::new());
    let cfg = Config {
        timeout,
        ..Config::default()
    };
    let sh = Shared::new(0, 2, false, &cfg, Links::default(), store.clone(), "t");
    (Arc::new(sh), store)
}

fn is_turn_timeout(r: &Result<u64>) -> bool {
    matches!(r, Err(Error::Timeout { op, .. }) if op == "waiting for earlier operations")
}

/// Runs the first ticket's operation on another thread and holds it there (bounded) until
/// the returned sender is used; returns once it runs.
fn hold_first_turn(sh: &Arc<Shared>) -> (Sender<()>, std::thread::JoinHandle<Result<()>>) {
    let (go_tx, go_rx) = crossbeam_channel::bounded::<()>(1);
    let (ran_tx, ran_rx) = crossbeam_channel::bounded::<()>(1);
    let (t0, _) = sh.take_ticket();
    let first = std::thread::spawn({
        let sh = Arc::clone(sh);
        move || {
            sh.run_turn(t0, 0, |st| {
                let _ = ran_tx.send(());
                let _ = go_rx.recv_timeout(Duration::from_secs(60));
                st.coll_seq += 1;
                Ok(())
            })
        }
    });
    ran_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("first operation runs");
    (go_tx, first)
}

/// An operation that times out waiting for its turn never runs: the next one must not take
/// its sequence number (peers would pair different data), so the communicator breaks and
/// every later operation reports the time-out.
#[test]
fn a_turn_time_out_breaks_the_communicator() {
    let (sh, store) = shared(Duration::from_millis(5));
    let (go_tx, first) = hold_first_turn(&sh);
    let (t1, ahead) = sh.take_ticket();
    let skipped = sh.run_turn(t1, ahead, |st| {
        st.coll_seq += 1;
        Ok(st.coll_seq)
    });
    assert!(is_turn_timeout(&skipped), "{skipped:?}");
    go_tx.send(()).unwrap();
    first
        .join()
        .unwrap()
        .expect("the operation ahead completes");
    // The running operation broke the communicator as it ended: the cause is published.
    assert!(store.try_get("t/error").unwrap().is_some());
    let (t2, ahead) = sh.take_ticket();
    let next = sh.run_turn(t2, ahead, |st| Ok(st.coll_seq));
    assert!(is_turn_timeout(&next), "{next:?}");
}

/// A ticket that a later one passed over (it gave up waiting first) fails as soon as it
/// sees the line has moved past it, instead of waiting out its own deadline.
#[test]
fn a_passed_over_ticket_fails_at_once() {
    let (sh, _store) = shared(Duration::from_millis(50));
    let (go_tx, first) = hold_first_turn(&sh);
    let (t1, a1) = sh.take_ticket();
    let (t2, a2) = sh.take_ticket();
    // Ticket 2 starts waiting now (deadline 3 x 50 ms + 1 s); ticket 1 half a second later
    // (deadline 2 x 50 ms + 1 s from then), so ticket 2 gives up first.
    let third = std::thread::spawn({
        let sh = Arc::clone(&sh);
        move || sh.run_turn(t2, a2, |_| Ok(2))
    });
    std::thread::sleep(Duration::from_millis(500));
    let second = sh.run_turn(t1, a1, |_| Ok(1));
    let third = third.join().unwrap();
    assert!(is_turn_timeout(&third), "{third:?}");
    match &second {
        Err(Error::Timeout { detail, .. }) => {
            assert!(detail.contains("a later operation gave up"), "{detail}")
        }
        other => panic!("{other:?}"),
    }
    go_tx.send(()).unwrap();
    first
        .join()
        .unwrap()
        .expect("the running operation completes");
}

/// With no operation running when the wait ends, the communicator breaks at once.
#[test]
fn a_turn_time_out_with_nothing_running_breaks_at_once() {
    let (sh, store) = shared(Duration::from_millis(5));
    let _never_runs = sh.take_ticket();
    let (t1, ahead) = sh.take_ticket();
    let r = sh.run_turn(t1, ahead, |st| Ok(st.coll_seq));
    assert!(is_turn_timeout(&r), "{r:?}");
    assert!(store.try_get("t/error").unwrap().is_some());
    assert!(lock(&sh.exec).broken.is_some());
}

/// Holds the progress thread (after serving its own turn, so later turns are free) until
/// the returned sender is used or dropped.
fn hold_progress_thread(sh: &Arc<Shared>) -> Sender<()> {
    let (gate_tx, gate_rx) = crossbeam_channel::bounded::<()>(1);
    let (held_tx, held_rx) = crossbeam_channel::bounded::<()>(1);
    let s = Arc::clone(sh);
    sh.submit_ticketed(move |ticket, ahead| {
        let _ = s.run_turn(ticket, ahead, |_| Ok(()));
        let _ = held_tx.send(());
        let _ = gate_rx.recv_timeout(Duration::from_secs(60));
    });
    held_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the progress thread runs the holding job");
    gate_tx
}

/// Queues an operation that appends `tag` and the thread it ran on to `log`.
fn logged(
    sh: &Arc<Shared>,
    log: &Arc<Mutex<Vec<(u32, std::thread::ThreadId)>>>,
    tag: u32,
) -> Work<u32> {
    let log = Arc::clone(log);
    sh.submit_work(
        "logged",
        tag,
        move |_, st, tag| {
            st.coll_seq += 1;
            lock(&log).push((*tag, std::thread::current().id()));
            Ok(())
        },
        |tag| tag,
    )
}

/// `wait()` on an operation the progress thread has not taken runs it on the waiting
/// thread; one the progress thread has finished is only collected.
#[test]
fn wait_runs_an_operation_the_progress_thread_has_not_taken() {
    let (sh, _store) = shared(Duration::from_millis(200));
    let log = Arc::new(Mutex::new(Vec::new()));
    let gate = hold_progress_thread(&sh);
    let w = logged(&sh, &log, 1);
    // The progress thread is held: without the waiter running it, this times out.
    assert_eq!(w.wait().expect("runs on the waiting thread"), 1);
    assert_eq!(lock(&log)[0], (1, std::thread::current().id()));
    drop(gate);
    let w = logged(&sh, &log, 2);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !w.is_done() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(w.wait().expect("done on the progress thread"), 2);
    let (tag, thread) = lock(&log)[1];
    assert_eq!(tag, 2);
    assert_ne!(thread, std::thread::current().id());
    sh.stop_worker();
}

/// A waiter that takes a later operation still runs it after the earlier one, which the
/// progress thread is running: the order on the wire is the issue order.
#[test]
fn a_waiter_keeps_the_turn_order() {
    let (sh, _store) = shared(Duration::from_secs(30));
    let log = Arc::new(Mutex::new(Vec::new()));
    let (gate_tx, gate_rx) = crossbeam_channel::bounded::<()>(1);
    let (started_tx, started_rx) = crossbeam_channel::bounded::<()>(1);
    let first_log = Arc::clone(&log);
    let first = sh.submit_work(
        "first",
        1u32,
        move |_, st, tag| {
            let _ = started_tx.send(());
            let _ = gate_rx.recv_timeout(Duration::from_secs(60));
            st.coll_seq += 1;
            lock(&first_log).push((*tag, std::thread::current().id()));
            Ok(())
        },
        |tag| tag,
    );
    started_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the progress thread runs the first operation");
    let second = logged(&sh, &log, 2);
    let parked = Arc::clone(&sh);
    let release = std::thread::spawn(move || {
        // Open the gate once this thread waits for its turn in `second` (it took the job).
        let deadline = Instant::now() + Duration::from_secs(60);
        while parked.turn.waiters.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(gate_tx);
    });
    // Taken by this thread, it waits for its turn until the progress thread ran `first`.
    assert_eq!(second.wait().unwrap(), 2);
    assert_eq!(first.wait().unwrap(), 1);
    release.join().unwrap();
    let log = lock(&log).clone();
    assert_eq!(log.iter().map(|e| e.0).collect::<Vec<_>>(), [1, 2]);
    assert_ne!(log[0].1, std::thread::current().id());
    assert_eq!(log[1].1, std::thread::current().id());
    assert_eq!(lock(&sh.exec).coll_seq, 2);
    sh.stop_worker();
}

/// A wait runs the operations queued ahead of its own on the waiting thread, in order, when
/// the progress thread is busy: otherwise its own would wait for them until it is free.
#[test]
fn a_wait_runs_the_operations_queued_ahead_of_it() {
    let (sh, _store) = shared(Duration::from_millis(300));
    let log = Arc::new(Mutex::new(Vec::new()));
    let gate = hold_progress_thread(&sh);
    let first = logged(&sh, &log, 1);
    let second = logged(&sh, &log, 2);
    assert_eq!(second.wait().expect("runs both here, in order"), 2);
    assert!(first.is_done());
    assert_eq!(first.wait().unwrap(), 1);
    let me = std::thread::current().id();
    assert_eq!(*lock(&log), [(1, me), (2, me)]);
    drop(gate);
    sh.stop_worker();
}

/// A blocking call runs the async operations queued ahead of it on its own thread when the
/// progress thread is busy (its turn would come only after them).
#[test]
fn a_blocking_call_runs_the_operations_queued_ahead_of_it() {
    let store = Arc::new(MemStore::new());
    let cfg = Config {
        timeout: Duration::from_millis(300),
        ..Config::default()
    };
    let sh = Arc::new(Shared::new(
        0,
        1,
        false,
        &cfg,
        Links::default(),
        store,
        "one",
    ));
    let log = Arc::new(Mutex::new(Vec::new()));
    let gate = hold_progress_thread(&sh);
    let queued = logged(&sh, &log, 1);
    let desc = OpDesc {
        coll: Collective::Barrier,
        dtype: oxccl_kernels::DType::U8,
        op: oxccl_kernels::ReduceOp::Sum,
        root: 0,
        count: 0,
    };
    sh.run(desc, |_, _| Ok(())).expect("its turn comes");
    assert_eq!(*lock(&log), [(1, std::thread::current().id())]);
    assert_eq!(lock(&sh.exec).coll_seq, 2, "both ran");
    assert_eq!(queued.wait().unwrap(), 1);
    drop(gate);
    sh.stop_worker();
}

/// Holds the progress thread while [`LAZY_AFTER`](super::queue::LAZY_AFTER) operations are
/// waited for right after their call (each waiter finds its operation queued), checks that the
/// line turned lazy, and lets the thread go.
fn make_lazy(sh: &Arc<Shared>, log: &Arc<Mutex<Vec<(u32, std::thread::ThreadId)>>>) {
    let gate = hold_progress_thread(sh);
    for i in 0..super::queue::LAZY_AFTER {
        assert_eq!(logged(sh, log, i).wait().unwrap(), i);
    }
    assert!(
        sh.queue.is_lazy(),
        "waits that came first make the line lazy"
    );
    drop(gate);
}

/// Queues an operation that nobody waits for or polls (either would hurry it) and waits
/// (bounded) until the progress thread has run it; whether it ran, and its handle.
fn unwaited_runs(sh: &Arc<Shared>) -> (bool, Work<()>) {
    let ran = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&ran);
    let w = sh.submit_work(
        "unwaited",
        (),
        move |_, _, _| {
            flag.store(true, Ordering::SeqCst);
            Ok(())
        },
        |b| b,
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ran.load(Ordering::SeqCst) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    (ran.load(Ordering::SeqCst), w)
}

/// Waits that find their operation still queued make queueing stop waking the progress
/// thread; an operation nobody waits for then still runs there (within a nap), and from then
/// on queueing wakes it again.
#[test]
fn early_waits_make_the_line_lazy_and_an_unwaited_operation_still_runs() {
    let (sh, _store) = shared(Duration::from_secs(30));
    let log = Arc::new(Mutex::new(Vec::new()));
    make_lazy(&sh, &log);
    let (ran, w) = unwaited_runs(&sh);
    assert!(ran, "the progress thread ran it");
    assert!(
        !sh.queue.is_lazy(),
        "an operation it had to run makes it wake again"
    );
    w.wait().unwrap();
    sh.stop_worker();
}

/// While waiters take every operation, each nap of the lazy progress thread is longer than the
/// one before, up to the longest; an operation nobody waits for still runs there, and makes
/// the naps short again.
#[test]
fn naps_grow_while_waiters_take_everything_and_shrink_when_the_thread_runs_one() {
    let (sh, _store) = shared(Duration::from_secs(30));
    let log = Arc::new(Mutex::new(Vec::new()));
    make_lazy(&sh, &log);
    let (_, first, longest) = sh.queue.naps();
    assert!(first < longest);
    // Waited operations, one at a time, until the naps have grown to the longest.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut i = 100;
    while sh.queue.naps().0 < longest && Instant::now() < deadline {
        // (A waiter held up for a whole nap leaves its operation to the thread, which makes
        // the line eager and the naps short; eight early waits later they grow again.)
        assert_eq!(logged(&sh, &log, i).wait().unwrap(), i);
        i += 1;
        std::thread::sleep(Duration::from_micros(200));
    }
    assert_eq!(
        sh.queue.naps().0,
        longest,
        "naps that found nothing to run grew"
    );
    let (ran, w) = unwaited_runs(&sh);
    assert!(ran, "the progress thread ran it after a long nap");
    w.wait().unwrap();
    // The thread shortens the naps once it holds the line again, after the operation ended.
    while sh.queue.naps().0 != first && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        sh.queue.naps().0,
        first,
        "running it made the naps short again"
    );
    sh.stop_worker();
}

/// A wait for an operation the progress thread started well before is not early (the caller
/// overlapped it with something): it ends a run of early waits.
#[test]
fn a_wait_for_an_operation_started_well_before_is_not_early() {
    let (sh, _store) = shared(Duration::from_secs(30));
    let gate = hold_progress_thread(&sh);
    let log = Arc::new(Mutex::new(Vec::new()));
    for i in 0..3 {
        assert_eq!(logged(&sh, &log, i).wait().unwrap(), i);
    }
    assert_eq!(
        sh.queue.early_waits(),
        3,
        "each found its operation still queued"
    );
    drop(gate);
    let (started_tx, started_rx) = crossbeam_channel::bounded::<()>(1);
    let w = sh.submit_work(
        "overlapped",
        (),
        move |_, _, _| {
            let _ = started_tx.send(());
            Ok(())
        },
        |b| b,
    );
    started_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the progress thread runs it");
    std::thread::sleep(Duration::from_millis(5));
    w.wait().unwrap();
    assert_eq!(sh.queue.early_waits(), 0);
    assert!(!sh.queue.is_lazy());
    sh.stop_worker();
}

/// Dropping a communicator stops its progress thread; an operation a waiting thread took
/// over is still running then, and must end before the connections close.
#[test]
fn stopping_waits_for_an_operation_a_waiter_runs() {
    let (sh, _store) = shared(Duration::from_secs(30));
    let gate = hold_progress_thread(&sh);
    let (started_tx, started_rx) = crossbeam_channel::bounded::<()>(1);
    let done = Arc::new(AtomicBool::new(false));
    let finished = Arc::clone(&done);
    let w = sh.submit_work(
        "slow",
        (),
        move |_, _, _| {
            let _ = started_tx.send(());
            std::thread::sleep(Duration::from_millis(100));
            finished.store(true, Ordering::SeqCst);
            Ok(())
        },
        |b| b,
    );
    let waiter = std::thread::spawn(move || w.wait());
    // The progress thread is held, so the waiter is the one running it.
    started_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the waiter runs the operation");
    drop(gate);
    sh.stop_worker();
    assert!(
        done.load(Ordering::SeqCst),
        "stop_worker returned while the operation was running"
    );
    waiter.join().unwrap().unwrap();
}

/// An operation that panics (here on the thread that waits for it) still ends its turn:
/// the next operation fails at once with the cause instead of waiting out its deadline.
#[test]
fn a_panicking_operation_breaks_the_communicator_and_ends_its_turn() {
    let (sh, store) = shared(Duration::from_secs(2));
    let w = sh.submit_work(
        "boom",
        (),
        |_, _, _| -> Result<()> { panic!("a bug in an operation") },
        |b| b,
    );
    let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.wait()));
    // Run on this thread (the panic reaches the caller) or on the progress thread (its
    // result channel is dropped): either way an error, never a result.
    assert!(!matches!(waited, Ok(Ok(()))), "{waited:?}");
    let (t, ahead) = sh.take_ticket();
    let next = sh.run_turn(t, ahead, |_| Ok(()));
    match &next {
        Err(Error::Aborted { reason, .. }) => assert!(reason.contains("panicked"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert!(store.try_get("t/error").unwrap().is_some());
    sh.stop_worker();
}

#[test]
fn errors_survive_the_store() {
    let e = Error::Mismatch {
        rank: 1,
        peer: 2,
        seq: 9,
        local: "a\nb".into(),
        remote: "c".into(),
    };
    match decode_error(&encode_error(&e), 1, None).unwrap() {
        Error::Mismatch {
            rank,
            peer,
            seq,
            local,
            remote,
        } => {
            assert_eq!(
                (rank, peer, seq, local.as_str(), remote.as_str()),
                (1, 2, 9, "a b", "c")
            )
        }
        other => panic!("{other:?}"),
    }
    let e = Error::PeerLost {
        rank: 3,
        peer: 2,
        op: "x".into(),
        detail: "eof".into(),
    };
    assert_eq!(
        decode_error(&encode_error(&e), 0, None)
            .unwrap()
            .lost_peer(),
        Some(2)
    );
    let e = Error::Timeout {
        rank: 3,
        op: "x".into(),
        timeout: Duration::from_secs(1),
        detail: "d".into(),
    };
    assert!(matches!(
        decode_error(&encode_error(&e), 0, None).unwrap(),
        Error::Aborted { rank: 0, .. }
    ));
    assert!(decode_error(b"junk", 0, None).is_none());
}

#[test]
fn a_groups_reports_carry_the_note_once_and_its_stored_cause_none() {
    let store = Arc::new(MemStore::new());
    let cfg = Config {
        timeout: Duration::from_secs(5),
        ..Config::default()
    };
    let mut sh = Shared::new(0, 2, false, &cfg, Links::default(), store.clone(), "t");
    sh.world = WorldNames::new("t", "w", &[3, 1]).map(Arc::new);
    let sh = Arc::new(sh);
    let note = "(ranks named here are of communicator t; its ranks 0-1 are ranks [3, 1] of w)";
    let run = |f: fn() -> Error| {
        let (t, ahead) = sh.take_ticket();
        sh.run_turn(t, ahead, |_| -> Result<()> { Err(f()) })
            .unwrap_err()
            .to_string()
    };
    let first = run(|| Error::PeerLost {
        rank: 0,
        peer: 1,
        op: "all-reduce".into(),
        detail: "EOF".into(),
    });
    assert!(first.ends_with(note), "{first}");
    // The broken state answers every later call, noted once.
    let later = run(|| unreachable!("a broken communicator runs nothing"));
    assert_eq!(later, first);
    // What peers read, and the state kept, have no note: each reader notes it itself.
    let stored = String::from_utf8(store.try_get("t/error").unwrap().unwrap()).unwrap();
    assert!(!stored.contains("ranks named here"), "{stored}");
    let kept = lock(&sh.exec).broken.clone().unwrap().to_string();
    assert!(!kept.contains("ranks named here"), "{kept}");
}

#[test]
fn a_published_mismatch_is_told_from_each_ranks_own_point_of_view() {
    use crate::base::op::{OpDesc, Tag};
    let tag = |count| Tag {
        seq: 4,
        desc: 0,
        count,
    };
    let (a, b) = (tag(100), tag(101));
    let (da, db) = (OpDesc::describe_tag(&a), OpDesc::describe_tag(&b));
    // Rank 1 (count 101) found that rank 0 called count 100; ranks 2 and 3 called 100 and 101.
    let e = Error::Mismatch {
        rank: 1,
        peer: 0,
        seq: 4,
        local: db.clone(),
        remote: format!("{da} (it runs a direct shared-memory algorithm)"),
    };
    let stored = encode_error(&e);
    let seen = |me: usize, mine: Option<&Tag>| match decode_error(&stored, me, mine).unwrap() {
        Error::Mismatch {
            rank,
            peer,
            local,
            remote,
            ..
        } => (rank, peer, local, remote),
        other => panic!("{other:?}"),
    };
    let (rank, peer, local, remote) = seen(0, Some(&a));
    assert_eq!(
        (rank, peer, local.as_str(), remote.as_str()),
        (0, 1, da.as_str(), db.as_str())
    );
    let (rank, peer, local, _) = seen(1, Some(&b));
    assert_eq!((rank, peer, local.as_str()), (1, 0, db.as_str()));
    let (rank, peer, local, remote) = seen(2, Some(&a));
    assert_eq!(
        (rank, peer, local.as_str(), remote.as_str()),
        (2, 1, da.as_str(), db.as_str())
    );
    let (rank, peer, local, remote) = seen(3, Some(&b));
    assert_eq!((rank, peer, local.as_str()), (3, 0, db.as_str()));
    assert!(remote.starts_with(&da), "{remote}");
    let (_, _, local, _) = seen(3, None);
    assert!(local.contains("nothing yet"), "{local}");
}

/// A rank that waits long enough to sleep announces itself on its doorbell, so its peer's post
/// rings it; once the wait is over it is counted no more, so later posts ring nothing (and touch
/// none of its cache lines).
#[test]
fn a_sleeping_wait_is_rung_then_quiet() {
    use crate::algorithm::prims::{Ctx, Links};
    use crate::transport::shm::{Segment, ShmWindow};
    use crate::transport::{Doorbell, Tag, Window};
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    let pid = std::process::id();
    let made: Vec<_> = (0..2)
        .map(|r| {
            Segment::create(
                r,
                &format!("oxccl-unittest-{pid}-bell-r{r}"),
                1,
                64,
                2,
                4096,
            )
        })
        .collect::<Result<_>>()
        .unwrap();
    let (own, paths): (Vec<_>, Vec<_>) = made.into_iter().map(|(s, p)| (Arc::new(s), p)).unzip();
    let window = |rank: usize| {
        let segs = (0..2)
            .map(|r| match r == rank {
                true => own[r].clone(),
                false => Arc::new(Segment::open(rank, r, paths[r].to_str().unwrap()).unwrap()),
            })
            .collect();
        ShmWindow::new(rank, segs, vec![pid; 2], (false, false))
    };
    let (w0, mut w1) = (window(0), window(1));
    for p in &paths {
        std::fs::remove_file(p).unwrap();
    }
    let tag = Tag {
        seq: 3,
        desc: 4,
        count: 5,
    };
    let bell = own[0].clone();
    let peer = std::thread::spawn(move || {
        // Post only once rank 0 sleeps (announced), however slowly its thread gets going.
        let until = Instant::now() + Duration::from_secs(60);
        while bell.sleepers() == 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        w1.publish(1, tag, 0, [0, 0]);
        w1
    });
    let mut links = Links::new(2);
    links.bell = Some(own[0].clone());
    links.window = Some(Box::new(w0));
    let abort = AtomicBool::new(false);
    let before = own[0].seq();
    let mut ctx = Ctx::new(0, 2, &mut links, tag, "t", Duration::from_secs(60), &abort);
    ctx.wait_step(1, Some(0)).unwrap();
    drop(ctx);
    let mut w1 = peer.join().unwrap();
    assert_ne!(own[0].seq(), before, "the post rang the sleeping rank");
    assert_eq!(own[0].sleepers(), 0, "counted no more once the wait ended");
    let quiet = own[0].seq();
    w1.publish(5, tag, 1, [0, 0]);
    assert_eq!(
        own[0].seq(),
        quiet,
        "a post to a rank that does not sleep rings nothing"
    );
}

/// An operation that panics on the progress thread: its handle says so at once (`is_done`,
/// then `Aborted` from `wait`) instead of letting the waiter wait out its deadline.
#[test]
fn a_panic_on_the_progress_thread_reaches_the_waiter() {
    let (sh, _store) = shared(Duration::from_secs(600));
    let w = sh.submit_work(
        "boom",
        (),
        |_, _, _| -> Result<()> { panic!("a bug in an operation") },
        |b| b,
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while !w.is_done() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(w.is_done(), "the progress thread ran it and noted the loss");
    match w.wait() {
        Err(Error::Aborted { reason, .. }) => assert!(reason.contains("dropped"), "{reason}"),
        other => panic!("{other:?}"),
    }
    sh.stop_worker();
}
