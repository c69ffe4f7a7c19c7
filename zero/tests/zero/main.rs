//! oxccl-zero on threaded ranks over shared memory, grouped into simulated nodes: the sharded
//! step equals DDP (gradients averaged over every rank) followed by the same optimizer on the
//! whole parameter vector on every rank.

use oxccl_comm::harness::spawn_world_on_nodes;
use oxccl_comm::Config;
use oxccl_zero::{AdamW, Hyper, Sgd, ShardGroup, ShardOptimizer, Zero, ZeroConfig};

const LENS: [usize; 4] = [37, 5, 100, 1];
const STEPS: usize = 10;

fn hypers() -> Vec<Hyper> {
    // Two parameter groups: the biases (1 and 3) without weight decay.
    (0..LENS.len())
        .map(|p| Hyper {
            lr: if p == 2 { 0.05 } else { 0.1 },
            weight_decay: if p % 2 == 1 { 0.0 } else { 0.01 },
        })
        .collect()
}

/// Rank `rank`'s gradient of parameter `p` at step `t`: multiples of 1/8, so sums over ranks are
/// exact in any order.
fn grad(rank: usize, t: usize, p: usize) -> Vec<f32> {
    (0..LENS[p])
        .map(|i| ((rank * 5 + t * 3 + p * 7 + i) % 13) as f32 / 8.0 - 0.75)
        .collect()
}

fn init(rank: usize, p: usize) -> Vec<f32> {
    (0..LENS[p])
        .map(|i| ((i + p + rank) % 7) as f32 * 0.25 - 0.5)
        .collect()
}

/// How a run feeds its gradients: micro-batches per step, and the clipping norm.
#[derive(Clone, Copy, Debug)]
struct Feed {
    micro: usize,
    max_norm: Option<f32>,
}

const PLAIN: Feed = Feed {
    micro: 1,
    max_norm: None,
};

/// DDP + the optimizer on the whole vector: what every rank would hold.
fn reference(world: usize, feed: Feed, opt: &mut dyn ShardOptimizer) -> Vec<Vec<f32>> {
    let mut params: Vec<Vec<f32>> = (0..LENS.len()).map(|p| init(0, p)).collect();
    let mut states: Vec<Vec<f32>> = LENS
        .iter()
        .map(|&l| vec![0.0; l * opt.state_per_elem()])
        .collect();
    let h = hypers();
    for t in 0..STEPS {
        let mut avgs: Vec<Vec<f32>> = Vec::new();
        for (p, &len) in LENS.iter().enumerate() {
            let mut avg = vec![0.0f32; len];
            for r in 0..world {
                let mut sum = vec![0.0f32; len];
                for m in 0..feed.micro {
                    sum.iter_mut()
                        .zip(grad(r, t * feed.micro + m, p))
                        .for_each(|(a, g)| *a += g);
                }
                avg.iter_mut().zip(sum).for_each(|(a, g)| *a += g);
            }
            avg.iter_mut().for_each(|a| *a /= world as f32);
            avgs.push(avg);
        }
        if let Some(max) = feed.max_norm {
            let ss: f64 = avgs
                .iter()
                .flatten()
                .map(|&g| f64::from(g) * f64::from(g))
                .sum();
            let coef = f64::from(max) / (ss.sqrt() + 1e-6);
            if coef < 1.0 {
                avgs.iter_mut().flatten().for_each(|g| *g *= coef as f32);
            }
        }
        let each = params.iter_mut().zip(&avgs).zip(&mut states).enumerate();
        for (p, ((param, avg), st)) in each {
            opt.step(t as u64 + 1, h[p], param, avg, st);
        }
    }
    params
}

fn check(
    world: usize,
    per_node: usize,
    group: ShardGroup,
    feed: Feed,
    make: fn() -> Box<dyn ShardOptimizer>,
) {
    let want = reference(world, feed, make().as_mut());
    let out = spawn_world_on_nodes(world, per_node, Config::default(), |comm| {
        let rank = comm.rank();
        let mut params: Vec<Vec<f32>> = (0..LENS.len()).map(|p| init(rank, p)).collect();
        let cfg = ZeroConfig {
            group,
            align: 4,
            max_grad_norm: feed.max_norm,
        };
        let mut views: Vec<&mut [f32]> = params.iter_mut().map(|p| p.as_mut_slice()).collect();
        let mut zero = Zero::new(&comm, &mut views, hypers(), make(), cfg).unwrap();
        for t in 0..STEPS {
            for m in 0..feed.micro {
                let grads: Vec<Vec<f32>> = (0..LENS.len())
                    .map(|p| grad(rank, t * feed.micro + m, p))
                    .collect();
                let g: Vec<&[f32]> = grads.iter().map(|g| g.as_slice()).collect();
                if m + 1 < feed.micro {
                    zero.accumulate(&g).unwrap();
                } else {
                    let mut views: Vec<&mut [f32]> =
                        params.iter_mut().map(|p| p.as_mut_slice()).collect();
                    zero.step(&mut views, &g).unwrap();
                }
            }
        }
        Ok((params, zero.last_grad_norm()))
    });
    for (rank, r) in out.into_iter().enumerate() {
        let (params, norm) = r.unwrap();
        assert_eq!(norm.is_some(), feed.max_norm.is_some());
        if let (Some(n), Some(max)) = (norm, feed.max_norm) {
            // The small limit is below the gradients' norm: those runs do clip.
            assert!(max > 10.0 || n > f64::from(max), "norm {n}, limit {max}");
        }
        for (p, (got, want)) in params.iter().zip(&want).enumerate() {
            for (i, (a, b)) in got.iter().zip(want).enumerate() {
                let tol = 1e-6 * b.abs().max(1.0);
                assert!(
                    (a - b).abs() <= tol,
                    "world {world} x {per_node}/node {group:?} {feed:?} rank {rank} param \
                     {p}[{i}]: {a} against {b}"
                );
            }
        }
    }
}

fn adamw() -> Box<dyn ShardOptimizer> {
    Box::new(AdamW::default())
}

fn sgd() -> Box<dyn ShardOptimizer> {
    Box::new(Sgd {
        momentum: 0.9,
        dampening: 0.0,
        nesterov: true,
    })
}

#[test]
fn node_local_shards_equal_ddp_and_the_same_optimizer() {
    // Shard groups of 1, 2, 3 and 4 ranks (the nodes), with replicas across the nodes.
    for (world, per_node) in [(2, 1), (4, 2), (3, 3), (4, 4), (6, 3)] {
        check(world, per_node, ShardGroup::Node, PLAIN, adamw);
        check(world, per_node, ShardGroup::Node, PLAIN, sgd);
    }
}

#[test]
fn world_shards_equal_ddp_and_the_same_optimizer() {
    check(4, 2, ShardGroup::World, PLAIN, adamw);
    check(3, 1, ShardGroup::World, PLAIN, sgd);
}

#[test]
fn accumulation_and_clipping_equal_those_of_the_full_gradient() {
    let accumulate = Feed {
        micro: 3,
        max_norm: None,
    };
    // The averaged gradients' norms are a few units: 1.0 clips every step, 100 none.
    for max in [1.0, 100.0] {
        let clip = Feed {
            micro: 2,
            max_norm: Some(max),
        };
        check(4, 2, ShardGroup::Node, clip, sgd);
        check(4, 4, ShardGroup::World, clip, adamw);
    }
    check(6, 3, ShardGroup::Node, accumulate, adamw);
}

#[test]
fn state_shrinks_with_the_shard_group() {
    let out = spawn_world_on_nodes(4, 4, Config::default(), |comm| {
        let mut params: Vec<Vec<f32>> = (0..LENS.len()).map(|p| init(0, p)).collect();
        let mut views: Vec<&mut [f32]> = params.iter_mut().map(|p| p.as_mut_slice()).collect();
        let cfg = ZeroConfig {
            group: ShardGroup::Node,
            align: 1,
            max_grad_norm: None,
        };
        let zero = Zero::new(&comm, &mut views, hypers(), adamw(), cfg).unwrap();
        Ok(zero.state_bytes())
    });
    let total: usize = LENS.iter().sum();
    let bytes: Vec<usize> = out.into_iter().map(|r| r.unwrap()).collect();
    // AdamW: two state vectors and the master weights, f32, over a quarter of the elements.
    assert_eq!(bytes.iter().sum::<usize>(), 3 * 4 * total);
    assert!(
        bytes.iter().all(|&b| b <= 3 * 4 * total.div_ceil(4)),
        "{bytes:?}"
    );
}

#[test]
fn another_parameter_list_is_named() {
    let out = spawn_world_on_nodes(2, 2, Config::default(), |comm| {
        let mut params: Vec<Vec<f32>> = (0..LENS.len()).map(|p| init(0, p)).collect();
        let mut views: Vec<&mut [f32]> = params.iter_mut().map(|p| p.as_mut_slice()).collect();
        let mut zero =
            Zero::new(&comm, &mut views, hypers(), sgd(), ZeroConfig::default()).unwrap();
        let g: Vec<&[f32]> = vec![&[0.0; 3]];
        let e = zero.step(&mut views, &g).unwrap_err().to_string();
        assert!(
            e.contains(&format!("rank {}: zero step", comm.rank())),
            "{e}"
        );
        Ok(())
    });
    for r in out {
        r.unwrap();
    }
}
