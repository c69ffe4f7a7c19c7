//! `Communicator::all_gather_v_into`, `reduce_scatter_v`, `gather_v` and `scatter_v`: random shard
//! lengths (empty shards included) against a serial reference over shared memory, TCP and two
//! simulated nodes, blocking and async; shards longer than a ring block; bad count lists; ranks
//! that disagree on the counts; `all_gather_bytes` and `broadcast_bytes`.

use std::time::Duration;

use oxccl_comm::config::TransportChoice;
use oxccl_comm::harness::{spawn_world, spawn_world_on_nodes};
use oxccl_comm::{Communicator, Config, Error, ReduceOp, Result};
use proptest::prelude::*;

fn cfg(t: TransportChoice) -> Config {
    Config {
        transport: t,
        timeout: Duration::from_secs(60),
        ..Config::default()
    }
}

/// Element `i` of rank `r`'s shard (all-gather-v), or of its contribution to shard `i`'s owner
/// (reduce-scatter-v: `i` indexes the whole input).
fn val(r: usize, i: usize, seed: u64) -> i64 {
    ((r as u64 * 1_000_003 + i as u64 * 31 + seed) % 10_007) as i64
}

/// One rank's calls for shard lengths `counts`, checked against the serial reference.
fn run_rank(c: &Communicator, counts: &[usize], seed: u64) -> Result<()> {
    let (me, n) = (c.rank(), c.size());
    let total: usize = counts.iter().sum();
    let at: usize = counts[..me].iter().sum();
    let shard = |r: usize| -> Vec<i64> { (0..counts[r]).map(|i| val(r, i, seed)).collect() };

    // All-gather-v: every rank's shard, in rank order.
    let want: Vec<i64> = (0..n).flat_map(shard).collect();
    let mut out = vec![-1i64; total];
    c.all_gather_v_into(&shard(me), &mut out, counts)?;
    assert_eq!(
        out, want,
        "all_gather_v: rank {me} of {n}, counts {counts:?}"
    );
    let (back, out) = c
        .all_gather_v_into_async(shard(me), vec![-1i64; total], counts)
        .wait()?;
    assert_eq!(back, shard(me));
    assert_eq!(out, want, "all_gather_v_async: rank {me} of {n}");
    let small: Vec<u8> = shard(me).iter().map(|&v| v as u8).collect();
    let mut out8 = vec![0u8; total];
    c.all_gather_v_into(&small, &mut out8, counts)?;
    let want8: Vec<u8> = want.iter().map(|&v| v as u8).collect();
    assert_eq!(out8, want8, "all_gather_v u8: rank {me} of {n}");

    // Reduce-scatter-v: this rank's shard of the sum (and max) over ranks.
    let input: Vec<i64> = (0..total).map(|i| val(me, i, seed)).collect();
    for op in [ReduceOp::Sum, ReduceOp::Max] {
        let want: Vec<i64> = (at..at + counts[me])
            .map(|i| {
                let vals = (0..n).map(|r| val(r, i, seed));
                match op {
                    ReduceOp::Sum => vals.sum(),
                    _ => vals.max().unwrap_or(0),
                }
            })
            .collect();
        let mut out = vec![-1i64; counts[me]];
        c.reduce_scatter_v_into(&input, &mut out, counts, op)?;
        assert_eq!(
            out, want,
            "reduce_scatter_v {op}: rank {me} of {n}, counts {counts:?}"
        );
        let (back, out) = c
            .reduce_scatter_v_into_async(input.clone(), vec![-1i64; counts[me]], counts, op)
            .wait()?;
        assert_eq!(back, input);
        assert_eq!(out, want, "reduce_scatter_v_async {op}: rank {me} of {n}");
    }
    // Avg of floats holding small integers: exact whatever the order.
    let input: Vec<f32> = (0..total)
        .map(|i| ((me + i) % 4) as f32 * n as f32)
        .collect();
    let mut out = vec![-1.0f32; counts[me]];
    c.reduce_scatter_v_into(&input, &mut out, counts, ReduceOp::Avg)?;
    let want: Vec<f32> = (at..at + counts[me])
        .map(|i| (0..n).map(|r| ((r + i) % 4) as f32).sum())
        .collect();
    assert_eq!(out, want, "reduce_scatter_v avg: rank {me} of {n}");

    // Gather-v and scatter-v, to and from the first and the last rank.
    let all: Vec<i64> = (0..n).flat_map(shard).collect();
    for root in [0, n - 1] {
        let mut got = vec![-1i64; if me == root { total } else { 0 }];
        c.gather_v_into(&shard(me), &mut got, counts, root)?;
        if me == root {
            assert_eq!(
                got, all,
                "gather_v to {root}: rank {me} of {n}, counts {counts:?}"
            );
        }
        let input = if me == root { all.clone() } else { Vec::new() };
        let mut mine = vec![-1i64; counts[me]];
        c.scatter_v_into(&input, &mut mine, counts, root)?;
        assert_eq!(mine, shard(me), "scatter_v from {root}: rank {me} of {n}");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn random_shard_lengths_match_a_serial_reference(
        n in 1usize..=5,
        // Shards of up to 70,000 elements (beyond a 512 KiB slot) are rare; most are small and
        // a quarter empty.
        raw in prop::collection::vec(prop_oneof![
            1 => Just(0usize),
            2 => 1usize..200,
            1 => 200usize..70_000,
        ], 5),
        transport in prop::sample::select(vec!["shm", "tcp", "nodes"]),
        seed in any::<u64>(),
    ) {
        let counts = raw[..n].to_vec();
        let f = |c: Communicator| run_rank(&c, &counts, seed);
        let res = match transport {
            "shm" => spawn_world(n, cfg(TransportChoice::Auto), f),
            "tcp" => spawn_world(n, cfg(TransportChoice::Tcp), f),
            _ => spawn_world_on_nodes(n, 2, cfg(TransportChoice::Auto), f),
        };
        for (rank, r) in res.into_iter().enumerate() {
            prop_assert!(r.is_ok(), "rank {}: {:?}", rank, r);
        }
    }
}

/// A shard longer than the ring's block (4 MiB over shared memory, 2 MiB over TCP) next to a
/// short and an empty one: several blocks, in which the short shards run out first.
#[test]
fn shards_longer_than_a_block() {
    let counts = [(4 << 20) + 3, 0, 1000];
    for t in [TransportChoice::Auto, TransportChoice::Tcp] {
        for r in spawn_world(3, cfg(t), |c| {
            let me = c.rank();
            let total: usize = counts.iter().sum();
            let at: usize = counts[..me].iter().sum();
            let byte = |r: usize, i: usize| ((r * 3 + i * 7) % 41) as u8;
            let mine: Vec<u8> = (0..counts[me]).map(|i| byte(me, i)).collect();
            let mut all = vec![0u8; total];
            c.all_gather_v_into(&mine, &mut all, &counts)?;
            for (r, &len) in counts.iter().enumerate() {
                let from: usize = counts[..r].iter().sum();
                let ok = (0..len).all(|i| all[from + i] == byte(r, i));
                assert!(
                    ok,
                    "all_gather_v: rank {me}, shard {r} of {len} differs ({t:?})"
                );
            }
            let input: Vec<u8> = (0..total).map(|i| byte(me, i)).collect();
            let mut out = vec![0u8; counts[me]];
            c.reduce_scatter_v_into(&input, &mut out, &counts, ReduceOp::Sum)?;
            let ok = (0..counts[me]).all(|i| out[i] == (0..3).map(|r| byte(r, at + i)).sum::<u8>());
            assert!(ok, "reduce_scatter_v: rank {me} ({t:?})");
            Ok(())
        }) {
            r.unwrap();
        }
    }
}

/// Count lists of the wrong length, buffers that do not fit them, and lists that overflow are
/// `InvalidArgument`s naming the rank, the call and the problem; nothing was sent, so the
/// communicator still works.
#[test]
fn bad_count_lists_are_named() {
    let res = spawn_world(3, cfg(TransportChoice::Auto), |c| {
        let me = c.rank();
        let mut errs = Vec::new();
        let mut out = vec![0.0f32; 6];
        errs.push(c.all_gather_v_into(&[1.0f32; 2], &mut out, &[2, 2]).err());
        errs.push(
            c.all_gather_v_into(&[1.0f32; 3], &mut out, &[2, 2, 2])
                .err(),
        );
        let mut seven = vec![2, 2, 2];
        seven[(me + 1) % 3] = 3;
        errs.push(c.all_gather_v_into(&[1.0f32; 2], &mut out, &seven).err());
        errs.push(
            c.all_gather_v_into(&[1.0f32; 2], &mut out, &[usize::MAX, 2, 2])
                .err(),
        );
        let mut shard = vec![0.0f32; 2];
        errs.push(
            c.reduce_scatter_v_into(&[1.0f32; 6], &mut shard, &[2, 2], ReduceOp::Sum)
                .err(),
        );
        let mut big = vec![0.0f32; 3];
        errs.push(
            c.reduce_scatter_v_into(&[1.0f32; 6], &mut big, &[2, 2, 2], ReduceOp::Sum)
                .err(),
        );
        errs.push(
            c.reduce_scatter_v_into(&[1.0f32; 7], &mut shard, &[2, 2, 2], ReduceOp::Sum)
                .err(),
        );
        errs.push(
            c.all_gather_v_into_async(vec![1.0f32; 2], vec![0.0f32; 6], &[2, 2])
                .wait()
                .err(),
        );
        errs.push(
            c.reduce_scatter_v_into_async(
                vec![1.0f32; 6],
                vec![0.0f32; 3],
                &[2, 2, 2],
                ReduceOp::Sum,
            )
            .wait()
            .err(),
        );
        let mut root_out = vec![0.0f32; if me == 0 { 5 } else { 0 }];
        errs.push(
            c.gather_v_into(&[1.0f32; 2], &mut root_out, &[2, 2, 2], 3)
                .err(),
        );
        errs.push(
            c.gather_v_into(&[1.0f32; 3], &mut root_out, &[2, 2, 2], 0)
                .err(),
        );
        errs.push(
            c.scatter_v_into(&[1.0f32; 2], &mut [0.0f32; 2], &[2, 2], 0)
                .err(),
        );
        let mut ok = vec![0.0f32; 6];
        let after = c.all_gather_v_into(&[me as f32; 2], &mut ok, &[2, 2, 2]);
        Ok((errs, after, ok))
    });
    for (rank, r) in res.into_iter().enumerate() {
        let (errs, after, ok) = r.unwrap();
        let wants = [
            (
                "all_gather_v",
                "counts has 2 entries; it must have one per rank (3)".to_string(),
            ),
            (
                "all_gather_v",
                format!("input has 3 elements but counts[{rank}] = 2"),
            ),
            (
                "all_gather_v",
                "output has 6 elements but counts add up to 7".to_string(),
            ),
            (
                "all_gather_v",
                "counts add up to more than usize::MAX".to_string(),
            ),
            ("reduce_scatter_v", "counts has 2 entries".to_string()),
            (
                "reduce_scatter_v",
                format!("output has 3 elements but counts[{rank}] = 2"),
            ),
            (
                "reduce_scatter_v",
                "input has 7 elements but counts add up to 6".to_string(),
            ),
            ("all_gather_v", "counts has 2 entries".to_string()),
            (
                "reduce_scatter_v",
                format!("output has 3 elements but counts[{rank}] = 2"),
            ),
            ("gather_v", "root 3 is not a rank".to_string()),
            (
                "gather_v",
                format!("input has 3 elements but counts[{rank}] = 2"),
            ),
            ("scatter_v", "counts has 2 entries".to_string()),
        ];
        assert_eq!(errs.len(), wants.len());
        for (e, (op, want)) in errs.iter().zip(wants) {
            let e = e.as_ref().expect("an error");
            let msg = e.to_string();
            assert!(
                matches!(e, Error::InvalidArgument { .. }),
                "rank {rank}: {msg}"
            );
            assert!(
                msg.contains(&format!("rank {rank}")) && msg.contains(op) && msg.contains(&want),
                "rank {rank}: {msg} (wanted {op}: {want:?})"
            );
        }
        after.unwrap();
        assert_eq!(ok, [0.0, 0.0, 1.0, 1.0, 2.0, 2.0], "rank {rank}");
    }
}

/// Rank 0 passes counts [2, 4, 3] while the others pass [3, 3, 3] (the same total), or rank 0
/// passes all-empty counts while the others do not: a `Mismatch` naming both lists'
/// fingerprints (`counts-hash=`), never a time-out or blocks of different lengths paired.
#[test]
fn ranks_disagreeing_on_the_counts_get_a_mismatch() {
    let cases: [(&[usize], &[usize]); 2] = [(&[2, 4, 3], &[3, 3, 3]), (&[0, 0, 0], &[0, 3, 0])];
    for t in [TransportChoice::Auto, TransportChoice::Tcp] {
        for (gather, (rank0, others)) in [
            (true, cases[0]),
            (true, cases[1]),
            (false, cases[0]),
            (false, cases[1]),
        ] {
            let res = spawn_world(3, cfg(t), |c| {
                let counts = if c.rank() == 0 { rank0 } else { others };
                let (mine, total) = (counts[c.rank()], counts.iter().sum());
                let first = if gather {
                    c.all_gather_v_into(&vec![1i32; mine], &mut vec![0i32; total], counts)
                } else {
                    c.reduce_scatter_v_into(
                        &vec![1i32; total],
                        &mut vec![0i32; mine],
                        counts,
                        ReduceOp::Sum,
                    )
                };
                Ok((first, c.barrier()))
            });
            let mut mismatches = 0;
            for (rank, r) in res.into_iter().enumerate() {
                let (first, then) = r.unwrap();
                if let Err(e @ Error::Mismatch { .. }) = &first {
                    let msg = e.to_string();
                    assert!(msg.contains("counts-hash="), "rank {rank}: {msg}");
                    mismatches += 1;
                }
                assert!(
                    !matches!(first, Err(Error::Timeout { .. })),
                    "rank {rank} ({t:?}): {first:?}"
                );
                assert!(
                    first.is_err() || then.is_err(),
                    "rank {rank} ({t:?}, gather {gather}): the disagreement went unnoticed"
                );
                // Rank 0 (the odd one out, even with nothing to send) learns in this call, not
                // at its next one.
                assert!(
                    rank != 0 || first.is_err(),
                    "rank 0 ({t:?}, gather {gather}, counts {rank0:?}): the call succeeded"
                );
            }
            assert!(
                mismatches >= 1,
                "{t:?}, gather {gather}: no rank reported it"
            );
        }
    }
}

/// Rank 1 and the root disagree on rank 1's count in a gather-v or scatter-v: the receiving side
/// (the root of a gather, rank 1 of a scatter) gets a `Mismatch` naming both counts in that
/// call, the sending side at the latest at its next call, and nobody times out.
#[test]
fn gather_v_and_scatter_v_disagreeing_on_a_count_get_a_mismatch() {
    for t in [TransportChoice::Auto, TransportChoice::Tcp] {
        for gather in [true, false] {
            let res = spawn_world(3, cfg(t), |c| {
                let counts: &[usize] = if c.rank() == 1 {
                    &[2, 5, 2]
                } else {
                    &[2, 3, 2]
                };
                let (me, total) = (c.rank(), counts.iter().sum::<usize>());
                let root_len = if me == 0 { total } else { 0 };
                let first = if gather {
                    c.gather_v_into(
                        &vec![1i32; counts[me]],
                        &mut vec![0i32; root_len],
                        counts,
                        0,
                    )
                } else {
                    c.scatter_v_into(
                        &vec![1i32; root_len],
                        &mut vec![0i32; counts[me]],
                        counts,
                        0,
                    )
                };
                Ok((first, c.barrier()))
            });
            for (rank, r) in res.into_iter().enumerate() {
                let (first, then) = r.unwrap();
                assert!(
                    !matches!(first, Err(Error::Timeout { .. })),
                    "rank {rank} ({t:?}, gather {gather}): {first:?}"
                );
                if rank == usize::from(!gather) {
                    match &first {
                        Err(e @ Error::Mismatch { .. }) => {
                            let msg = e.to_string();
                            assert!(
                                msg.contains("count=3") && msg.contains("count=5"),
                                "rank {rank}: {msg}"
                            );
                        }
                        other => panic!("rank {rank} ({t:?}, gather {gather}): {other:?}"),
                    }
                }
                assert!(first.is_err() || then.is_err(), "rank {rank}: unnoticed");
            }
        }
    }
}

/// `all_gather_bytes` and `broadcast_bytes`: byte strings of any length (empty ones and one
/// longer than a slot included) from every rank or from a root; a bad root is named.
#[test]
fn bytes_of_any_length() {
    let text = |r: usize| -> Vec<u8> {
        let len = [0, 1, 100_003, 7][r];
        (0..len).map(|i| (r * 13 + i * 7) as u8).collect()
    };
    for t in [TransportChoice::Auto, TransportChoice::Tcp] {
        for r in spawn_world(4, cfg(t), |c| {
            let me = c.rank();
            let all = c.all_gather_bytes(&text(me))?;
            assert_eq!(
                all,
                (0..4).map(text).collect::<Vec<_>>(),
                "rank {me} ({t:?})"
            );
            let mine = if me == 2 { text(2) } else { Vec::new() };
            let from2 = c.broadcast_bytes(&mine, 2)?;
            assert_eq!(from2, text(2), "rank {me} ({t:?})");
            // Non-root ranks' data is ignored, and an empty root's string arrives empty.
            let from0 = c.broadcast_bytes(&text(me), 0)?;
            assert!(from0.is_empty(), "rank {me} ({t:?})");
            let bad = c.broadcast_bytes(b"x", 4).expect_err("root 4 of 4");
            let msg = bad.to_string();
            assert!(
                msg.contains(&format!("rank {me}")) && msg.contains("root 4"),
                "{msg}"
            );
            Ok(())
        }) {
            r.unwrap();
        }
    }
}
