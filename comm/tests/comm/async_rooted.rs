//! The async forms of the rooted collectives and the barrier (`reduce_async`,
//! `reduce_in_place_async`, `gather_async`, `scatter_async`, `gather_v_async`, `scatter_v_async`,
//! `barrier_async`): all issued back to back for every root, waited for in reverse order, over
//! shared memory and TCP, against the values the blocking forms give; bad arguments fail in the
//! returned `Work`, before anything is queued; a count the root disagrees with is a `Mismatch`
//! at the root.

use std::time::Duration;

use oxccl_comm::config::TransportChoice;
use oxccl_comm::harness::spawn_world;
use oxccl_comm::{Communicator, Config, Error, ReduceOp, Result};

fn cfg(t: TransportChoice) -> Config {
    Config {
        transport: t,
        timeout: Duration::from_secs(60),
        ..Config::default()
    }
}

/// Element `i` of rank `r`'s input.
fn val(r: usize, i: usize) -> f32 {
    (r * 1000 + i) as f32
}

fn ramp(r: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| val(r, i)).collect()
}

/// Every rooted async form for `root`, issued at once, then waited for last to first.
fn rooted(c: &Communicator, root: usize, count: usize) -> Result<()> {
    let (me, n) = (c.rank(), c.size());
    let at_root = me == root;
    let full = |len: usize| if at_root { len } else { 0 };
    // Block lengths that differ per rank and per root, an empty one among them.
    let counts: Vec<usize> = (0..n).map(|r| (r * 3 + root) % 4 * count).collect();
    let total: usize = counts.iter().sum();
    let premul = ReduceOp::premul_sum((me + 1) as f64);

    let reduce =
        c.reduce_into_async::<f32, _, _>(ramp(me, count), vec![0.0; full(count)], premul, root);
    let reduce_ip = c.reduce_async::<f32, _>(ramp(me, count), ReduceOp::Max, root);
    let gather =
        c.gather_into_async::<f32, _, _>(ramp(me, count), vec![0.0; full(n * count)], root);
    let scatter =
        c.scatter_into_async::<f32, _, _>(ramp(me, full(n * count)), vec![0.0; count], root);
    let gather_v = c.gather_v_into_async::<f32, _, _>(
        ramp(me, counts[me]),
        vec![0.0; full(total)],
        &counts,
        root,
    );
    let scatter_v = c.scatter_v_into_async::<f32, _, _>(
        ramp(me, full(total)),
        vec![0.0; counts[me]],
        &counts,
        root,
    );
    let barrier = c.barrier_async();

    let what = |op: &str| format!("rank {me} of {n}, root {root}, count {count}: {op}");
    barrier.wait()?;

    let (input, out) = scatter_v.wait()?;
    assert_eq!(input.len(), full(total), "{}", what("scatter_v input back"));
    let at: usize = counts[..me].iter().sum();
    let want: Vec<f32> = (at..at + counts[me]).map(|i| val(root, i)).collect();
    assert_eq!(out, want, "{}", what("scatter_v"));

    let (_, out) = gather_v.wait()?;
    if at_root {
        let want: Vec<f32> = (0..n).flat_map(|r| ramp(r, counts[r])).collect();
        assert_eq!(out, want, "{}", what("gather_v"));
    }

    let (_, out) = scatter.wait()?;
    let want: Vec<f32> = (me * count..(me + 1) * count)
        .map(|i| val(root, i))
        .collect();
    assert_eq!(out, want, "{}", what("scatter"));

    let (_, out) = gather.wait()?;
    if at_root {
        let want: Vec<f32> = (0..n).flat_map(|r| ramp(r, count)).collect();
        assert_eq!(out, want, "{}", what("gather"));
    }

    let buf = reduce_ip.wait()?;
    let want = if at_root {
        ramp(n - 1, count)
    } else {
        ramp(me, count)
    };
    assert_eq!(buf, want, "{}", what("reduce_in_place (max)"));

    let (input, out) = reduce.wait()?;
    assert_eq!(input, ramp(me, count), "{}", what("reduce input back"));
    if at_root {
        let want: Vec<f32> = (0..count)
            .map(|i| (0..n).map(|r| (r + 1) as f32 * val(r, i)).sum())
            .collect();
        assert_eq!(out, want, "{}", what("reduce (premul_sum)"));
    } else {
        assert!(out.is_empty());
    }
    Ok(())
}

#[test]
fn rooted_async_forms_give_what_the_blocking_ones_give() {
    for t in [TransportChoice::Shm, TransportChoice::Tcp] {
        for r in spawn_world(3, cfg(t), |c| {
            for root in 0..c.size() {
                for count in [0, 1, 1000, 70_001] {
                    rooted(&c, root, count)?;
                }
            }
            c.barrier()
        }) {
            r.unwrap_or_else(|e| panic!("{t:?}: {e}"));
        }
    }
}

/// A root out of range or a root buffer of the wrong length fails in the returned `Work` at
/// once, naming the rank and the call; nothing was queued, so the communicator goes on.
#[test]
fn bad_rooted_async_calls_fail_in_their_work() {
    for r in spawn_world(2, cfg(TransportChoice::Shm), |c| {
        let (me, n) = (c.rank(), c.size());
        let mut errors = vec![
            c.reduce_into_async::<f32, _, _>(vec![1.0; 4], vec![0.0; 4], ReduceOp::Sum, n)
                .wait()
                .unwrap_err(),
            c.reduce_async::<f32, _>(vec![1.0; 4], ReduceOp::Sum, 7)
                .wait()
                .unwrap_err(),
            c.gather_into_async::<f32, _, _>(vec![1.0; 4], vec![0.0; 8], n)
                .wait()
                .unwrap_err(),
            c.scatter_into_async::<f32, _, _>(vec![1.0; 8], vec![0.0; 4], n)
                .wait()
                .unwrap_err(),
            c.gather_v_into_async::<f32, _, _>(vec![1.0; 1], vec![0.0; 3], &[1, 2], n)
                .wait()
                .unwrap_err(),
            c.scatter_v_into_async::<f32, _, _>(vec![1.0; 3], vec![0.0; 1], &[1], 0)
                .wait()
                .unwrap_err(),
        ];
        if me == 0 {
            // Wrong lengths on the root only: the other rank does not call.
            errors.push(
                c.gather_into_async::<f32, _, _>(vec![1.0; 4], vec![0.0; 7], 0)
                    .wait()
                    .unwrap_err(),
            );
            errors.push(
                c.reduce_into_async::<f32, _, _>(vec![1.0; 4], vec![0.0; 3], ReduceOp::Sum, 0)
                    .wait()
                    .unwrap_err(),
            );
        }
        c.barrier_async().wait()?;
        Ok((me, errors))
    }) {
        let (me, errors) = r.unwrap();
        for e in errors {
            let text = e.to_string();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{text}");
            assert!(text.contains(&format!("rank {me}")), "{text}");
        }
    }
}

/// A rank and the root that disagree on the rank's count: `Mismatch` from the root's `wait()`
/// naming both counts, no time-out anywhere.
#[test]
fn async_gather_v_with_a_disputed_count_is_a_mismatch() {
    let res = spawn_world(3, cfg(TransportChoice::Shm), |c| {
        let counts: &[usize] = if c.rank() == 1 {
            &[2, 5, 2]
        } else {
            &[2, 3, 2]
        };
        let me = c.rank();
        let root_len = if me == 0 { 7 } else { 0 };
        let r = c
            .gather_v_into_async::<i32, _, _>(vec![1; counts[me]], vec![0; root_len], counts, 0)
            .wait();
        Ok(r.map(|_| ()))
    });
    for (rank, r) in res.into_iter().enumerate() {
        let r = r.unwrap();
        assert!(
            !matches!(r, Err(Error::Timeout { .. })),
            "rank {rank}: {r:?}"
        );
        if rank == 0 {
            // The root checks each block's tag against its own count.
            let e = r.unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, Error::Mismatch { .. }), "{msg}");
            assert!(msg.contains("count=3") && msg.contains("count=5"), "{msg}");
        }
    }
}
