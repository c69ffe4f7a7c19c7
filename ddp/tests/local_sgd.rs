//! Post-local SGD on threaded ranks: gradients averaged over every rank before `start_step` and
//! over the rank's group from it (through `sync` and `grad_ready`, with buckets of two dtypes),
//! groups per simulated node, parameters averaged when the averager is due and only then, and
//! errors for a period of 0 and for uneven inputs that rescale by the ranks training.

use oxccl_comm::harness::{spawn_world, spawn_world_on_nodes};
use oxccl_comm::{Config, ReduceOp};
use oxccl_ddp::{
    Ddp, DdpConfig, DdpError, ModelAverager, Param, PostLocalSgd, Step, TensorMut, UnevenInputs,
};

const N: usize = 4;

/// A gradient element that sums exactly: rank, element and step as small integers.
fn grad(rank: usize, i: usize, step: usize) -> f64 {
    ((rank + 1) * (i + 1) * (step + 1)) as f64
}

/// The mean of `grad` over `ranks`.
fn mean(ranks: std::ops::Range<usize>, i: usize, step: usize) -> f64 {
    let n = ranks.len() as f64;
    ranks.map(|r| grad(r, i, step)).sum::<f64>() / n
}

#[test]
fn gradients_average_over_every_rank_then_over_the_node() {
    const START: usize = 2;
    // Two simulated nodes of two ranks: shared memory inside, TCP between.
    let out = spawn_world_on_nodes(N, 2, Config::default(), |comm| {
        let rank = comm.rank();
        let mut w = vec![0.0f32; 6];
        let mut v = vec![0.0f64; 3];
        let cfg = DdpConfig {
            // Several buckets: w and v, and w cut in two.
            bucket_cap_bytes: 16,
            first_bucket_bytes: 16,
            ..DdpConfig::default()
        };
        let hook = PostLocalSgd::intra_node(&comm, START as u64).unwrap();
        assert_eq!(hook.group().size(), 2, "rank {rank}: the node's group");
        assert_eq!(hook.group().rank(), rank % 2);
        let mut ddp = Ddp::new(
            &comm,
            &mut [Param::new("w", &mut w), Param::new("v", &mut v)],
            cfg,
        )
        .unwrap();
        ddp.set_comm_hook(hook).unwrap();
        for step in 0..5 {
            let gw: Vec<f32> = (0..6).map(|i| grad(rank, i, step) as f32).collect();
            let gv: Vec<f64> = (0..3).map(|i| grad(rank, i, step)).collect();
            // Odd steps through grad_ready + finish, even ones through sync.
            let (got_w, got_v) = if step % 2 == 1 {
                ddp.grad_ready(1, &gv).unwrap();
                ddp.grad_ready(0, &gw).unwrap();
                assert_eq!(ddp.finish().unwrap(), Step::Synced { step: step as u64 });
                (
                    ddp.grad::<f32>(0).unwrap().to_vec(),
                    ddp.grad::<f64>(1).unwrap().to_vec(),
                )
            } else {
                let (mut gw, mut gv) = (gw, gv);
                let mut grads = [TensorMut::new(&mut gw), TensorMut::new(&mut gv)];
                assert_eq!(
                    ddp.sync(&mut grads).unwrap(),
                    Step::Synced { step: step as u64 }
                );
                (gw, gv)
            };
            let ranks = if step < START {
                0..N
            } else {
                (rank / 2) * 2..(rank / 2) * 2 + 2
            };
            for (i, g) in got_w.iter().enumerate() {
                assert_eq!(
                    f64::from(*g),
                    mean(ranks.clone(), i, step),
                    "rank {rank} step {step} w[{i}]"
                );
            }
            for (i, g) in got_v.iter().enumerate() {
                assert_eq!(
                    *g,
                    mean(ranks.clone(), i, step),
                    "rank {rank} step {step} v[{i}]"
                );
            }
        }
        Ok(())
    });
    for r in out {
        r.unwrap();
    }
}

#[test]
fn parameters_are_averaged_when_due_and_only_then() {
    let out = spawn_world(N, Config::default(), |comm| {
        let rank = comm.rank();
        // Every 3 calls from call 2; 24-byte all-reduces: a (20 bytes) alone, b (24) alone, c
        // (28, over the cap) alone, d and e (8 + 8) together.
        let mut avg = ModelAverager::new(3, 2).with_bucket_cap_bytes(24);
        let value = |call: usize, p: usize, i: usize| ((rank * 16 + call * 4 + p) * 8 + i) as f64;
        let mut averaged = Vec::new();
        for call in 0..9 {
            let mut a: Vec<f32> = (0..5).map(|i| value(call, 0, i) as f32).collect();
            let mut b: Vec<f64> = (0..3).map(|i| value(call, 1, i)).collect();
            let mut c: Vec<f32> = (0..7).map(|i| value(call, 2, i) as f32).collect();
            let mut d: Vec<i32> = (0..2).map(|i| value(call, 3, i) as i32).collect();
            let mut e: Vec<i32> = (0..2).map(|i| value(call, 4, i) as i32).collect();
            assert_eq!(avg.due(), call >= 2 && (call - 2) % 3 == 0);
            let did = {
                let mut params = [
                    TensorMut::new(&mut a),
                    TensorMut::new(&mut b),
                    TensorMut::new(&mut c),
                    TensorMut::new(&mut d),
                    TensorMut::new(&mut e),
                ];
                avg.average(&comm, &mut params).unwrap()
            };
            if did {
                averaged.push(call);
            }
            // Averaged: the mean over ranks (rank * 128 averages to 192: exact in every dtype).
            let want = |p: usize, i: usize| {
                let own = value(call, p, i);
                if did {
                    own - (rank * 128) as f64 + 192.0
                } else {
                    own
                }
            };
            let got: Vec<(usize, usize, f64)> = a
                .iter()
                .enumerate()
                .map(|(i, &x)| (0, i, f64::from(x)))
                .chain(b.iter().enumerate().map(|(i, &x)| (1, i, x)))
                .chain(c.iter().enumerate().map(|(i, &x)| (2, i, f64::from(x))))
                .chain(d.iter().enumerate().map(|(i, &x)| (3, i, f64::from(x))))
                .chain(e.iter().enumerate().map(|(i, &x)| (4, i, f64::from(x))))
                .collect();
            for (p, i, x) in got {
                assert_eq!(x, want(p, i), "rank {rank} call {call} param {p} [{i}]");
            }
        }
        assert_eq!(averaged, [2, 5, 8], "rank {rank}");
        assert_eq!(avg.steps(), 9);
        Ok(())
    });
    for r in out {
        r.unwrap();
    }
}

#[test]
fn a_zero_period_and_rescaled_uneven_inputs_are_refused() {
    let out = spawn_world(2, Config::default(), |comm| {
        let rank = comm.rank();
        let mut w = vec![1.0f32; 4];
        let e = ModelAverager::new(0, 0)
            .average(&comm, &mut [&mut w])
            .unwrap_err();
        match &e {
            DdpError::InvalidArgument { rank: r, op, msg } => {
                assert_eq!((*r, *op), (rank, "model averager"));
                assert!(msg.contains("period"), "{msg}");
            }
            e => panic!("rank {rank}: {e}"),
        }
        // Nothing was issued: the communicator goes on.
        let mut x = [rank as u32 + 1];
        comm.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        assert_eq!(x, [3]);

        let group = || comm.split(Some(0), rank as i64).unwrap().unwrap();
        for (uneven, ok) in [
            (UnevenInputs::DivideByActiveRanks, false),
            (UnevenInputs::DivideByWorldSize, true),
        ] {
            let cfg = DdpConfig {
                uneven_inputs: uneven,
                ..DdpConfig::default()
            };
            let mut ddp = Ddp::new(&comm, &mut [Param::new("w", &mut w)], cfg).unwrap();
            let set = ddp.set_comm_hook(PostLocalSgd::new(group(), 0));
            match (set, ok) {
                (Ok(()), true) => {}
                (Err(DdpError::InvalidArgument { op, msg, .. }), false) => {
                    assert_eq!(op, "set_comm_hook");
                    assert!(
                        msg.contains("post_local_sgd") && msg.contains("DivideByWorldSize"),
                        "{msg}"
                    );
                }
                (r, _) => panic!("rank {rank}: {uneven:?}: {r:?}"),
            }
        }
        Ok(())
    });
    for r in out {
        r.unwrap();
    }
}

#[test]
fn with_groups_of_one_rank_each_replica_trains_alone_until_averaged() {
    // start 0, period 2: steps 0 and 2 are averaged after the update, step 1 is not.
    let out = spawn_world(N, Config::default(), |comm| {
        let rank = comm.rank();
        let alone = comm.split(Some(rank as u32), 0)?.expect("a group");
        let mut w = vec![0.0f32; 3];
        let mut ddp =
            Ddp::new(&comm, &mut [Param::new("w", &mut w)], DdpConfig::default()).unwrap();
        ddp.set_comm_hook(PostLocalSgd::new(alone, 0)).unwrap();
        let mut avg = ModelAverager::new(2, 0);
        let mut history = Vec::new();
        for step in 0..3 {
            let mut g = [(0..3)
                .map(|i| grad(rank, i, step) as f32)
                .collect::<Vec<_>>()];
            ddp.sync(&mut g).unwrap();
            // Each rank's own gradient: its group is itself.
            for (i, x) in g[0].iter().enumerate() {
                assert_eq!(f64::from(*x), grad(rank, i, step));
            }
            w.iter_mut().zip(&g[0]).for_each(|(x, g)| *x -= g);
            avg.average(&comm, &mut [&mut w]).unwrap();
            history.push(w.clone());
        }
        // After step 0: minus the mean gradient; after step 1 each its own; after step 2 the
        // mean of everything.
        let all = |i: usize, steps: std::ops::Range<usize>| -> f64 {
            steps.map(|s| mean(0..N, i, s)).sum::<f64>()
        };
        let want = |step: usize, i: usize| match step {
            0 => -all(i, 0..1),
            1 => -all(i, 0..1) - grad(rank, i, 1),
            _ => -all(i, 0..3),
        };
        for (step, got) in history.iter().enumerate() {
            for (i, x) in got.iter().enumerate() {
                assert_eq!(
                    f64::from(*x),
                    want(step, i),
                    "rank {rank} step {step} [{i}]"
                );
            }
        }
        Ok(())
    });
    for r in out {
        r.unwrap();
    }
}
