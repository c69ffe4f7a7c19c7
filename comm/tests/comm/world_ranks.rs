//! A communicator made from another knows its ranks' ranks in the world (`world_ranks`,
//! `world_rank`, `world_id`) through splits and shrinks, and every error of its operations
//! ends with a note naming them, while the error's fields keep its own ranks.

use std::time::Duration;

use oxccl_comm::config::TransportChoice;
use oxccl_comm::harness::spawn_world;
use oxccl_comm::{Config, Error, ReduceOp};

fn cfg() -> Config {
    Config {
        transport: TransportChoice::Shm,
        timeout: Duration::from_secs(30),
        ..Config::default()
    }
}

#[test]
fn world_ranks_through_splits_and_shrinks() {
    let res = spawn_world(6, cfg(), |c| {
        let r = c.rank();
        assert_eq!(c.world_id(), c.id());
        assert_eq!(c.world_ranks(), &[0, 1, 2, 3, 4, 5]);
        assert_eq!(c.world_rank(6), None);
        // Even ranks in reverse order; odd ones stay out.
        let even = c.split((r % 2 == 0).then_some(0), -(r as i64))?;
        let mut left = None;
        if let Some(g) = &even {
            assert_eq!(g.world_id(), c.id());
            assert_eq!(g.world_ranks(), &[4, 2, 0]);
            assert_eq!(g.world_rank(g.rank()), Some(r));
            // A split of the split (in the world's order again), and a shrink of that: still
            // the world's ranks.
            let sub = g.split(Some(0), r as i64)?.expect("member");
            assert_eq!(sub.world_ranks(), &[0, 2, 4]);
            let sub_ranks: Vec<usize> = sub.world_ranks().to_vec();
            // Leave out the world rank 2.
            let out = sub_ranks
                .iter()
                .position(|&w| w == 2)
                .expect("world rank 2");
            if r != 2 {
                let fewer = sub.shrink(&[out])?;
                assert_eq!(fewer.world_id(), c.id());
                let expect: Vec<usize> = sub_ranks.iter().copied().filter(|&w| w != 2).collect();
                assert_eq!(fewer.world_ranks(), &expect[..]);
                let mut all = vec![0u64; fewer.size()];
                fewer.all_gather_into(&[r as u64], &mut all)?;
                assert_eq!(all, expect.iter().map(|&w| w as u64).collect::<Vec<_>>());
                left = Some(fewer.world_ranks().to_vec());
            }
        }
        c.barrier()?;
        Ok(left)
    });
    for (rank, r) in res.into_iter().enumerate() {
        let left = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        match rank {
            0 | 4 => assert_eq!(left, Some(vec![0, 4]), "rank {rank}"),
            _ => assert_eq!(left, None, "rank {rank}"),
        }
    }
}

#[test]
fn a_groups_errors_name_its_world_ranks() {
    // Groups [3, 1] and [2, 0] of a world of 4 (reverse order).
    let res = spawn_world(4, cfg(), |c| {
        let r = c.rank();
        let g = c.split(Some((r % 2) as u32), -(r as i64))?.expect("member");
        let note = format!(
            "(ranks named here are of communicator {}; its ranks 0-1 are ranks {:?} of {})",
            g.id(),
            g.world_ranks(),
            c.id()
        );
        // A bad argument: this rank's note.
        let e = g.broadcast(&mut [0u8; 4], 7).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        assert!(e.to_string().ends_with(&note), "{e}");
        // The world's own errors need no note.
        let e = c.broadcast(&mut [0u8; 4], 7).unwrap_err();
        assert!(!e.to_string().contains("ranks named here"), "{e}");
        if r == 1 {
            // The odd group loses world rank 1 (its group rank 1).
            drop(g);
            c.barrier()?;
            return Ok(None);
        }
        let e = if r == 3 {
            let mut v = vec![1u32; 1000];
            g.all_reduce(&mut v, ReduceOp::Sum).unwrap_err()
        } else {
            // The even group's ranks disagree on the count.
            let mut v = vec![1f32; if r == 2 { 10 } else { 20 }];
            g.all_reduce(&mut v, ReduceOp::Sum).unwrap_err()
        };
        {
            let msg = e.to_string();
            assert!(msg.ends_with(&note), "rank {r}: {msg}");
            assert_eq!(msg.matches("ranks named here").count(), 1, "{msg}");
            // Later calls, async ones too, report the cause with the note once.
            let later = g
                .all_reduce_async(vec![0u8; 8], ReduceOp::Sum)
                .wait()
                .unwrap_err();
            let later = later.to_string();
            assert!(later.ends_with(&note), "rank {r}: {later}");
            assert_eq!(later.matches("ranks named here").count(), 1, "{later}");
        }
        c.barrier()?;
        Ok(Some(e))
    });
    for (rank, r) in res.into_iter().enumerate() {
        let failed = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        match rank {
            1 => assert!(failed.is_none()),
            3 => {
                let e = failed.expect("rank 3 fails");
                // The field keeps the group's rank: what the group's `shrink` takes.
                assert_eq!(e.lost_peer(), Some(1), "{e}");
                assert!(e.to_string().contains("ranks [3, 1] of"), "{e}");
            }
            _ => {
                let e = failed.expect("the even group fails");
                assert!(matches!(e, Error::Mismatch { .. }), "rank {rank}: {e}");
                assert!(e.to_string().contains("ranks [2, 0] of"), "{e}");
            }
        }
    }
}
