//! Uneven inputs (`DdpConfig::uneven_inputs`, PyTorch's `Join`): ranks that run out of data
//! early stand in for the others' steps with `join_step` until every rank has joined. Threaded
//! ranks over shared memory, against a serial reference of which ranks trained in each step.

use oxccl_comm::harness::spawn_world;
use oxccl_comm::{Communicator, Config, ReduceOp};
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

#[derive(Clone, Copy, Debug, PartialEq)]
enum Feed {
    /// `grad_ready` per parameter, in a rank-dependent order, then `finish()`.
    GradReady,
    /// `sync()` of every gradient (large ones in place, small ones packed).
    Sync,
    /// `sync()` with a comm hook set on every rank: every gradient through the buckets.
    SyncHooked,
}

/// How the micro-batches before a step's last one are kept from reducing.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Micro {
    /// `Ddp::accumulate(k)`.
    Accumulate,
    /// A `no_sync` guard around each of them.
    NoSync,
}

/// The order in which `rank` hands over its gradients: a rotation of the forward order, so no
/// rank's is the default (reverse) one and the rebuilt buckets depend on whose order is used.
fn ready_order(rank: usize) -> Vec<usize> {
    let n = LENS.len();
    (0..n).map(|i| (i + 2 * rank + 1) % n).collect()
}

/// Hash of a bucket layout, for comparing ranks'.
fn layout_hash(buckets: &[Vec<usize>]) -> u64 {
    buckets
        .iter()
        .flatten()
        .chain(buckets.iter().map(Vec::len).collect::<Vec<_>>().iter())
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &p| {
            (h ^ p as u64).wrapping_mul(0x0100_0000_01b3)
        })
}

/// A `Ddp` over parameters of the lengths in `LENS`, with the communicator held as `C`.
fn new_ddp<C: std::borrow::Borrow<Communicator>>(
    comm: C,
    cfg: DdpConfig,
) -> oxccl_ddp::Result<Ddp<C>> {
    let mut store: Vec<Vec<f32>> = LENS.iter().map(|&l| vec![0.0; l]).collect();
    let mut params: Vec<Param> = store
        .iter_mut()
        .enumerate()
        .map(|(p, v)| Param::new(format!("w{p}"), v.as_mut_slice()))
        .collect();
    Ddp::new(comm, &mut params, cfg)
}

/// Runs `f` on `n` threaded ranks and fails the test if any rank fails.
fn on_ranks(n: usize, f: impl Fn(Communicator) -> oxccl_comm::Result<()> + Sync) {
    for (rank, r) in spawn_world(n, Config::default(), f).into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}

/// Runs `f` on `ddp`, under a `no_sync` guard when `guard`.
fn with_guard<R>(ddp: &mut Ddp, guard: bool, f: impl FnOnce(&mut Ddp) -> R) -> R {
    if guard {
        let mut g = ddp.no_sync();
        f(&mut g)
    } else {
        f(ddp)
    }
}

/// Runs one epoch where rank `r` has `batches[r]` steps of `micro` micro-batches each, then
/// `join_step` until every rank has joined, then one more step on every rank; checks every
/// rank's gradients after every step, its own or stood in for, and that every rank ends with
/// the same rebuilt bucket layout, built from the order of the lowest rank that trained in
/// step 0.
fn epoch(batches: &[usize], micro: usize, feed: Feed, overlap: Overlap, uneven: UnevenInputs) {
    epoch_with(batches, micro, Micro::Accumulate, feed, overlap, uneven);
}

fn epoch_with(
    batches: &[usize],
    micro: usize,
    how: Micro,
    feed: Feed,
    overlap: Overlap,
    uneven: UnevenInputs,
) {
    let n = batches.len();
    let last = batches.iter().copied().max().unwrap_or(0);
    let lead = (0..n).find(|&r| batches[r] > 0).unwrap_or(0);
    on_ranks(n, |comm: Communicator| {
        let rank = comm.rank();
        let mut ddp = new_ddp(comm, cfg(overlap, uneven)).unwrap();
        let initial = ddp.bucket_params();
        if how == Micro::Accumulate {
            ddp.accumulate(micro).unwrap();
        }
        if feed == Feed::SyncHooked {
            ddp.set_comm_hook(Counting(Default::default())).unwrap();
        }
        let what = |step: usize, p: usize| {
            format!("{feed:?} {how:?} {overlap:?} {uneven:?} rank {rank} step {step} param {p}")
        };
        let active = |step: usize| (0..n).filter(|&r| batches[r] > step).count();
        for step in 0..batches[rank] {
            for m in 0..micro {
                let batch = step * micro + m;
                let guard = how == Micro::NoSync && m + 1 < micro;
                let s = with_guard(&mut ddp, guard, |ddp| {
                    if feed == Feed::GradReady {
                        for p in ready_order(rank) {
                            ddp.grad_ready(p, &grad(rank, batch, p)).unwrap();
                        }
                        ddp.finish().unwrap()
                    } else {
                        let mut grads: Vec<Vec<f32>> =
                            (0..LENS.len()).map(|p| grad(rank, batch, p)).collect();
                        let s = ddp.sync(&mut grads).unwrap();
                        if m + 1 == micro {
                            for (p, g) in grads.iter().enumerate() {
                                let want = expected(batches, micro, step, p, uneven);
                                assert_close(g, &want, &what(step, p));
                            }
                        }
                        s
                    }
                });
                if m + 1 < micro {
                    assert_eq!(s, Step::Accumulated { micro_batch: m });
                    continue;
                }
                assert_eq!(s, Step::Synced { step: step as u64 }, "{}", what(step, 0));
                assert_eq!(ddp.active_ranks(), active(step), "{}", what(step, 0));
                if feed != Feed::Sync {
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
            with_guard(&mut ddp, how == Micro::NoSync && m + 1 < micro, |ddp| {
                for p in (0..LENS.len()).rev() {
                    ddp.grad_ready(p, &grad(rank, last * micro + m, p)).unwrap();
                }
                ddp.finish().unwrap()
            });
        }
        assert_eq!(ddp.active_ranks(), n);
        for p in 0..LENS.len() {
            let want = expected(&all, micro, last, p, uneven);
            assert_close(ddp.grad::<f32>(p).unwrap(), &want, &what(last, p));
        }
        // One layout everywhere, rebuilt from the order of the lowest rank that trained in
        // step 0: with `grad_ready` its ready order (one dtype: the buckets keep the order),
        // with `sync` the bucket order it fed (the initial one).
        let layout = ddp.bucket_params();
        let h = layout_hash(&layout);
        let mut v = [h, !h];
        ddp.comm().all_reduce(&mut v, ReduceOp::Max).unwrap();
        assert_eq!(
            v,
            [h, !h],
            "rank {rank}: bucket layouts differ between ranks"
        );
        let want = if feed == Feed::GradReady {
            ready_order(lead)
        } else {
            initial.concat()
        };
        assert_eq!(
            layout.concat(),
            want,
            "rank {rank}: rebuilt from rank {lead}'s order"
        );
        Ok(())
    });
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
        epoch(&[3, 5, 1, 5], 1, Feed::SyncHooked, Overlap::Off, uneven);
    }
}

#[test]
fn rank_0_without_data_leaves_the_rebuilt_order_to_the_lowest_rank_training() {
    // Rank 0 joins before the first step: rank 1's order is broadcast after it.
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
    epoch_with(
        &[2, 3, 1],
        2,
        Micro::NoSync,
        Feed::SyncHooked,
        Overlap::On,
        UnevenInputs::DivideByActiveRanks,
    );
    epoch_with(
        &[1, 3, 2],
        2,
        Micro::NoSync,
        Feed::GradReady,
        Overlap::Off,
        UnevenInputs::DivideByWorldSize,
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
    on_ranks(3, |comm: Communicator| {
        let rank = comm.rank();
        let r = format!("rank {rank}");
        // Off: join_step is refused before any collective, on every rank alike.
        let comm = std::sync::Arc::new(comm);
        let mut off = new_ddp(
            std::sync::Arc::clone(&comm),
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
        match new_ddp(std::sync::Arc::clone(&comm), cfg(Overlap::On, mixed)) {
            Err(e @ DdpError::InvalidArgument { .. }) => {
                assert!(e.to_string().contains("differs between ranks"), "{e}")
            }
            other => panic!(
                "rank {rank}: expected a mismatch, got {:?}",
                other.map(|_| ())
            ),
        }
        let mut ddp = new_ddp(comm, cfg(Overlap::On, UnevenInputs::DivideByWorldSize)).unwrap();
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
}

#[test]
fn a_ddp_with_a_flag_in_flight_can_move_to_another_thread() {
    fn send<T: Send>(_: &T) {}
    on_ranks(1, |comm: Communicator| {
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
}

/// One step on 3 ranks fed both ways: rank 0 through `sync`, rank 1 through `grad_ready`, rank
/// 2 joined. Every rank must get the error naming it, under its own call.
fn mixed_step<C: std::borrow::Borrow<Communicator>>(ddp: &mut Ddp<C>, rank: usize) {
    let e = match rank {
        0 => {
            let mut grads: Vec<Vec<f32>> = (0..LENS.len()).map(|p| grad(rank, 0, p)).collect();
            ddp.sync(&mut grads).map(|_| ())
        }
        1 => {
            for p in (0..LENS.len()).rev() {
                ddp.grad_ready(p, &grad(rank, 0, p)).unwrap();
            }
            ddp.finish().map(|_| ())
        }
        _ => ddp.join_step().map(|_| ()),
    }
    .unwrap_err()
    .to_string();
    let op = ["sync", "finish", "join_step"][rank];
    assert!(
        e.contains(&format!("rank {rank}"))
            && e.contains(op)
            && e.contains("1 feed it through sync()"),
        "{e}"
    );
}

#[test]
fn mixed_feeds_are_named_on_every_rank_and_buffers_come_from_a_rank_still_training() {
    on_ranks(3, |comm: Communicator| {
        let rank = comm.rank();
        let r = format!("rank {rank}");
        let comm = std::sync::Arc::new(comm);
        // Integer parameters cannot be scaled by world / active ranks: refused at new().
        let mut ints = vec![0u8; 4];
        let cfg_active = cfg(Overlap::On, UnevenInputs::DivideByActiveRanks);
        let e = Ddp::new(
            std::sync::Arc::clone(&comm),
            &mut [Param::new("counts", &mut ints)],
            cfg_active,
        )
        .map(|_| ())
        .unwrap_err()
        .to_string();
        assert!(
            e.contains(&r) && e.contains("counts (u8)") && e.contains("DivideByWorldSize"),
            "{e}"
        );
        let mut ddp = new_ddp(
            std::sync::Arc::clone(&comm),
            cfg(Overlap::On, UnevenInputs::DivideByWorldSize),
        )
        .unwrap();
        // With a hook `sync` issues what `grad_ready` does, so ranks that mix them stay in step;
        // the flag still tells, and every rank names it.
        let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        ddp.set_comm_hook(Counting(count)).unwrap();
        let grads = |batch: usize| -> Vec<Vec<f32>> {
            (0..LENS.len()).map(|p| grad(rank, batch, p)).collect()
        };
        mixed_step(&mut ddp, rank);
        // Still in step: every rank feeds the next one alike.
        for p in (0..LENS.len()).rev() {
            ddp.grad_ready(p, &grad(rank, 1, p)).unwrap();
        }
        assert_eq!(ddp.finish().unwrap(), Step::Synced { step: 0 });
        // With the default hook `sync` would reduce large gradients in place: seeing the mixed
        // flag, it takes the bucket path the others take, and the ranks stay in step too.
        let mut plain = new_ddp(
            std::sync::Arc::clone(&comm),
            cfg(Overlap::Off, UnevenInputs::DivideByActiveRanks),
        )
        .unwrap();
        for _ in 0..2 {
            mixed_step(&mut plain, rank);
        }
        let mut g = grads(3);
        assert_eq!(plain.sync(&mut g).unwrap(), Step::Synced { step: 0 });
        for (p, g) in g.iter().enumerate() {
            let want = expected(&[4, 4, 4], 1, 3, p, UnevenInputs::DivideByActiveRanks);
            assert_close(g, &want, &r);
        }
        drop(plain);
        // Rank 0 runs out: buffers come from rank 1, the lowest rank still training, and stay
        // so after everyone joined.
        for round in 0..2 {
            let mut buffers = vec![vec![rank as f32 + 10.0 * round as f32; 3]];
            if rank == 0 && round == 0 {
                assert!(ddp.join_step().unwrap().is_some());
            } else if round == 0 {
                ddp.sync(&mut grads(2)).unwrap();
            } else {
                assert_eq!(ddp.join_step().unwrap(), None);
            }
            ddp.broadcast_buffers(&mut buffers).unwrap();
            assert_eq!(
                buffers[0],
                vec![1.0 + 10.0 * round as f32; 3],
                "{r} round {round}"
            );
        }
        Ok(())
    });
}

#[test]
fn a_joined_rank_uses_no_parameter() {
    // find_unused_parameters with 3 ranks; rank 2 joins after step 0. In step 1 parameter 1 gets
    // a gradient on rank 1 only and parameter 4 on none of the trainers: only 4 is unused on
    // every rank, on the joined rank too (it stands in with no parameter used).
    on_ranks(3, |comm| {
        let rank = comm.rank();
        let cfg = DdpConfig {
            find_unused_parameters: true,
            ..cfg(Overlap::On, UnevenInputs::DivideByWorldSize)
        };
        let mut ddp = new_ddp(comm, cfg).unwrap();
        for p in 0..LENS.len() {
            ddp.grad_ready(p, &grad(rank, 0, p)).unwrap();
        }
        ddp.finish().unwrap();
        assert_eq!(ddp.unused_on_every_rank(), &[] as &[usize], "rank {rank}");
        if rank == 2 {
            assert!(ddp.join_step().unwrap().is_some());
        } else {
            for p in (0..LENS.len()).filter(|&p| p != 4 && (p, rank) != (1, 0)) {
                ddp.grad_ready(p, &grad(rank, 1, p)).unwrap();
            }
            ddp.finish().unwrap();
        }
        assert_eq!(ddp.unused_on_every_rank(), &[4], "rank {rank}");
        // Everyone out: the training ranks join too.
        while ddp.join_step().unwrap().is_some() {}
        Ok(())
    });
}

/// The default all-reduce with one setting, which DDP compares between the ranks.
struct Keyed(u64);

impl CommHook for Keyed {
    fn name(&self) -> &str {
        "keyed"
    }
    fn start(&mut self, comm: &Communicator, bucket: oxccl_ddp::GradBucket) -> oxccl_ddp::HookWork {
        oxccl_ddp::AllReduceAvg.start(comm, bucket)
    }
    fn settings(&self) -> Vec<(&'static str, u64)> {
        vec![("k", self.0)]
    }
}

#[test]
fn a_hook_whose_settings_differ_is_refused_in_join_step_too() {
    on_ranks(3, |comm: Communicator| {
        let rank = comm.rank();
        let mut ddp = new_ddp(&comm, cfg(Overlap::On, UnevenInputs::DivideByWorldSize)).unwrap();
        // Ranks 0 and 1 train, rank 2 has no data and stands in.
        let step = |ddp: &mut Ddp<&Communicator>, batch: usize| {
            if rank == 2 {
                return ddp.join_step();
            }
            for p in (0..LENS.len()).rev() {
                ddp.grad_ready(p, &grad(rank, batch, p))?;
            }
            ddp.finish().map(Some)
        };
        ddp.set_comm_hook(Keyed(u64::from(rank == 2))).unwrap();
        match step(&mut ddp, 0) {
            Err(DdpError::InvalidArgument { rank: r, op, msg }) => {
                let call = if rank == 2 { "join_step" } else { "finish" };
                assert_eq!((r, op), (rank, call));
                let what = format!("k differs between ranks: {} here", u64::from(rank == 2));
                assert!(msg.contains("keyed") && msg.contains(&what), "{msg}");
            }
            other => panic!("rank {rank}: accepted: {other:?}"),
        }
        // Alike: the stand-in step goes through, then every rank joins.
        ddp.set_comm_hook(Keyed(5)).unwrap();
        assert_eq!(step(&mut ddp, 1).unwrap(), Some(Step::Synced { step: 0 }));
        assert_eq!(ddp.active_ranks(), 2);
        assert_eq!(ddp.join_step().unwrap(), None);
        let mut x = [1u32];
        comm.all_reduce(&mut x, ReduceOp::Sum)?;
        assert_eq!(x, [3]);
        Ok(())
    });
}
