//! The mapped all-gather: ranks that share memory write straight into each other's registered
//! outputs. `Stats::registered_recv_bytes` tells whether it ran (it counts what peers wrote into
//! this rank's outputs), so every case checks both the result and the path.

use oxccl_comm::config::TransportChoice;
use oxccl_comm::harness::spawn_world;
use oxccl_comm::{Communicator, Registered, Result};

use crate::collectives::config;

/// Rank `r`'s block of `count` elements in pass `pass`.
fn block(r: usize, count: usize, pass: usize) -> Vec<i32> {
    (0..count)
        .map(|i| (pass * 100_000 + r * 1000 + i % 1000) as i32)
        .collect()
}

/// What every rank's all-gather of `count` elements per rank holds in pass `pass`.
fn whole(n: usize, count: usize, pass: usize) -> Vec<i32> {
    (0..n).flat_map(|r| block(r, count, pass)).collect()
}

/// Bytes peers wrote straight into this rank's registered buffers so far.
fn landed(c: &Communicator) -> u64 {
    c.stats().registered_recv_bytes
}

/// Every output registered: out of place, in place in a part of a larger buffer (not at the
/// start of its file), sizes that do not divide evenly, and empty ones.
fn registered_outputs(c: &Communicator) -> Result<()> {
    let (n, me) = (c.size(), c.rank());
    for count in [0usize, 1, 7, 100_003] {
        let bytes = ((n - 1) * count * 4) as u64;
        let before = landed(c);
        let mut out = Registered::new(vec![-1i32; n * count])?;
        assert_eq!(out.is_shared(), count > 0, "empty buffers have no file");
        c.all_gather_into(&block(me, count, 0), &mut out)?;
        assert_eq!(&out[..], &whole(n, count, 0)[..], "out of place, {count}");
        assert_eq!(landed(c) - before, bytes, "peers wrote into the output");
        let mut big = Registered::new(vec![-1i32; n * count + 3])?;
        let part = 1..1 + n * count;
        big[1 + me * count..1 + (me + 1) * count].copy_from_slice(&block(me, count, 1));
        c.all_gather(&mut big[part.clone()])?;
        assert_eq!(&big[part], &whole(n, count, 1)[..], "in place, {count}");
        assert_eq!((big[0], big[n * count + 1]), (-1, -1), "nothing outside");
        assert_eq!(landed(c) - before, 2 * bytes, "and into the part");
        // The same output again: the peers' mappings are reused.
        c.all_gather_into(&block(me, count, 2), &mut out)?;
        assert_eq!(&out[..], &whole(n, count, 2)[..], "again, {count}");
    }
    Ok(())
}

/// Outputs dropped and registered again (the same descriptor comes back with a new id) more
/// often than peers keep mappings: every pass lands in the new buffer.
fn outputs_come_and_go(c: &Communicator) -> Result<()> {
    let (n, me) = (c.size(), c.rank());
    let count = 4099;
    for pass in 0..7 {
        let mut out = Registered::new(vec![-1i32; n * count])?;
        c.all_gather_into(&block(me, count, pass), &mut out)?;
        assert_eq!(&out[..], &whole(n, count, pass)[..], "pass {pass}");
    }
    Ok(())
}

/// A registered output moved into the async call lands there too, and comes back.
fn async_output(c: &Communicator) -> Result<()> {
    let (n, me) = (c.size(), c.rank());
    let count = 30_000;
    let before = landed(c);
    let out = Registered::<i32>::zeroed(n * count)?;
    let (_, out) = c.all_gather_into_async(block(me, count, 6), out).wait()?;
    assert_eq!(&out[..], &whole(n, count, 6)[..]);
    assert_eq!(landed(c) - before, ((n - 1) * count * 4) as u64);
    Ok(())
}

/// One rank's output is private memory: every rank sees it and runs the ring.
fn one_private_output(c: &Communicator) -> Result<()> {
    let (n, me) = (c.size(), c.rank());
    let count = 70_001;
    let before = landed(c);
    let mine = block(me, count, 3);
    if me == n - 1 {
        let mut out = vec![-1i32; n * count];
        c.all_gather_into(&mine, &mut out)?;
        assert_eq!(out, whole(n, count, 3), "private output");
    } else {
        let mut out = Registered::new(vec![-1i32; n * count])?;
        c.all_gather_into(&mine, &mut out)?;
        assert_eq!(&out[..], &whole(n, count, 3)[..], "registered output");
    }
    assert_eq!(landed(c), before, "the ring ran: nothing written by peers");
    // Many in a row, each rank arriving at its own time: a rank still waiting for the epoch's
    // first step when a peer has already gone on to the ring's first slot must not take the
    // peer for a rank on the other path.
    for pass in 0..300 {
        if (pass + me) % 7 == 0 {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        let mut out = vec![-1i32; n * 64];
        c.all_gather_into(&block(me, 64, pass), &mut out)?;
        assert_eq!(out, whole(n, 64, pass), "pass {pass}");
    }
    Ok(())
}

fn mapped(n: usize) {
    let cfg = config("all-gather=mapped", TransportChoice::Shm);
    for r in spawn_world(n, cfg, |c| {
        registered_outputs(&c)?;
        outputs_come_and_go(&c)?;
        async_output(&c)?;
        one_private_output(&c)
    }) {
        r.unwrap();
    }
}

#[test]
fn mapped_all_gather_2() {
    mapped(2);
}

#[test]
fn mapped_all_gather_3() {
    mapped(3);
}

#[test]
fn mapped_all_gather_5() {
    mapped(5);
}

/// The tuner picks the mapped all-gather from `MAPPED_MIN` on, without an override; with
/// `OXCCL_SHM_MAPPED=0` nobody maps anything and the ring runs, even when the override forces
/// `mapped`.
#[test]
fn the_tuner_maps_large_registered_outputs_unless_turned_off() {
    for on in [true, false] {
        let mut cfg = config("", TransportChoice::Shm);
        cfg.shm_mapped = on;
        for r in spawn_world(2, cfg, move |c| {
            let me = c.rank();
            let before = landed(&c);
            let big = oxccl_comm::internal::tuning::MAPPED_MIN / 8;
            let mut out = Registered::new(vec![0i32; 2 * big])?;
            c.all_gather_into(&block(me, big, 4), &mut out)?;
            assert_eq!(&out[..], &whole(2, big, 4)[..]);
            let want = if on { (big * 4) as u64 } else { 0 };
            assert_eq!(landed(&c) - before, want, "mapped: {on}");
            let small = 100;
            let mut out = Registered::new(vec![0i32; 2 * small])?;
            c.all_gather_into(&block(me, small, 5), &mut out)?;
            assert_eq!(&out[..], &whole(2, small, 5)[..]);
            assert_eq!(landed(&c) - before, want, "small outputs take the ring");
            Ok(())
        }) {
            r.unwrap();
        }
        let mut forced = config("all-gather=mapped", TransportChoice::Shm);
        forced.shm_mapped = on;
        for r in spawn_world(2, forced, move |c| {
            let before = landed(&c);
            let mut out = Registered::new(vec![0i32; 2 * 1000])?;
            c.all_gather_into(&block(c.rank(), 1000, 9), &mut out)?;
            assert_eq!(&out[..], &whole(2, 1000, 9)[..]);
            let want = if on { 4000 } else { 0 };
            assert_eq!(landed(&c) - before, want, "forced, mapped: {on}");
            Ok(())
        }) {
            r.unwrap();
        }
    }
}

/// A rank that runs the ring (its count is below the threshold) against one that maps is a
/// mismatch on both, not a hang; a rank that left is a lost peer to the others.
#[test]
fn mismatched_or_missing_ranks_fail_the_mapped_all_gather_cleanly() {
    let t0 = std::time::Instant::now();
    let mut cfg = config("", TransportChoice::Shm);
    cfg.timeout = std::time::Duration::from_secs(30);
    let res = spawn_world(2, cfg.clone(), |c| {
        let count = if c.rank() == 0 { 1 << 16 } else { 10 };
        let mut out = Registered::<i32>::zeroed(2 * count)?;
        Ok(c.all_gather_into(&block(c.rank(), count, 7), &mut out))
    });
    for (rank, r) in res.into_iter().enumerate() {
        let e = r.unwrap().expect_err("mismatched all-gathers must fail");
        assert!(
            matches!(e, oxccl_comm::Error::Mismatch { .. }),
            "rank {rank}: {e}"
        );
    }
    let res = spawn_world(3, cfg, |c| {
        if c.rank() == 2 {
            return Ok(None); // drops its communicator
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
        let count = 1 << 16;
        let mut out = Registered::<i32>::zeroed(3 * count)?;
        Ok(Some(
            c.all_gather_into(&block(c.rank(), count, 8), &mut out),
        ))
    });
    for r in res.into_iter().take(2) {
        let e = r.unwrap().unwrap().expect_err("rank 2 is gone");
        assert_eq!(e.lost_peer(), Some(2), "{e}");
    }
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(25),
        "noticed, not timed out"
    );
}

/// Below `MAPPED_SURE`, a try that found a private output makes the next `MAPPED_RETRY` such
/// all-gathers run the ring at once (every rank alike), then one tries again; larger ones try
/// every time.
#[test]
fn small_all_gathers_skip_the_mapped_try_for_a_while_after_one_fell_back() {
    use oxccl_comm::internal::tuning::{MAPPED_MIN, MAPPED_RETRY, MAPPED_SURE};
    for r in spawn_world(2, config("", TransportChoice::Shm), |c| {
        let me = c.rank();
        let count = MAPPED_MIN / 8; // 2 ranks of i32: MAPPED_MIN bytes of output
        let mut reg = Registered::<i32>::zeroed(2 * count)?;
        let mut private = vec![0i32; 2 * count];
        let gather = |out: &mut [i32], pass: usize| -> Result<()> {
            c.all_gather_into(&block(me, count, pass), out)?;
            assert_eq!(out, &whole(2, count, pass)[..], "pass {pass}");
            Ok(())
        };
        let before = landed(&c);
        gather(&mut reg, 0)?;
        assert!(landed(&c) > before, "registered everywhere: mapped");
        let before = landed(&c);
        if me == 1 {
            gather(&mut private, 1)?; // the try falls back
        } else {
            gather(&mut reg, 1)?;
        }
        let big = MAPPED_SURE / 8;
        let mut large = Registered::<i32>::zeroed(2 * big)?;
        c.all_gather_into(&block(me, big, 2), &mut large)?;
        assert_eq!(&large[..], &whole(2, big, 2)[..]);
        assert_eq!(
            landed(&c) - before,
            (big * 4) as u64,
            "large ones still try"
        );
        let before = landed(&c);
        for pass in 0..MAPPED_RETRY as usize {
            gather(&mut reg, 3 + pass)?;
        }
        assert_eq!(landed(&c), before, "skipped without a try");
        gather(&mut reg, 100)?;
        assert_eq!(landed(&c) - before, (count * 4) as u64, "then tried again");
        Ok(())
    }) {
        r.unwrap();
    }
}

/// Rank `r`'s element `i` of all-reduce pass `pass` (small integers: every dtype and order of
/// summation gives the exact result).
fn val<T: oxccl_comm::Element>(r: usize, i: usize, pass: usize) -> T {
    T::from_f64(((r * 7 + i * 3 + pass) % 13) as f64 + 1.0)
}

/// Bytes of piece `me` of `count` elements over `n` ranks (the mapped all-reduce's own piece,
/// which no peer writes into this rank's buffer).
fn own_piece(count: usize, n: usize, me: usize, es: usize) -> usize {
    (count / n + usize::from(me < count % n)) * es
}

/// One all-reduce in place into a registered buffer and one out of place into a registered
/// output, checked element by element and by what peers wrote (when `mapped`).
fn all_reduce_case<T: oxccl_comm::Element>(
    c: &Communicator,
    count: usize,
    op: oxccl_comm::ReduceOp,
    pass: usize,
    mapped: bool,
) -> Result<()> {
    let (n, me, es) = (c.size(), c.rank(), std::mem::size_of::<T>());
    let want: Vec<T> = (0..count)
        .map(|i| {
            let vals: Vec<T> = (0..n).map(|r| val(r, i, pass)).collect();
            oxccl_kernels::reference_reduce(&vals, op)
        })
        .collect();
    let mine: Vec<T> = (0..count).map(|i| val(me, i, pass)).collect();
    let before = landed(c);
    let mut buf = Registered::new(mine.clone())?;
    c.all_reduce(&mut buf, op)?;
    assert_eq!(&buf[..], &want[..], "in place, {count} x {op:?}");
    let mut out = Registered::<T>::zeroed(count)?;
    c.all_reduce_into(&mine, &mut out, op)?;
    assert_eq!(&out[..], &want[..], "out of place, {count} x {op:?}");
    let wrote = if mapped && count > 0 {
        2 * (count * es - own_piece(count, n, me, es)) as u64
    } else {
        0
    };
    assert_eq!(
        landed(c) - before,
        wrote,
        "{count} x {op:?}: mapped {mapped}"
    );
    Ok(())
}

/// The mapped all-reduce, forced at every size: dtypes and operations (average and
/// pre-multiplied sum included), uneven and empty counts; one rank's buffer private makes
/// every rank run the tuner's other choice.
fn mapped_all_reduce(n: usize) {
    use half::bf16;
    use oxccl_comm::ReduceOp;
    let cfg = config("all-reduce=mapped", TransportChoice::Shm);
    for r in spawn_world(n, cfg, |c| {
        for (pass, count) in [0usize, 1, 7, 100_003].into_iter().enumerate() {
            all_reduce_case::<f32>(&c, count, ReduceOp::Sum, pass, true)?;
            all_reduce_case::<i64>(&c, count, ReduceOp::Max, pass, true)?;
            all_reduce_case::<bf16>(&c, count, ReduceOp::Sum, pass, true)?;
            all_reduce_case::<f64>(&c, count, ReduceOp::Avg, pass, true)?;
            all_reduce_case::<f32>(&c, count, ReduceOp::premul_sum(0.5), pass, true)?;
        }
        // One rank's buffer private: every rank falls back, and nothing is divided twice.
        let (n, me) = (c.size(), c.rank());
        for count in [5usize, 70_001] {
            let before = landed(&c);
            let mine: Vec<f64> = (0..count).map(|i| val(me, i, 9)).collect();
            let want: Vec<f64> = (0..count)
                .map(|i| (0..n).map(|r| val::<f64>(r, i, 9)).sum::<f64>() / n as f64)
                .collect();
            if me == 0 {
                let mut buf = mine.clone();
                c.all_reduce(&mut buf, ReduceOp::Avg)?;
                assert_eq!(buf, want, "private buffer, {count}");
            } else {
                let mut buf = Registered::new(mine.clone())?;
                c.all_reduce(&mut buf, ReduceOp::Avg)?;
                assert_eq!(&buf[..], &want[..], "registered buffer, {count}");
            }
            assert_eq!(landed(&c), before, "the other choice ran");
        }
        Ok(())
    }) {
        r.unwrap();
    }
}

#[test]
fn mapped_all_reduce_2() {
    mapped_all_reduce(2);
}

#[test]
fn mapped_all_reduce_3() {
    mapped_all_reduce(3);
}

#[test]
fn mapped_all_reduce_5() {
    mapped_all_reduce(5);
}

/// Without an override the tuner maps all-reduces from `MAPPED_AR_MIN` on, in place and out of
/// place; below it the usual choice runs.
#[test]
fn the_tuner_maps_large_registered_all_reduces() {
    use oxccl_comm::internal::tuning::MAPPED_AR_MIN;
    use oxccl_comm::ReduceOp;
    for n in [2, 4] {
        for r in spawn_world(n, config("", TransportChoice::Shm), |c| {
            all_reduce_case::<f32>(&c, MAPPED_AR_MIN / 4, ReduceOp::Sum, 1, true)?;
            all_reduce_case::<f32>(&c, MAPPED_AR_MIN / 4 - 1, ReduceOp::Sum, 2, false)
        }) {
            r.unwrap();
        }
    }
}

/// All-reduces below `MAPPED_AR_SURE` skip the try for `MAPPED_RETRY` calls after one fell back,
/// as all-gathers do below theirs; the two count apart.
#[test]
fn small_all_reduces_skip_the_mapped_try_for_a_while_after_one_fell_back() {
    use oxccl_comm::internal::tuning::{MAPPED_AR_MIN, MAPPED_RETRY};
    use oxccl_comm::ReduceOp;
    for r in spawn_world(2, config("", TransportChoice::Shm), |c| {
        let count = MAPPED_AR_MIN / 4; // f32
        let mut reg = Registered::new(vec![1.0f32; count])?;
        let before = landed(&c);
        if c.rank() == 1 {
            c.all_reduce(&mut vec![1.0f32; count], ReduceOp::Sum)?; // the try falls back
        } else {
            c.all_reduce(&mut reg, ReduceOp::Sum)?;
        }
        for _ in 0..MAPPED_RETRY {
            reg.fill(1.0);
            c.all_reduce(&mut reg, ReduceOp::Sum)?;
            assert!(reg.iter().all(|&x| x == 2.0));
        }
        assert_eq!(landed(&c), before, "skipped without a try");
        // The all-gather's counter is its own: it tries at once.
        let big = oxccl_comm::internal::tuning::MAPPED_MIN / 8;
        let mut out = Registered::<i32>::zeroed(2 * big)?;
        c.all_gather_into(&block(c.rank(), big, 11), &mut out)?;
        assert_eq!(
            landed(&c) - before,
            (big * 4) as u64,
            "all-gathers still map"
        );
        let before = landed(&c);
        reg.fill(1.0);
        c.all_reduce(&mut reg, ReduceOp::Sum)?;
        assert!(reg.iter().all(|&x| x == 2.0));
        assert!(landed(&c) > before, "then the all-reduce tries again");
        Ok(())
    }) {
        r.unwrap();
    }
}
