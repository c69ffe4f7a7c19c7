//! Stall reports in `Timeout` errors: the ranks of a hung collective name the rank that never
//! came, and a rank waiting in another communicator (two communicators waiting on each other)
//! is named with that communicator's operation.

use std::time::Duration;

use oxccl_comm::config::TransportChoice;
use oxccl_comm::harness::spawn_world;
use oxccl_comm::{Config, Error, ReduceOp};

fn cfg(timeout: Duration) -> Config {
    Config {
        transport: TransportChoice::Auto,
        timeout,
        ..Config::default()
    }
}

/// Rank 3 is busy in its own code past the time-out: ranks 0-2 time out in the all-reduce, and
/// the error every one of them reports says they all waited in it and rank 3 never posted a
/// wait.
#[test]
fn a_rank_that_never_comes_is_named() {
    let res = spawn_world(4, cfg(Duration::from_secs(2)), |c| {
        let mut x = vec![1f32; 1000];
        if c.rank() == 3 {
            std::thread::sleep(Duration::from_millis(3500));
        }
        Ok(c.all_reduce(&mut x, ReduceOp::Sum).err())
    });
    for (rank, r) in res.into_iter().enumerate().take(3) {
        let e = r.unwrap().expect("the all-reduce must fail without rank 3");
        let text = e.to_string();
        assert!(
            matches!(e, Error::Timeout { .. }) || text.contains("timed out"),
            "rank {rank}: {text}"
        );
        assert!(text.contains("stall reports: "), "rank {rank}: {text}");
        assert!(
            text.contains("rank 3 posted no stall"),
            "rank {rank}: rank 3 must be named: {text}"
        );
        // "ranks 0-1 wait in this ..." or, if one of them had not posted yet, "rank 1 waits".
        assert!(
            text.contains(" in this all-reduce(count=1000, dtype=float, op=sum) too"),
            "rank {rank}: {text}"
        );
    }
}

/// Ranks 0-2 run an all-reduce on the world while rank 3 runs one on a communicator of ranks 2
/// and 3 first: each waits for the other. The world's error names rank 3's wait in the other
/// communicator, and the pair's error names rank 2's wait in the world.
#[test]
fn a_rank_waiting_in_another_communicator_is_named() {
    let res = spawn_world(4, cfg(Duration::from_secs(2)), |c| {
        let pair = c
            .split(Some(u32::from(c.rank() >= 2)), 0)?
            .expect("every rank has a color");
        let mut x = vec![1i64; 16];
        let err = if c.rank() == 3 {
            pair.all_reduce(&mut x, ReduceOp::Max).err()
        } else {
            c.all_reduce(&mut x, ReduceOp::Sum).err()
        };
        // Keep both communicators open until every rank has timed out (closing one would end
        // the other side's wait early, as a lost peer).
        std::thread::sleep(Duration::from_millis(2500));
        Ok(err.map(|e| e.to_string()))
    });
    let texts: Vec<String> = res
        .into_iter()
        .map(|r| r.unwrap().expect("every call must fail"))
        .collect();
    for (rank, text) in texts.iter().enumerate().take(2) {
        assert!(
            text.contains(
                "rank 3 waits in all-reduce(count=16, dtype=int64, op=max) #0 of communicator"
            ) && text.contains("/split0/c1 (as its rank 1 of 2)"),
            "rank {rank}: {text}"
        );
    }
    // Rank 3's pair: its peer (rank 0 there, world rank 2) waits in the world's all-reduce.
    assert!(
        texts[3].contains(
            "rank 0 waits in all-reduce(count=16, dtype=int64, op=sum) #1 of communicator"
        ),
        "rank 3: {}",
        texts[3]
    );
}
