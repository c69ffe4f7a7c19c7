//! Uneven inputs (`DdpConfig::uneven_inputs`, PyTorch's `Join`): ranks that run out of data
//! early stand in for the others' steps with `join_step` until every rank has joined. Threaded
//! ranks over shared memory, against a serial reference of which ranks trained in each step.

use oxccl_comm::harness::spawn_world;
use oxccl_comm::{Communicator, Config};
use oxccl_ddp::{CommHook, Ddp, DdpConfig, DdpError, Overlap, Param, Step, UnevenInputs};

/// Parameter lengths: one above the in-place threshold of `cfg` for `sync`, one empty.
const LENS: [usize; 6] = [300, 7, 2500, 0, 64, 33];

fn cfg(overlap: Overlap, uneven: UnevenInputs) -> DdpConfig {
    DdpConfig {
        bucket_cap_bytes: 4096,
        first_bucket_bytes: 512,
        sync_in_place_bytes: 4096,
        overlap,
        uneven_inputs: uneven,
        ..DdpConfig::default()
    }
}

/// Integer-valued gradient of parameter `p` on `rank` in (micro-)batch `batch`.
fn grad(rank: usize, batch: usize, p: usize) -> Vec<f32> {
    (0..LENS[p])
        .map(|i| ((rank * 7 + batch * 3 + p * 5 + i) % 17) as f32 + 1.0)
        .collect()
}

/// What every rank must read after step `step`: the sum over the ranks that still had data
/// (`batches[r] > step`) of their micro-batches' gradients, divided as `uneven` says.
fn expected(
    batches: &[usize],
    micro: usize,
    step: usize,
    p: usize,
    uneven: UnevenInputs,
) -> Vec<f32> {
    let active: Vec<usize> = (0..batches.len()).filter(|&r| batches[r] > step).collect();
    let mut sum = vec![0.0f64; LENS[p]];
    for &r in &active {
        for m in 0..micro {
            for (a, g) in sum.iter_mut().zip(grad(r, step * micro + m, p)) {
                *a += f64::from(g);
            }
        }
    }
    let div = match uneven {
        UnevenInputs::DivideByActiveRanks => active.len(),
        _ => batches.len(),
    };
    sum.iter().map(|s| (s / div as f64) as f32).collect()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
            "{what}: element {i} is {g}, expected {w}"
        );
    }
}

#[derive(Clone, Copy, Debug)]
enum Feed {
    /// `grad_ready` per parameter (last first, or in a rank-dependent order), then `finish()`.
    GradReady,
    /// `sync()` of every gradient.
    Sync,
}

/// Runs one epoch where rank `r` has `batches[r]` steps of `micro` micro-batches each, then
/// `join_step` until every rank has joined, then one more step on every rank; checks every
/// rank's gradients after every step, its own or stood in for.
fn epoch(batches: &[usize], micro: usize, feed: Feed, overlap: Overlap, uneven: UnevenInputs) {
    let n = batches.len();
    let last = batches.iter().copied().max().unwrap_or(0);
    let out = spawn_world(n, Config::default(), |comm: Communicator| {
        let rank = comm.rank();
        let mut store: Vec<Vec<f32>> = LENS.iter().map(|&l| vec![0.0; l]).collect();
        let mut params: Vec<Param> = store
            .iter_mut()
            .enumerate()
            .map(|(p, v)| Param::new(format!("w{p}"), v.as_mut_slice()))
            .collect();
        let mut ddp = Ddp::new(comm, &mut params, cfg(overlap, uneven)).unwrap();
        ddp.accumulate(micro).unwrap();
        let what = |step: usize, p: usize| {
            format!("{feed:?} {overlap:?} {uneven:?} rank {rank} step {step} param {p}")
        };
        let active = |step: usize| (0..n).filter(|&r| batches[r] > step).count();
        for step in 0..batches[rank] {
            for m in 0..micro {
                let batch = step * micro + m;
                let s = match feed {
                    Feed::GradReady => {
                        // Odd ranks hand gradients over in another order than even ones.
                        let order: Vec<usize> = if rank.is_multiple_of(2) {
                            (0..LENS.len()).rev().collect()
                        } else {
                            (0..LENS.len()).collect()
                        };
                        for p in order {
                            ddp.grad_ready(p, &grad(rank, batch, p)).unwrap();
                        }
                        ddp.finish().unwrap()
                    }
                    Feed::Sync => {
                        let mut grads: Vec<Vec<f32>> =
                            (0..LENS.len()).map(|p| grad(rank, batch, p)).collect();
                        let s = ddp.sync(&mut grads).unwrap();
                        if m + 1 == micro {
                            for (p, g) in grads.iter().enumerate() {
                                assert_close(
                                    g,
                                    &expected(batches, micro, step, p, uneven),
                                    &what(step, p),
                                );
                            }
                        }
                        s
                    }
                };
                if m + 1 < micro {
                    assert_eq!(s, Step::Accumulated { micro_batch: m });
                    continue;
                }
                assert_eq!(s, Step::Synced { step: step as u64 }, "{}", what(step, 0));
                assert_eq!(ddp.active_ranks(), active(step), "{}", what(step, 0));
                if let Feed::GradReady = feed {
                    for p in 0..LENS.len() {
                        let want = expected(batches, micro, step, p, uneven);
                        assert_close(ddp.grad::<f32>(p).unwrap(), &want, &what(step, p));
                    }
                }
            }
        }
        // Out of data: stand in for the others' steps.
        let mut step = batches[rank];
        while let Some(s) = ddp.join_step().unwrap() {
            assert_eq!(s, Step::Synced { step: step as u64 }, "{}", what(step, 0));
            assert_eq!(ddp.active_ranks(), active(step), "{}", what(step, 0));
            for p in 0..LENS.len() {
                let want = expected(batches, micro, step, p, uneven);
                assert_close(ddp.grad::<f32>(p).unwrap(), &want, &what(step, p));
            }
            step += 1;
        }
        assert_eq!(
            step, last,
            "rank {rank} stood in until the last rank joined"
        );
        assert_eq!(ddp.active_ranks(), 0);
        // A next epoch: every rank trains again, and every rank counts.
        let all = vec![last + 1; n];
        for m in 0..micro {
            for p in (0..LENS.len()).rev() {
                ddp.grad_ready(p, &grad(rank, last * micro + m, p)).unwrap();
            }
            ddp.finish().unwrap();
        }
        assert_eq!(ddp.active_ranks(), n);
        for p in 0..LENS.len() {
            let want = expected(&all, micro, last, p, uneven);
            assert_close(ddp.grad::<f32>(p).unwrap(), &want, &what(last, p));
        }
        Ok(())
    });
    for (rank, r) in out.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}

#[test]
fn ranks_out_of_data_stand_in_with_grad_ready_until_every_rank_joins() {
    for overlap in [Overlap::On, Overlap::Off] {
        for uneven in [
            UnevenInputs::DivideByWorldSize,
            UnevenInputs::DivideByActiveRanks,
        ] {
            epoch(&[3, 5, 1, 5], 1, Feed::GradReady, overlap, uneven);
        }
    }
}

#[test]
fn ranks_out_of_data_stand_in_with_sync_until_every_rank_joins() {
    for uneven in [
        UnevenInputs::DivideByWorldSize,
        UnevenInputs::DivideByActiveRanks,
    ] {
        epoch(&[3, 5, 1, 5], 1, Feed::Sync, Overlap::On, uneven);
    }
}

#[test]
fn rank_0_without_data_still_agrees_on_the_rebuilt_buckets() {
    // Rank 0 joins before the first step, so the order broadcast after it is rank 0's default.
    epoch(
        &[0, 3, 2, 1],
        1,
        Feed::GradReady,
        Overlap::On,
        UnevenInputs::DivideByActiveRanks,
    );
    epoch(
        &[0, 2, 1],
        1,
        Feed::Sync,
        Overlap::Off,
        UnevenInputs::DivideByWorldSize,
    );
}

#[test]
fn joined_ranks_stand_in_for_the_last_micro_batch_of_accumulated_steps() {
    epoch(
        &[2, 3, 1],
        2,
        Feed::GradReady,
        Overlap::On,
        UnevenInputs::DivideByWorldSize,
    );
    epoch(
        &[2, 1, 3],
        3,
        Feed::Sync,
        Overlap::Off,
        UnevenInputs::DivideByActiveRanks,
    );
}

/// A user hook that counts the buckets it is given (to see that `join_step` goes through it).
struct Counting(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl CommHook for Counting {
    fn name(&self) -> &str {
        "counting"
    }
    fn start(&mut self, comm: &Communicator, bucket: oxccl_ddp::GradBucket) -> oxccl_ddp::HookWork {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        oxccl_ddp::AllReduceAvg.start(comm, bucket)
    }
}

#[test]
fn join_step_goes_through_the_comm_hook_and_bad_calls_are_named() {
    let out = spawn_world(3, Config::default(), |comm: Communicator| {
        let rank = comm.rank();
        let r = format!("rank {rank}");
        let mut w: Vec<Vec<f32>> = LENS.iter().map(|&l| vec![0.0; l]).collect();
        let mut params: Vec<Param> = w
            .iter_mut()
            .enumerate()
            .map(|(p, v)| Param::new(format!("w{p}"), v.as_mut_slice()))
            .collect();
        // Off: join_step is refused before any collective, on every rank alike.
        let comm = std::sync::Arc::new(comm);
        let mut off = Ddp::new(
            std::sync::Arc::clone(&comm),
            &mut params,
            cfg(Overlap::On, UnevenInputs::Off),
        )
        .unwrap();
        let e = off.join_step().unwrap_err().to_string();
        assert!(
            e.contains(&r) && e.contains("join_step") && e.contains("uneven_inputs"),
            "{e}"
        );
        drop(off);
        // A setting that differs between ranks is caught at new().
        let mixed = if rank == 1 {
            UnevenInputs::Off
        } else {
            UnevenInputs::DivideByWorldSize
        };
        match Ddp::new(
            std::sync::Arc::clone(&comm),
            &mut params,
            cfg(Overlap::On, mixed),
        ) {
            Err(e @ DdpError::InvalidArgument { .. }) => {
                assert!(e.to_string().contains("differs between ranks"), "{e}")
            }
            other => panic!(
                "rank {rank}: expected a mismatch, got {:?}",
                other.map(|_| ())
            ),
        }
        let mut ddp = Ddp::new(
            comm,
            &mut params,
            cfg(Overlap::On, UnevenInputs::DivideByWorldSize),
        )
        .unwrap();
        let buckets0 = ddp.bucket_params().len();
        let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        ddp.set_comm_hook(Counting(std::sync::Arc::clone(&count)))
            .unwrap();
        // In the middle of a micro-batch join_step is refused (locally, nothing issued).
        ddp.grad_ready(1, &grad(rank, 0, 1)).unwrap();
        let e = ddp.join_step().unwrap_err().to_string();
        assert!(e.contains(&r) && e.contains("middle of step 0"), "{e}");
        for p in (0..LENS.len()).filter(|&p| p != 1) {
            ddp.grad_ready(p, &grad(rank, 0, p)).unwrap();
        }
        ddp.finish().unwrap();
        // Rank 2 has no second batch: it stands in through the same hook.
        if rank < 2 {
            for p in (0..LENS.len()).rev() {
                ddp.grad_ready(p, &grad(rank, 1, p)).unwrap();
            }
            ddp.finish().unwrap();
        } else {
            assert_eq!(ddp.join_step().unwrap(), Some(Step::Synced { step: 1 }));
        }
        assert_eq!(ddp.active_ranks(), 2);
        let want = expected(&[2, 2, 1], 1, 1, 5, UnevenInputs::DivideByWorldSize);
        assert_close(ddp.grad::<f32>(5).unwrap(), &want, &r);
        assert_eq!(ddp.join_step().unwrap(), None);
        // Step 1 runs on the buckets rebuilt after step 0.
        let buckets1 = ddp.bucket_params().len();
        assert_eq!(
            count.load(std::sync::atomic::Ordering::Relaxed),
            buckets0 + buckets1,
            "{r}"
        );
        Ok(())
    });
    for (rank, r) in out.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}

#[test]
fn a_ddp_with_a_flag_in_flight_can_move_to_another_thread() {
    fn send<T: Send>(_: &T) {}
    let out = spawn_world(1, Config::default(), |comm: Communicator| {
        let mut w = vec![0.0f32; 3];
        let cfg = cfg(Overlap::On, UnevenInputs::DivideByWorldSize);
        let mut ddp = Ddp::new(comm, &mut [Param::new("w", &mut w)], cfg).unwrap();
        ddp.grad_ready(0, &[1.0f32, 2.0, 3.0]).unwrap();
        send(&ddp);
        let mut ddp = std::thread::spawn(move || ddp).join().unwrap();
        ddp.finish().unwrap();
        assert_eq!(ddp.grad::<f32>(0).unwrap(), &[1.0, 2.0, 3.0]);
        assert_eq!(ddp.join_step().unwrap(), None);
        Ok(())
    });
    for r in out {
        r.unwrap();
    }
}
