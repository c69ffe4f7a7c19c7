//! DDP on threaded ranks (one communicator per thread, over shared memory): averaging, bucket
//! order when ranks' gradient orders differ, accumulation, unused parameters, comm hooks, the
//! initial broadcast, and errors for bad input.

use std::sync::Arc;
use std::time::Duration;

use oxccl_comm::harness::{spawn_world, spawn_world_with};
use oxccl_comm::{Communicator, Config, ReduceOp, Work};
use oxccl_ddp::{
    CommHook, CompressHook, Ddp, DdpConfig, DdpError, FlatBuffer, GradBucket, HookWork, Overlap,
    Param, Step, TensorMut, Typed,
};
use oxccl_kernels::bf16;

/// Parameter lengths used by several tests: sizes around the small caps below, one empty.
const LENS: [usize; 7] = [300, 7, 1000, 0, 64, 2500, 33];

/// Small caps, overlap on (the tests of one mode or the other say so).
fn small_buckets() -> DdpConfig {
    small(Overlap::On)
}

fn small(overlap: Overlap) -> DdpConfig {
    DdpConfig {
        bucket_cap_bytes: 4096,
        first_bucket_bytes: 512,
        overlap,
        ..DdpConfig::default()
    }
}

/// Integer-valued gradient of parameter `p` on `rank` at `step`: sums and averages over 4 ranks
/// are exact in f32.
fn grad(rank: usize, step: usize, p: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((rank * 7 + step * 3 + p * 5 + i) % 17) as f32)
        .collect()
}

fn avg_grad(n: usize, step: usize, p: usize, len: usize) -> Vec<f32> {
    let mut s = vec![0.0f32; len];
    for r in 0..n {
        for (a, g) in s.iter_mut().zip(grad(r, step, p, len)) {
            *a += g;
        }
    }
    s.iter().map(|x| x / n as f32).collect()
}

/// Every parameter's gradient in `ddp` is the average over `n` ranks of `grad(.., step, ..)`.
fn assert_averaged<C: std::borrow::Borrow<Communicator>>(ddp: &Ddp<C>, n: usize, step: usize) {
    let rank = ddp.comm().rank();
    for (p, &len) in LENS.iter().enumerate() {
        assert_eq!(
            ddp.grad::<f32>(p).unwrap(),
            avg_grad(n, step, p, len).as_slice(),
            "rank {rank} step {step} param {p}"
        );
    }
}

/// Overlap on for even ranks, off for odd ones (ranks may differ).
fn even_ranks_overlap(rank: usize) -> Overlap {
    if rank.is_multiple_of(2) {
        Overlap::On
    } else {
        Overlap::Off
    }
}

/// Runs `f` on `n` threaded ranks and fails the test if any rank fails.
fn on_ranks(n: usize, f: impl Fn(Communicator) -> oxccl_comm::Result<()> + Sync) {
    for (rank, r) in spawn_world(n, Config::default(), f).into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}

/// A `Ddp` over parameters of the lengths in `LENS`, with the communicator held as `C`.
fn new_ddp<C: std::borrow::Borrow<Communicator>>(
    comm: C,
    cfg: DdpConfig,
) -> oxccl_ddp::Result<Ddp<C>> {
    let mut store: Vec<Vec<f32>> = LENS.iter().map(|&n| vec![0.0; n]).collect();
    let mut params: Vec<Param> = store
        .iter_mut()
        .enumerate()
        .map(|(p, v)| Param::new(format!("layer{p}.weight"), v.as_mut_slice()))
        .collect();
    Ddp::new(comm, &mut params, cfg)
}

/// A permutation of 0..n that depends on `seed` (ranks pass different seeds).
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut s = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    for i in (1..n).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.swap(i, (s % (i as u64 + 1)) as usize);
    }
    v
}

#[test]
fn grad_ready_averages_every_parameter_over_steps() {
    for overlap in [Overlap::On, Overlap::Off] {
        grad_ready_averages_every_parameter_over_steps_with(overlap);
    }
}

fn grad_ready_averages_every_parameter_over_steps_with(overlap: Overlap) {
    on_ranks(4, |comm| {
        let rank = comm.rank();
        let mut ddp = new_ddp(comm, small(overlap)).unwrap();
        assert!(
            ddp.bucket_params().len() >= 4,
            "small caps give several buckets"
        );
        for step in 0..3 {
            for p in (0..LENS.len()).rev() {
                ddp.grad_ready(p, &grad(rank, step, p, LENS[p])).unwrap();
            }
            assert_eq!(ddp.finish().unwrap(), Step::Synced { step: step as u64 });
            assert_averaged(&ddp, 4, step);
        }
        Ok(())
    });
}

#[test]
fn sync_writes_the_average_back_in_mixed_dtypes() {
    on_ranks(3, |comm| {
        let rank = comm.rank();
        let (mut a, mut b, mut c) = (vec![0f32; 100], vec![0f64; 2000], vec![bf16::ZERO; 513]);
        let mut params = [
            Param::new("a", &mut a),
            Param::new("b", &mut b),
            Param::new("c", &mut c),
        ];
        let mut ddp = Ddp::new(comm, &mut params, small_buckets()).unwrap();
        for step in 0..2 {
            let mut ga: Vec<f32> = (0..100).map(|i| (i + rank + step) as f32).collect();
            let mut gb: Vec<f64> = (0..2000).map(|i| (i * rank) as f64).collect();
            let mut gc: Vec<bf16> = (0..513)
                .map(|i| bf16::from_f32((i % 8 * rank) as f32))
                .collect();
            let mut grads = [
                TensorMut::from(&mut ga),
                TensorMut::from(&mut gb),
                TensorMut::from(&mut gc),
            ];
            assert_eq!(
                ddp.sync(&mut grads).unwrap(),
                Step::Synced { step: step as u64 }
            );
            // Sum over ranks 0..3 of rank = 3, divided by 3.
            assert!(ga
                .iter()
                .enumerate()
                .all(|(i, &x)| x == (i + 1 + step) as f32));
            assert!(gb.iter().enumerate().all(|(i, &x)| x == i as f64));
            assert!(gc
                .iter()
                .enumerate()
                .all(|(i, &x)| x == bf16::from_f32((i % 8) as f32)));
        }
        Ok(())
    });
}

#[test]
fn ranks_with_different_ready_orders_agree_and_rebuild_from_rank_0() {
    for overlap in [Overlap::On, Overlap::Off] {
        ranks_with_different_ready_orders_agree_and_rebuild_from_rank_0_with(overlap);
    }
}

fn ranks_with_different_ready_orders_agree_and_rebuild_from_rank_0_with(overlap: Overlap) {
    let out = spawn_world(4, Config::default(), |comm| {
        let rank = comm.rank();
        let mut ddp = new_ddp(comm, small(overlap)).unwrap();
        let mut layouts = Vec::new();
        for step in 0..4 {
            // Every rank, every step: its own order.
            for p in shuffled(LENS.len(), (rank * 10 + step) as u64) {
                ddp.grad_ready(p, &grad(rank, step, p, LENS[p])).unwrap();
            }
            ddp.finish().unwrap();
            assert_averaged(&ddp, 4, step);
            layouts.push(ddp.bucket_params());
        }
        Ok(layouts)
    });
    let layouts: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
    for l in &layouts[1..] {
        assert_eq!(l, &layouts[0], "every rank uses the same buckets");
    }
    // After step 0 the layout follows rank 0's step-0 order: the first bucket holds the first
    // parameter that rank 0 handed over.
    let rank0_order = shuffled(LENS.len(), 0);
    let first_nonempty = rank0_order.iter().find(|&&p| LENS[p] > 0).copied();
    let after = &layouts[0][1];
    assert!(after[0].contains(&rank0_order[0]) || Some(after[0][0]) == first_nonempty);
    assert_ne!(
        layouts[0][0], layouts[0][1],
        "the rebuilt layout differs from reverse order"
    );
    assert_eq!(layouts[0][1], layouts[0][3], "rebuilt once");
}

#[test]
fn accumulation_over_micro_batches_equals_the_large_batch() {
    for overlap in [Overlap::On, Overlap::Off] {
        accumulation_over_micro_batches_equals_the_large_batch_with(overlap);
    }
}

fn accumulation_over_micro_batches_equals_the_large_batch_with(overlap: Overlap) {
    on_ranks(4, |comm| {
        let rank = comm.rank();
        let mut ddp = new_ddp(comm, small(overlap)).unwrap();
        ddp.accumulate(4).unwrap();
        for step in 0..2 {
            for micro in 0..4 {
                for p in (0..LENS.len()).rev() {
                    ddp.grad_ready(p, &grad(rank, step * 4 + micro, p, LENS[p]))
                        .unwrap();
                }
                let s = ddp.finish().unwrap();
                if micro < 3 {
                    assert_eq!(s, Step::Accumulated { micro_batch: micro });
                    // No communication yet: the bucket holds this rank's running sum.
                    let want: f32 = (0..=micro)
                        .map(|m| grad(rank, step * 4 + m, 6, 33)[5])
                        .sum();
                    assert_eq!(ddp.grad::<f32>(6).unwrap()[5], want);
                } else {
                    assert_eq!(s, Step::Synced { step: step as u64 });
                }
            }
            for (p, &len) in LENS.iter().enumerate() {
                let mut want = vec![0.0f32; len];
                for m in 0..4 {
                    for (w, g) in want.iter_mut().zip(avg_grad(4, step * 4 + m, p, len)) {
                        *w += g;
                    }
                }
                assert_eq!(ddp.grad::<f32>(p).unwrap(), want.as_slice(), "param {p}");
            }
        }
        // The no_sync guard does the same for a micro-batch at a time.
        ddp.accumulate(1).unwrap();
        for micro in 0..2 {
            let mut g = ddp.no_sync();
            for (p, &len) in LENS.iter().enumerate() {
                g.grad_ready(p, &vec![(rank + micro) as f32; len]).unwrap();
            }
            assert_eq!(
                g.finish().unwrap(),
                Step::Accumulated { micro_batch: micro }
            );
        }
        for (p, &len) in LENS.iter().enumerate() {
            ddp.grad_ready(p, &vec![1.0f32; len]).unwrap();
        }
        assert_eq!(ddp.finish().unwrap(), Step::Synced { step: 2 });
        // Per rank: r + (r + 1) + 1 = 2r + 2; average over 0..4: 5.
        assert!(ddp.grad::<f32>(2).unwrap().iter().all(|&x| x == 5.0));
        Ok(())
    });
}

#[test]
fn an_unused_parameter_is_named_or_reduced_as_zeros() {
    for overlap in [Overlap::On, Overlap::Off] {
        an_unused_parameter_is_named_or_reduced_as_zeros_with(overlap);
    }
}

fn an_unused_parameter_is_named_or_reduced_as_zeros_with(overlap: Overlap) {
    for find_unused in [false, true] {
        let out = spawn_world(3, Config::default(), |comm| {
            let rank = comm.rank();
            let cfg = DdpConfig {
                find_unused_parameters: find_unused,
                ..small(overlap)
            };
            let mut ddp = new_ddp(comm, cfg).unwrap();
            let mut results = Vec::new();
            for step in 0..2 {
                for p in (0..LENS.len()).filter(|&p| p != 2) {
                    ddp.grad_ready(p, &grad(rank, step, p, LENS[p])).unwrap();
                }
                results.push(ddp.finish());
                assert_eq!(
                    ddp.grad::<f32>(1).unwrap(),
                    avg_grad(3, step, 1, 7).as_slice()
                );
                assert!(ddp.grad::<f32>(2).unwrap().iter().all(|&x| x == 0.0));
            }
            Ok(results)
        });
        for r in out {
            for res in r.unwrap() {
                match (find_unused, res) {
                    (false, Err(DdpError::UnusedParameters { names, .. })) => {
                        assert_eq!(names, vec!["layer2.weight".to_string()]);
                    }
                    (true, Ok(Step::Synced { .. })) => {}
                    (f, other) => panic!("find_unused={f}: unexpected {other:?}"),
                }
            }
        }
    }
    // The message names the rank, the call and the parameter.
    let e = DdpError::UnusedParameters {
        rank: 2,
        step: 0,
        names: vec!["fc.bias".into()],
    };
    let msg = e.to_string();
    assert!(
        msg.contains("rank 2") && msg.contains("finish") && msg.contains("fc.bias"),
        "{msg}"
    );
}

#[test]
fn parameters_no_rank_used_are_listed_with_find_unused_parameters() {
    // Parameter 2 gets no gradient on any rank, parameter 4 none on rank 0 only (used
    // elsewhere, so not listed); then a `sync`, which takes every gradient; then a step of two
    // micro-batches, where a gradient in the first one counts. Without the setting the list
    // stays empty (and the step fails on the unused parameter).
    for find_unused in [true, false] {
        let out = spawn_world(3, Config::default(), |comm| {
            let rank = comm.rank();
            let cfg = DdpConfig {
                find_unused_parameters: find_unused,
                ..small(Overlap::On)
            };
            let mut ddp = new_ddp(comm, cfg).unwrap();
            let mut lists = Vec::new();
            for step in 0..3 {
                for p in (0..LENS.len()).filter(|&p| p != 2 && (p, rank) != (4, 0)) {
                    ddp.grad_ready(p, &grad(rank, step, p, LENS[p])).unwrap();
                }
                let r = ddp.finish();
                assert_eq!(r.is_ok(), find_unused, "rank {rank} step {step}: {r:?}");
                lists.push(ddp.unused_on_every_rank().to_vec());
            }
            let mut grads: Vec<Vec<f32>> = LENS.iter().map(|&n| vec![1.0; n]).collect();
            ddp.sync(&mut grads).unwrap();
            lists.push(ddp.unused_on_every_rank().to_vec());
            // Two micro-batches: parameter 2 only in the first (used), 4 in neither.
            ddp.accumulate(2).unwrap();
            for micro in 0..2 {
                for p in (0..LENS.len()).filter(|&p| p != 4 && (p != 2 || micro == 0)) {
                    ddp.grad_ready(p, &grad(rank, 10 + micro, p, LENS[p]))
                        .unwrap();
                }
                let r = ddp.finish();
                assert!(micro == 0 || r.is_ok() == find_unused, "rank {rank}: {r:?}");
            }
            lists.push(ddp.unused_on_every_rank().to_vec());
            Ok(lists)
        });
        let want: Vec<Vec<usize>> = if find_unused {
            vec![vec![2], vec![2], vec![2], vec![], vec![4]]
        } else {
            vec![vec![]; 5]
        };
        for (rank, r) in out.into_iter().enumerate() {
            assert_eq!(r.unwrap(), want, "rank {rank}, find_unused {find_unused}");
        }
    }
}

/// The worst-case error of compressing to a 16-bit float with `mant` mantissa bits: every rank's
/// value rounded once, every partial sum rounded once.
fn compression_bound(vals: &[f32], mant: i32) -> f32 {
    let u = 2f32.powi(-mant);
    let n = vals.len() as f32;
    let abs_sum: f32 = vals.iter().map(|v| v.abs()).sum();
    (n + 1.0) * u * abs_sum / n + 1e-6
}

#[test]
fn compression_hooks_stay_within_16_bit_rounding() {
    for (hook, mant) in [(CompressHook::bf16(), 8), (CompressHook::fp16(), 11)] {
        let n = 4;
        let len = 5000;
        let value = |r: usize, i: usize| ((r * 31 + i * 17) % 1000) as f32 * 0.001 - 0.3;
        let out = spawn_world(n, Config::default(), |comm| {
            let rank = comm.rank();
            let mut w = vec![0.0f32; len];
            let mut ddp = Ddp::new(comm, &mut [Param::new("w", &mut w)], small_buckets()).unwrap();
            ddp.set_comm_hook(hook).unwrap();
            let g: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
            ddp.grad_ready(0, &g).unwrap();
            ddp.finish().unwrap();
            Ok(ddp.grad::<f32>(0).unwrap().to_vec())
        });
        let mut changed = 0;
        for r in out {
            let got = r.unwrap();
            for (i, &x) in got.iter().enumerate() {
                let vals: Vec<f32> = (0..n).map(|r| value(r, i)).collect();
                let exact = vals.iter().sum::<f32>() / n as f32;
                let bound = compression_bound(&vals, mant);
                assert!(
                    (x - exact).abs() <= bound,
                    "{} element {i}: {x} vs {exact} (bound {bound})",
                    hook.wire().short_name()
                );
                changed += usize::from(x != exact);
            }
        }
        assert!(
            changed > 0,
            "{}: compression must actually round",
            hook.wire().short_name()
        );
    }
}

/// A user hook: sums instead of averaging, and counts the buckets it saw.
struct SumHook(Arc<std::sync::atomic::AtomicUsize>);

impl CommHook for SumHook {
    fn name(&self) -> &str {
        "sum"
    }
    fn start(&mut self, comm: &Communicator, bucket: GradBucket) -> HookWork {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let t = bucket.buffer.into_typed::<f32>().expect("f32 buckets");
        let work = comm.all_reduce_async(t, ReduceOp::Sum);
        HookWork::new(move || Ok(work.wait()?.into_inner()))
    }
}

/// A broken user hook: hands back a buffer of the wrong size.
struct ShortHook;

impl CommHook for ShortHook {
    fn name(&self) -> &str {
        "short"
    }
    fn start(&mut self, _comm: &Communicator, bucket: GradBucket) -> HookWork {
        HookWork::ready(FlatBuffer::zeros(
            bucket.buffer.dtype(),
            bucket.buffer.len() + 1,
        ))
    }
}

#[test]
fn user_comm_hooks_run_per_bucket_and_bad_ones_are_caught() {
    for overlap in [Overlap::On, Overlap::Off] {
        user_comm_hooks_run_per_bucket_and_bad_ones_are_caught_with(overlap);
    }
}

fn user_comm_hooks_run_per_bucket_and_bad_ones_are_caught_with(overlap: Overlap) {
    on_ranks(2, |comm| {
        let rank = comm.rank();
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut ddp = new_ddp(comm, small(overlap)).unwrap();
        ddp.set_comm_hook(SumHook(Arc::clone(&count))).unwrap();
        for p in (0..LENS.len()).rev() {
            ddp.grad_ready(p, &vec![(rank + 1) as f32; LENS[p]])
                .unwrap();
        }
        ddp.finish().unwrap();
        assert!(ddp.grad::<f32>(5).unwrap().iter().all(|&x| x == 3.0));
        assert_eq!(
            count.load(std::sync::atomic::Ordering::Relaxed),
            ddp.bucket_params().len()
        );
        ddp.set_comm_hook(ShortHook).unwrap();
        for p in (0..LENS.len()).rev() {
            ddp.grad_ready(p, &vec![1.0f32; LENS[p]]).unwrap();
        }
        let e = ddp.finish().unwrap_err().to_string();
        assert!(e.contains("comm hook short returned"), "{e}");
        Ok(())
    });
}

#[test]
fn new_broadcasts_rank_0_values_and_buffers_follow_on_request() {
    on_ranks(3, |comm| {
        let rank = comm.rank();
        // Many small parameters (packed together) and one larger than the cap (alone).
        let mut small: Vec<Vec<f32>> = (0..20).map(|p| vec![(rank * 100 + p) as f32; 5]).collect();
        let mut big = vec![rank as u64; 1000];
        let mut params: Vec<Param> = small
            .iter_mut()
            .enumerate()
            .map(|(p, v)| Param::new(format!("s{p}"), v.as_mut_slice()))
            .collect();
        params.push(Param::new("big", &mut big));
        let ddp = Ddp::new(&comm, &mut params, small_buckets()).unwrap();
        drop(params);
        assert!(small
            .iter()
            .enumerate()
            .all(|(p, v)| v.iter().all(|&x| x == p as f32)));
        assert!(big.iter().all(|&x| x == 0));
        let mut stats = vec![vec![rank as f32; 3], vec![rank as f32 + 0.5; 10_000]];
        ddp.broadcast_buffers(&mut stats).unwrap();
        assert_eq!(stats, vec![vec![0.0; 3], vec![0.5; 10_000]]);
        Ok(())
    });
}

fn expect_invalid(r: oxccl_ddp::Result<impl std::fmt::Debug>, needles: &[&str]) {
    match r {
        Err(e @ DdpError::InvalidArgument { .. }) => {
            let msg = e.to_string();
            for n in needles {
                assert!(msg.contains(n), "{msg:?} lacks {n:?}");
            }
        }
        other => panic!("expected InvalidArgument with {needles:?}, got {other:?}"),
    }
}

#[test]
fn bad_input_gets_an_error_naming_rank_call_and_parameter() {
    on_ranks(2, |comm| {
        let rank = comm.rank();
        let r = format!("rank {rank}");
        let comm = Arc::new(comm);
        let mut ddp = new_ddp(Arc::clone(&comm), small_buckets()).unwrap();
        expect_invalid(
            ddp.grad_ready(9, &[1.0f32]),
            &[&r, "grad_ready", "out of range"],
        );
        expect_invalid(
            ddp.grad_ready(1, &[1.0f64; 7]),
            &[&r, "layer1.weight", "is f32", "f64"],
        );
        expect_invalid(
            ddp.grad_ready(1, &[1.0f32; 6]),
            &[&r, "layer1.weight", "7 elements"],
        );
        ddp.grad_ready(1, &[1.0f32; 7]).unwrap();
        expect_invalid(
            ddp.grad_ready(1, &[1.0f32; 7]),
            &[&r, "already got its gradient"],
        );
        let mut grads: Vec<Vec<f32>> = LENS.iter().map(|&n| vec![0.0; n]).collect();
        expect_invalid(
            ddp.sync(&mut grads),
            &[&r, "sync", "was already called in this backward pass"],
        );
        expect_invalid(ddp.sync(&mut grads[..3]), &[&r, "3 gradients given for 7"]);
        expect_invalid(ddp.accumulate(2), &[&r, "middle of a step"]);
        expect_invalid(ddp.accumulate(0), &[&r, "at least 1"]);
        expect_invalid(ddp.grad::<u8>(1), &[&r, "grad", "read as u8"]);
        for p in (0..LENS.len()).filter(|&p| p != 1) {
            ddp.grad_ready(p, &vec![1.0f32; LENS[p]]).unwrap();
        }
        ddp.finish().unwrap();
        drop(ddp);
        // Parameter lists that differ between ranks are caught before any gradient moves.
        let mut w = vec![0.0f32; 10 + rank];
        let e = Ddp::new(&*comm, &mut [Param::new("w", &mut w)], DdpConfig::default());
        let list = format!(
            "the parameter list (lengths, dtypes) differs between ranks: this rank has 1 \
             parameter(s), {} elements",
            10 + rank
        );
        expect_invalid(e.map(|_| ()), &[&r, "new", &list]);
        // So are settings that would make ranks end a step differently (one rank's finish()
        // failing on an unused parameter while the others go on).
        let mut w = vec![0.0f32; 10];
        let cfg = DdpConfig {
            find_unused_parameters: rank == 1,
            ..DdpConfig::default()
        };
        let e = Ddp::new(&*comm, &mut [Param::new("w", &mut w)], cfg);
        let unused = format!(
            "find_unused_parameters differs between ranks: this rank has {}",
            rank == 1
        );
        expect_invalid(e.map(|_| ()), &[&r, "new", &unused]);
        // Every setting that differs is named, with its range across the ranks.
        let cfg = DdpConfig {
            bucket_cap_bytes: 4096 << rank,
            sync_in_place_bytes: 1 << 20,
            rebuild_buckets: rank == 0,
            ..DdpConfig::default()
        };
        let e = Ddp::new(&*comm, &mut [Param::new("w", &mut w)], cfg);
        let cap = format!(
            "bucket_cap_bytes differs between ranks: {} here, from 4096 to 8192 across the ranks",
            4096 << rank
        );
        let rebuild = format!(
            "rebuild_buckets differs between ranks: this rank has {}",
            rank == 0
        );
        expect_invalid(e.map(|_| ()), &[&r, "new", &cap, &rebuild]);
        let cfg = DdpConfig {
            bucket_cap_bytes: 0,
            ..DdpConfig::default()
        };
        expect_invalid(
            Ddp::new(&*comm, &mut [], cfg).map(|_| ()),
            &[&r, "positive"],
        );
        Ok(())
    });
}

#[test]
fn gradients_computed_in_their_slots_match_grad_ready_and_accumulate() {
    // Odd parameters are written into their bucket slots, even ones handed over by grad_ready,
    // in each rank's own order; ranks 0 and 2 overlap, 1 and 3 do not. Two micro-batches per
    // step: the second adds into what the first left.
    on_ranks(4, |comm| {
        let rank = comm.rank();
        let overlap = even_ranks_overlap(rank);
        let mut ddp = new_ddp(comm, small(overlap)).unwrap();
        ddp.accumulate(2).unwrap();
        for step in 0..3 {
            for micro in 0..2 {
                let m = step * 2 + micro;
                for p in shuffled(LENS.len(), (rank * 10 + m) as u64) {
                    let g = grad(rank, m, p, LENS[p]);
                    if p % 2 == 0 {
                        ddp.grad_ready(p, &g).unwrap();
                        continue;
                    }
                    let (slot, fresh) = ddp.grad_slot::<f32>(p).unwrap();
                    assert_eq!(fresh, micro == 0, "rank {rank} step {step} param {p}");
                    assert_eq!(slot.len(), LENS[p]);
                    if fresh {
                        // Stale values (the last step's average) to overwrite.
                        slot.copy_from_slice(&g);
                    } else {
                        let first = grad(rank, m - 1, p, LENS[p]);
                        assert_eq!(slot, first.as_slice(), "the first micro-batch's gradient");
                        for (x, y) in slot.iter_mut().zip(&g) {
                            *x += y;
                        }
                    }
                    ddp.grad_ready_in_place(p).unwrap();
                }
                if micro == 1 && overlap == Overlap::On {
                    // Every bucket was launched as it filled, slots and copies alike.
                    for p in 0..LENS.len() {
                        assert!(ddp.grad::<f32>(p).is_err(), "rank {rank}: param {p} idle");
                    }
                }
                ddp.finish().unwrap();
            }
            for (p, &len) in LENS.iter().enumerate() {
                let want: Vec<f32> = avg_grad(4, step * 2, p, len)
                    .iter()
                    .zip(avg_grad(4, step * 2 + 1, p, len))
                    .map(|(a, b)| a + b)
                    .collect();
                assert_eq!(
                    ddp.grad::<f32>(p).unwrap(),
                    want.as_slice(),
                    "rank {rank} step {step} param {p}"
                );
            }
        }
        Ok(())
    });
}

#[test]
fn bad_slot_calls_get_an_error_naming_rank_call_and_parameter() {
    on_ranks(2, |comm| {
        let r = format!("rank {}", comm.rank());
        let mut ddp = new_ddp(comm, small_buckets()).unwrap();
        expect_invalid(
            ddp.grad_slot::<f32>(9).map(|_| ()),
            &[&r, "grad_slot", "out of range"],
        );
        expect_invalid(
            ddp.grad_slot::<f64>(1).map(|_| ()),
            &[&r, "grad_slot", "layer1.weight", "is f32", "f64"],
        );
        expect_invalid(
            ddp.grad_ready_in_place(7),
            &[&r, "grad_ready_in_place", "out of range"],
        );
        expect_invalid(
            ddp.grad_ready_in_place(2),
            &[
                &r,
                "grad_ready_in_place",
                "layer2.weight",
                "not taken with grad_slot",
            ],
        );
        ddp.grad_slot::<f32>(1).unwrap().0.fill(1.0);
        ddp.grad_ready_in_place(1).unwrap();
        expect_invalid(
            ddp.grad_ready_in_place(1),
            &[
                &r,
                "grad_ready_in_place",
                "layer1.weight",
                "already got its gradient",
            ],
        );
        expect_invalid(
            ddp.grad_slot::<f32>(1).map(|_| ()),
            &[&r, "grad_slot", "already got its gradient"],
        );
        expect_invalid(
            ddp.grad_ready(1, &[1.0f32; 7]),
            &[&r, "grad_ready", "already got its gradient"],
        );
        for p in (0..LENS.len()).filter(|&p| p != 1) {
            ddp.grad_ready(p, &vec![1.0f32; LENS[p]]).unwrap();
        }
        ddp.finish().unwrap();
        assert_eq!(ddp.grad::<f32>(1).unwrap(), &[1.0f32; 7]);
        // A slot taken (even if not declared ready) and then `sync`: refused, nothing issued.
        ddp.grad_slot::<f32>(2).unwrap().0.fill(1.0);
        let mut grads: Vec<Vec<f32>> = LENS.iter().map(|&n| vec![0.0; n]).collect();
        expect_invalid(
            ddp.sync(&mut grads),
            &[&r, "sync", "grad_ready or grad_slot was already called"],
        );
        ddp.grad_ready_in_place(2).unwrap();
        for p in (0..LENS.len()).filter(|&p| p != 2) {
            ddp.grad_ready(p, &vec![2.0f32; LENS[p]]).unwrap();
        }
        ddp.finish().unwrap();
        // A refused grad_ready_in_place starts no backward pass: sync may follow it.
        expect_invalid(
            ddp.grad_ready_in_place(3),
            &[&r, "grad_ready_in_place", "not taken with grad_slot"],
        );
        let mut grads: Vec<Vec<f32>> = LENS.iter().map(|&n| vec![3.0; n]).collect();
        assert_eq!(ddp.sync(&mut grads).unwrap(), Step::Synced { step: 2 });
        assert!(grads.iter().flatten().all(|&x| x == 3.0));
        Ok(())
    });
}

#[test]
fn overlap_off_all_reduces_in_finish_and_ranks_may_differ() {
    // Ranks 0 and 2 overlap, 1 and 3 do not, each handing its gradients over in its own order.
    on_ranks(4, |comm| {
        let rank = comm.rank();
        let overlap = even_ranks_overlap(rank);
        let mut ddp = new_ddp(comm, small(overlap)).unwrap();
        assert_eq!(ddp.overlaps(), overlap == Overlap::On);
        for step in 0..3 {
            for p in shuffled(LENS.len(), (rank * 10 + step) as u64) {
                ddp.grad_ready(p, &grad(rank, step, p, LENS[p])).unwrap();
            }
            // Every gradient is in. Overlapping, every bucket's all-reduce has started (grad()
            // refuses to read a bucket in flight); not overlapping, none has, and the buckets
            // hold this rank's own gradients.
            for (p, &len) in LENS.iter().enumerate() {
                if overlap == Overlap::On {
                    let e = ddp.grad::<f32>(p).unwrap_err();
                    assert!(e.to_string().contains("in flight"), "rank {rank}: {e}");
                } else {
                    assert_eq!(
                        ddp.grad::<f32>(p).unwrap(),
                        grad(rank, step, p, len).as_slice(),
                        "rank {rank} step {step} param {p}: launched before finish()"
                    );
                }
            }
            assert_eq!(ddp.finish().unwrap(), Step::Synced { step: step as u64 });
            assert_averaged(&ddp, 4, step);
        }
        Ok(())
    });
}

/// The default hook's all-reduce (average, f32 buckets), each bucket's operation also kept
/// where the test can ask whether it is done before `finish()` waits for it.
type Watched = Arc<std::sync::Mutex<Option<Work<Typed<f32>>>>>;

struct WatchHook(Arc<std::sync::Mutex<Vec<Watched>>>);

impl CommHook for WatchHook {
    fn name(&self) -> &str {
        "watched all_reduce_avg"
    }
    fn start(&mut self, comm: &Communicator, bucket: GradBucket) -> HookWork {
        let t = bucket.buffer.into_typed::<f32>().expect("f32 buckets");
        let work: Watched = Arc::new(std::sync::Mutex::new(Some(
            comm.all_reduce_async(t, ReduceOp::Avg),
        )));
        self.0.lock().unwrap().push(work.clone());
        HookWork::new(move || {
            let w = work.lock().unwrap().take().expect("waited once");
            Ok(w.wait()?.into_inner())
        })
    }
}

#[test]
fn overlap_on_reduces_buckets_in_the_background_before_finish() {
    // What overlap is for: with `On`, a bucket's all-reduce is carried out by the progress
    // thread while the trainer goes on (here it only polls), so every bucket is done before
    // `finish()` is called; with `Off`, none is even started by then.
    for overlap in [Overlap::On, Overlap::Off] {
        on_ranks(4, |comm| {
            let rank = comm.rank();
            let started = Arc::new(std::sync::Mutex::new(Vec::new()));
            let mut ddp = new_ddp(comm, small(overlap)).unwrap();
            ddp.set_comm_hook(WatchHook(started.clone())).unwrap();
            for step in 0..3 {
                started.lock().unwrap().clear();
                for p in shuffled(LENS.len(), (rank * 10 + step) as u64) {
                    ddp.grad_ready(p, &grad(rank, step, p, LENS[p])).unwrap();
                }
                let works: Vec<Watched> = started.lock().unwrap().clone();
                if overlap == Overlap::Off {
                    assert!(works.is_empty(), "rank {rank}: launched before finish()");
                } else {
                    assert_eq!(works.len(), ddp.bucket_params().len(), "rank {rank}");
                    let deadline = std::time::Instant::now() + Duration::from_secs(60);
                    let mut waiting: Vec<_> = (0..works.len()).collect();
                    while !waiting.is_empty() {
                        waiting.retain(|&b| {
                            !works[b].lock().unwrap().as_ref().is_some_and(Work::is_done)
                        });
                        assert!(
                            std::time::Instant::now() < deadline,
                            "rank {rank} step {step}: buckets {waiting:?} not reduced in the \
                             background"
                        );
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                assert_eq!(ddp.finish().unwrap(), Step::Synced { step: step as u64 });
                assert_averaged(&ddp, 4, step);
            }
            Ok(())
        });
    }
}

#[test]
fn overlap_auto_asks_for_two_cpus_per_rank_of_the_node_groups_included() {
    // 4 ranks of one node, the node's CPUs given as a parent communicator hands them down
    // (`Config::node_cpus`; the union of the ranks' CPU lists counts where it is more). The
    // world and its groups of 2 ({0, 2}, {1, 3}, as a data-parallel group of a 2D layout) pick
    // alike: a group shares the node with the world's 4 ranks.
    let usable = oxccl_comm::internal::affinity::usable_cpus().len();
    if usable == 0 {
        eprintln!("skipped: this system does not give CPU lists, so the node's count is unknown");
        return;
    }
    for given in [6, 8, 64] {
        let want = usable.max(given) >= 2 * 4;
        let cfg = Config {
            node_cpus: Some(given),
            ..Config::default()
        };
        let out = spawn_world(4, cfg, |comm| {
            let group = comm
                .split(Some((comm.rank() % 2) as u32), 0)?
                .expect("a color");
            let holds = (comm.stats().node_holds(2), group.stats().node_holds(2));
            let world = new_ddp(&comm, small(Overlap::Auto)).map(|d| d.overlaps());
            let grouped = new_ddp(&group, small(Overlap::Auto)).map(|d| d.overlaps());
            Ok((holds, world.unwrap(), grouped.unwrap()))
        });
        for (rank, r) in out.into_iter().enumerate() {
            let got = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            assert_eq!(got, ((want, want), want, want), "rank {rank}, {given} CPUs");
        }
    }
    // A node of 2^20 ranks never has 2 CPUs each.
    let crowded = Config {
        node_ranks: Some(1 << 20),
        ..Config::default()
    };
    let out = spawn_world(2, crowded, |comm| {
        let auto = new_ddp(&comm, DdpConfig::default()).unwrap().overlaps();
        let on = DdpConfig {
            overlap: Overlap::On,
            ..DdpConfig::default()
        };
        Ok((auto, new_ddp(&comm, on).unwrap().overlaps()))
    });
    for (rank, r) in out.into_iter().enumerate() {
        assert_eq!(r.unwrap(), (false, true), "rank {rank}");
    }
    // Two nodes, one with CPUs to spare and one without: Auto decides for every rank alike
    // (off), so ranks never mix modes unasked.
    let out = spawn_world_with(
        4,
        |rank| {
            let mut c = Config {
                node_id: Some(format!("node{}", rank / 2)),
                ..Config::default()
            };
            if rank < 2 {
                c.node_cpus = Some(64);
            } else {
                c.node_ranks = Some(1 << 20);
            }
            c
        },
        |comm| {
            let holds = comm.stats().node_holds(2);
            Ok((
                holds,
                new_ddp(&comm, small(Overlap::Auto)).unwrap().overlaps(),
            ))
        },
    );
    for (rank, r) in out.into_iter().enumerate() {
        assert_eq!(r.unwrap(), (rank < 2, false), "rank {rank}");
    }
}

#[test]
fn ddp_over_tcp_matches_shared_memory() {
    let cfg = Config {
        transport: oxccl_comm::config::TransportChoice::Tcp,
        ..Config::default()
    };
    let out = spawn_world(2, cfg, |comm| {
        let rank = comm.rank();
        let mut ddp = new_ddp(comm, DdpConfig::default()).unwrap();
        let mut grads: Vec<Vec<f32>> = (0..LENS.len()).map(|p| grad(rank, 0, p, LENS[p])).collect();
        ddp.sync(&mut grads).unwrap();
        for (p, g) in grads.iter().enumerate() {
            assert_eq!(g, &avg_grad(2, 0, p, LENS[p]));
        }
        Ok(())
    });
    for r in out {
        r.unwrap();
    }
}

#[test]
fn sync_reduces_large_gradients_in_place_and_accumulates() {
    on_ranks(4, |comm| {
        let rank = comm.rank();
        // Parameters of at least 1 KiB (256 f32) go in place; the rest are packed.
        let cfg = DdpConfig {
            sync_in_place_bytes: 1024,
            ..small_buckets()
        };
        let mut ddp = new_ddp(comm, cfg).unwrap();
        for step in 0..2 {
            let mut grads: Vec<Vec<f32>> = (0..LENS.len())
                .map(|p| grad(rank, step, p, LENS[p]))
                .collect();
            assert_eq!(
                ddp.sync(&mut grads).unwrap(),
                Step::Synced { step: step as u64 }
            );
            for (p, g) in grads.iter().enumerate() {
                assert_eq!(g, &avg_grad(4, step, p, LENS[p]), "step {step} param {p}");
            }
        }
        // After an in-place sync the averages are in the caller's slices, not in the buckets.
        let e = ddp.grad::<f32>(0).unwrap_err().to_string();
        assert!(e.contains("slices given to sync"), "{e}");
        // Accumulation through sync: two micro-batches, the second reduces the sum.
        ddp.accumulate(2).unwrap();
        let mut sums: Vec<Vec<f32>> = LENS.iter().map(|&n| vec![0.0; n]).collect();
        for micro in 0..2 {
            let mut grads: Vec<Vec<f32>> = (0..LENS.len())
                .map(|p| grad(rank, 10 + micro, p, LENS[p]))
                .collect();
            let s = ddp.sync(&mut grads).unwrap();
            for (p, sum) in sums.iter_mut().enumerate() {
                for (a, g) in sum.iter_mut().zip(avg_grad(4, 10 + micro, p, LENS[p])) {
                    *a += g;
                }
            }
            if micro == 0 {
                assert_eq!(s, Step::Accumulated { micro_batch: 0 });
                assert_eq!(
                    grads[2],
                    grad(rank, 10, 2, LENS[2]),
                    "only read while accumulating"
                );
            } else {
                assert_eq!(s, Step::Synced { step: 2 });
                assert_eq!(grads, sums);
            }
        }
        // With a hook every gradient goes through the buckets (and grad() reads them).
        ddp.accumulate(1).unwrap();
        ddp.set_comm_hook(CompressHook::bf16()).unwrap();
        let mut grads: Vec<Vec<f32>> = LENS.iter().map(|&n| vec![rank as f32; n]).collect();
        ddp.sync(&mut grads).unwrap();
        assert!(grads.iter().flatten().all(|&x| x == 1.5));
        assert!(ddp.grad::<f32>(5).unwrap().iter().all(|&x| x == 1.5));
        Ok(())
    });
}

#[test]
fn a_no_sync_guard_taken_mid_backward_does_not_change_that_micro_batch() {
    for overlap in [Overlap::On, Overlap::Off] {
        a_no_sync_guard_taken_mid_backward_does_not_change_that_micro_batch_with(overlap);
    }
}

fn a_no_sync_guard_taken_mid_backward_does_not_change_that_micro_batch_with(overlap: Overlap) {
    on_ranks(2, |comm| {
        let rank = comm.rank();
        let mut ddp = new_ddp(comm, small(overlap)).unwrap();
        for p in (0..LENS.len()).rev() {
            ddp.grad_ready(p, &grad(rank, 0, p, LENS[p])).unwrap();
        }
        // With overlap the buckets were launched when they filled, without it they launch in
        // finish(): either way, finishing under a guard still reduces.
        assert_eq!(ddp.no_sync().finish().unwrap(), Step::Synced { step: 0 });
        for (p, &len) in LENS.iter().enumerate() {
            assert_eq!(
                ddp.grad::<f32>(p).unwrap(),
                avg_grad(2, 0, p, len).as_slice()
            );
        }
        Ok(())
    });
}

/// The default all-reduce under another name, with one setting: a user hook whose settings
/// DDP compares between the ranks.
struct Tagged(u64);

impl CommHook for Tagged {
    fn name(&self) -> &str {
        "tagged"
    }

    fn start(&mut self, comm: &Communicator, bucket: GradBucket) -> HookWork {
        oxccl_ddp::AllReduceAvg.start(comm, bucket)
    }

    fn settings(&self) -> Vec<(&'static str, u64)> {
        vec![("k", self.0)]
    }
}

/// One step of `LENS`' gradients of `step`, through `grad_ready` (`via_sync` false) or `sync`.
fn one_step<C: std::borrow::Borrow<Communicator>>(
    ddp: &mut Ddp<C>,
    step: usize,
    via_sync: bool,
) -> oxccl_ddp::Result<Step> {
    let rank = ddp.comm().rank();
    if via_sync {
        let mut grads: Vec<Vec<f32>> = (0..LENS.len())
            .map(|p| grad(rank, step, p, LENS[p]))
            .collect();
        let s = ddp.sync(&mut grads)?;
        for (p, g) in grads.iter().enumerate() {
            assert_eq!(g, &avg_grad(2, step, p, LENS[p]), "rank {rank} param {p}");
        }
        return Ok(s);
    }
    for p in (0..LENS.len()).rev() {
        ddp.grad_ready(p, &grad(rank, step, p, LENS[p]))?;
    }
    ddp.finish()
}

#[test]
fn hooks_whose_settings_differ_between_ranks_fail_every_step_on_every_rank() {
    // Overlap per rank (it may differ between ranks): the comparison happens in grad_ready on
    // a rank with overlap, in finish() on one without.
    for (overlaps, via_sync) in [
        ([Overlap::On; 2], false),
        ([Overlap::Off; 2], false),
        ([Overlap::On, Overlap::Off], false),
        ([Overlap::On; 2], true),
    ] {
        on_ranks(2, |comm| {
            let rank = comm.rank();
            let op = if via_sync { "sync" } else { "finish" };
            let r = format!("rank {rank}: ddp {op}: hook ");
            let mut ddp = new_ddp(&comm, small(overlaps[rank])).unwrap();
            // Another hook on each rank (one would round to f16, the other to bf16).
            if rank == 0 {
                ddp.set_comm_hook(CompressHook::fp16()).unwrap();
            } else {
                ddp.set_comm_hook(CompressHook::bf16()).unwrap();
            }
            let name = ["fp16_compress", "bf16_compress"][rank];
            let msg = format!("the comm hook differs between ranks: this rank has {name}");
            // Refused before any bucket goes through it, in this step and the next.
            for step in 0..2 {
                expect_invalid(
                    one_step(&mut ddp, step, via_sync),
                    &[&r, "(given to set_comm_hook)", &msg],
                );
                // Nothing was averaged, so there is nothing to read.
                expect_invalid(ddp.grad::<f32>(0), &[&format!("rank {rank}: ddp grad")]);
            }
            // The same hook with another setting: the setting is named, with its range.
            ddp.set_comm_hook(Tagged(rank as u64)).unwrap();
            let msg = format!("k differs between ranks: {rank} here, from 0 to 1 across the ranks");
            expect_invalid(one_step(&mut ddp, 2, via_sync), &[&r, "tagged", &msg]);
            // Alike again: the step goes through and averages.
            ddp.set_comm_hook(Tagged(7)).unwrap();
            assert_eq!(
                one_step(&mut ddp, 3, via_sync).unwrap(),
                Step::Synced { step: 0 }
            );
            if !via_sync {
                assert_averaged(&ddp, 2, 3);
            }
            // The communicator is still in step.
            let mut x = [rank as u32 + 1];
            comm.all_reduce(&mut x, ReduceOp::Sum)?;
            assert_eq!(x, [3]);
            Ok(())
        });
    }
}

#[test]
fn a_custom_hook_on_one_rank_only_fails_instead_of_hanging() {
    // Rank 0 compares its hook's settings; rank 1's default hook has none to compare, so the
    // comparison meets rank 1's first bucket: the communicator sees two different calls.
    let cfg = Config {
        timeout: Duration::from_secs(20),
        ..Config::default()
    };
    let out = spawn_world(2, cfg, |comm| {
        let mut ddp = new_ddp(&comm, small(Overlap::On)).unwrap();
        if comm.rank() == 0 {
            ddp.set_comm_hook(Tagged(1)).unwrap();
        }
        Ok(one_step(&mut ddp, 0, false))
    });
    for (rank, r) in out.into_iter().enumerate() {
        match r {
            Ok(Err(DdpError::Comm(e))) => {
                let s = e.to_string();
                assert!(s.contains("collective mismatch"), "rank {rank}: {s}");
            }
            other => panic!("rank {rank}: expected a communicator error, got {other:?}"),
        }
    }
}
