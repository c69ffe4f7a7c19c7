//! `Communicator::all_to_all_v_into`: random count matrices (empty blocks included) against a serial
//! reference over shared memory, TCP and two simulated nodes; bad count lists; ranks that
//! disagree on a count.

use std::time::Duration;

use oxccl_comm::config::TransportChoice;
use oxccl_comm::harness::{spawn_world, spawn_world_on_nodes};
use oxccl_comm::{Communicator, Config, Error, Result};
use proptest::prelude::*;

fn cfg(t: TransportChoice) -> Config {
    Config {
        transport: t,
        timeout: Duration::from_secs(60),
        ..Config::default()
    }
}

/// Element `i` of the block rank `from` sends rank `to`.
fn val(from: usize, to: usize, i: usize, seed: u64) -> i64 {
    ((from as u64 * 1_000_003 + to as u64 * 7919 + i as u64 * 31 + seed) % 100_003) as i64
}

/// One rank's call for the count matrix `c` (`c[from][to]` elements), checked against the
/// serial reference: its output is, in rank order, the block every rank sent it.
fn run_rank(c: &Communicator, counts: &[Vec<usize>], seed: u64) -> Result<()> {
    let (me, n) = (c.rank(), c.size());
    let send: Vec<usize> = counts[me].clone();
    let recv: Vec<usize> = (0..n).map(|j| counts[j][me]).collect();
    let input: Vec<i64> = (0..n)
        .flat_map(|to| (0..send[to]).map(move |i| val(me, to, i, seed)))
        .collect();
    let mut output = vec![-1i64; recv.iter().sum()];
    c.all_to_all_v_into(&input, &send, &mut output, &recv)?;
    let want: Vec<i64> = (0..n)
        .flat_map(|from| (0..recv[from]).map(move |i| val(from, me, i, seed)))
        .collect();
    assert_eq!(output, want, "rank {me} of {n}, counts {counts:?}");
    // The async form: owns both buffers until `wait()`; a blocking call issued meanwhile on
    // another thread would queue behind it, so the caller computes instead.
    let work = c.all_to_all_v_into_async(input.clone(), &send, vec![-1i64; want.len()], &recv);
    let (back_in, out) = work.wait()?;
    assert_eq!(back_in, input);
    assert_eq!(out, want, "rank {me} of {n}, async");
    // One-byte elements too, same matrix.
    let input: Vec<u8> = input.iter().map(|&v| v as u8).collect();
    let mut output = vec![0u8; want.len()];
    c.all_to_all_v_into(&input, &send, &mut output, &recv)?;
    let want: Vec<u8> = want.iter().map(|&v| v as u8).collect();
    assert_eq!(output, want, "rank {me} of {n}, u8");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn random_count_matrices_match_a_serial_reference(
        n in 1usize..=5,
        // Blocks of up to 70,000 elements (beyond a 512 KiB slot) are rare; most are small and
        // a quarter empty.
        raw in prop::collection::vec(prop_oneof![
            1 => Just(0usize),
            2 => 1usize..200,
            1 => 200usize..70_000,
        ], 25),
        transport in prop::sample::select(vec!["shm", "tcp", "nodes"]),
        seed in any::<u64>(),
    ) {
        let counts: Vec<Vec<usize>> = (0..n).map(|r| raw[r * 5..r * 5 + n].to_vec()).collect();
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

/// `all_to_all_async` gives the same blocks as `all_to_all`, and both async forms refuse bad
/// lengths through `wait()` with the blocking form's error.
#[test]
fn async_all_to_all_and_bad_lengths() {
    for t in [TransportChoice::Auto, TransportChoice::Tcp] {
        let res = spawn_world(3, cfg(t), |c| {
            let me = c.rank() as i32;
            let inp: Vec<i32> = (0..12).map(|i| me * 100 + i).collect();
            let (_, out) = c.all_to_all_into_async(inp, vec![0i32; 12]).wait()?;
            let want: Vec<i32> = (0..3)
                .flat_map(|r| (0..4).map(move |i| r * 100 + me * 4 + i))
                .collect();
            assert_eq!(out, want, "rank {me}");
            let bad = c
                .all_to_all_into_async(vec![0i32; 12], vec![0i32; 11])
                .wait();
            let bad_v = c
                .all_to_all_v_into_async(vec![0i32; 6], &[2, 2, 2], vec![0i32; 6], &[2, 2])
                .wait();
            c.barrier()?;
            Ok((bad.err(), bad_v.err()))
        });
        for (rank, r) in res.into_iter().enumerate() {
            let (bad, bad_v) = r.unwrap();
            for (e, want) in [
                (bad, "must have the same length"),
                (bad_v, "recv_counts has 2 entries"),
            ] {
                let msg = e.expect("an error").to_string();
                assert!(
                    msg.contains(&format!("rank {rank}")) && msg.contains(want),
                    "{msg}"
                );
            }
        }
    }
}

/// Count lists of the wrong length, or that do not add up to the buffers, or whose own block
/// differs between sending and receiving, are `InvalidArgument`s naming the rank, the call and
/// the problem; nothing was sent, so the communicator still works.
#[test]
fn bad_count_lists_are_named() {
    let res = spawn_world(3, cfg(TransportChoice::Auto), |c| {
        let inp = vec![1.0f32; 6];
        let mut out = vec![0.0f32; 6];
        let mut errs = Vec::new();
        for (send, recv) in [
            (vec![2, 2], vec![2, 2, 2]),
            (vec![2, 2, 2], vec![2, 2, 3]),
            (vec![2, 2, 1], vec![2, 2, 2]),
            (vec![usize::MAX, 2, 2], vec![2, 2, 2]),
            (vec![1, 1, 4], vec![2, 2, 2]),
        ] {
            errs.push(c.all_to_all_v_into(&inp, &send, &mut out, &recv).err());
            if errs.last().unwrap().is_none() {
                return Ok((errs, Err(Error::Config("unexpected success".into()))));
            }
        }
        Ok((errs, c.barrier()))
    });
    for (rank, r) in res.into_iter().enumerate() {
        let (errs, after) = r.unwrap();
        let wants = [
            "send_counts has 2 entries; it must have one per rank (3)",
            "recv_counts add up to more than the buffer's 6 elements",
            "send_counts add up to 5 elements but the buffer has 6",
            "send_counts add up to more than the buffer's 6 elements",
            "the block a rank sends itself",
        ];
        for (e, want) in errs.iter().zip(wants) {
            let e = e.as_ref().expect("an error");
            let msg = e.to_string();
            assert!(
                matches!(e, Error::InvalidArgument { .. }),
                "rank {rank}: {msg}"
            );
            assert!(
                msg.contains(&format!("rank {rank}"))
                    && msg.contains("all_to_all_v")
                    && msg.contains(want),
                "rank {rank}: {msg} (wanted {want:?})"
            );
        }
        assert!(
            after.is_ok(),
            "rank {rank}: barrier after refused calls: {after:?}"
        );
    }
}

/// Rank 0 sends rank 1 a block of 3 (or none) while rank 1 expects 5 from it: a `Mismatch`
/// naming both counts at once (not a time-out), and the communicator is broken afterwards.
#[test]
fn ranks_disagreeing_on_a_count_get_a_mismatch() {
    for (sent, t) in [
        (3usize, TransportChoice::Auto),
        (0, TransportChoice::Auto),
        (3, TransportChoice::Tcp),
        (0, TransportChoice::Tcp),
    ] {
        let res = spawn_world(2, cfg(t), |c| {
            let (send, recv) = if c.rank() == 0 {
                (vec![1, sent], vec![1, 1])
            } else {
                (vec![1, 1], vec![5, 1])
            };
            let inp = vec![7i32; send.iter().sum()];
            let mut out = vec![0i32; recv.iter().sum()];
            let first = c.all_to_all_v_into(&inp, &send, &mut out, &recv);
            Ok((first, c.barrier()))
        });
        let mut mismatches = 0;
        for (rank, r) in res.into_iter().enumerate() {
            let (first, then) = r.unwrap();
            if let Err(e @ Error::Mismatch { .. }) = &first {
                let msg = e.to_string();
                assert!(
                    msg.contains("count=5") && msg.contains(&format!("count={sent}")),
                    "rank {rank}: {msg}"
                );
                mismatches += 1;
            }
            assert!(
                !matches!(first, Err(Error::Timeout { .. })),
                "rank {rank} ({t:?}, sent {sent}): {first:?}"
            );
            assert!(
                first.is_err() || then.is_err(),
                "rank {rank} ({t:?}, sent {sent}): the disagreement went unnoticed"
            );
        }
        assert!(
            mismatches >= 1,
            "{t:?}, sent {sent}: no rank reported the mismatch"
        );
    }
}
