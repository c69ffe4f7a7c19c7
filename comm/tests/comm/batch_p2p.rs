//! `Communicator::batch_p2p`: neighbour exchanges that would deadlock as blocking calls in
//! that order, several messages to one peer matched in order (also with plain `send`/`recv`),
//! sends to this rank itself, and bad batches.

use std::time::Duration;

use oxccl_comm::config::TransportChoice;
use oxccl_comm::harness::{spawn_world, spawn_world_on_nodes};
use oxccl_comm::{Communicator, Config, Error, P2pOp, Result};

fn cfg(t: TransportChoice) -> Config {
    Config {
        transport: t,
        timeout: Duration::from_secs(60),
        ..Config::default()
    }
}

fn val(from: usize, to: usize, k: usize, i: usize) -> u32 {
    (from * 1_000_000 + to * 10_000 + k * 1000) as u32 ^ i as u32
}

/// Every rank sends to both neighbours first, then receives from both: as blocking calls in
/// this order every rank would wait in its first send for a receive nobody has posted (the
/// messages are larger than a connection buffers). In one batch it completes.
fn halo(c: &Communicator, len: usize) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let to_next: Vec<u32> = (0..len).map(|i| val(r, next, 0, i)).collect();
    let to_prev: Vec<u32> = (0..len).map(|i| val(r, prev, 1, i)).collect();
    let (mut from_prev, mut from_next) = (vec![0u32; len], vec![0u32; len]);
    c.batch_p2p(vec![
        P2pOp::Send {
            buf: &to_next,
            peer: next,
        },
        P2pOp::Send {
            buf: &to_prev,
            peer: prev,
        },
        P2pOp::Recv {
            buf: &mut from_prev,
            peer: prev,
        },
        P2pOp::Recv {
            buf: &mut from_next,
            peer: next,
        },
    ])?;
    if n == 2 {
        // Both neighbours are the same rank: its first message (to its next) arrives first.
        let first: Vec<u32> = (0..len).map(|i| val(prev, r, 0, i)).collect();
        let second: Vec<u32> = (0..len).map(|i| val(prev, r, 1, i)).collect();
        assert_eq!(from_prev, first, "rank {r}");
        assert_eq!(from_next, second, "rank {r}");
    } else {
        let want_prev: Vec<u32> = (0..len).map(|i| val(prev, r, 0, i)).collect();
        let want_next: Vec<u32> = (0..len).map(|i| val(next, r, 1, i)).collect();
        assert_eq!(from_prev, want_prev, "rank {r} of {n}");
        assert_eq!(from_next, want_next, "rank {r} of {n}");
    }
    Ok(())
}

#[test]
fn neighbour_exchange_in_one_batch() {
    // 3 M elements (12 MiB) per message: far beyond the slots and socket buffers.
    for t in [TransportChoice::Auto, TransportChoice::Tcp] {
        for n in [2, 3, 5] {
            for len in [0, 7, 3 << 20] {
                let res = spawn_world(n, cfg(t), |c| halo(&c, len));
                for (rank, r) in res.into_iter().enumerate() {
                    r.unwrap_or_else(|e| panic!("{t:?} {n} ranks, {len}: rank {rank}: {e}"));
                }
            }
        }
    }
    let res = spawn_world_on_nodes(4, 2, cfg(TransportChoice::Auto), |c| halo(&c, 100_000));
    for r in res {
        r.unwrap();
    }
}

/// Three messages from rank 0 to rank 1 in one batch (of different lengths, larger than a slot)
/// arrive in order; rank 1 takes the first with a plain `recv` and the other two in a batch,
/// and a plain `send` after the batch is the next message.
#[test]
fn messages_to_one_peer_are_matched_in_order() {
    for t in [TransportChoice::Auto, TransportChoice::Tcp] {
        let lens = [300_000usize, 5, 200_000];
        let res = spawn_world(2, cfg(t), |c| {
            let msgs: Vec<Vec<u32>> = (0..4)
                .map(|k| (0..lens[k % 3]).map(|i| val(0, 1, k, i)).collect())
                .collect();
            if c.rank() == 0 {
                c.batch_p2p(
                    msgs[..3]
                        .iter()
                        .map(|m| P2pOp::Send { buf: m, peer: 1 })
                        .collect(),
                )?;
                c.send(&msgs[3], 1)?;
            } else {
                let mut got: Vec<Vec<u32>> = (0..4).map(|k| vec![0u32; lens[k % 3]]).collect();
                let (first, rest) = got.split_at_mut(1);
                c.recv(&mut first[0], 0)?;
                c.batch_p2p(
                    rest.iter_mut()
                        .map(|b| P2pOp::Recv { buf: b, peer: 0 })
                        .collect(),
                )?;
                assert_eq!(got, msgs, "{t:?}");
            }
            Ok(())
        });
        for r in res {
            r.unwrap();
        }
    }
}

/// Sends to this rank itself pair with receives from it, in order; a batch with only those
/// (or none at all) touches no connection.
#[test]
fn sends_to_self_are_copies() {
    let res = spawn_world(2, cfg(TransportChoice::Auto), |c| {
        let me = c.rank();
        let (a, b) = (vec![1.5f64; 10], vec![2.5f64; 3]);
        let (mut x, mut y) = (vec![0f64; 10], vec![0f64; 3]);
        c.batch_p2p(vec![
            P2pOp::Recv {
                buf: &mut x,
                peer: me,
            },
            P2pOp::Send { buf: &a, peer: me },
            P2pOp::Send { buf: &b, peer: me },
            P2pOp::Recv {
                buf: &mut y,
                peer: me,
            },
        ])?;
        assert_eq!((x, y), (a, b));
        c.batch_p2p::<f64>(Vec::new())?;
        c.barrier()
    });
    for r in res {
        r.unwrap();
    }
}

/// A peer outside the communicator, self sends and receives that do not pair up, and a length
/// that differs from the peer's: errors naming the rank, the call and what is wrong.
#[test]
fn bad_batches_are_named() {
    let res = spawn_world(2, cfg(TransportChoice::Auto), |c| {
        let me = c.rank();
        let a = vec![0u8; 4];
        let mut b = vec![0u8; 5];
        let bad_peer = c.batch_p2p(vec![P2pOp::Send { buf: &a, peer: 2 }]).err();
        let unpaired = c.batch_p2p(vec![P2pOp::Send { buf: &a, peer: me }]).err();
        let lengths = c
            .batch_p2p(vec![
                P2pOp::Send { buf: &a, peer: me },
                P2pOp::Recv {
                    buf: &mut b,
                    peer: me,
                },
            ])
            .err();
        // Then a real disagreement: rank 0 sends 4 elements, rank 1 expects 5.
        let mismatch = if me == 0 {
            c.batch_p2p(vec![P2pOp::Send { buf: &a, peer: 1 }])
                .and_then(|_| c.barrier())
        } else {
            c.batch_p2p(vec![P2pOp::Recv {
                buf: &mut b,
                peer: 0,
            }])
        }
        .err();
        Ok([bad_peer, unpaired, lengths, mismatch])
    });
    for (rank, r) in res.into_iter().enumerate() {
        let [bad_peer, unpaired, lengths, mismatch] = r.unwrap();
        for (e, want) in [
            (bad_peer, "operation 0: peer 2 is not a rank"),
            (unpaired, "1 sends to this rank itself but 0 receives"),
            (
                lengths,
                "operation 0 sends 4 elements to this rank, but operation 1 receives 5",
            ),
        ] {
            let e = e.expect("an error");
            let msg = e.to_string();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{msg}");
            assert!(
                msg.contains(&format!("rank {rank}"))
                    && msg.contains("batch_p2p")
                    && msg.contains(want),
                "rank {rank}: {msg}"
            );
        }
        let e = mismatch.expect("the length disagreement must surface");
        if rank == 1 {
            assert!(matches!(e, Error::Mismatch { .. }), "rank 1: {e}");
            let msg = e.to_string();
            assert!(msg.contains("count=4") && msg.contains("count=5"), "{msg}");
        }
    }
}
