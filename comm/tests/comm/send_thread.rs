//! The send thread (`OXCCL_SOCKET_SEND_THREAD`, `Config::socket_send_thread`): large sends to TCP
//! peers go out on a thread of their own while the rank's thread receives and reduces. Every
//! collective with it against a serial reference, over TCP and across simulated nodes (shared
//! memory inside, TCP between), with the count of exchanges that used it checked, and its
//! failures: a peer lost in the middle, a missing peer and `abort` end in errors within the
//! deadline, never a hang.

use std::time::{Duration, Instant};

use oxccl_comm::config::TransportChoice;
use oxccl_comm::harness::{spawn_world, spawn_world_on_nodes};
use oxccl_comm::{Communicator, Config, Error, ReduceOp, Result};

fn cfg(timeout_s: u64) -> Config {
    Config {
        transport: TransportChoice::Tcp,
        socket_send_thread: Some(true),
        timeout: Duration::from_secs(timeout_s),
        ..Config::default()
    }
}

/// Elements per rank: 3 MiB of f32, divisible by 2, 3 and 4 (every piece of a reduce-scatter
/// or all-to-all of up to 4 ranks is at least 768 KiB, above the send thread's minimum).
const LEN: usize = 3 << 18;
/// The same plus 60 elements (240 bytes): messages that are not whole 64-byte lines, so the
/// last frame of a message ends in padding the send thread must still write.
const ODD: usize = LEN + 60;

/// Small integers: every sum is exact in f32 whatever the order.
fn val(rank: usize, i: usize) -> f32 {
    ((rank * 31 + i * 17) % 11) as f32
}

fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| val(rank, i)).collect()
}

fn sum(n: usize, i: usize) -> f32 {
    (0..n).map(|r| val(r, i)).sum()
}

fn check(what: &str, rank: usize, got: &[f32], want: impl Fn(usize) -> f32) {
    for (i, &g) in got.iter().enumerate() {
        let w = want(i);
        assert!(
            g.to_bits() == w.to_bits(),
            "{what}: rank {rank}, element {i} of {}: got {g}, want {w}",
            got.len()
        );
    }
}

/// Every collective that moves large messages, with `LEN` and `ODD` elements, checked; returns
/// how many exchanges used the send thread.
fn every_collective(c: &Communicator) -> Result<u64> {
    collectives_of(c, LEN)?;
    collectives_of(c, ODD)
}

fn collectives_of(c: &Communicator, len: usize) -> Result<u64> {
    let (rank, n) = (c.rank(), c.size());
    let mine = input(rank, len);

    let mut v = mine.clone();
    c.all_reduce(&mut v, ReduceOp::Sum)?;
    check("all_reduce", rank, &v, |i| sum(n, i));

    let mut out = vec![0f32; len];
    c.all_reduce_into(&mine, &mut out, ReduceOp::Sum)?;
    check("all_reduce_into", rank, &out, |i| sum(n, i));

    let mut shard = vec![0f32; len / n];
    c.reduce_scatter_into(&mine, &mut shard, ReduceOp::Sum)?;
    check("reduce_scatter", rank, &shard, |i| {
        sum(n, rank * (len / n) + i)
    });

    let piece = input(rank, len / n);
    let mut all = vec![0f32; len];
    c.all_gather_into(&piece, &mut all)?;
    check("all_gather", rank, &all, |i| {
        val(i / (len / n), i % (len / n))
    });

    let mut b = if rank == 1 {
        mine.clone()
    } else {
        vec![0f32; len]
    };
    c.broadcast(&mut b, 1)?;
    check("broadcast", rank, &b, |i| val(1, i));

    let mut r = vec![0f32; len];
    c.reduce_into(&mine, &mut r, ReduceOp::Sum, 0)?;
    if rank == 0 {
        check("reduce", rank, &r, |i| sum(n, i));
    }

    // Block j of rank r's input is val(r, j * blk + i); rank r receives block r from everyone.
    let mut a2a = vec![0f32; len];
    c.all_to_all_into(&mine, &mut a2a)?;
    let blk = len / n;
    check("all_to_all", rank, &a2a, |i| {
        val(i / blk, rank * blk + i % blk)
    });

    // A ring of send_recv: to the next rank, from the previous.
    let mut got = vec![0f32; len];
    c.send_recv(&mine, (rank + 1) % n, &mut got, (rank + n - 1) % n)?;
    check("send_recv", rank, &got, |i| val((rank + n - 1) % n, i));

    Ok(c.stats().send_thread_exchanges.unwrap_or(0))
}

#[test]
fn every_collective_over_tcp_with_the_send_thread() {
    for n in [2, 3, 4] {
        let res = spawn_world(n, cfg(60), |c| {
            assert_eq!(
                c.stats().send_thread_exchanges,
                Some(0),
                "rank {}",
                c.rank()
            );
            every_collective(&c)
        });
        for (rank, r) in res.into_iter().enumerate() {
            let used = r.unwrap_or_else(|e| panic!("{n} ranks: rank {rank}: {e}"));
            assert!(
                used > 0,
                "{n} ranks: rank {rank} never used its send thread"
            );
        }
    }
}

#[test]
fn small_socket_buffers_and_many_sockets_with_the_send_thread() {
    // 32 KiB socket buffers fill at once, so frames (and their padding) are often cut short;
    // 8 sockets per direction leave frames queued on sockets a send does not reach.
    for (buffer, nsocks) in [(32 << 10, 2), (0, 8)] {
        let c = Config {
            socket_buffer: buffer,
            nsocks,
            ..cfg(60)
        };
        let res = spawn_world(2, c, |c| every_collective(&c));
        for (rank, r) in res.into_iter().enumerate() {
            let used =
                r.unwrap_or_else(|e| panic!("buffer {buffer}, {nsocks} sockets: rank {rank}: {e}"));
            assert!(used > 0);
        }
    }
}

#[test]
fn hierarchical_and_mixed_nodes_with_the_send_thread() {
    let mut c = cfg(60);
    c.transport = TransportChoice::Auto;
    // 2 nodes x 2 ranks: hierarchical all-reduce (rings inside nodes over shm, across over TCP).
    let res = spawn_world_on_nodes(4, 2, c.clone(), |c| {
        assert!(c.is_hierarchical());
        every_collective(&c)
    });
    for (rank, r) in res.into_iter().enumerate() {
        let used = r.unwrap_or_else(|e| panic!("2 x 2: rank {rank}: {e}"));
        assert!(used > 0, "2 x 2: rank {rank} never used its send thread");
    }
    // 3 nodes of one rank each are not hierarchical: a flat ring, all over TCP.
    let res = spawn_world_on_nodes(3, 1, c, |c| every_collective(&c));
    for (rank, r) in res.into_iter().enumerate() {
        assert!(r.unwrap_or_else(|e| panic!("3 x 1: rank {rank}: {e}")) > 0);
    }
}

#[test]
fn without_tcp_peers_or_when_off_there_is_no_send_thread() {
    let mut shm = cfg(30);
    shm.transport = TransportChoice::Shm;
    let res = spawn_world(2, shm, |c| Ok(c.stats().send_thread_exchanges));
    for r in res {
        assert_eq!(r.unwrap(), None);
    }
    let mut off = cfg(30);
    off.socket_send_thread = Some(false);
    let res = spawn_world(2, off, |c| {
        let mut v = input(c.rank(), LEN);
        c.all_reduce(&mut v, ReduceOp::Sum)?;
        check("all_reduce", c.rank(), &v, |i| sum(2, i));
        Ok(c.stats().send_thread_exchanges)
    });
    for r in res {
        assert_eq!(r.unwrap(), None);
    }
}

#[test]
fn a_peer_lost_during_large_sends_is_an_error_on_the_others() {
    let res = spawn_world(3, cfg(30), |c| {
        if c.rank() == 2 {
            // Takes part in one all-reduce, then drops its communicator (closing its
            // connections) while the others start the next.
            let mut v = input(2, LEN);
            c.all_reduce(&mut v, ReduceOp::Sum)?;
            return Ok(None);
        }
        let mut v = input(c.rank(), LEN);
        c.all_reduce(&mut v, ReduceOp::Sum)?;
        let t0 = Instant::now();
        let mut big = vec![1f32; 4 * LEN];
        let e = c.all_reduce(&mut big, ReduceOp::Sum);
        Ok(Some((e, t0.elapsed())))
    });
    for (rank, r) in res.into_iter().take(2).enumerate() {
        let (e, took) = r.unwrap().unwrap();
        let e = e.expect_err("rank 2 is gone");
        assert_eq!(e.lost_peer(), Some(2), "rank {rank}: {e}");
        assert!(took < Duration::from_secs(30), "rank {rank}: {took:?}");
    }
}

#[test]
fn a_missing_peer_times_out_and_abort_ends_a_large_exchange() {
    // Rank 1 never calls: rank 0's large all-reduce times out after 1 s.
    let t0 = Instant::now();
    let res = spawn_world(2, cfg(1), |c| {
        if c.rank() == 0 {
            let mut v = vec![1f32; 4 * LEN];
            let e = c
                .all_reduce(&mut v, ReduceOp::Sum)
                .expect_err("rank 1 never comes");
            assert!(matches!(e, Error::Timeout { rank: 0, .. }), "{e}");
        } else {
            std::thread::sleep(Duration::from_millis(2500));
        }
        Ok(())
    });
    res.into_iter().for_each(|r| r.unwrap());
    assert!(t0.elapsed() < Duration::from_secs(20));

    // Rank 1 never calls either; rank 0 aborts its own pending all-reduce from another thread.
    let res = spawn_world(2, cfg(60), |c| {
        if c.rank() == 0 {
            let t0 = Instant::now();
            std::thread::scope(|s| {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(300));
                    c.abort();
                });
                let mut v = vec![1f32; 4 * LEN];
                let e = c.all_reduce(&mut v, ReduceOp::Sum).expect_err("aborted");
                assert!(matches!(e, Error::Aborted { .. }), "{e}");
            });
            assert!(t0.elapsed() < Duration::from_secs(30));
        } else {
            std::thread::sleep(Duration::from_millis(1500));
        }
        Ok(())
    });
    res.into_iter().for_each(|r| r.unwrap());
}
