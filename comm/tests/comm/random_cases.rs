//! proptest: random (world size, count, algorithm, slot size) cases of all-reduce, broadcast and
//! reduce against a serial reference, threaded ranks over TCP on loopback.

use std::time::Duration;

use oxccl_comm::{harness::spawn_world, Config, ReduceOp};
use proptest::prelude::*;

fn val(rank: usize, i: usize, seed: u64) -> i64 {
    ((rank as u64 * 7919 + i as u64 * 104_729 + seed) % 2001) as i64 - 1000
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn random_all_reduce_broadcast_reduce(
        n in 1usize..=6,
        count in 0usize..6000,
        algo in prop::sample::select(vec!["ring", "tree", "hd"]),
        slot in prop::sample::select(vec![64usize, 256, 4096, 512 << 10]),
        op in prop::sample::select(ReduceOp::ALL.to_vec()),
        seed in any::<u64>(),
    ) {
        let spec = format!("all-reduce={algo},broadcast={},reduce={}",
            if algo == "ring" { "chain" } else { "tree" }, if algo == "ring" { "chain" } else { "tree" });
        let mut cfg = Config::from_lookup(&|k| (k == "OXCCL_ALGO").then(|| spec.clone())).unwrap();
        cfg.timeout = Duration::from_secs(60);
        cfg.slot_bytes = slot;
        let res = spawn_world(n, cfg, |c| {
            let me = c.rank();
            let mut v: Vec<i64> = (0..count).map(|i| val(me, i, seed)).collect();
            c.all_reduce(&mut v, op)?;
            let root = (seed as usize) % n;
            let mut b: Vec<i64> = (0..count).map(|i| val(me, i, seed)).collect();
            c.broadcast(&mut b, root)?;
            let inp: Vec<i64> = (0..count).map(|i| val(me, i, seed)).collect();
            let mut out = vec![0i64; if me == root { count } else { 0 }];
            c.reduce_into(&inp, &mut out, op, root)?;
            Ok((v, b, out, root))
        });
        for (me, r) in res.into_iter().enumerate() {
            let (v, b, out, root) = r.unwrap();
            for i in 0..count {
                let vals: Vec<i64> = (0..n).map(|r| val(r, i, seed)).collect();
                let want = oxccl_kernels::reference_reduce(&vals, op);
                prop_assert_eq!(v[i], want, "all-reduce rank {} elem {}", me, i);
                prop_assert_eq!(b[i], val(root, i, seed));
                if me == root {
                    prop_assert_eq!(out[i], want, "reduce elem {}", i);
                }
            }
        }
    }
}
