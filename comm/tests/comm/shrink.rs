//! `Communicator::shrink`: survivors of a lost rank make a communicator without it and go on;
//! a healthy communicator shrinks too (ranks leaving), also twice and from a split one; bad
//! exclude lists are named, and ranks that pass different lists get `Mismatch`.

use std::time::Duration;

use oxccl_comm::config::TransportChoice;
use oxccl_comm::harness::{spawn_world, spawn_world_on_nodes};
use oxccl_comm::{Communicator, Config, Error, ReduceOp, Result};

fn cfg(t: TransportChoice) -> Config {
    Config {
        transport: t,
        timeout: Duration::from_secs(30),
        ..Config::default()
    }
}

/// Checks that `c` is a working communicator of the old ranks `old` (in order), this rank
/// being old rank `me`: rank, size, an all-reduce and an all-gather of old ranks.
fn check_members(c: &Communicator, me: usize, old: &[usize]) -> Result<()> {
    assert_eq!(c.size(), old.len(), "old rank {me}");
    assert_eq!(old[c.rank()], me, "old rank {me}: new rank {}", c.rank());
    let mut x = vec![1u32; 100_000];
    c.all_reduce(&mut x, ReduceOp::Sum)?;
    assert!(x.iter().all(|&v| v as usize == old.len()), "old rank {me}");
    let mut all = vec![0u64; old.len()];
    c.all_gather_into(&[me as u64], &mut all)?;
    assert_eq!(all, old.iter().map(|&r| r as u64).collect::<Vec<_>>());
    Ok(())
}

/// Rank 2 leaves in the middle of a series of all-reduces (its thread drops its communicator);
/// the others' all-reduce fails with `PeerLost` naming it, they shrink it away and go on.
fn survive(c: Communicator) -> Result<()> {
    let me = c.rank();
    let mut x = vec![1f32; 300_000];
    for i in 0..5 {
        if i == 2 && me == 2 {
            return Ok(());
        }
        if let Err(e) = c.all_reduce(&mut x, ReduceOp::Sum) {
            let lost = e
                .lost_peer()
                .unwrap_or_else(|| panic!("rank {me}: expected PeerLost, got {e}"));
            assert_eq!(lost, 2, "rank {me}: {e}");
            let fewer = c.shrink(&[lost])?;
            // The old communicator stays broken.
            assert!(c.barrier().is_err(), "rank {me}");
            return check_members(&fewer, me, &[0, 1, 3]);
        }
        x.fill(1.0);
    }
    panic!("rank {me}: the all-reduces went on without rank 2");
}

#[test]
fn survivors_of_a_lost_rank_go_on_without_it() {
    for t in [TransportChoice::Auto, TransportChoice::Tcp] {
        for (rank, r) in spawn_world(4, cfg(t), survive).into_iter().enumerate() {
            r.unwrap_or_else(|e| panic!("{t:?}: rank {rank}: {e}"));
        }
    }
    // Two simulated nodes: the survivors' nodes are no longer of equal size.
    for (rank, r) in spawn_world_on_nodes(4, 2, cfg(TransportChoice::Auto), survive)
        .into_iter()
        .enumerate()
    {
        r.unwrap_or_else(|e| panic!("nodes: rank {rank}: {e}"));
    }
}

/// Ranks 0 and 3 of 5 leave a healthy communicator; the rest shrink it (the list in any order,
/// with repeats). A communicator split from the result (in reverse order) shrinks too, when old
/// rank 4 leaves it.
#[test]
fn a_healthy_communicator_shrinks_and_so_does_a_split_one() {
    let res = spawn_world(5, cfg(TransportChoice::Auto), |c| {
        let me = c.rank();
        c.barrier()?;
        if me == 0 || me == 3 {
            return Ok(());
        }
        let fewer = c.shrink(&[3, 0, 3])?;
        check_members(&fewer, me, &[1, 2, 4])?;
        let reversed = fewer
            .split(Some(0), -(fewer.rank() as i64))?
            .expect("a color");
        check_members(&reversed, me, &[4, 2, 1])?;
        if me == 4 {
            return Ok(());
        }
        let two = reversed.shrink(&[0])?;
        check_members(&two, me, &[2, 1])
    });
    for (rank, r) in res.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}

/// A rank outside the communicator, this rank itself, and ranks that disagree on the list.
#[test]
fn bad_shrinks_are_named() {
    let res = spawn_world(3, cfg(TransportChoice::Auto), |c| {
        let me = c.rank();
        let outside = c.shrink(&[5]).err();
        let itself = c.shrink(&[me]).err();
        // Rank 0 wants rank 2 out; ranks 1 and 2 want nobody out.
        let list: &[usize] = if me == 0 { &[2] } else { &[] };
        let differ = c.shrink(list).err();
        Ok([outside, itself, differ])
    });
    for (rank, r) in res.into_iter().enumerate() {
        let [outside, itself, differ] = r.unwrap();
        for (e, want) in [
            (
                outside,
                "rank 5 in the exclude list is not a rank".to_string(),
            ),
            (itself, format!("this rank ({rank}) is in the exclude list")),
        ] {
            let e = e.expect("an error");
            let text = e.to_string();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{text}");
            assert!(
                text.contains(&format!("rank {rank}: shrink")) && text.contains(&want),
                "rank {rank}: {text}"
            );
        }
        let e = differ.expect("disagreeing lists must fail");
        let text = e.to_string();
        assert!(matches!(e, Error::Mismatch { .. }), "rank {rank}: {text}");
        assert!(
            text.contains("shrink(exclude=[2])") && text.contains("shrink(exclude=[])"),
            "rank {rank}: {text}"
        );
    }
}

/// A failed attempt counts on every rank: rank 0 passes a bad list (refused at once), so ranks
/// 1 and 2 time out waiting for its list, naming it; then all three try again and succeed.
#[test]
fn a_failed_shrink_can_be_tried_again() {
    let short = Config {
        timeout: Duration::from_secs(2),
        ..Config::default()
    };
    let res = spawn_world(3, short, |c| {
        let me = c.rank();
        let first = if me == 0 {
            c.shrink(&[0]).err()
        } else {
            c.shrink(&[]).err()
        };
        // Ranks 1 and 2 time out after 2 s; rank 0 waits that long before trying again.
        if me == 0 {
            std::thread::sleep(Duration::from_millis(2500));
        }
        let again = c.shrink(&[])?;
        check_members(&again, me, &[0, 1, 2])?;
        Ok(first)
    });
    for (rank, r) in res.into_iter().enumerate() {
        let e = r
            .unwrap_or_else(|e| panic!("rank {rank}: {e}"))
            .expect("the first attempt must fail");
        let text = e.to_string();
        if rank == 0 {
            assert!(matches!(e, Error::InvalidArgument { .. }), "{text}");
        } else {
            assert!(
                matches!(e, Error::Timeout { .. }) && text.contains("rank 0 did not call shrink"),
                "rank {rank}: {text}"
            );
        }
    }
}
