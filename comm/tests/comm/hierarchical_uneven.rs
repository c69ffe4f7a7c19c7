//! The hierarchical all-reduce on nodes of different sizes (a node that lost a rank and was
//! shrunk away, 8 + 7): results against a serial reference for several layouts, dtypes, ops,
//! counts (fewer elements than pieces, within one block, several blocks in flight), in place
//! and out of place; the tuner's own choice;
//! and the hierarchical reduce-scatter and all-gather refused with a clear error there (their
//! shards are per rank), while the tuner picks the flat ring for them.

use std::time::Duration;

use oxccl_comm::config::TransportChoice;
use oxccl_comm::harness::spawn_world_with;
use oxccl_comm::{Communicator, Config, Element, Error, ReduceOp, Result};

/// `nodes[r]`: rank `r`'s node.
fn config(algo: &str, node: &str) -> Config {
    let mut cfg = Config::from_lookup(&|k| (k == "OXCCL_ALGO").then(|| algo.to_string())).unwrap();
    cfg.timeout = Duration::from_secs(120);
    cfg.transport = TransportChoice::Auto;
    cfg.node_id = Some(node.to_string());
    // Small slots: several frames per message even at moderate counts.
    cfg.slot_bytes = 64 << 10;
    cfg
}

fn world<R: Send>(
    nodes: &[&str],
    algo: &str,
    f: impl Fn(Communicator) -> Result<R> + Sync,
) -> Vec<Result<R>> {
    spawn_world_with(nodes.len(), |r| config(algo, nodes[r]), f)
}

/// Rank `r`'s input element `i`: small integers, so every dtype and op is exact.
fn x(r: usize, i: usize) -> i64 {
    ((r * 7 + i * 3) % 5) as i64 + 1
}

/// The reduction of element `i` over `n` ranks (exact: small integers, and `Avg` in `f64`).
fn reference(n: usize, i: usize, op: ReduceOp) -> f64 {
    let v = (0..n).map(|r| x(r, i));
    match op {
        ReduceOp::Sum => v.sum::<i64>() as f64,
        ReduceOp::Prod => v.product::<i64>() as f64,
        ReduceOp::Min => v.min().unwrap_or(0) as f64,
        ReduceOp::Max => v.max().unwrap_or(0) as f64,
        ReduceOp::Avg => v.sum::<i64>() as f64 / n as f64,
        // The same factor on every rank here (`premul.rs` gives each rank its own).
        ReduceOp::PreMulSum(f) => f.get() * v.sum::<i64>() as f64,
    }
}

/// One all-reduce in place and one out of place, checked element by element.
fn check<T: Element + Copy + PartialEq + std::fmt::Debug>(
    c: &Communicator,
    count: usize,
    op: ReduceOp,
    of: impl Fn(f64) -> T,
) -> Result<()> {
    let (me, n) = (c.rank(), c.size());
    let input: Vec<T> = (0..count).map(|i| of(x(me, i) as f64)).collect();
    let want: Vec<T> = (0..count).map(|i| of(reference(n, i, op))).collect();
    let mut buf = input.clone();
    c.all_reduce(&mut buf, op)?;
    let mut out = vec![of(0.0); count];
    c.all_reduce_into(&input, &mut out, op)?;
    for (what, got) in [("in place", &buf), ("out of place", &out)] {
        if let Some(i) = (0..count).find(|&i| got[i] != want[i]) {
            panic!(
                "rank {me} of {n}: {} {op:?} {what}, count {count}: element {i} is {:?}, want {:?}",
                std::any::type_name::<T>(),
                got[i],
                want[i]
            );
        }
    }
    Ok(())
}

fn all_reduces(c: &Communicator) -> Result<()> {
    assert!(c.is_hierarchical(), "rank {}: no node layout", c.rank());
    for count in [0, 1, 2, 5, 1000, 70_001] {
        let premul = ReduceOp::premul_sum(0.5);
        for op in [
            ReduceOp::Sum,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Avg,
            premul,
        ] {
            check(c, count, op, |v| v as f32)?;
        }
        check(c, count, ReduceOp::Sum, |v| v as i64)?;
        check(c, count, ReduceOp::Sum, |v| v)?;
        check(c, count, ReduceOp::Max, |v| v as u8)?;
    }
    check(c, 7, ReduceOp::Prod, |v| v as i32)?;
    // Blocks are 2 MiB per piece here (ranks on different nodes talk over TCP): 2.5 M f32 make
    // 3 blocks with 2 pieces and 2 with 3, so a node's ranks interleave local steps of one
    // block with cross steps (or idle ones) of another.
    check(c, 2_500_001, ReduceOp::Sum, |v| v as f32)
}

#[test]
fn uneven_nodes_all_reduce_hierarchically() {
    let layouts: [&[&str]; 4] = [
        &["a", "a", "a", "b", "b"],
        // 3 pieces, and local rank 3 of node a without one.
        &["a", "a", "a", "a", "b", "b", "b"],
        // Ranks of one node need not be consecutive.
        &["a", "b", "a", "a", "b", "a"],
        &["a", "a", "b", "b", "b", "c", "c", "c", "c"],
    ];
    for nodes in layouts {
        for r in world(nodes, "all-reduce=hierarchical", |c| all_reduces(&c)) {
            r.unwrap_or_else(|e| panic!("{nodes:?}: {e}"));
        }
    }
    // The tuner's own choice on an uneven layout (hierarchical from 256 KiB; the pick itself
    // is tested in `tuning.rs`).
    for r in world(&["a", "a", "a", "b", "b"], "", |c| {
        check(&c, 1 << 20, ReduceOp::Sum, |v| v as f32)
    }) {
        r.unwrap();
    }
}

/// On nodes of different sizes the hierarchical reduce-scatter and all-gather are refused with
/// the node sizes named; left to the tuner, they run (flat ring).
#[test]
fn uneven_nodes_reduce_scatter_and_all_gather_stay_flat() {
    let nodes = ["a", "a", "a", "b", "b"];
    let forced = "reduce-scatter=hierarchical,all-gather=hierarchical";
    for r in world(&nodes, forced, |c| {
        let n = c.size();
        let rs = c
            .reduce_scatter_into(&vec![1f32; 4 * n], &mut [0f32; 4], ReduceOp::Sum)
            .err();
        let ag = c.all_gather_into(&[1f32; 4], &mut vec![0f32; 4 * n]).err();
        Ok([rs, ag])
    }) {
        for e in r.unwrap() {
            let e = e.expect("hierarchical on uneven nodes must be refused");
            let text = e.to_string();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{text}");
            assert!(text.contains("[3, 2]"), "{text}");
        }
    }
    for r in world(&nodes, "", |c| {
        let (me, n) = (c.rank(), c.size());
        let count = 300_000;
        let mut out = vec![0f32; count];
        c.reduce_scatter_into(&vec![1f32; count * n], &mut out, ReduceOp::Sum)?;
        assert!(out.iter().all(|&v| v == n as f32), "rank {me}");
        let mut all = vec![0f32; count * n];
        c.all_gather_into(&vec![me as f32; count], &mut all)?;
        for r in 0..n {
            assert!(all[r * count..(r + 1) * count]
                .iter()
                .all(|&v| v == r as f32));
        }
        Ok(())
    }) {
        r.unwrap();
    }
}
