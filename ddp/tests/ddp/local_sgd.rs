//! Post-local SGD on threaded ranks: gradients averaged over every rank before `start_step` and
//! over the rank's group from it (through `sync` and `grad_ready`, with buckets of two dtypes),
//! groups per simulated node, parameters averaged when the averager is due and only then, and
//! errors for a period of 0 and for uneven inputs that rescale by the ranks training.

use oxccl_comm::harness::{spawn_world, spawn_world_on_nodes};
use oxccl_comm::{Communicator, Config, ReduceOp};
use oxccl_ddp::{
    Ddp, DdpConfig, DdpError, HierarchicalAverager, ModelAverager, Param, PostLocalSgd, Step,
    TensorMut, UnevenInputs,
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

/// This rank's group of two: ranks {0, 1} and {2, 3}.
fn pair(comm: &Communicator) -> Communicator {
    let rank = comm.rank();
    comm.split(Some((rank / 2) as u32), rank as i64)
        .expect("split")
        .expect("a group")
}

/// DDP of the one parameter `w` on `comm` (rank 0's values are broadcast into it), with `hook`.
fn with_hook<'a>(
    comm: &'a Communicator,
    w: &mut [f32],
    cfg: DdpConfig,
    hook: PostLocalSgd,
) -> Ddp<&'a Communicator> {
    let mut ddp = Ddp::new(comm, &mut [Param::new("w", w)], cfg).unwrap();
    ddp.set_comm_hook(hook).unwrap();
    ddp
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
        // Every 3 calls from call 2; 24-byte all-reduces: a (20 bytes), b (24), c (28, over the
        // cap) alone, d and e (8 + 8) together, f (12) cut from them by the cap; h, an empty
        // bf16 parameter, a bucket with nothing to average.
        let mut avg = ModelAverager::new(3, 2).with_bucket_cap_bytes(24);
        let value = |call: usize, p: usize, i: usize| ((rank * 16 + call * 4 + p) * 8 + i) as f64;
        let lens = [5, 3, 7, 2, 2, 3];
        let mut averaged = Vec::new();
        for call in 0..9 {
            let v = |p: usize| (0..lens[p]).map(move |i| value(call, p, i));
            let mut a: Vec<f32> = v(0).map(|x| x as f32).collect();
            let mut b: Vec<f64> = v(1).collect();
            let mut c: Vec<f32> = v(2).map(|x| x as f32).collect();
            let mut d: Vec<f32> = v(3).map(|x| x as f32).collect();
            let mut e: Vec<f32> = v(4).map(|x| x as f32).collect();
            let mut f: Vec<f32> = v(5).map(|x| x as f32).collect();
            let mut h: Vec<half::bf16> = Vec::new();
            assert_eq!(avg.due(), call >= 2 && (call - 2) % 3 == 0);
            let did = {
                let mut params = [
                    TensorMut::new(&mut a),
                    TensorMut::new(&mut b),
                    TensorMut::new(&mut c),
                    TensorMut::new(&mut d),
                    TensorMut::new(&mut e),
                    TensorMut::new(&mut f),
                    TensorMut::new(&mut h),
                ];
                avg.average(&comm, &mut params).unwrap()
            };
            if did {
                averaged.push(call);
            }
            // Averaged: the mean over ranks (rank * 128 averages to 192: exact).
            let want = |p: usize, i: usize| {
                let own = value(call, p, i);
                if did {
                    own - (rank * 128) as f64 + 192.0
                } else {
                    own
                }
            };
            let wide = |x: &[f32]| x.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
            let got = [wide(&a), b.clone(), wide(&c), wide(&d), wide(&e), wide(&f)];
            for (p, xs) in got.iter().enumerate() {
                for (i, &x) in xs.iter().enumerate() {
                    assert_eq!(x, want(p, i), "rank {rank} call {call} param {p} [{i}]");
                }
            }
        }
        assert_eq!(averaged, [2, 5, 8], "rank {rank}");
        assert_eq!(avg.steps(), 9);
        // Resumed after 4 calls: the next one (call 4) is not due, call 5 is.
        let mut resumed = ModelAverager::new(3, 2).with_steps(4);
        let mut w = vec![rank as f32; 2];
        assert!(!resumed.average(&comm, &mut [&mut w]).unwrap());
        assert!(resumed.average(&comm, &mut [&mut w]).unwrap());
        assert_eq!(w, [1.5, 1.5]);
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
        let mut w = vec![rank as f32; 4];
        let e = ModelAverager::new(0, 0)
            .average(&comm, &mut [&mut w])
            .unwrap_err();
        match &e {
            DdpError::InvalidArgument { rank: r, op, msg } => {
                assert_eq!((*r, *op), (rank, "ModelAverager::average"));
                assert!(msg.contains("period"), "{msg}");
            }
            e => panic!("rank {rank}: {e}"),
        }
        // An integer parameter, when due: refused before any averaging, and not counted.
        let mut avg = ModelAverager::new(1, 0);
        let mut n = vec![7i32; 2];
        let e = avg
            .average(&comm, &mut [TensorMut::new(&mut w), TensorMut::new(&mut n)])
            .unwrap_err();
        match &e {
            DdpError::InvalidArgument { rank: r, op, msg } => {
                assert_eq!((*r, *op), (rank, "ModelAverager::average"));
                assert!(msg.contains("parameter 1 is i32"), "{msg}");
            }
            e => panic!("rank {rank}: {e}"),
        }
        assert_eq!((avg.steps(), avg.due()), (0, true));
        // Nothing was averaged (w differs between the ranks), and only the comparison of the
        // settings was issued, alike on every rank: the communicator goes on.
        assert_eq!(
            (w.as_slice(), n.as_slice()),
            ([rank as f32; 4].as_slice(), [7, 7].as_slice())
        );
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
            let set = ddp.set_comm_hook(PostLocalSgd::new(&comm, group(), 0).unwrap());
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
        let hook = PostLocalSgd::new(&comm, alone, 0).unwrap();
        let mut ddp = with_hook(&comm, &mut w, DdpConfig::default(), hook);
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

#[test]
fn local_sgd_counts_synchronised_steps_with_accumulation() {
    // Two micro-batches per step, local from step 1: the switch comes at the second step, not
    // at the second micro-batch. Groups {0, 1} and {2, 3}.
    let out = spawn_world(N, Config::default(), |comm| {
        let rank = comm.rank();
        let hook = PostLocalSgd::new(&comm, pair(&comm), 1).unwrap();
        let mut ddp = with_hook(&comm, &mut [0.0; 3], DdpConfig::default(), hook);
        ddp.accumulate(2).unwrap();
        for step in 0..3 {
            for micro in 0..2 {
                let g: Vec<f32> = (0..3)
                    .map(|i| grad(rank, i, 2 * step + micro) as f32)
                    .collect();
                ddp.grad_ready(0, &g).unwrap();
                let want = if micro == 0 {
                    Step::Accumulated { micro_batch: 0 }
                } else {
                    Step::Synced { step: step as u64 }
                };
                assert_eq!(ddp.finish().unwrap(), want);
            }
            let ranks = if step < 1 {
                0..N
            } else {
                (rank / 2) * 2..(rank / 2) * 2 + 2
            };
            for (i, g) in ddp.grad::<f32>(0).unwrap().iter().enumerate() {
                let sum = mean(ranks.clone(), i, 2 * step) + mean(ranks.clone(), i, 2 * step + 1);
                assert_eq!(f64::from(*g), sum, "rank {rank} step {step} [{i}]");
            }
        }
        Ok(())
    });
    for r in out {
        r.unwrap();
    }
}

#[test]
fn a_joined_rank_stands_in_within_its_group_and_averages_with_everyone() {
    // Uneven inputs (DivideByWorldSize): rank 3 trains 1 step, the others 4. Local from step 1
    // in groups {0, 1} and {2, 3}, parameters averaged after steps 1 and 3. Rank 3's zeros count
    // in its group's average, and it takes part in every average through its join loop.
    const STEPS: usize = 4;
    let out = spawn_world(N, Config::default(), |comm| {
        let rank = comm.rank();
        let mut w = vec![0.0f32; 2];
        let cfg = DdpConfig {
            uneven_inputs: UnevenInputs::DivideByWorldSize,
            ..DdpConfig::default()
        };
        let hook = PostLocalSgd::new(&comm, pair(&comm), 1).unwrap();
        let mut ddp = with_hook(&comm, &mut w, cfg, hook);
        let mut avg = ModelAverager::new(2, 1);
        let own = if rank == 3 { 1 } else { STEPS };
        let mut steps = 0;
        let update = |w: &mut Vec<f32>, g: &[f32], avg: &mut ModelAverager| {
            w.iter_mut().zip(g).for_each(|(x, g)| *x -= g);
            avg.average(&comm, &mut [&mut *w])
        };
        for step in 0..own {
            let mut g = [(0..2)
                .map(|i| grad(rank, i, step) as f32)
                .collect::<Vec<_>>()];
            ddp.sync(&mut g).unwrap();
            update(&mut w, &g[0], &mut avg).unwrap();
            steps += 1;
        }
        while ddp.join_step().unwrap().is_some() {
            let g = ddp.grad::<f32>(0).unwrap().to_vec();
            update(&mut w, &g, &mut avg).unwrap();
            steps += 1;
        }
        Ok((steps, w))
    });
    let out: Vec<(usize, Vec<f32>)> = out.into_iter().map(|r| r.unwrap()).collect();
    // The serial model: per group, minus the group's mean gradient (a joined rank's is zero)
    // after step 0's global one; after steps 1 and 3 every replica is the mean of the groups'.
    let g = |r: usize, i: usize, s: usize| if r == 3 && s >= 1 { 0.0 } else { grad(r, i, s) };
    let mut model = [[0.0f64; 2]; 2];
    for s in 0..STEPS {
        for (k, m) in model.iter_mut().enumerate() {
            for (i, x) in m.iter_mut().enumerate() {
                let ranks = if s == 0 { 0..N } else { 2 * k..2 * k + 2 };
                let n = ranks.len() as f64;
                *x -= ranks.map(|r| g(r, i, s)).sum::<f64>() / n;
            }
        }
        if s == 1 || s == 3 {
            let mean = [0, 1].map(|i| (model[0][i] + model[1][i]) / 2.0);
            model = [mean, mean];
        }
    }
    for (rank, (steps, w)) in out.iter().enumerate() {
        assert_eq!(*steps, STEPS, "rank {rank}");
        for (i, x) in w.iter().enumerate() {
            assert_eq!(f64::from(*x), model[0][i], "rank {rank} [{i}]");
        }
    }
}

#[test]
fn a_rank_lost_in_the_group_is_named_by_its_rank_in_ddp() {
    // Groups {0, 1} and {2, 3}, local from step 0; rank 3 leaves after step 0. Rank 2's group
    // all-reduce of step 1 fails with PeerLost naming rank 3 (its rank in the group is 1),
    // reported by rank 2 (the group's rank 0): the ranks `shrink` needs.
    let out = spawn_world(N, Config::default(), |comm| {
        let rank = comm.rank();
        let hook = PostLocalSgd::new(&comm, pair(&comm), 0).unwrap();
        assert_eq!(hook.members(), [rank / 2 * 2, rank / 2 * 2 + 1]);
        let mut ddp = with_hook(&comm, &mut [0.0; 3], DdpConfig::default(), hook);
        Ok(until_lost(rank, 1, 2, |step| {
            ddp.sync(&mut [vec![step as f32; 3]]).map(|_| ())
        }))
    });
    let msg = rank_3_lost_by_rank_2(out, (2, 3));
    assert!(msg.contains("post_local_sgd"), "{msg}");
    // The group's own note names the world's ranks (here DDP's too).
    assert!(msg.contains("its ranks 0-1 are ranks [2, 3] of"), "{msg}");
}

/// A rank's first communication error: its lost peer and text.
type Lost = Option<(Option<usize>, String)>;

/// Calls `call(0)`, `call(1)`, ... `call(calls - 1)` on `rank`, rank 3 leaving (its
/// communicators closing) before call `leave`: the first communication error, as its lost peer
/// and text, or `None`.
fn until_lost(
    rank: usize,
    leave: usize,
    calls: usize,
    mut call: impl FnMut(usize) -> Result<(), DdpError>,
) -> Lost {
    for c in 0..calls {
        if rank == 3 && c == leave {
            return None;
        }
        match call(c) {
            Ok(()) => {}
            Err(DdpError::Comm(e)) => return Some((e.lost_peer(), e.to_string())),
            Err(e) => panic!("rank {rank}: {e}"),
        }
    }
    None
}

/// The text of rank 2's error in `out` ([`until_lost`]'s, per rank), checked to be reported by
/// rank 2 and to name rank 3 as lost, the two numbered `(reporter, lost)` in the error; ranks 0
/// and 1 (the other group) saw nothing.
fn rank_3_lost_by_rank_2(out: Vec<oxccl_comm::Result<Lost>>, named: (usize, usize)) -> String {
    let out: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
    let (lost, msg) = out[2].clone().expect("rank 2 sees the loss");
    assert_eq!(lost, Some(named.1), "{msg}");
    assert!(msg.starts_with(&format!("rank {}:", named.0)), "{msg}");
    assert!(out[0].is_none() && out[1].is_none(), "{out:?}");
    msg
}

#[test]
fn a_hook_on_another_communicator_or_a_group_larger_than_it_is_refused() {
    let out = spawn_world(N, Config::default(), |comm| {
        let rank = comm.rank();
        let half = pair(&comm);
        // The whole world as the "group" of a half: larger than the communicator.
        let world_again = comm.split(Some(0), rank as i64)?.expect("the world");
        match PostLocalSgd::new(&half, world_again, 0) {
            Err(DdpError::InvalidArgument { rank: r, op, msg }) => {
                assert_eq!((r, op), (rank % 2, "PostLocalSgd::new"));
                assert!(
                    msg.contains("the group has 4 ranks, the communicator 2"),
                    "{msg}"
                );
            }
            r => panic!("rank {rank}: {r:?}"),
        }
        // A hook made for the world, set on a DDP of a half: every step fails on every rank
        // with an error that says so, and nothing is issued on the group.
        let group = comm
            .split(Some((rank % 2) as u32), rank as i64)?
            .expect("a group");
        let hook = PostLocalSgd::new(&comm, group, 0).unwrap();
        let mut ddp = with_hook(&half, &mut [0.0; 2], DdpConfig::default(), hook);
        let mut g = [vec![1.0f32; 2]];
        match ddp.sync(&mut g) {
            Err(DdpError::InvalidArgument { op, msg, .. }) => {
                assert_eq!(op, "post_local_sgd hook");
                assert!(
                    msg.contains(&format!("made for rank {rank} of a communicator of 4")),
                    "{msg}"
                );
            }
            r => panic!("rank {rank}: {r:?}"),
        }
        Ok(())
    });
    for r in out {
        r.unwrap();
    }
}

#[test]
fn a_resumed_hook_starts_local_sgd_at_the_same_step() {
    // start 3, resumed after 2 steps: the first step of the new run is step 2 (global), the
    // second step 3 (local). Groups {0, 1} and {2, 3}.
    let out = spawn_world(N, Config::default(), |comm| {
        let rank = comm.rank();
        let hook = PostLocalSgd::new(&comm, pair(&comm), 3)
            .unwrap()
            .with_steps(2);
        assert_eq!((hook.steps(), hook.start_step()), (2, 3));
        let mut ddp = with_hook(&comm, &mut [0.0; 2], DdpConfig::default(), hook);
        for (k, step) in [2usize, 3].into_iter().enumerate() {
            let mut g = [(0..2)
                .map(|i| grad(rank, i, step) as f32)
                .collect::<Vec<_>>()];
            assert_eq!(ddp.sync(&mut g).unwrap(), Step::Synced { step: k as u64 });
            let ranks = if step < 3 {
                0..N
            } else {
                (rank / 2) * 2..(rank / 2) * 2 + 2
            };
            for (i, x) in g[0].iter().enumerate() {
                assert_eq!(
                    f64::from(*x),
                    mean(ranks.clone(), i, step),
                    "rank {rank} step {step}"
                );
            }
        }
        Ok(())
    });
    for r in out {
        r.unwrap();
    }
}

/// This rank's parameter after `steps` calls of a hierarchical averager with `levels`
/// ((period, group size), warm-up `warmup`), every rank adding `bump(rank, i, step)` to its
/// parameter before each call: the serial reference of every rank at once.
fn hierarchical_reference(levels: &[(u64, usize)], warmup: u64, steps: usize) -> Vec<Vec<f64>> {
    let bump = |rank: usize, i: usize, step: usize| ((rank + 1) * (i + 2) * (step + 1)) as f64;
    let mut p: Vec<Vec<f64>> = (0..N)
        .map(|r| (0..5).map(|i| (10 * r + i) as f64).collect())
        .collect();
    for step in 0..steps {
        for (r, pr) in p.iter_mut().enumerate() {
            pr.iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x += bump(r, i, step));
        }
        let s = step as u64;
        if s < warmup {
            continue;
        }
        let Some(&(_, size)) = levels
            .iter()
            .rev()
            .find(|&&(period, _)| s.is_multiple_of(period))
        else {
            continue;
        };
        for group in p.chunks_mut(size) {
            for i in 0..5 {
                let m = group.iter().map(|pr| pr[i]).sum::<f64>() / size as f64;
                group.iter_mut().for_each(|pr| pr[i] = m);
            }
        }
    }
    p
}

#[test]
fn a_hierarchical_averager_averages_each_level_at_its_period() {
    // Pairs every 2 calls, everyone every 4, from call 1 (PyTorch's rule: periods count from
    // call 0): at calls 2 (pairs), 4 (everyone), 6 (pairs), 8 (everyone).
    const LEVELS: [(u64, usize); 2] = [(2, 2), (4, N)];
    const STEPS: usize = 10;
    let expect_levels = [
        None,
        None,
        Some(0),
        None,
        Some(1),
        None,
        Some(0),
        None,
        Some(1),
        None,
    ];
    let out = spawn_world(N, Config::default(), |comm| {
        let rank = comm.rank();
        let by_sizes = HierarchicalAverager::by_group_sizes(&comm, &LEVELS, 1).unwrap();
        let sizes: Vec<(u64, usize)> = by_sizes.levels().map(|(p, g)| (p, g.size())).collect();
        assert_eq!(sizes, LEVELS);
        // The same levels by hand, over borrowed groups: f32 parameters in the first, f64 in
        // the second, cut into one-element buckets.
        let half = pair(&comm);
        let by_hand = HierarchicalAverager::new(2, &half, 1)
            .then(4, &comm)
            .with_bucket_cap_bytes(1);
        let bump = |i: usize, step: usize| ((rank + 1) * (i + 2) * (step + 1)) as f64;
        let init = |i: usize| (10 * rank + i) as f64;
        let mut a: Vec<f32> = (0..5).map(|i| init(i) as f32).collect();
        let (mut b, mut c): (Vec<f64>, Vec<f32>) = (
            (0..3).map(init).collect(),
            (3..5).map(|i| init(i) as f32).collect(),
        );
        let (mut by_sizes, mut by_hand) = (by_sizes, by_hand);
        for (step, &level) in expect_levels.iter().enumerate() {
            a.iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x += bump(i, step) as f32);
            b.iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x += bump(i, step));
            c.iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x += bump(i + 3, step) as f32);
            assert_eq!(by_sizes.due(), level, "rank {rank} call {step}");
            let got = by_sizes.average(&mut [&mut a[..]]).unwrap();
            assert_eq!(got, level, "rank {rank} call {step}");
            let got = by_hand
                .average(&mut [TensorMut::new(&mut b), TensorMut::new(&mut c)])
                .unwrap();
            assert_eq!(got, level, "rank {rank} call {step}");
            let reference = &hierarchical_reference(&LEVELS, 1, step + 1)[rank];
            for (i, &want) in reference.iter().enumerate() {
                let hand = if i < 3 { b[i] } else { f64::from(c[i - 3]) };
                assert_eq!(
                    (f64::from(a[i]), hand),
                    (want, want),
                    "rank {rank} call {step} [{i}]"
                );
            }
        }
        assert_eq!(by_sizes.steps(), STEPS as u64);
        Ok(())
    });
    out.into_iter().for_each(|r| r.unwrap());
}

#[test]
fn a_hierarchical_averager_refuses_bad_levels_before_splitting() {
    let out = spawn_world(N, Config::default(), |comm| {
        let rank = comm.rank();
        let refused =
            |levels: &[(u64, usize)], what: &str| match HierarchicalAverager::by_group_sizes(
                &comm, levels, 0,
            ) {
                Err(DdpError::InvalidArgument { rank: r, op, msg }) => {
                    assert_eq!((r, op), (rank, "HierarchicalAverager::by_group_sizes"));
                    assert!(msg.contains(what), "{levels:?}: {msg}");
                }
                other => panic!("rank {rank}: {levels:?} accepted: {other:?}"),
            };
        refused(&[], "no levels");
        refused(&[(4, 2), (2, N)], "larger than the one before");
        refused(&[(0, N)], "at least 1");
        refused(
            &[(2, 3), (4, N)],
            "does not divide the communicator's 4 ranks",
        );
        refused(&[(2, 0), (4, N)], "group size 0");
        refused(
            &[(2, 2)],
            "the last level's group size 2 is not the communicator's 4",
        );
        // Groups of 4 do not lie inside groups of 2.
        refused(
            &[(2, 4), (4, 2), (8, N)],
            "does not divide the next level's 2",
        );
        // Levels that differ between ranks (rank 0's last period) are refused on every rank.
        let last = if rank == 0 { 4 } else { 8 };
        refused(
            &[(2, 2), (last, N)],
            &format!(
                "the list of levels (period, group size) differs between ranks: this rank has [(2, 2), \
                 ({last}, 4)]"
            ),
        );
        // Nothing was split: the next split is the communicator's first.
        let mut x = [1u32];
        comm.all_reduce(&mut x, ReduceOp::Sum)?;
        assert_eq!(x[0] as usize, N);
        // Made by hand: periods that do not increase and a period of 0 are refused at the
        // first call, which is not counted.
        let half = pair(&comm);
        assert!(half.id().contains("/split0/"), "{}", half.id());
        let mut w = [1.0f32; 2];
        for mut bad in [
            HierarchicalAverager::new(2, &half, 0).then(2, &comm),
            HierarchicalAverager::new(0, &half, 0),
        ] {
            match bad.average(&mut [&mut w[..]]) {
                Err(DdpError::InvalidArgument { rank: r, msg, .. }) => {
                    assert_eq!(r, bad.levels().last().unwrap().1.rank());
                    assert!(msg.contains("larger than the one before"), "{msg}");
                }
                other => panic!("rank {rank}: accepted: {other:?}"),
            }
            assert_eq!(bad.steps(), 0);
        }
        // An integer parameter is refused when due, and the call is not counted.
        let mut ok = HierarchicalAverager::new(1, &half, 0);
        let mut n = [1i32; 2];
        assert!(matches!(
            ok.average(&mut [&mut n[..]]),
            Err(DdpError::InvalidArgument { .. })
        ));
        assert_eq!(ok.steps(), 0);
        assert_eq!(ok.average(&mut [&mut w[..]]).unwrap(), Some(0));
        Ok(())
    });
    out.into_iter().for_each(|r| r.unwrap());
}

#[test]
fn a_rank_lost_under_a_hierarchical_averager_is_named_by_its_rank_in_the_communicator() {
    // Pairs every 2 calls, everyone every 4, from call 0: call 0 averages everyone, rank 3
    // leaves after it, and call 2 averages the pairs. Rank 2's pair all-reduce fails with
    // PeerLost naming rank 3 of `comm` (rank 1 of the pair), the rank to shrink away.
    let out = spawn_world(N, Config::default(), |comm| {
        let rank = comm.rank();
        let mut avg = HierarchicalAverager::by_group_sizes(&comm, &[(2, 2), (4, N)], 0).unwrap();
        let mut w = [rank as f32; 3];
        Ok(until_lost(rank, 1, 3, |_| {
            avg.average(&mut [&mut w[..]]).map(|_| ())
        }))
    });
    let msg = rank_3_lost_by_rank_2(out, (2, 3));
    assert!(msg.contains("members = [2, 3]"), "{msg}");
}

#[test]
fn averagers_resumed_at_the_last_step_count_do_not_overflow() {
    let out = spawn_world(2, Config::default(), |comm| {
        let mut w = [comm.rank() as f32; 2];
        let mut flat = ModelAverager::new(1, 0).with_steps(u64::MAX);
        assert!(flat.average(&comm, &mut [&mut w[..]]).unwrap());
        assert_eq!(flat.steps(), u64::MAX);
        let mut tiers = HierarchicalAverager::new(1, &comm, 0).with_steps(u64::MAX);
        assert_eq!(tiers.average(&mut [&mut w[..]]).unwrap(), Some(0));
        assert_eq!(tiers.steps(), u64::MAX);
        assert_eq!(w, [0.5; 2]);
        Ok(())
    });
    out.into_iter().for_each(|r| r.unwrap());
}

#[test]
fn a_level_added_after_by_group_sizes_names_its_own_groups_ranks() {
    // by_group_sizes' one level (everyone every 2 calls), then pairs every 4 by hand: call 0
    // averages the pairs (the largest period dividing 0). Rank 3 leaves before it; rank 2's
    // error names its pair's rank 1 (the level has no mapping to `comm`'s ranks) and nothing
    // panics.
    let out = spawn_world(N, Config::default(), |comm| {
        let rank = comm.rank();
        let pairs = pair(&comm);
        let mut avg = HierarchicalAverager::by_group_sizes(&comm, &[(2, N)], 0)
            .unwrap()
            .then(4, pairs);
        Ok(until_lost(rank, 0, 1, |_| {
            let level = avg.average(&mut [&mut [1.0f32; 2][..]])?;
            assert_eq!(level, Some(1), "rank {rank}");
            Ok(())
        }))
    });
    // Ranks 2 and 3 are their pair's ranks 0 and 1.
    let msg = rank_3_lost_by_rank_2(out, (0, 1));
    assert!(!msg.contains("by_group_sizes"), "{msg}");
}

#[test]
fn model_averagers_set_up_differently_on_some_rank_are_refused_on_every_rank() {
    let out = spawn_world(N, Config::default(), |comm| {
        let rank = comm.rank();
        let refused = |mut avg: ModelAverager, params: &mut [&mut [f32]], what: &str| {
            let steps = avg.steps();
            match avg.average(&comm, params) {
                Err(DdpError::InvalidArgument { rank: r, op, msg }) => {
                    assert_eq!((r, op), (rank, "ModelAverager::average"));
                    assert!(msg.contains(what), "rank {rank}: {msg}");
                }
                other => panic!("rank {rank}: accepted: {other:?}"),
            }
            // Not counted, and nothing averaged.
            assert_eq!(avg.steps(), steps);
            assert!(params.iter().all(|p| p.iter().all(|&x| x == rank as f32)));
        };
        let mut w = vec![rank as f32; 4];
        let mut v = [rank as f32; 2];
        // Rank 3 averages every 4 calls, the others every 2: the first call (0) compares.
        let period = if rank == 3 { 4 } else { 2 };
        let what = format!("period differs between ranks: {period} here, from 2 to 4");
        refused(ModelAverager::new(period, 0), &mut [&mut w], &what);
        // Resumed at other call counts: the first due call is a different one.
        let avg = ModelAverager::new(1, 0).with_steps(rank as u64 % 2);
        let what = format!(
            "the call's number (0-based, counting with_steps) differs between ranks: {} here, \
             from 0 to 1",
            rank % 2
        );
        refused(avg, &mut [&mut w], &what);
        // Another parameter list, and another bucket cap, named together.
        let avg = ModelAverager::new(1, 0).with_bucket_cap_bytes(if rank == 0 { 8 } else { 16 });
        let mut params: Vec<&mut [f32]> = vec![&mut w[..]];
        if rank == 1 {
            params.push(&mut v[..]);
        }
        let n = params.len();
        let list = format!(
            "the parameter list (count, lengths, dtypes) differs between ranks: this rank has {n} \
             parameter(s)"
        );
        let cap = format!(
            "the bucket cap differs between ranks: {} here, from 8 to 16",
            if rank == 0 { 8 } else { 16 }
        );
        refused(avg.clone(), &mut params, &list);
        refused(avg, &mut params, &cap);
        // A period of 0 on one rank: named on every rank, none left waiting.
        let p = u64::from(rank != 2);
        let what = format!("period differs between ranks: {p} here, from 0 to 1");
        refused(ModelAverager::new(p, 0), &mut [&mut w], &what);
        // Alike: it averages.
        let mut avg = ModelAverager::new(1, 0);
        assert!(avg.average(&comm, &mut [&mut w[..]]).unwrap());
        assert_eq!(w, [1.5; 4]);
        // A clone keeps the comparison made: the clone on rank 0 does not compare again
        // (the others would not meet it).
        let mut avg = if rank == 0 { avg.clone() } else { avg };
        assert!(avg.average(&comm, &mut [&mut w[..]]).unwrap());
        // Resumed (with_steps) after the comparison: compared again, so rank 1's other count
        // is named.
        let calls = if rank == 1 { 9 } else { 2 };
        let what = format!(
            "the call's number (0-based, counting with_steps) differs between ranks: {calls} \
             here, from 2 to 9"
        );
        let mut resumed = avg.clone().with_steps(calls);
        let before = w.clone();
        match resumed.average(&comm, &mut [&mut w[..]]) {
            Err(DdpError::InvalidArgument { msg, .. }) => assert!(msg.contains(&what), "{msg}"),
            other => panic!("rank {rank}: accepted: {other:?}"),
        }
        assert_eq!(w, before);
        // On another communicator the settings are compared again: rank 3, resumed at another
        // call, is named in its pair; the other pair averages.
        let half = pair(&comm);
        let mut avg = if rank == 3 { avg.with_steps(7) } else { avg };
        w = vec![rank as f32; 4];
        let got = avg.average(&half, &mut [&mut w[..]]);
        if rank < 2 {
            assert!(got.unwrap());
            assert_eq!(w, [0.5; 4]);
        } else {
            let calls = if rank == 3 { 7 } else { 2 };
            let what = format!(
                "the call's number (0-based, counting with_steps) differs between ranks: \
                 {calls} here, from 2 to 7"
            );
            match got {
                Err(DdpError::InvalidArgument { rank: r, msg, .. }) => {
                    assert_eq!(r, rank - 2);
                    assert!(msg.contains(&what), "rank {rank}: {msg}");
                }
                other => panic!("rank {rank}: accepted: {other:?}"),
            }
        }
        // The communicator is in step.
        let mut x = [1u32];
        comm.all_reduce(&mut x, ReduceOp::Sum)?;
        assert_eq!(x[0] as usize, N);
        Ok(())
    });
    for r in out {
        r.unwrap();
    }
}

#[test]
fn post_local_sgd_starting_at_another_step_on_one_rank_is_refused_on_every_rank() {
    let out = spawn_world(N, Config::default(), |comm| {
        let rank = comm.rank();
        let start = u64::from(rank == 3);
        let mut w = vec![0.0f32; 4];
        let hook = PostLocalSgd::new(&comm, pair(&comm), start).unwrap();
        let mut ddp = with_hook(&comm, &mut w, DdpConfig::default(), hook);
        let g = vec![rank as f32; 4];
        ddp.grad_ready(0, &g).unwrap();
        match ddp.finish() {
            Err(DdpError::InvalidArgument { rank: r, op, msg }) => {
                assert_eq!((r, op), (rank, "finish"));
                let what = format!("start_step differs between ranks: {start} here, from 0 to 1");
                assert!(
                    msg.contains("post_local_sgd (given to set_comm_hook)") && msg.contains(&what),
                    "{msg}"
                );
            }
            other => panic!("rank {rank}: accepted: {other:?}"),
        }
        // Alike: the step averages over every rank (before the start step).
        ddp.set_comm_hook(PostLocalSgd::new(&comm, pair(&comm), 1).unwrap())
            .unwrap();
        ddp.grad_ready(0, &g).unwrap();
        assert_eq!(ddp.finish().unwrap(), Step::Synced { step: 0 });
        assert_eq!(ddp.grad::<f32>(0).unwrap(), [1.5; 4]);
        // Resumed at other step counts: named too.
        let begun = if rank == 0 { 3 } else { 4 };
        let hook = PostLocalSgd::new(&comm, pair(&comm), 1)
            .unwrap()
            .with_steps(begun);
        ddp.set_comm_hook(hook).unwrap();
        ddp.grad_ready(0, &g).unwrap();
        match ddp.finish() {
            Err(DdpError::InvalidArgument { msg, .. }) => {
                let what = format!(
                    "steps begun (with_steps) differs between ranks: {begun} here, from 3 to 4"
                );
                assert!(msg.contains(&what), "{msg}");
            }
            other => panic!("rank {rank}: accepted: {other:?}"),
        }
        Ok(())
    });
    for r in out {
        r.unwrap();
    }
}
