//! Async point-to-point: `batch_p2p_async`, `send_async`, `recv_async`. They return before the
//! data moves (a receive posted before its send exists), exchange large messages in both
//! directions together, keep message order with blocking calls and collectives, hand the
//! buffers back in order, and report bad calls and mismatches through `wait()`.

use std::sync::Barrier;
use std::time::Duration;

use oxccl_comm::config::TransportChoice;
use oxccl_comm::harness::{spawn_world, spawn_world_on_nodes};
use oxccl_comm::{Communicator, Config, Error, OwnedP2pOp, ReduceOp, Result};

fn cfg(t: TransportChoice, timeout_s: u64) -> Config {
    Config {
        transport: t,
        timeout: Duration::from_secs(timeout_s),
        ..Config::default()
    }
}

fn val(from: usize, to: usize, k: usize, i: usize) -> u32 {
    (from * 1_000_000 + to * 10_000 + k * 1000) as u32 ^ i as u32
}

fn msg(from: usize, to: usize, k: usize, len: usize) -> Vec<u32> {
    (0..len).map(|i| val(from, to, k, i)).collect()
}

/// Both neighbours at once, larger than a connection buffers, while the caller keeps working:
/// the buffers come back in the order of the batch, the sent ones unchanged.
fn halo_async(c: &Communicator, len: usize) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let work = c.batch_p2p_async(vec![
        OwnedP2pOp::Send {
            buf: msg(r, next, 0, len),
            peer: next,
        },
        OwnedP2pOp::Recv {
            buf: vec![0u32; len],
            peer: prev,
        },
        OwnedP2pOp::Send {
            buf: msg(r, prev, 1, len),
            peer: prev,
        },
        OwnedP2pOp::Recv {
            buf: vec![0u32; len],
            peer: next,
        },
    ]);
    // The caller's own work meanwhile.
    let busy: u64 = (0..100_000u64).map(|i| i * i % 7).sum();
    assert!(busy > 0);
    let bufs = work.wait()?;
    assert_eq!(bufs.len(), 4);
    assert_eq!(
        bufs[0],
        msg(r, next, 0, len),
        "rank {r}: send buffer changed"
    );
    assert_eq!(
        bufs[2],
        msg(r, prev, 1, len),
        "rank {r}: send buffer changed"
    );
    if n == 2 {
        // One neighbour on both sides: its first message (to its next) arrives first.
        assert_eq!(bufs[1], msg(prev, r, 0, len), "rank {r}");
        assert_eq!(bufs[3], msg(prev, r, 1, len), "rank {r}");
    } else {
        assert_eq!(bufs[1], msg(prev, r, 0, len), "rank {r} of {n}");
        assert_eq!(bufs[3], msg(next, r, 1, len), "rank {r} of {n}");
    }
    Ok(())
}

#[test]
fn neighbour_exchange_in_the_background() {
    // 3 M elements (12 MiB) per message: far beyond the slots and socket buffers.
    for t in [TransportChoice::Auto, TransportChoice::Tcp] {
        for n in [2, 3] {
            for len in [0, 3 << 20] {
                let res = spawn_world(n, cfg(t, 60), |c| halo_async(&c, len));
                for (rank, r) in res.into_iter().enumerate() {
                    r.unwrap_or_else(|e| panic!("{t:?} {n} ranks, {len}: rank {rank}: {e}"));
                }
            }
        }
    }
    let res = spawn_world_on_nodes(4, 2, cfg(TransportChoice::Auto, 60), |c| {
        halo_async(&c, 100_000)
    });
    for r in res {
        r.unwrap();
    }
}

/// `recv_async` returns before the data exists: rank 1 sends only after rank 0 has passed the
/// call (a barrier outside the communicator). A receive that blocked the caller would never
/// reach the barrier and would time out instead.
#[test]
fn a_receive_is_posted_before_its_send_exists() {
    let gate = Barrier::new(2);
    let res = spawn_world(2, cfg(TransportChoice::Auto, 10), |c| {
        let data = msg(1, 0, 0, 1 << 20);
        if c.rank() == 0 {
            let work = c.recv_async(vec![0u32; 1 << 20], 1);
            gate.wait();
            assert_eq!(work.wait()?, data);
        } else {
            gate.wait();
            c.send(&data, 0)?;
        }
        Ok(())
    });
    for r in res {
        r.unwrap();
    }
}

/// A pipeline in one direction, as 1F1B's warm-up streams activations: each stage posts the
/// receives of four micro-batches at once, works on each as it arrives and passes it on with
/// `send_async`; an all-reduce issued after them runs after them (one line per communicator),
/// and messages keep their order.
#[test]
fn pipeline_stages_stream_micro_batches() {
    for t in [TransportChoice::Auto, TransportChoice::Tcp] {
        let res = spawn_world(3, cfg(t, 60), |c| {
            let (r, n) = (c.rank(), c.size());
            let len = 300_000;
            let input = |k: usize| -> Vec<f32> { (0..len).map(|i| (k * len + i) as f32).collect() };
            let recvs: Vec<_> = (0..4)
                .filter(|_| r > 0)
                .map(|_| c.recv_async(vec![0f32; len], r - 1))
                .collect();
            let mut recvs = recvs.into_iter();
            let mut sends = Vec::new();
            for k in 0..4 {
                let mut act = match recvs.next() {
                    Some(w) => w.wait()?,
                    None => input(k),
                };
                act.iter_mut().for_each(|x| *x += 1.0);
                if r + 1 < n {
                    sends.push(c.send_async(act, r + 1));
                } else {
                    let want: Vec<f32> = input(k).iter().map(|x| x + n as f32).collect();
                    assert_eq!(act, want, "{t:?}: micro-batch {k}");
                }
            }
            let mut total = [1u64];
            c.all_reduce(&mut total, ReduceOp::Sum)?;
            assert_eq!(total[0], n as u64);
            for (k, w) in sends.into_iter().enumerate() {
                let sent = w.wait()?;
                assert_eq!(
                    sent[0],
                    (k * len) as f32 + r as f32 + 1.0,
                    "buffer {k} came back"
                );
            }
            Ok(())
        });
        for r in res {
            r.unwrap();
        }
    }
}

/// Messages between two ranks are matched in order whatever call carries them: blocking,
/// single async and batches, on either side.
#[test]
fn order_holds_across_blocking_and_async_calls() {
    let lens = [70_000usize, 3, 400_000, 0, 9];
    let res = spawn_world(2, cfg(TransportChoice::Auto, 60), |c| {
        let msgs: Vec<Vec<u32>> = (0..5).map(|k| msg(0, 1, k, lens[k])).collect();
        if c.rank() == 0 {
            let w0 = c.send_async(msgs[0].clone(), 1);
            c.send(&msgs[1], 1)?;
            let w2 = c.batch_p2p_async(
                msgs[2..4]
                    .iter()
                    .map(|m| OwnedP2pOp::Send {
                        buf: m.clone(),
                        peer: 1,
                    })
                    .collect(),
            );
            let w4 = c.send_async(msgs[4].clone(), 1);
            w0.wait()?;
            w2.wait()?;
            w4.wait()?;
        } else {
            let mut first = vec![0u32; lens[0]];
            c.recv(&mut first, 0)?;
            let w = c.batch_p2p_async(
                (1..3)
                    .map(|k| OwnedP2pOp::Recv {
                        buf: vec![0u32; lens[k]],
                        peer: 0,
                    })
                    .collect(),
            );
            let w3 = c.recv_async(vec![0u32; lens[3]], 0);
            let mut last = vec![0u32; lens[4]];
            c.recv(&mut last, 0)?;
            let mid = w.wait()?;
            let got = vec![first, mid[0].clone(), mid[1].clone(), w3.wait()?, last];
            assert_eq!(got, msgs);
        }
        Ok(())
    });
    for r in res {
        r.unwrap();
    }
}

/// Bad calls fail through `wait()` naming the rank, the call and the problem, without
/// touching the line; a length the peer does not expect is a `Mismatch` on the receiver.
#[test]
fn bad_async_calls_are_named() {
    let res = spawn_world(2, cfg(TransportChoice::Auto, 20), |c| {
        let me = c.rank();
        let to_self = c.send_async(vec![1u8; 4], me).wait().err();
        let outside = c.recv_async(vec![0u8; 4], 7).wait().err();
        let unpaired = c
            .batch_p2p_async(vec![OwnedP2pOp::Recv {
                buf: vec![0u8; 4],
                peer: me,
            }])
            .wait()
            .err();
        // The communicator still works after them.
        c.barrier()?;
        let mismatch = if me == 0 {
            c.send_async(vec![0i32; 4], 1)
                .wait()
                .and_then(|_| c.barrier())
        } else {
            c.recv_async(vec![0i32; 5], 0).wait().map(|_| ())
        }
        .err();
        Ok([to_self, outside, unpaired, mismatch])
    });
    for (rank, r) in res.into_iter().enumerate() {
        let [to_self, outside, unpaired, mismatch] = r.unwrap();
        for (e, call, want) in [
            (to_self, "send", format!("peer {rank} must be another rank")),
            (outside, "recv", "peer 7 must be another rank".to_string()),
            (
                unpaired,
                "batch_p2p",
                "0 sends to this rank itself but 1 receives".to_string(),
            ),
        ] {
            let e = e.expect("an error");
            let text = e.to_string();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{text}");
            assert!(
                text.contains(&format!("rank {rank}"))
                    && text.contains(call)
                    && text.contains(&want),
                "rank {rank}: {text}"
            );
        }
        let e = mismatch.expect("the length disagreement must surface");
        if rank == 1 {
            assert!(matches!(e, Error::Mismatch { .. }), "rank 1: {e}");
            let text = e.to_string();
            assert!(
                text.contains("count=4") && text.contains("count=5"),
                "{text}"
            );
        }
    }
}
