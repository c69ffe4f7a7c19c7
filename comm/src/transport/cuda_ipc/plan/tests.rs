//! The plans run on a host model of the GPU: every rank a thread, its scratch a host
//! allocation the other threads read through raw addresses, as kernels read IPC mappings,
//! and the barrier the same flag protocol as the CUDA kernel (`oxccl_ipc_barrier`), with
//! atomics. Ranks run concurrently and unsynchronised except by those barriers, so a plan
//! that read a slot before its writer passed the barrier, or reused a slot too early, would
//! give wrong results here.

use super::layout::shard;
use super::*;
use proptest::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One rank's view of the model GPU.
struct Model<'a> {
    rank: usize,
    size: usize,
    dt: DType,
    op: ReduceOp,
    scratch: &'a [u64],
    error: &'a AtomicU32,
    timeout: Duration,
}

impl Model<'_> {
    fn flag(&self, owner: usize, index: usize) -> &AtomicU64 {
        let addr = self.scratch[owner] as usize + index * 8;
        // SAFETY: every scratch allocation starts with FLAGS_BYTES of u64-aligned flags that
        // live as long as the test's world; they are accessed only atomically.
        unsafe { AtomicU64::from_ptr(addr as *mut u64) }
    }
}

impl Exec for Model<'_> {
    type Error = u32;
    fn copy(&mut self, dst: u64, src: u64, len: usize) -> Result<(), u32> {
        // SAFETY: both are live ranges of this world's buffers; the plan keeps writers and
        // readers apart with barriers (which is what these tests check).
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
        Ok(())
    }
    fn reduce(&mut self, dst: u64, inputs: &[u64], len: usize) -> Result<(), u32> {
        // SAFETY: as for `copy`.
        let read = |a: u64| unsafe { std::slice::from_raw_parts(a as *const u8, len) }.to_vec();
        let mut acc = read(inputs[0]);
        for &i in &inputs[1..] {
            oxccl_kernels::reduce_bytes(self.dt, self.op, &mut acc, &read(i)).unwrap();
        }
        self.copy(dst, acc.as_ptr() as u64, len)
    }
    fn avg(&mut self, dst: u64, len: usize) -> Result<(), u32> {
        // SAFETY: as for `copy`; only this rank touches its averaged range here.
        let d = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
        oxccl_kernels::finish_avg_bytes(self.dt, d, self.size).unwrap();
        Ok(())
    }
    fn barrier(&mut self, epoch: u32, sig: u32) -> Result<(), u32> {
        let this = &*self;
        let at = HostBarrier {
            rank: this.rank,
            size: this.size,
            error: this.error,
            deadline: Instant::now() + this.timeout,
            abort: None,
        };
        at.wait(
            |owner, i| this.flag(owner, i),
            epoch,
            sig,
            std::thread::yield_now,
        )
    }
}

/// Flags of `n` ranks in host memory, as `ThreadSync` keeps them.
fn host_flags(n: usize) -> Vec<Vec<AtomicU64>> {
    (0..n)
        .map(|_| (0..2 * MAX_RANKS).map(|_| AtomicU64::new(0)).collect())
        .collect()
}

#[test]
fn cuda_ipc_host_barrier_gives_up_on_abort_and_its_peers_follow() {
    let flags = host_flags(2);
    let errors = [AtomicU32::new(0), AtomicU32::new(0)];
    let abort = AtomicBool::new(false);
    let flag = |q: usize, i: usize| &flags[q][i];
    let at = |rank: usize, abort: Option<&'static AtomicBool>| HostBarrier {
        rank,
        size: 2,
        error: &errors[rank],
        deadline: Instant::now() + Duration::from_secs(30),
        abort,
    };
    // Rank 0 never comes: rank 1 waits until its abort flag is set, not for 30 s.
    let started = Instant::now();
    let r = std::thread::scope(|sc| {
        let h = sc.spawn(|| {
            let at1 = HostBarrier {
                abort: Some(&abort),
                ..at(1, None)
            };
            at1.wait(flag, 1, 7, std::thread::yield_now)
        });
        std::thread::sleep(Duration::from_millis(50));
        abort.store(true, Ordering::Relaxed);
        h.join().unwrap()
    });
    let by_1 = Err(ERR_ABORTED | 1 << 8);
    assert_eq!(r, by_1);
    assert!(started.elapsed() < Duration::from_secs(20));
    // Rank 0, arriving late at the same barrier, finds rank 1's poison and names it.
    assert_eq!(at(0, None).wait(flag, 1, 7, std::thread::yield_now), by_1);
    // Rank 1's later barriers fail at once with its first code.
    assert_eq!(at(1, None).wait(flag, 2, 7, std::thread::yield_now), by_1);
}

#[test]
fn cuda_ipc_host_barrier_poisoned_after_passing_stops_the_peer_at_the_next_one() {
    // A CUDA call failing after rank 1 passed barrier 1 (its stream wait on a peer's event):
    // rank 0 must fail at barrier 2 naming rank 1 instead of waiting for its time-out.
    let flags = host_flags(2);
    let errors = [AtomicU32::new(0), AtomicU32::new(0)];
    let flag = |q: usize, i: usize| &flags[q][i];
    let at = |rank: usize| HostBarrier {
        rank,
        size: 2,
        error: &errors[rank],
        deadline: Instant::now() + Duration::from_secs(30),
        abort: None,
    };
    std::thread::scope(|sc| {
        let h = sc.spawn(|| at(1).wait(flag, 1, 7, std::thread::yield_now));
        assert_eq!(at(0).wait(flag, 1, 7, std::thread::yield_now), Ok(()));
        assert_eq!(h.join().unwrap(), Ok(()));
    });
    let code = ERR_ABORTED | 1 << 8;
    at(1).poison(&flag, 1, code);
    let started = Instant::now();
    assert_eq!(at(0).wait(flag, 2, 7, std::thread::yield_now), Err(code));
    assert!(started.elapsed() < Duration::from_secs(20));
    assert_eq!(errors[1].load(Ordering::Relaxed), code);
}

/// A call of one rank: the operation, its input and its output length (elements).
#[derive(Clone)]
struct Call {
    kind: Kind,
    count: usize,
    input: Vec<i32>,
    out_len: usize,
    in_place: bool,
    /// Sleep before the call.
    delay: Duration,
}

/// Runs every rank's calls in order on the model; returns each rank's output of every call,
/// or the error word of its failed barrier.
fn run_world(
    size: usize,
    slot_bytes: usize,
    one_shot: usize,
    algo: Option<Algorithm>,
    calls: impl Fn(usize) -> Vec<Call> + Sync,
    timeout: impl Fn(usize) -> Duration + Sync,
) -> Vec<Vec<Result<Vec<i32>, u32>>> {
    let scratch: Vec<Vec<u64>> = (0..size)
        .map(|_| vec![0u64; (FLAGS_BYTES + 2 * slot_bytes).div_ceil(8)])
        .collect();
    let bases: Vec<u64> = scratch.iter().map(|s| s.as_ptr() as u64).collect();
    let errors: Vec<AtomicU32> = (0..size).map(|_| AtomicU32::new(0)).collect();
    let bases = Arc::new(bases);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                let (bases, errors, calls, timeout) =
                    (Arc::clone(&bases), &errors, &calls, &timeout);
                s.spawn(move || {
                    let mut cur = Cursor::default();
                    let mut outs = Vec::new();
                    for call in calls(rank) {
                        std::thread::sleep(call.delay);
                        let mut input = call.input.clone();
                        let mut out = if call.in_place {
                            Vec::new()
                        } else {
                            vec![-7i32; call.out_len]
                        };
                        let plan = ipc_plan(
                            call.kind,
                            DType::I32,
                            rank,
                            size,
                            call.count,
                            slot_bytes,
                            one_shot,
                            algo,
                        )
                        .expect("a collective");
                        let (input_addr, output_addr) = if call.in_place {
                            let p = input.as_mut_ptr() as u64;
                            (p, p)
                        } else {
                            (input.as_ptr() as u64, out.as_mut_ptr() as u64)
                        };
                        let b = Bases {
                            input: input_addr,
                            output: output_addr,
                            scratch: &bases,
                            slot_bytes,
                        };
                        let mut m = Model {
                            rank,
                            size,
                            dt: DType::I32,
                            op: call.kind.op(),
                            scratch: &bases,
                            error: &errors[rank],
                            timeout: timeout(rank),
                        };
                        let r = execute(&plan, &b, &mut cur, &mut m);
                        outs.push(r.map(|()| if call.in_place { input } else { out }));
                    }
                    outs
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn data(rank: usize, n: usize, salt: usize) -> Vec<i32> {
    (0..n)
        .map(|i| ((rank * 7919 + i * 31 + salt * 131) % 2001) as i32 - 1000)
        .collect()
}

/// The serial reference of one call, from every rank's input.
fn reference(kind: Kind, rank: usize, size: usize, count: usize, inputs: &[Vec<i32>]) -> Vec<i32> {
    let red = |op: ReduceOp, f: &dyn Fn(usize) -> usize, len: usize| -> Vec<i32> {
        (0..len)
            .map(|i| {
                let vals: Vec<i32> = (0..size).map(|q| inputs[q][f(i)]).collect();
                oxccl_kernels::reference_reduce(&vals, op)
            })
            .collect()
    };
    match kind {
        Kind::AllReduce(op) => red(op, &|i| i, count),
        Kind::Reduce { op, .. } => red(op, &|i| i, count),
        Kind::ReduceScatter(op) => red(op, &|i| rank * count + i, count),
        Kind::AllGather | Kind::Gather { .. } => inputs.concat(),
        Kind::Broadcast { root } => inputs[root].clone(),
        Kind::Scatter { root } => inputs[root][rank * count..(rank + 1) * count].to_vec(),
        Kind::AllToAll => (0..size)
            .flat_map(|q| inputs[q][rank * count..(rank + 1) * count].to_vec())
            .collect(),
        Kind::Send { .. } | Kind::Recv { .. } => unreachable!(),
    }
}

/// Input and output lengths of `kind` on `rank` (0 where the rank has no such buffer).
fn lengths(kind: Kind, rank: usize, size: usize, count: usize) -> (usize, usize) {
    match kind {
        Kind::AllReduce(_) | Kind::Broadcast { .. } => (count, count),
        Kind::Reduce { root, .. } => (count, if rank == root { count } else { 0 }),
        Kind::ReduceScatter(_) => (count * size, count),
        Kind::AllGather => (count, count * size),
        Kind::Gather { root } => (count, if rank == root { count * size } else { 0 }),
        Kind::Scatter { root } => (if rank == root { count * size } else { 0 }, count),
        Kind::AllToAll => (count * size, count * size),
        Kind::Send { .. } | Kind::Recv { .. } => unreachable!(),
    }
}

fn kinds(size: usize) -> Vec<Kind> {
    let last = size - 1;
    vec![
        Kind::AllReduce(ReduceOp::Sum),
        Kind::AllReduce(ReduceOp::Max),
        Kind::AllReduce(ReduceOp::Avg),
        Kind::ReduceScatter(ReduceOp::Sum),
        Kind::ReduceScatter(ReduceOp::Min),
        Kind::AllGather,
        Kind::Broadcast { root: last },
        Kind::Reduce {
            op: ReduceOp::Sum,
            root: last,
        },
        Kind::Reduce {
            op: ReduceOp::Prod,
            root: 0,
        },
        Kind::Gather { root: last },
        Kind::Scatter { root: 0 },
        Kind::AllToAll,
    ]
}

/// Every collective, back to back on one communicator, against the serial reference.
fn check_world(
    size: usize,
    counts: &[usize],
    slot_bytes: usize,
    one_shot: usize,
    algo: Option<Algorithm>,
) {
    let mut script: Vec<(Kind, usize, bool)> = Vec::new();
    for (salt, &count) in counts.iter().enumerate() {
        for kind in kinds(size) {
            let in_place_ok = matches!(kind, Kind::AllReduce(_) | Kind::Broadcast { .. });
            script.push((kind, count, in_place_ok && salt % 2 == 1));
        }
    }
    let input_of = |rank: usize, i: usize| {
        let (kind, count, _) = script[i];
        let (ni, _) = lengths(kind, rank, size, count);
        data(rank, ni, i)
    };
    let results = run_world(
        size,
        slot_bytes,
        one_shot,
        algo,
        |rank| {
            script
                .iter()
                .enumerate()
                .map(|(i, &(kind, count, in_place))| Call {
                    kind,
                    count,
                    input: input_of(rank, i),
                    out_len: lengths(kind, rank, size, count).1,
                    in_place,
                    delay: Duration::ZERO,
                })
                .collect()
        },
        |_| Duration::from_secs(20),
    );
    for (rank, outs) in results.into_iter().enumerate() {
        for (i, (&(kind, count, in_place), got)) in script.iter().zip(outs).enumerate() {
            let got = got.unwrap_or_else(|e| panic!("size {size} rank {rank}: error {e:#x}"));
            let (_, no) = lengths(kind, rank, size, count);
            if no == 0 {
                continue;
            }
            let inputs: Vec<Vec<i32>> = (0..size).map(|q| input_of(q, i)).collect();
            let full: Vec<Vec<i32>> = match kind {
                // Every rank's full input, for the reference (non-roots pass none).
                Kind::Broadcast { root } | Kind::Scatter { root } => (0..size)
                    .map(|q| {
                        if q == root {
                            inputs[q].clone()
                        } else {
                            Vec::new()
                        }
                    })
                    .collect(),
                _ => inputs,
            };
            let want = reference(kind, rank, size, count, &full);
            assert_eq!(
                got, want,
                "size {size} rank {rank} call {i} {kind:?} count {count} in_place {in_place} \
                 algo {algo:?}"
            );
        }
    }
}

#[test]
fn cuda_ipc_plans_compute_every_collective() {
    // Slots of 24 bytes: 6 i32, so most calls run in several chunks of both parities;
    // one-shot up to 16 bytes, two-shot above (with empty shards at 5 elements over 4+).
    for size in 2..=5 {
        check_world(size, &[1, 4, 5, 13, 40], 24 * size, 16, None);
    }
    // Larger slots, everything one-shot.
    check_world(3, &[0, 7, 300], 4096, 1 << 20, None);
    check_world(8, &[3, 100], 256, 64, None);
}

#[test]
fn cuda_ipc_ring_and_forced_shots_compute_every_collective() {
    // OXCCL_ALGO=ring: ring steps for all-reduce, reduce-scatter and all-gather (the rest
    // keep their plans, interleaved on the same communicator); slots of 2..=5 ranks' worth,
    // so blocks of one or two elements per half slot and many chunks, and odd slot sizes.
    for size in 2..=5 {
        check_world(
            size,
            &[1, 4, 5, 13, 40],
            8 * size,
            16,
            Some(Algorithm::Ring),
        );
        check_world(size, &[0, 3, 29], 4 * size + 4, 16, Some(Algorithm::Ring));
    }
    check_world(8, &[3, 100, 1000], 256, 64, Some(Algorithm::Ring));
    // Forced one-shot above the one-shot size, two-shot below it.
    check_world(3, &[1, 13, 40], 24, 16, Some(Algorithm::OneShot));
    check_world(4, &[1, 13, 40], 32, 1 << 20, Some(Algorithm::TwoShot));
    // A host-only algorithm leaves the default plans.
    check_world(3, &[1, 13, 40], 24, 16, Some(Algorithm::Tree));
}

#[test]
fn cuda_ipc_ring_plans_read_only_the_previous_rank() {
    for size in 2..=8 {
        for count in [1usize, 5, 9, 50] {
            for kind in [
                Kind::AllReduce(ReduceOp::Sum),
                Kind::ReduceScatter(ReduceOp::Sum),
                Kind::AllGather,
            ] {
                for rank in 0..size {
                    let p = ipc_plan(
                        kind,
                        DType::I32,
                        rank,
                        size,
                        count,
                        8 * size,
                        32,
                        Some(Algorithm::Ring),
                    )
                    .unwrap();
                    let prev = (rank + size - 1) % size;
                    let reads = p.chunks.iter().flatten().flat_map(|s| match s {
                        Step::Copy { src, .. } => vec![*src],
                        Step::Reduce { inputs, .. } => inputs.clone(),
                        _ => Vec::new(),
                    });
                    for l in reads {
                        if let Loc::Slot { rank: q, .. } = l {
                            assert!(q == prev || q == rank, "{kind:?} rank {rank} reads {q}");
                        }
                    }
                    // n - 1 barriers per phase.
                    let phases = if matches!(kind, Kind::AllReduce(_)) {
                        2
                    } else {
                        1
                    };
                    for c in &p.chunks {
                        let bars = c.iter().filter(|s| **s == Step::Barrier).count();
                        assert_eq!(bars, phases * (size - 1), "{kind:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn cuda_ipc_ranks_with_different_plans_for_one_call_are_a_mismatch() {
    // Rank 1 runs OXCCL_ALGO=ring, the others the default: same call, different layout.
    let sig = |algo| {
        ipc_plan(
            Kind::AllReduce(ReduceOp::Sum),
            DType::I32,
            0,
            3,
            40,
            64,
            16,
            algo,
        )
        .unwrap()
        .sig
    };
    assert_ne!(sig(Some(Algorithm::Ring)), sig(None));
    assert_ne!(sig(Some(Algorithm::OneShot)), sig(None));
    assert_eq!(
        sig(Some(Algorithm::TwoShot)),
        sig(None),
        "40 elements are two-shot anyway"
    );
    assert_eq!(sig(Some(Algorithm::Tree)), sig(None));
}

#[test]
fn cuda_ipc_two_shot_splits_shards_evenly_and_covers_everything() {
    for elems in 0..30 {
        for n in 1..=8 {
            let mut next = 0;
            for q in 0..n {
                let (s, l) = shard(elems, n, q);
                assert_eq!(s, next);
                assert!(l == elems / n || l == elems / n + 1);
                next += l;
            }
            assert_eq!(next, elems);
        }
    }
}

#[test]
fn cuda_ipc_plans_keep_to_their_slot_and_buffers() {
    // Every slot access of every plan lies inside the slot, and every rank writes only its
    // own slot and output (the invariant double buffering rests on).
    let slot = 96;
    for size in 2..=8 {
        for count in [1usize, 3, 8, 9, 50] {
            for kind in kinds(size) {
                for rank in 0..size {
                    for algo in [None, Some(Algorithm::Ring)] {
                        let p =
                            ipc_plan(kind, DType::I32, rank, size, count, slot, 32, algo).unwrap();
                        let ring = algo.is_some()
                            && matches!(
                                kind,
                                Kind::AllReduce(_) | Kind::ReduceScatter(_) | Kind::AllGather
                            );
                        let (ni, no) = lengths(kind, rank, size, count);
                        let check = |l: Loc, len: usize, write: bool| match l {
                            Loc::In(o) => assert!(!write && o + len <= ni * 4),
                            Loc::Out(o) => assert!(o + len <= no * 4, "{kind:?} {o}+{len}"),
                            Loc::Slot { rank: q, off } => {
                                assert!(off + len <= slot, "{kind:?} slot {off}+{len}");
                                assert!(!write || q == rank, "{kind:?} writes rank {q}'s slot");
                            }
                        };
                        for chunk in &p.chunks {
                            assert!(chunk.contains(&Step::Barrier));
                            for s in chunk {
                                match s {
                                    Step::Copy { dst, src, len } => {
                                        check(*src, *len, false);
                                        check(*dst, *len, true);
                                    }
                                    Step::Reduce { dst, inputs, len } => {
                                        assert!(inputs.len() == if ring { 2 } else { size });
                                        inputs.iter().for_each(|i| check(*i, *len, false));
                                        check(*dst, *len, true);
                                    }
                                    Step::Avg { dst, len } => check(*dst, *len, true),
                                    Step::Barrier => {}
                                }
                            }
                        }
                        // Every rank has the same number of barriers in every chunk.
                        let bars = |rank: usize| -> Vec<usize> {
                            ipc_plan(kind, DType::I32, rank, size, count, slot, 32, algo)
                                .unwrap()
                                .chunks
                                .iter()
                                .map(|c| c.iter().filter(|s| **s == Step::Barrier).count())
                                .collect()
                        };
                        assert_eq!(bars(rank), bars(0), "{kind:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn cuda_ipc_mismatched_calls_are_reported_with_the_peer() {
    // Rank 1 all-gathers 4 elements where the others all-reduce 4: the first barrier sees
    // a different signature, and every rank stops instead of hanging.
    let results = run_world(
        3,
        64,
        64,
        None,
        |rank| {
            let kind = if rank == 1 {
                Kind::AllGather
            } else {
                Kind::AllReduce(ReduceOp::Sum)
            };
            let (ni, no) = lengths(kind, rank, 3, 4);
            vec![Call {
                kind,
                count: 4,
                input: data(rank, ni, 0),
                out_len: no,
                in_place: false,
                delay: Duration::ZERO,
            }]
        },
        |_| Duration::from_secs(20),
    );
    let first = |r: &Vec<Result<Vec<i32>, u32>>| r[0].clone().expect_err("a failure");
    // Whoever saw it first reports the mismatch itself.
    assert!(results.iter().any(|r| first(r) & 0xff == ERR_MISMATCH));
    for (rank, r) in results.into_iter().enumerate() {
        let e = r[0].clone().expect_err("a mismatch");
        // A mismatch names a rank that called something else; otherwise the rank found the
        // poison of one that had already seen the mismatch.
        let peer = (e >> 8) as usize;
        match e & 0xff {
            ERR_MISMATCH if rank == 1 => assert_ne!(peer, 1),
            ERR_MISMATCH => assert_eq!(peer, 1, "rank {rank} names the odd rank"),
            ERR_ABORTED => assert_ne!(peer, rank),
            _ => panic!("rank {rank}: {e:#x}"),
        }
    }
    // Same operation, different lengths: also a mismatch.
    let results = run_world(
        2,
        64,
        64,
        None,
        |rank| {
            let count = 4 + rank;
            vec![Call {
                kind: Kind::AllReduce(ReduceOp::Sum),
                count,
                input: data(rank, count, 0),
                out_len: count,
                in_place: false,
                delay: Duration::ZERO,
            }]
        },
        |_| Duration::from_secs(20),
    );
    assert!(results.iter().any(|r| first(r) & 0xff == ERR_MISMATCH));
    for r in results {
        let e = r[0].clone().expect_err("a mismatch") & 0xff;
        assert!([ERR_MISMATCH, ERR_ABORTED].contains(&e), "{e:#x}");
    }
}

#[test]
fn cuda_ipc_missing_rank_times_out_naming_it() {
    // Rank 2 makes no call: the others time out at their first barrier, naming rank 2, and
    // their second call fails with the same error word.
    let results = run_world(
        3,
        64,
        64,
        None,
        |rank| {
            if rank == 2 {
                return Vec::new();
            }
            (0..2)
                .map(|i| Call {
                    kind: Kind::AllReduce(ReduceOp::Sum),
                    count: 4,
                    input: data(rank, 4, i),
                    out_len: 4,
                    in_place: false,
                    delay: Duration::ZERO,
                })
                .collect()
        },
        |_| Duration::from_millis(300),
    );
    // Rank 0 and 1 each time out on rank 2, or one of them first and the other then sees its
    // poison.
    for (rank, r) in results[..2].iter().enumerate() {
        assert_eq!(r.len(), 2);
        let first = r[0].clone().expect_err("a failure");
        let other = 1 - rank as u32;
        assert!(
            first == ERR_TIMEOUT | (2 << 8) || first == ERR_ABORTED | (other << 8),
            "rank {rank}: {first:#x}"
        );
        assert_eq!(
            r[1],
            Err(first),
            "rank {rank}: later calls fail with the same word"
        );
    }
    assert!(results[2].is_empty());
}

#[test]
fn cuda_ipc_a_rank_that_gives_up_makes_its_peers_fail_too() {
    // Rank 1 times out at once while rank 2 is late: rank 1 poisons its flags, so rank 0
    // (patient) and rank 2 (late) fail instead of reading its slot.
    let results = run_world(
        3,
        64,
        64,
        None,
        |rank| {
            vec![Call {
                kind: Kind::AllReduce(ReduceOp::Sum),
                count: 4,
                input: data(rank, 4, 0),
                out_len: 4,
                in_place: false,
                delay: Duration::from_millis(if rank == 2 { 300 } else { 0 }),
            }]
        },
        |rank| Duration::from_millis(if rank == 1 { 20 } else { 20_000 }),
    );
    assert_eq!(results[1][0], Err(ERR_TIMEOUT | (2 << 8)));
    // Rank 2 finds rank 1's poison. Rank 0 finds it too, or finds rank 2's; or it read both
    // peers' words before either gave up, and then every slot it reads holds this call's
    // data (a rank that gave up overwrites its slot only in a later chunk, behind a barrier
    // rank 0 has not passed), so its result must be the right one.
    assert_eq!(results[2][0], Err(ERR_ABORTED | (1 << 8)));
    match &results[0][0] {
        Err(e0) => assert!(
            *e0 == ERR_ABORTED | (1 << 8) || *e0 == ERR_ABORTED | (2 << 8),
            "{e0:#x}"
        ),
        Ok(got) => {
            let inputs: Vec<Vec<i32>> = (0..3).map(|q| data(q, 4, 0)).collect();
            let want = reference(Kind::AllReduce(ReduceOp::Sum), 0, 3, 4, &inputs);
            assert_eq!(
                got, &want,
                "rank 0 passed its barrier: its result must be right"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn cuda_ipc_plans_match_the_reference_for_any_shape(
        size in 2usize..=6,
        counts in prop::collection::vec(0usize..60, 1..4),
        slot_elems in 1usize..20,
        one_shot in 0usize..200,
    ) {
        // Slots must hold one element per rank (the configuration guarantees it).
        check_world(size, &counts, (slot_elems * 4).max(size * 4), one_shot, None);
    }

    #[test]
    fn cuda_ipc_ring_plans_match_the_reference_for_any_shape(
        size in 2usize..=6,
        counts in prop::collection::vec(0usize..60, 1..4),
        slot_elems in 1usize..20,
    ) {
        check_world(size, &counts, (slot_elems * 4).max(size * 4), 64, Some(Algorithm::Ring));
    }
}
