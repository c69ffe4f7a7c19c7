//! oxccl-zero on threaded ranks over shared memory, grouped into simulated nodes (TCP between
//! them): the sharded step equals DDP (gradients averaged over every rank) followed by the same
//! optimizer on the whole parameter vector on every rank.

mod checkpoint;
#[cfg(feature = "cuda")]
mod device;
mod kernel;

use half::{bf16, f16};
use oxccl_comm::harness::spawn_world_on_nodes;
use oxccl_comm::{Communicator, Config};
use oxccl_zero::{
    AdamW, Hyper, Overlap, ParamElement, Sgd, ShardGroup, ShardOptimizer, Stage, Zero, ZeroConfig,
};

/// The communicators' settings: a deadline of a minute (a hang fails in time).
pub(crate) fn test_config() -> Config {
    Config {
        timeout: std::time::Duration::from_secs(60),
        ..Config::default()
    }
}

pub(crate) const LENS: [usize; 4] = [37, 5, 96, 1];
const STEPS: usize = 10;

pub(crate) fn hypers() -> Vec<Hyper> {
    // Two parameter groups: the biases (1 and 3) without weight decay.
    (0..LENS.len())
        .map(|p| Hyper {
            lr: if p == 2 { 0.05 } else { 0.1 },
            weight_decay: if p % 2 == 1 { 0.0 } else { 0.01 },
        })
        .collect()
}

/// Rank `rank`'s gradient of parameter `p` in micro-batch `m` (counted over the run): multiples
/// of 1/8, so sums over ranks are exact in any order and exact in f16 and bf16.
pub(crate) fn grad(rank: usize, m: usize, p: usize) -> Vec<f32> {
    (0..LENS[p])
        .map(|i| ((rank * 5 + m * 3 + p * 7 + i) % 13) as f32 / 8.0 - 0.75)
        .collect()
}

/// Whether rank `rank` has a gradient for `p` in micro-batch `m` with a feed that skips some.
fn given(feed: &Feed, rank: usize, m: usize, p: usize) -> bool {
    !feed.skip || !(rank + m + p).is_multiple_of(5)
}

pub(crate) fn init(rank: usize, p: usize) -> Vec<f32> {
    (0..LENS[p])
        .map(|i| ((i + p + rank) % 7) as f32 * 0.25 - 0.5)
        .collect()
}

/// How a run feeds its gradients.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Feed {
    /// Micro-batches per step.
    pub(crate) micro: usize,
    pub(crate) max_norm: Option<f32>,
    /// Some parameters get no gradient in some micro-batches (`given`).
    pub(crate) skip: bool,
    /// One `grad_ready` per parameter, in a rank-dependent order (else `step_with`).
    pub(crate) each: bool,
}

pub(crate) const PLAIN: Feed = Feed {
    micro: 1,
    max_norm: None,
    skip: false,
    each: false,
};

/// DDP + the optimizer on the whole vector, steps `from..to` on `worlds[t]` ranks, from
/// `params` and `states`: what every rank would hold.
pub(crate) fn reference_from(
    worlds: &[usize],
    feed: Feed,
    opt: &mut dyn ShardOptimizer,
    params: &mut [Vec<f32>],
    states: &mut [Vec<f32>],
    steps: std::ops::Range<usize>,
) {
    let h = hypers();
    for t in steps {
        let world = worlds[t];
        let mut avgs: Vec<Vec<f32>> = Vec::new();
        for (p, &len) in LENS.iter().enumerate() {
            let mut avg = vec![0.0f32; len];
            for r in 0..world {
                for m in t * feed.micro..(t + 1) * feed.micro {
                    if given(&feed, r, m, p) {
                        avg.iter_mut().zip(grad(r, m, p)).for_each(|(a, g)| *a += g);
                    }
                }
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
        let each = params.iter_mut().zip(&avgs).zip(states.iter_mut());
        for (p, ((param, avg), st)) in each.enumerate() {
            opt.step(t as u64 + 1, h[p], param, avg, st);
        }
    }
}

pub(crate) fn reference(world: usize, feed: Feed, opt: &mut dyn ShardOptimizer) -> Vec<Vec<f32>> {
    let mut params: Vec<Vec<f32>> = (0..LENS.len()).map(|p| init(0, p)).collect();
    let mut states = fresh_states(opt);
    reference_from(
        &[world; STEPS],
        feed,
        opt,
        &mut params,
        &mut states,
        0..STEPS,
    );
    params
}

pub(crate) fn fresh_states(opt: &dyn ShardOptimizer) -> Vec<Vec<f32>> {
    LENS.iter()
        .map(|&l| vec![0.0; l * opt.state_per_elem()])
        .collect()
}

/// One rank's steps `steps` (micro-batches counted from `steps.start * feed.micro`).
pub(crate) fn train<T: ParamElement>(
    zero: &mut Zero<T>,
    rank: usize,
    feed: Feed,
    params: &mut [Vec<T>],
    steps: std::ops::Range<usize>,
) {
    for t in steps {
        for m in t * feed.micro..(t + 1) * feed.micro {
            let grads: Vec<Vec<T>> = (0..LENS.len())
                .map(|p| grad(rank, m, p).into_iter().map(T::from_f32).collect())
                .collect();
            if feed.each || feed.skip {
                // Arrival order differs between ranks; every rank launches its buckets alike.
                for k in 0..LENS.len() {
                    let p = (k + rank + m) % LENS.len();
                    if given(&feed, rank, m, p) {
                        zero.grad_ready(p, &grads[p]).unwrap();
                    }
                }
            } else {
                let g: Vec<&[T]> = grads.iter().map(|g| g.as_slice()).collect();
                zero.grads_ready(&g).unwrap();
            }
            let mut views: Vec<&mut [T]> = params.iter_mut().map(|p| p.as_mut_slice()).collect();
            let stepped = zero.step(&mut views).unwrap();
            assert_eq!(stepped, m + 1 == (t + 1) * feed.micro);
        }
    }
}

/// A shard layout and stage to run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Setup {
    pub(crate) group: ShardGroup,
    pub(crate) stage: Stage,
    /// Elements per bucket (0: one bucket).
    pub(crate) bucket: usize,
    pub(crate) overlap: Overlap,
}

pub(crate) fn config(setup: Setup, feed: Feed) -> ZeroConfig {
    ZeroConfig {
        group: setup.group,
        stage: setup.stage,
        bucket_elems: setup.bucket,
        buckets_in_flight: 2,
        overlap: setup.overlap,
        align: 4,
        max_grad_norm: feed.max_norm,
    }
}

pub(crate) fn zero_on<T: ParamElement>(
    comm: &Communicator,
    setup: Setup,
    feed: Feed,
    make: fn() -> Box<dyn ShardOptimizer>,
) -> (Zero<T>, Vec<Vec<T>>) {
    let rank = comm.rank();
    let mut params: Vec<Vec<T>> = (0..LENS.len())
        .map(|p| init(rank, p).into_iter().map(T::from_f32).collect())
        .collect();
    let mut views: Vec<&mut [T]> = params.iter_mut().map(|p| p.as_mut_slice()).collect();
    let mut zero = Zero::new(comm, &mut views, hypers(), make(), config(setup, feed)).unwrap();
    zero.accumulate(feed.micro).unwrap();
    (zero, params)
}

/// `got` within 1e-6 relative of `want` rounded to `T` (and one rounding step of `T` for 16
/// bits).
pub(crate) fn assert_close<T: ParamElement>(got: &[Vec<T>], want: &[Vec<f32>], what: &str) {
    let eps = f32::EPSILON.max(T::from_f32(1.0 + 1.0 / 128.0).to_f32() - 1.0);
    let eps = if eps > f32::EPSILON { eps } else { 1e-6 };
    for (p, (got, want)) in got.iter().zip(want).enumerate() {
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            let (a, b) = (a.to_f32(), *b);
            let tol = eps * b.abs().max(1.0);
            assert!(
                (a - b).abs() <= tol,
                "{what}: param {p}[{i}]: {a} against {b}"
            );
        }
    }
}

fn check<T: ParamElement>(
    world: usize,
    per_node: usize,
    setup: Setup,
    feed: Feed,
    make: fn() -> Box<dyn ShardOptimizer>,
) {
    let want = reference(world, feed, make().as_mut());
    let out = spawn_world_on_nodes(world, per_node, test_config(), |comm| {
        let rank = comm.rank();
        let (mut zero, mut params) = zero_on::<T>(&comm, setup, feed, make);
        train(&mut zero, rank, feed, &mut params, 0..STEPS);
        Ok((params, zero.last_grad_norm()))
    });
    for (rank, r) in out.into_iter().enumerate() {
        let (params, norm) = r.unwrap();
        assert_eq!(norm.is_some(), feed.max_norm.is_some());
        if let (Some(n), Some(max)) = (norm, feed.max_norm) {
            // The small limit is below the gradients' norm: those runs do clip.
            assert!(max > 10.0 || n > f64::from(max), "norm {n}, limit {max}");
        }
        let what = format!("{world} x {per_node}/node {setup:?} {feed:?} rank {rank}");
        assert_close(&params, &want, &what);
    }
}

pub(crate) fn adamw() -> Box<dyn ShardOptimizer> {
    Box::new(AdamW::default())
}

pub(crate) fn sgd() -> Box<dyn ShardOptimizer> {
    Box::new(Sgd {
        momentum: 0.9,
        dampening: 0.0,
        nesterov: true,
    })
}

/// Stage 2 overlaps backward, stage 1 does not (both are tested with both below).
const fn setup(group: ShardGroup, stage: Stage, bucket: usize) -> Setup {
    Setup {
        group,
        stage,
        bucket,
        overlap: match stage {
            Stage::One => Overlap::Off,
            Stage::Two => Overlap::On,
        },
    }
}

/// `s` with `overlap`.
const fn with(s: Setup, overlap: Overlap) -> Setup {
    Setup { overlap, ..s }
}

#[test]
fn node_local_shards_equal_ddp_and_the_same_optimizer() {
    // Shard groups of 1, 2, 3 and 4 ranks (the nodes), with replicas across the nodes; one
    // bucket and buckets of 40 elements (a parameter larger than that alone), stages 1 and 2.
    let each = Feed {
        each: true,
        ..PLAIN
    };
    for (world, per_node) in [(2, 1), (4, 2), (3, 3), (4, 4), (6, 3)] {
        let one = setup(ShardGroup::Node, Stage::One, 0);
        let two = setup(ShardGroup::Node, Stage::Two, 40);
        check::<f32>(world, per_node, two, each, adamw);
        check::<f32>(world, per_node, one, PLAIN, sgd);
    }
}

#[test]
fn world_shards_equal_ddp_and_the_same_optimizer() {
    check::<f32>(4, 2, setup(ShardGroup::World, Stage::Two, 40), PLAIN, adamw);
    check::<f32>(3, 1, setup(ShardGroup::World, Stage::One, 7), PLAIN, sgd);
}

#[test]
fn accumulation_missing_gradients_and_clipping_equal_those_of_the_full_gradient() {
    let accumulate = Feed {
        micro: 3,
        skip: true,
        ..PLAIN
    };
    // The averaged gradients' norms are a few units: 1.0 clips every step, 100 none.
    for max in [1.0, 100.0] {
        let clip = Feed {
            micro: 2,
            max_norm: Some(max),
            ..PLAIN
        };
        check::<f32>(4, 2, setup(ShardGroup::Node, Stage::Two, 40), clip, sgd);
        check::<f32>(4, 4, setup(ShardGroup::World, Stage::One, 0), clip, adamw);
    }
    for (stage, overlap) in [(Stage::One, Overlap::On), (Stage::Two, Overlap::Off)] {
        let s = with(setup(ShardGroup::Node, stage, 30), overlap);
        check::<f32>(6, 3, s, accumulate, adamw);
    }
}

#[test]
fn half_parameters_step_f32_masters() {
    let two = setup(ShardGroup::Node, Stage::Two, 40);
    check::<bf16>(4, 2, two, PLAIN, adamw);
    check::<f16>(4, 2, setup(ShardGroup::World, Stage::One, 0), PLAIN, sgd);
}

#[test]
fn state_shrinks_with_the_shard_group() {
    let out = spawn_world_on_nodes(4, 4, test_config(), |comm| {
        let one = setup(ShardGroup::Node, Stage::One, 0);
        let two = setup(ShardGroup::Node, Stage::Two, 40);
        let (z1, _) = zero_on::<f32>(&comm, one, PLAIN, adamw);
        let (mut z2, mut params) = zero_on::<f32>(&comm, two, PLAIN, adamw);
        train(&mut z2, comm.rank(), PLAIN, &mut params, 0..1);
        Ok((
            z1.state_bytes(),
            z1.master_bytes(),
            z1.grad_bytes(),
            z2.grad_bytes(),
        ))
    });
    let total: usize = LENS.iter().sum();
    let bytes: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
    for &(state, master, g1, g2) in &bytes {
        // AdamW: two f32 state vectors over a quarter of the elements (one bucket: padded to
        // 4 x 4 x 4 elements at most), and the f32 master weights of that quarter.
        assert!(state <= 2 * 4 * (total / 4 + 4), "{bytes:?}");
        assert!(state * 4 >= 2 * 4 * total, "{bytes:?}");
        assert_eq!(master * 2, state, "{bytes:?}");
        // Stage 1 keeps every gradient; stage 2 its shard and two buckets of at most 100.
        assert!(g1 >= 4 * total, "{bytes:?}");
        assert!(g2 <= 4 * (total / 4 + 16 + 2 * 112), "{bytes:?}");
    }
}

#[test]
fn another_parameter_list_fails_the_step_on_every_rank() {
    let out = spawn_world_on_nodes(3, 3, test_config(), |comm| {
        let rank = comm.rank();
        let two = setup(ShardGroup::Node, Stage::Two, 40);
        let (mut zero, mut params) = zero_on::<f32>(&comm, two, PLAIN, sgd);
        let grads: Vec<Vec<f32>> = (0..LENS.len()).map(|p| grad(rank, 0, p)).collect();
        let mut g: Vec<&[f32]> = grads.iter().map(|g| g.as_slice()).collect();
        if rank == 1 {
            g.pop();
        }
        let mut views: Vec<&mut [f32]> = params.iter_mut().map(|p| p.as_mut_slice()).collect();
        let e = zero.step_with(&mut views, &g).unwrap_err().to_string();
        // The optimizer is unusable afterwards, and says why.
        let again = zero.step(&mut views).unwrap_err().to_string();
        Ok((e, again))
    });
    for (rank, r) in out.into_iter().enumerate() {
        let (e, again) = r.unwrap();
        assert!(e.starts_with(&format!("rank {rank}: zero step")), "{e}");
        assert!(
            e.contains("rank 1: gradients of lengths [37, 5, 96]"),
            "{e}"
        );
        assert!(e.contains("ranks 0, 2: step 1 of parameters"), "{e}");
        assert!(again.contains("unusable after an earlier error"), "{again}");
    }
}

#[test]
fn accumulation_that_differs_between_ranks_is_named_on_every_rank() {
    let out = spawn_world_on_nodes(2, 2, test_config(), |comm| {
        let rank = comm.rank();
        let mut params: Vec<Vec<f32>> = (0..LENS.len()).map(|p| init(rank, p)).collect();
        let mut views: Vec<&mut [f32]> = params.iter_mut().map(|p| p.as_mut_slice()).collect();
        let cfg = config(setup(ShardGroup::Node, Stage::Two, 40), PLAIN);
        let mut zero = Zero::new(&comm, &mut views, hypers(), sgd(), cfg).unwrap();
        Ok(zero.accumulate(rank + 1).unwrap_err().to_string())
    });
    for (rank, r) in out.into_iter().enumerate() {
        let e = r.unwrap();
        assert!(
            e.starts_with(&format!("rank {rank}: zero accumulate")),
            "{e}"
        );
        assert!(
            e.contains("rank 0: accumulate(1); rank 1: accumulate(2)"),
            "{e}"
        );
    }
}
