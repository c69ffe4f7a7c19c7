//! The pre-multiplied sum (`ReduceOp::PreMulSum`) in every reducing collective: each rank scales
//! its own input by its own factor, then the inputs are summed. Every collective (in place, out
//! of place, async), every all-reduce algorithm, shared memory, TCP and two simulated nodes,
//! against a serial reference (each rank's value scaled with the kernels' `scale`, then summed);
//! out-of-place inputs are left alone; a mismatch with a plain sum and a factor that an integer
//! type refuses fail clearly. And `Avg`, which the ring finishes shard by shard: divided exactly
//! once under every all-reduce algorithm.

use std::time::Duration;

use oxccl_comm::config::TransportChoice;
use oxccl_comm::harness::{spawn_world_on_nodes, spawn_world_with};
use oxccl_comm::{Communicator, Config, Element, Error, ReduceOp, Result};
use oxccl_kernels::{bf16, f16, reference_reduce, scale_into};

/// Rank `r`'s factor: 0.5, 1, 1.5, ... for floats; 1, -2, 3, ... for integers (whole, and the
/// negative ones wrap an unsigned type round).
fn factor<T: Element>(r: usize) -> f64 {
    if T::DTYPE.is_float() {
        (r + 1) as f64 * 0.5
    } else if r % 2 == 1 {
        -((r + 1) as f64)
    } else {
        (r + 1) as f64
    }
}

/// Rank `r`'s input element `i`: 1 to 5, so every partial sum is exact in every type.
fn x<T: Element>(r: usize, i: usize) -> T {
    T::from_f64(((r * 7 + i * 3) % 5 + 1) as f64)
}

fn input<T: Element>(r: usize, count: usize) -> Vec<T> {
    (0..count).map(|i| x(r, i)).collect()
}

/// `sum over r of factor_r * x(r, i)`, each product rounded as the kernels round it.
fn want<T: Element>(n: usize, count: usize) -> Vec<T> {
    (0..count)
        .map(|i| {
            let vals: Vec<T> = (0..n)
                .map(|r| {
                    let mut v = [T::from_f64(0.0)];
                    scale_into(&mut v, &[x::<T>(r, i)], factor::<T>(r)).unwrap();
                    v[0]
                })
                .collect();
            reference_reduce(&vals, ReduceOp::Sum)
        })
        .collect()
}

fn expect<T: Element>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!("{what}: element {i} is {:?}, want {:?}", got[i], want[i]);
    }
}

fn config(algo: &str, transport: TransportChoice) -> Config {
    let mut cfg = Config::from_lookup(&|k| (k == "OXCCL_ALGO").then(|| algo.to_string())).unwrap();
    cfg.timeout = Duration::from_secs(60);
    cfg.transport = transport;
    // Small slots: several frames per message at the larger counts.
    cfg.slot_bytes = 64 << 10;
    cfg
}

/// Every reducing collective on `count` elements per shard, blocking and async.
fn every_collective<T: Element>(c: &Communicator, count: usize) -> Result<()> {
    let (me, n) = (c.rank(), c.size());
    let op = ReduceOp::premul_sum(factor::<T>(me));
    let name = format!("rank {me} of {n}, {}, count {count}", T::DTYPE);
    let full = input::<T>(me, count * n);
    let want_full = want::<T>(n, count * n);
    let zero = T::from_f64(0.0);

    // All-reduce: in place, out of place, and both async.
    let mut buf = full.clone();
    c.all_reduce(&mut buf, op)?;
    expect(&buf, &want_full, &format!("{name}: all_reduce"));
    let mut out = vec![zero; full.len()];
    c.all_reduce_into(&full, &mut out, op)?;
    expect(&out, &want_full, &format!("{name}: all_reduce_into"));
    expect(
        &full,
        &input::<T>(me, count * n),
        &format!("{name}: all_reduce_into input"),
    );
    let buf = c.all_reduce_async::<T, _>(full.clone(), op).wait()?;
    expect(&buf, &want_full, &format!("{name}: all_reduce_async"));
    let (i, o) = c
        .all_reduce_into_async::<T, _, _>(full.clone(), vec![zero; full.len()], op)
        .wait()?;
    expect(&o, &want_full, &format!("{name}: all_reduce_into_async"));
    expect(&i, &full, &format!("{name}: all_reduce_into_async input"));

    // Reduce-scatter: rank `me`'s shard of the full reduction.
    let mine = &want_full[me * count..(me + 1) * count];
    let mut out = vec![zero; count];
    c.reduce_scatter_into(&full, &mut out, op)?;
    expect(&out, mine, &format!("{name}: reduce_scatter"));
    let mut buf = full.clone();
    c.reduce_scatter(&mut buf, op)?;
    expect(
        &buf[me * count..(me + 1) * count],
        mine,
        &format!("{name}: in place"),
    );
    let buf = c.reduce_scatter_async::<T, _>(full.clone(), op).wait()?;
    expect(
        &buf[me * count..(me + 1) * count],
        mine,
        &format!("{name}: rs async"),
    );
    let (i, o) = c
        .reduce_scatter_into_async::<T, _, _>(full.clone(), vec![zero; count], op)
        .wait()?;
    expect(&o, mine, &format!("{name}: reduce_scatter_into_async"));
    expect(
        &i,
        &full,
        &format!("{name}: reduce_scatter_into_async input"),
    );

    // Reduce-scatter-v: rank r's shard has r * count / 2 + 1 elements (uneven).
    let counts: Vec<usize> = (0..n).map(|r| r * count / 2 + 1).collect();
    let total: usize = counts.iter().sum();
    let at: usize = counts[..me].iter().sum();
    let (vin, vwant) = (input::<T>(me, total), want::<T>(n, total));
    let mut out = vec![zero; counts[me]];
    c.reduce_scatter_v_into(&vin, &mut out, &counts, op)?;
    expect(
        &out,
        &vwant[at..at + counts[me]],
        &format!("{name}: reduce_scatter_v"),
    );
    let (_, o) = c
        .reduce_scatter_v_into_async::<T, _, _>(vin.clone(), vec![zero; counts[me]], &counts, op)
        .wait()?;
    expect(
        &o,
        &vwant[at..at + counts[me]],
        &format!("{name}: reduce_scatter_v_async"),
    );

    // Reduce to every root in turn: out of place, then in place (other ranks keep their input).
    for root in 0..n {
        let mut out = vec![zero; if me == root { full.len() } else { 0 }];
        c.reduce_into(&full, &mut out, op, root)?;
        if me == root {
            expect(&out, &want_full, &format!("{name}: reduce to {root}"));
        }
        let mut buf = full.clone();
        c.reduce(&mut buf, op, root)?;
        let w = if me == root { &want_full } else { &full };
        expect(&buf, w, &format!("{name}: reduce_in_place to {root}"));
    }
    Ok(())
}

fn every_type(c: &Communicator, count: usize) -> Result<()> {
    every_collective::<f32>(c, count)?;
    every_collective::<i32>(c, count)?;
    if count < 10_000 {
        every_collective::<f64>(c, count)?;
        every_collective::<bf16>(c, count)?;
        every_collective::<f16>(c, count)?;
        every_collective::<u8>(c, count)?;
        every_collective::<i64>(c, count)?;
    }
    Ok(())
}

#[test]
fn premul_sum_in_every_collective_over_shm_and_tcp() {
    for (transport, n) in [(TransportChoice::Shm, 3), (TransportChoice::Tcp, 4)] {
        for r in spawn_world_with(
            n,
            |_| config("", transport),
            |c| {
                for count in [0, 1, 7, 1000, 40_001] {
                    every_type(&c, count)?;
                }
                Ok(())
            },
        ) {
            r.unwrap_or_else(|e| panic!("{transport:?}: {e}"));
        }
    }
}

/// Each all-reduce algorithm and each reduce algorithm: the first step happens before any of
/// them, in place and out of place alike.
#[test]
fn premul_sum_under_every_algorithm() {
    let algos = [
        "all-reduce=ring",
        "all-reduce=tree",
        "all-reduce=hd",
        "all-reduce=rd",
        "all-reduce=one-shot",
        "all-reduce=two-shot",
        "all-reduce=single-copy,reduce=chain",
        "reduce=tree",
    ];
    for algo in algos {
        for r in spawn_world_with(
            3,
            |_| config(algo, TransportChoice::Shm),
            |c| {
                for count in [1, 1000, 40_001] {
                    every_collective::<f32>(&c, count)?;
                }
                if algo == "all-reduce=ring" {
                    // Several ring blocks (the ring scales each chunk as it first uses it).
                    every_collective::<f32>(&c, 1_500_001)?;
                }
                every_collective::<i32>(&c, 333)
            },
        ) {
            r.unwrap_or_else(|e| panic!("{algo}: {e}"));
        }
    }
}

/// Two simulated nodes of two ranks: the hierarchical all-reduce and reduce-scatter.
#[test]
fn premul_sum_across_nodes() {
    for algo in [
        "all-reduce=hierarchical,reduce-scatter=hierarchical",
        "ring",
    ] {
        for r in spawn_world_on_nodes(4, 2, config(algo, TransportChoice::Auto), |c| {
            assert!(c.is_hierarchical());
            for count in [1, 1000, 300_001] {
                every_collective::<f32>(&c, count)?;
            }
            Ok(())
        }) {
            r.unwrap_or_else(|e| panic!("{algo}: {e}"));
        }
    }
}

/// A rank with a plain sum against ranks with a pre-multiplied one: `Mismatch` on every rank,
/// naming both operations.
#[test]
fn premul_sum_against_a_plain_sum_is_a_mismatch() {
    for r in spawn_world_with(
        3,
        |_| config("", TransportChoice::Shm),
        |c| {
            let op = if c.rank() == 1 {
                ReduceOp::Sum
            } else {
                ReduceOp::premul_sum(2.0)
            };
            Ok(c.all_reduce(&mut [1f32; 16], op).unwrap_err())
        },
    ) {
        let e = r.unwrap();
        let text = e.to_string();
        assert!(matches!(e, Error::Mismatch { .. }), "{text}");
        assert!(
            text.contains("op=premul_sum") && text.contains("op=sum"),
            "{text}"
        );
    }
}

/// A factor an integer type cannot take fails on its rank at once, before any message, with the
/// rank, the operation and the factor named; the communicator goes on working.
#[test]
fn a_fractional_factor_for_integers_fails_at_once() {
    for r in spawn_world_with(
        2,
        |_| config("", TransportChoice::Shm),
        |c| {
            let bad = ReduceOp::premul_sum(0.5);
            let mut buf = [1i32; 8];
            let errors = [
                c.all_reduce(&mut buf, bad).unwrap_err(),
                c.reduce_scatter_into(&[1u8; 4], &mut [0u8; 2], bad)
                    .unwrap_err(),
                c.reduce_into(&[1i64; 2], &mut [0i64; 2], bad, 0)
                    .unwrap_err(),
                c.all_reduce_async::<i32, _>(vec![1i32; 4], bad)
                    .wait()
                    .unwrap_err(),
            ];
            assert_eq!(buf, [1; 8], "rank {}: the buffer is untouched", c.rank());
            // Floats take any factor; the communicator is still in step.
            let mut f = [1f32; 4];
            c.all_reduce(&mut f, ReduceOp::premul_sum(0.5))?;
            assert_eq!(f, [1.0; 4]);
            Ok((c.rank(), errors))
        },
    ) {
        let (rank, errors) = r.unwrap();
        for e in errors {
            let text = e.to_string();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{text}");
            assert!(text.contains(&format!("rank {rank}")), "{text}");
            assert!(
                text.contains("0.5") && text.contains("premul_sum"),
                "{text}"
            );
        }
    }
}

/// `Avg` under every all-reduce algorithm, in place and out of place: the ring divides each
/// rank's chunk before its all-gather, the others the whole buffer afterwards; either way every
/// element is divided exactly once (also by the hierarchical all-reduce's flat-ring fallback for
/// fewer elements than pieces).
#[test]
fn avg_divides_exactly_once_under_every_algorithm() {
    fn check<T: Element>(c: &Communicator, count: usize, what: &str) -> Result<()> {
        let (me, n) = (c.rank(), c.size());
        let mine = input::<T>(me, count);
        let want: Vec<T> = (0..count)
            .map(|i| {
                let vals: Vec<T> = (0..n).map(|r| x::<T>(r, i)).collect();
                reference_reduce(&vals, ReduceOp::Avg)
            })
            .collect();
        let mut buf = mine.clone();
        c.all_reduce(&mut buf, ReduceOp::Avg)?;
        expect(
            &buf,
            &want,
            &format!("rank {me}, {what}, count {count}: in place"),
        );
        let mut out = vec![T::from_f64(0.0); count];
        c.all_reduce_into(&mine, &mut out, ReduceOp::Avg)?;
        expect(
            &out,
            &want,
            &format!("rank {me}, {what}, count {count}: out of place"),
        );
        Ok(())
    }
    let algos = ["ring", "tree", "hd", "rd", "one-shot", "two-shot"];
    for algo in algos {
        let rule = format!("all-reduce={algo}");
        for r in spawn_world_with(
            3,
            |_| config(&rule, TransportChoice::Shm),
            |c| {
                for count in [1, 2, 3, 1000, 40_001] {
                    check::<f32>(&c, count, algo)?;
                    check::<i32>(&c, count, algo)?;
                }
                if algo == "ring" {
                    check::<f32>(&c, 1_500_001, algo)?;
                }
                Ok(())
            },
        ) {
            r.unwrap_or_else(|e| panic!("{algo}: {e}"));
        }
    }
    let cfg = config("all-reduce=hierarchical", TransportChoice::Auto);
    for r in spawn_world_on_nodes(4, 2, cfg, |c| {
        for count in [1, 2, 3, 1000, 300_001] {
            check::<f32>(&c, count, "hierarchical")?;
        }
        Ok(())
    }) {
        r.unwrap();
    }
}
