//! Every collective x every dtype x every op x world sizes 1..=8 x counts {0, 1, 7, 1000,
//! 2^20+3} x every algorithm x both transports (TCP on loopback and shared memory), threaded
//! ranks, against a serial reference.
//!
//! Inputs are chosen so that every reduction is exact in every type whatever the order (small
//! non-negative integers, 0 or 1 for fp8; powers of two for `prod`), so results are compared bit for bit, floats
//! included. `float_tolerance` checks random floats against the bound of recursive summation.
//!
//! The largest count runs for every dtype but fp8 with `sum` and for f32/i32 with every op, to
//! keep the suite inside CI's time; the smaller counts run the full matrix.

use std::time::Duration;

use half::{bf16, f16};
use oxccl_comm::config::TransportChoice;
use oxccl_comm::harness::{spawn_world, spawn_world_on_nodes};
use oxccl_comm::{Communicator, Config, Element, ReduceOp, Result};
use oxccl_kernels::{reference_reduce, F8E4M3, F8E5M2};

pub(crate) const COUNTS: [usize; 6] = [0, 1, 4, 7, 1000, (1 << 20) + 3];
pub(crate) const BIG: usize = (1 << 20) + 3;

fn val<T: Element>(rank: usize, i: usize, op: ReduceOp) -> T {
    // fp8 holds the integers exactly only up to 16 (E4M3) and 8 (E5M2): 0 or 1 per rank keeps
    // every sum of up to 8 ranks exact.
    let m = if T::DTYPE.is_float() && T::DTYPE.size() == 1 {
        2
    } else {
        11
    };
    let v = match op {
        ReduceOp::Prod => 1 + (rank + i) % 2,
        _ => (rank * 31 + i * 17) % m,
    };
    T::from_f64(v as f64)
}

fn input<T: Element>(rank: usize, len: usize, op: ReduceOp) -> Vec<T> {
    (0..len).map(|i| val(rank, i, op)).collect()
}

/// Reduction over ranks of element `i` of every rank's input.
fn expect<T: Element>(n: usize, i: usize, op: ReduceOp) -> T {
    let vals: Vec<T> = (0..n).map(|r| val(r, i, op)).collect();
    reference_reduce(&vals, op)
}

/// Inputs repeat in `i` with this period (`val`: `(rank * 31 + i * 17) % m` has period `m`,
/// products `1 + (rank + i) % 2` period 2), and so does the expected reduction.
fn period<T: Element>(op: ReduceOp) -> usize {
    match op {
        ReduceOp::Prod => 2,
        _ if T::DTYPE.is_float() && T::DTYPE.size() == 1 => 2,
        _ => 11,
    }
}

/// [`expect`] for every element: computed once per residue of the inputs' period, then looked
/// up (the checks compare millions of elements; the expectation is the same).
struct Expect<T> {
    table: Vec<T>,
}

impl<T: Element> Expect<T> {
    fn new(n: usize, op: ReduceOp) -> Expect<T> {
        let table = (0..period::<T>(op))
            .map(|i| expect::<T>(n, i, op))
            .collect();
        Expect { table }
    }

    fn at(&self, i: usize) -> T {
        self.table[i % self.table.len()]
    }
}

fn check<T: Element>(what: &str, rank: usize, got: &[T], want: impl Fn(usize) -> T) {
    for (i, g) in got.iter().enumerate() {
        let w = want(i);
        assert!(
            bytemuck::bytes_of(g) == bytemuck::bytes_of(&w),
            "{what}: rank {rank}, element {i} of {}: got {g:?}, want {w:?}",
            got.len()
        );
    }
}

/// All-reduce of `count` elements in place, out of place and (with `with_async`) async, each
/// checked against the serial expectation.
fn all_reduce_forms<T: Element>(
    comm: &Communicator,
    count: usize,
    op: ReduceOp,
    tag: &str,
    with_async: bool,
) -> Result<()> {
    let (n, me) = (comm.size(), comm.rank());
    let want = Expect::<T>::new(n, op);
    let mut buf = input::<T>(me, count, op);
    comm.all_reduce(&mut buf, op)?;
    check(&format!("all_reduce {tag}"), me, &buf, |i| want.at(i));
    let inp = input::<T>(me, count, op);
    let mut out = vec![T::from_f64(99.0); count];
    comm.all_reduce_into(&inp, &mut out, op)?;
    check(&format!("all_reduce_into {tag}"), me, &out, |i| want.at(i));
    if with_async {
        let got = comm.all_reduce_async(inp, op).wait()?;
        check(&format!("all_reduce_async {tag}"), me, &got, |i| want.at(i));
    }
    Ok(())
}

/// Runs every collective for dtype `T` on one communicator.
pub(crate) fn all_collectives<T: Element>(
    comm: &Communicator,
    counts: &[usize],
    ops: &[ReduceOp],
    reduce_algos_only: bool,
) -> Result<()> {
    let (n, me) = (comm.size(), comm.rank());
    let dt = T::DTYPE;
    for &count in counts {
        for &op in ops {
            let want = Expect::<T>::new(n, op);
            let tag = format!("{dt} {op} count {count} n {n}");
            // all-reduce, in place and out of place
            all_reduce_forms::<T>(comm, count, op, &tag, false)?;
            let inp = input::<T>(me, count, op);
            // reduce to a root that moves with the count
            let root = count % n;
            let mut out = vec![T::from_f64(99.0); if me == root { count } else { 0 }];
            comm.reduce_into(&inp, &mut out, op, root)?;
            check(&format!("reduce {tag}"), me, &out, |i| want.at(i));
            let mut buf = input::<T>(me, count, op);
            comm.reduce(&mut buf, op, root)?;
            if me == root {
                check(&format!("reduce_in_place {tag}"), me, &buf, |i| want.at(i));
            } else {
                check(
                    &format!("reduce_in_place leaves non-roots {tag}"),
                    me,
                    &buf,
                    |i| val::<T>(me, i, op),
                );
            }
            if reduce_algos_only {
                continue;
            }
            // reduce-scatter: every rank's input has n shards of `count`
            let inp = input::<T>(me, count * n, op);
            let mut out = vec![T::from_f64(99.0); count];
            comm.reduce_scatter_into(&inp, &mut out, op)?;
            check(&format!("reduce_scatter {tag}"), me, &out, |j| {
                want.at(me * count + j)
            });
            let mut buf = inp.clone();
            comm.reduce_scatter(&mut buf, op)?;
            check(
                &format!("reduce_scatter_in_place {tag}"),
                me,
                &buf[me * count..(me + 1) * count],
                |j| want.at(me * count + j),
            );
        }
        if reduce_algos_only {
            continue;
        }
        let tag = format!("{dt} count {count} n {n}");
        let op = ReduceOp::Sum;
        // all-gather
        let inp = input::<T>(me, count, op);
        let mut out = vec![T::from_f64(99.0); count * n];
        comm.all_gather_into(&inp, &mut out)?;
        check(&format!("all_gather {tag}"), me, &out, |k| {
            val::<T>(k / count.max(1), k % count.max(1), op)
        });
        let mut buf = vec![T::from_f64(99.0); count * n];
        buf[me * count..(me + 1) * count].copy_from_slice(&inp);
        comm.all_gather(&mut buf)?;
        check(&format!("all_gather_in_place {tag}"), me, &buf, |k| {
            val::<T>(k / count.max(1), k % count.max(1), op)
        });
        // broadcast
        let root = (count + 1) % n;
        let mut buf = input::<T>(me, count, op);
        comm.broadcast(&mut buf, root)?;
        check(&format!("broadcast {tag}"), me, &buf, |i| {
            val::<T>(root, i, op)
        });
        let mut out = vec![T::from_f64(99.0); count];
        comm.broadcast_into(&inp, &mut out, root)?;
        check(&format!("broadcast_into {tag}"), me, &out, |i| {
            val::<T>(root, i, op)
        });
        // gather / scatter
        let mut out = vec![T::from_f64(99.0); if me == root { count * n } else { 0 }];
        comm.gather_into(&inp, &mut out, root)?;
        check(&format!("gather {tag}"), me, &out, |k| {
            val::<T>(k / count.max(1), k % count.max(1), op)
        });
        let sin = if me == root {
            input::<T>(me, count * n, op)
        } else {
            Vec::new()
        };
        let mut out = vec![T::from_f64(99.0); count];
        comm.scatter_into(&sin, &mut out, root)?;
        check(&format!("scatter {tag}"), me, &out, |j| {
            val::<T>(root, me * count + j, op)
        });
        // all-to-all: block j of rank r goes to block r of rank j
        let ain = input::<T>(me, count * n, op);
        let mut out = vec![T::from_f64(99.0); count * n];
        comm.all_to_all_into(&ain, &mut out)?;
        check(&format!("all_to_all {tag}"), me, &out, |k| {
            let (r, j) = (k / count.max(1), k % count.max(1));
            val::<T>(r, me * count + j, op)
        });
        // point to point: a ring exchange, then even ranks send to the next odd rank
        if n > 1 {
            let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
            let mut out = vec![T::from_f64(99.0); count];
            comm.send_recv(&inp, next, &mut out, prev)?;
            check(&format!("send_recv {tag}"), me, &out, |i| {
                val::<T>(prev, i, op)
            });
            if me % 2 == 0 && me + 1 < n {
                comm.send(&inp, me + 1)?;
            } else if me % 2 == 1 {
                let mut out = vec![T::from_f64(99.0); count];
                comm.recv(&mut out, me - 1)?;
                check(&format!("recv {tag}"), me, &out, |i| {
                    val::<T>(me - 1, i, op)
                });
            }
        }
        comm.barrier()?;
    }
    Ok(())
}

pub(crate) fn every_dtype(comm: &Communicator, reduce_algos_only: bool) -> Result<()> {
    let small = &COUNTS[..5];
    macro_rules! each {
        ($($t:ty),*) => {$(
            all_collectives::<$t>(comm, small, &ReduceOp::ALL, reduce_algos_only)?;
            all_collectives::<$t>(comm, &[BIG], &[ReduceOp::Sum], reduce_algos_only)?;
        )*};
    }
    each!(f32, f64, f16, bf16, i8, u8, i32, u32, i64, u64);
    // fp8 at the small counts only: its large-count paths are the 1-byte ones i8 and u8 take.
    all_collectives::<F8E4M3>(comm, small, &ReduceOp::ALL, reduce_algos_only)?;
    all_collectives::<F8E5M2>(comm, small, &ReduceOp::ALL, reduce_algos_only)?;
    all_collectives::<f32>(
        comm,
        &[BIG],
        &[ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg],
        true,
    )?;
    all_collectives::<i32>(
        comm,
        &[BIG],
        &[ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg],
        true,
    )?;
    Ok(())
}

/// The lookup of [`Expect`] gives exactly [`expect`] for every element: the inputs repeat with
/// [`period`] in every type and op.
#[test]
fn expectations_repeat_with_the_inputs() {
    fn each<T: Element>() {
        for op in ReduceOp::ALL {
            for n in 1..=8 {
                let want = Expect::<T>::new(n, op);
                for i in 0..300 {
                    let (a, b) = (want.at(i), expect::<T>(n, i, op));
                    assert!(
                        bytemuck::bytes_of(&a) == bytemuck::bytes_of(&b),
                        "{} {op} n {n} element {i}",
                        T::DTYPE
                    );
                }
            }
        }
    }
    each::<f32>();
    each::<f64>();
    each::<f16>();
    each::<bf16>();
    each::<i8>();
    each::<u8>();
    each::<i32>();
    each::<u32>();
    each::<i64>();
    each::<u64>();
    each::<F8E4M3>();
    each::<F8E5M2>();
}

pub(crate) fn config(algo: &str, transport: TransportChoice) -> Config {
    let mut cfg = Config::from_lookup(&|k| (k == "OXCCL_ALGO").then(|| algo.to_string())).unwrap();
    cfg.timeout = Duration::from_secs(120);
    cfg.transport = transport;
    // Small slots so that multi-slot pipelining runs even at moderate counts.
    cfg.slot_bytes = 64 << 10;
    cfg
}

/// Every algorithm over `transport`.
fn world_on(n: usize, t: TransportChoice) {
    // Ring and chains, plus every single-algorithm collective.
    for r in spawn_world(
        n,
        config("all-reduce=ring,broadcast=chain,reduce=chain", t),
        |c| every_dtype(&c, false),
    ) {
        r.unwrap();
    }
    // Trees for all-reduce, broadcast and reduce.
    for r in spawn_world(n, config("tree", t), |c| every_dtype(&c, true)) {
        r.unwrap();
    }
    // Halving-doubling all-reduce.
    for r in spawn_world(n, config("all-reduce=hd", t), |c| every_dtype(&c, true)) {
        r.unwrap();
    }
    // Recursive doubling (independent of the transport: run once).
    if t == TransportChoice::Tcp {
        for r in spawn_world(n, config("all-reduce=rd", t), |c| every_dtype(&c, true)) {
            r.unwrap();
        }
    }
    // Tree broadcast runs in every_dtype(.., true) only through reduce/all-reduce; cover it.
    for r in spawn_world(n, config("broadcast=tree", t), |c| {
        for &count in &COUNTS {
            let root = count % c.size();
            let mut v = input::<u32>(c.rank(), count, ReduceOp::Sum);
            c.broadcast(&mut v, root)?;
            check("tree broadcast", c.rank(), &v, |i| {
                val::<u32>(root, i, ReduceOp::Sum)
            });
        }
        Ok(())
    }) {
        r.unwrap();
    }
}

/// All-reduce (blocking in place, out of place, async) for every dtype, op and count.
fn all_reduce_every_dtype(comm: &Communicator) -> Result<()> {
    fn one<T: Element>(comm: &Communicator) -> Result<()> {
        let n = comm.size();
        for &count in &COUNTS {
            for op in ReduceOp::ALL {
                let tag = format!("{} {op} count {count} n {n}", T::DTYPE);
                all_reduce_forms::<T>(comm, count, op, &tag, true)?;
            }
        }
        Ok(())
    }
    one::<f32>(comm)?;
    one::<f64>(comm)?;
    one::<f16>(comm)?;
    one::<bf16>(comm)?;
    one::<i8>(comm)?;
    one::<u8>(comm)?;
    one::<i32>(comm)?;
    one::<u32>(comm)?;
    one::<i64>(comm)?;
    one::<u64>(comm)?;
    one::<F8E4M3>(comm)?;
    one::<F8E5M2>(comm)
}

/// The direct all-reduces over the shared-memory window, with a small staging area so that
/// messages run in several pieces.
fn direct_algorithms(n: usize) {
    if n < 2 {
        return;
    }
    for algo in ["one-shot", "two-shot", "single-copy"] {
        let mut cfg = config(&format!("all-reduce={algo}"), TransportChoice::Shm);
        cfg.direct_bytes = 8 << 10;
        for r in spawn_world(n, cfg, |c| all_reduce_every_dtype(&c)) {
            r.unwrap();
        }
    }
}

/// Single-copy broadcast and all-gather (peers' buffers read with `process_vm_readv`): every
/// root, in place and out of place, sizes that do not divide evenly, and empty buffers.
fn single_copy_moves(n: usize) {
    if n < 2 {
        return;
    }
    let cfg = config(
        "broadcast=single-copy,all-gather=single-copy",
        TransportChoice::Shm,
    );
    for r in spawn_world(n, cfg, |c| {
        let (n, me) = (c.size(), c.rank());
        for count in [0usize, 1, 7, 100_003] {
            for root in 0..n {
                let pattern = |i: usize| (i * 31 + root) as u32;
                let mut b: Vec<u32> = if me == root {
                    (0..count).map(pattern).collect()
                } else {
                    vec![0; count]
                };
                c.broadcast(&mut b, root)?;
                assert!(
                    b.iter().enumerate().all(|(i, &x)| x == pattern(i)),
                    "in place"
                );
                let src: Vec<u32> = (0..count).map(pattern).collect();
                let mut out = vec![7u32; count];
                c.broadcast_into(&src, &mut out, root)?;
                assert_eq!(out, src, "broadcast out of place, root {root}");
            }
            let mine: Vec<i32> = (0..count).map(|i| (me * 1000 + i % 1000) as i32).collect();
            let want: Vec<i32> = (0..n * count)
                .map(|k| ((k / count.max(1)) * 1000 + (k % count.max(1)) % 1000) as i32)
                .collect();
            let mut out = vec![0i32; n * count];
            c.all_gather_into(&mine, &mut out)?;
            assert_eq!(out, want, "all-gather out of place");
            let mut whole = vec![0i32; n * count];
            whole[me * count..(me + 1) * count].copy_from_slice(&mine);
            c.all_gather(&mut whole)?;
            assert_eq!(whole, want, "all-gather in place");
        }
        Ok(())
    }) {
        r.unwrap();
    }
}

fn world(n: usize) {
    single_copy_moves(n);
    world_on(n, TransportChoice::Tcp);
    world_on(n, TransportChoice::Shm);
    direct_algorithms(n);
}

#[test]
fn world_1() {
    world(1);
}
#[test]
fn world_2() {
    world(2);
}
#[test]
fn world_3() {
    world(3);
}
#[test]
fn world_4() {
    world(4);
}
#[test]
fn world_5() {
    world(5);
}
#[test]
fn world_6() {
    world(6);
}
#[test]
fn world_7() {
    world(7);
}
#[test]
fn world_8() {
    world(8);
}

/// Every async form (in place and out of place) of all-reduce, reduce-scatter, all-gather and
/// broadcast for dtype `T`, several queued before the first wait, against the serial reference.
fn async_forms<T: Element>(comm: &Communicator, count: usize, op: ReduceOp) -> Result<()> {
    let (n, me) = (comm.size(), comm.rank());
    let want = Expect::<T>::new(n, op);
    let tag = format!("{} {op} count {count} n {n}", T::DTYPE);
    let root = (count + 1) % n;
    let junk = || vec![T::from_f64(99.0); count];
    let junk_n = || vec![T::from_f64(99.0); count * n];
    let ar = comm.all_reduce_into_async(input::<T>(me, count, op), junk(), op);
    let rs = comm.reduce_scatter_into_async(input::<T>(me, count * n, op), junk(), op);
    let ag = comm.all_gather_into_async(input::<T>(me, count, op), junk_n());
    let bc = comm.broadcast_into_async(input::<T>(me, count, op), junk(), root);
    let rs_in = comm.reduce_scatter_async(input::<T>(me, count * n, op), op);
    let mut gathered = junk_n();
    gathered[me * count..(me + 1) * count].copy_from_slice(&input::<T>(me, count, op));
    let ag_in = comm.all_gather_async(gathered);
    let bc_in = comm.broadcast_async(input::<T>(me, count, op), root);
    let (inp, out) = ar.wait()?;
    assert!(
        inp == input::<T>(me, count, op),
        "all_reduce_into_async changed its input"
    );
    check(&format!("all_reduce_into_async {tag}"), me, &out, |i| {
        want.at(i)
    });
    let (_, out) = rs.wait()?;
    check(&format!("reduce_scatter_into_async {tag}"), me, &out, |j| {
        want.at(me * count + j)
    });
    let (_, out) = ag.wait()?;
    check(&format!("all_gather_into_async {tag}"), me, &out, |k| {
        val::<T>(k / count.max(1), k % count.max(1), op)
    });
    let (_, out) = bc.wait()?;
    check(&format!("broadcast_into_async {tag}"), me, &out, |i| {
        val::<T>(root, i, op)
    });
    let buf = rs_in.wait()?;
    check(
        &format!("reduce_scatter_async {tag}"),
        me,
        &buf[me * count..(me + 1) * count],
        |j| want.at(me * count + j),
    );
    let buf = ag_in.wait()?;
    check(&format!("all_gather_async {tag}"), me, &buf, |k| {
        val::<T>(k / count.max(1), k % count.max(1), op)
    });
    let buf = bc_in.wait()?;
    check(&format!("broadcast_async {tag}"), me, &buf, |i| {
        val::<T>(root, i, op)
    });
    Ok(())
}

/// Async operations waited for in an order that differs between ranks (and one never waited
/// for): whether the waiting thread or the progress thread runs each, every rank runs them in
/// the order they were issued, so the results and the next blocking call agree.
#[test]
fn async_waits_in_any_order() {
    for t in [TransportChoice::Shm, TransportChoice::Tcp] {
        for r in spawn_world(3, config("", t), |c| {
            let (me, size) = (c.rank(), c.size());
            let count = 1000;
            let mut works: Vec<Option<oxccl_comm::Work<Vec<u32>>>> = (0..6)
                .map(|k| {
                    Some(c.all_reduce_async(
                        input::<u32>(me + k, count, ReduceOp::Sum),
                        ReduceOp::Sum,
                    ))
                })
                .collect();
            let dropped = c.broadcast_async(input::<u32>(me, count, ReduceOp::Sum), 0);
            drop(dropped);
            // Rank r waits for operation (k * (r + 1) + r) % 6 at its k-th wait: a different
            // order on every rank, the last issued first on some.
            for k in 0..6 {
                let j = (k * (me + 1) + me) % 6;
                let j = (0..6)
                    .map(|d| (j + d) % 6)
                    .find(|&j| works[j].is_some())
                    .unwrap();
                let got = works[j].take().unwrap().wait()?;
                check(&format!("all_reduce_async #{j}"), me, &got, |i| {
                    (0..size).map(|r| val::<u32>(r + j, i, ReduceOp::Sum)).sum()
                });
            }
            let mut buf = input::<u32>(me, count, ReduceOp::Sum);
            c.all_reduce(&mut buf, ReduceOp::Sum)?;
            let want = Expect::<u32>::new(size, ReduceOp::Sum);
            check("all_reduce after the async ones", me, &buf, |i| want.at(i));
            Ok(())
        }) {
            r.unwrap();
        }
    }
}

/// The async forms on 1 to 4 ranks over both transports, with a blocking reduce-scatter on
/// another thread of each rank holding the communicator's scratch buffer at the same time as
/// the async one (which then works in a fresh buffer), and bad lengths refused by name.
#[test]
fn async_forms_in_place_and_out_of_place() {
    for t in [TransportChoice::Shm, TransportChoice::Tcp] {
        for n in 1..=4 {
            for r in spawn_world(n, config("", t), |c| {
                for &count in &COUNTS {
                    for op in ReduceOp::ALL {
                        async_forms::<f32>(&c, count, op)?;
                    }
                    async_forms::<bf16>(&c, count, ReduceOp::Sum)?;
                    async_forms::<u8>(&c, count, ReduceOp::Max)?;
                }
                let (me, size) = (c.rank(), c.size());
                let want = Expect::<u32>::new(size, ReduceOp::Sum);
                std::thread::scope(|s| {
                    let blocking = s.spawn(|| {
                        let mut out = vec![0u32; BIG];
                        c.reduce_scatter_into(
                            &input::<u32>(me, BIG * size, ReduceOp::Sum),
                            &mut out,
                            ReduceOp::Sum,
                        )?;
                        check("blocking reduce_scatter", me, &out, |j| {
                            want.at(me * BIG + j)
                        });
                        Ok::<_, oxccl_comm::Error>(())
                    });
                    let w = c.reduce_scatter_into_async(
                        input::<u32>(me, BIG * size, ReduceOp::Sum),
                        vec![0u32; BIG],
                        ReduceOp::Sum,
                    );
                    let (_, out) = w.wait()?;
                    check("async reduce_scatter", me, &out, |j| want.at(me * BIG + j));
                    blocking.join().expect("blocking reduce-scatter thread")
                })?;
                let bad = [
                    c.all_reduce_into_async(vec![1.0f32; 4], vec![0.0f32; 5], ReduceOp::Sum)
                        .wait()
                        .map(|_| ()),
                    c.reduce_scatter_into_async(
                        vec![1.0f32; 4 * size + 1],
                        vec![0.0; 4],
                        ReduceOp::Sum,
                    )
                    .wait()
                    .map(|_| ()),
                    c.all_gather_into_async(vec![1.0f32; 4], vec![0.0f32; 4 * size + 1])
                        .wait()
                        .map(|_| ()),
                    c.broadcast_into_async(vec![1.0f32; 4], vec![0.0f32; 4], size)
                        .wait()
                        .map(|_| ()),
                ];
                for (e, what) in
                    bad.into_iter()
                        .zip(["all_reduce", "reduce_scatter", "all_gather", "broadcast"])
                {
                    let e = e.expect_err(what).to_string();
                    assert!(e.contains(&format!("rank {me}")) && e.contains(what), "{e}");
                }
                // Refused calls queue nothing: the communicator still works.
                async_forms::<f32>(&c, 7, ReduceOp::Sum)
            }) {
                r.unwrap();
            }
        }
    }
}

/// The hierarchical all-reduce, reduce-scatter and all-gather on `nodes` simulated nodes of
/// `per_node` ranks (shared memory inside a node, TCP across), every dtype, op and count; and
/// the tuner's own choice on the same layout.
fn hierarchical(nodes: usize, per_node: usize) {
    let n = nodes * per_node;
    let algo = "all-reduce=hierarchical,reduce-scatter=hierarchical,all-gather=hierarchical";
    for r in spawn_world_on_nodes(n, per_node, config(algo, TransportChoice::Auto), |c| {
        assert!(c.is_hierarchical(), "rank {} sees no node layout", c.rank());
        for p in 0..n {
            let want = match (p == c.rank(), p / per_node == c.rank() / per_node) {
                (true, _) => "self",
                (false, true) => "shm",
                (false, false) => "tcp",
            };
            assert_eq!(
                c.stats().transports.get(p).copied(),
                Some(want),
                "rank {} to {p}",
                c.rank()
            );
        }
        every_dtype(&c, false)
    }) {
        r.unwrap();
    }
}

#[test]
fn hierarchical_2_nodes_x_2() {
    hierarchical(2, 2);
}

#[test]
fn hierarchical_3_nodes_x_2_and_2_nodes_x_3() {
    hierarchical(3, 2);
    hierarchical(2, 3);
}

#[test]
fn hierarchical_override_without_nodes_is_a_clear_error() {
    let cfg = config("all-reduce=hierarchical", TransportChoice::Tcp);
    for r in spawn_world(2, cfg, |c| {
        assert!(!c.is_hierarchical());
        let mut v = vec![1.0f32; 16];
        Ok(c.all_reduce(&mut v, ReduceOp::Sum))
    }) {
        let e = r.unwrap().unwrap_err().to_string();
        assert!(e.contains("hierarchical algorithms need"), "{e}");
    }
}

/// Random floats: the result must be within the error bound of recursive summation,
/// `|got - exact| <= (n + 1) * eps * sum |x_i|`, for every all-reduce algorithm.
#[test]
fn float_tolerance() {
    fn rnd(seed: u64) -> f64 {
        let x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((x >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }
    /// Values in `[-scale, scale]`.
    fn run<T: Element>(c: &Communicator, eps: f64, scale: f64) -> Result<()> {
        let (n, me) = (c.size(), c.rank());
        let len = 4099;
        let x = |r: usize, i: usize| T::from_f64(rnd((r * 100_003 + i) as u64) * scale).to_f64();
        let mut v: Vec<T> = (0..len).map(|i| T::from_f64(x(me, i))).collect();
        c.all_reduce(&mut v, ReduceOp::Sum)?;
        // Every rank holds the same bits.
        let mut all = vec![T::from_f64(0.0); len * n];
        c.all_gather_into(&v, &mut all)?;
        for r in 0..n {
            assert!(
                bytemuck::cast_slice::<T, u8>(&all[r * len..(r + 1) * len])
                    == bytemuck::cast_slice::<T, u8>(&v),
                "{} rank {me}: rank {r} got different bits",
                T::DTYPE
            );
        }
        for (i, g) in v.iter().enumerate() {
            let exact: f64 = (0..n).map(|r| x(r, i)).sum();
            let mag: f64 = (0..n).map(|r| x(r, i).abs()).sum();
            let err = (g.to_f64() - exact).abs();
            assert!(
                err <= (n as f64 + 1.0) * eps * mag,
                "{} rank {me} element {i}: {} vs {exact}",
                T::DTYPE,
                g.to_f64()
            );
        }
        Ok(())
    }
    for algo in [
        "ring",
        "tree",
        "hd",
        "rd",
        "one-shot",
        "two-shot",
        "single-copy",
    ] {
        for r in spawn_world(
            5,
            config(&format!("all-reduce={algo}"), TransportChoice::Auto),
            |c| {
                run::<f32>(&c, f32::EPSILON as f64 / 2.0, 100.0)?;
                run::<f64>(&c, f64::EPSILON / 2.0, 100.0)?;
                run::<f16>(&c, 2f64.powi(-11), 100.0)?;
                run::<bf16>(&c, 2f64.powi(-8), 100.0)?;
                // fp8: 5 x 40 stays below E4M3's saturation at 448.
                run::<F8E4M3>(&c, 2f64.powi(-4), 40.0)?;
                run::<F8E5M2>(&c, 2f64.powi(-3), 40.0)
            },
        ) {
            r.unwrap();
        }
    }
}
