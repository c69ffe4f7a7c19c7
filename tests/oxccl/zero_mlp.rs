//! Node-local ZeRO end to end on the MLP of examples/07_zero_mlp.rs: every rank's model after
//! every step within 1e-4 relative of one process trained on the concatenated batch with AdamW
//! on whole parameters, and the replicas bit-identical. As threads on simulated nodes (stages 1
//! and 2, node-local and world-wide shard groups, overlap on and off, accumulation, clipping, a
//! checkpoint resumed), as processes started by `oxccl launch`, and on 2 nodes x 2 ranks in
//! network namespaces (`multinode`): shards inside each node, replicas across.
//!
//! The process ranks are this test binary: `rank_entry` does nothing in a normal run and trains
//! ([`play_rank`]) when `OXCCL_TEST_ZERO` is set (its value: the steps to train).

#[path = "../../examples/07_zero_mlp/run.rs"]
#[allow(dead_code)]
mod run;

use oxccl::comm::harness::spawn_world_on_nodes;
use oxccl::comm::{Communicator, Config};
use oxccl::zero::{Overlap, ShardGroup, Stage, ZeroConfig};

use crate::common;
// The MLP module, compiled once for the test binary (`run` reaches it as `super::mlp`).
use crate::ddp_mlp::mlp;

/// The run: `steps` steps of `micro` micro-batches, small buckets (the MLP spans several).
fn opts(steps: usize, micro: usize, cfg: ZeroConfig) -> run::Opts {
    run::Opts {
        shape: mlp::Shape::default(),
        steps,
        micro,
        cfg: ZeroConfig {
            bucket_elems: 1500,
            ..cfg
        },
        check: true,
        save: None,
        resume: None,
    }
}

/// Trains with `--check` on this rank, returning the model's hash: the caller compares them.
fn train(comm: &Communicator, o: &run::Opts) -> Result<u64, String> {
    let t = run::train(comm, o, |_, _| {}).map_err(|e| e.to_string())?;
    if !(t.losses.iter().all(|l| l.is_finite()) && t.worst <= run::CHECK_TOL) {
        return Err(format!("losses {:?}, worst {}", t.losses, t.worst));
    }
    Ok(mlp::param_hash(&t.model))
}

fn threads(world: usize, per_node: usize, o: &run::Opts) {
    let out = spawn_world_on_nodes(world, per_node, Config::default(), |c| Ok(train(&c, o)));
    let hashes: Vec<u64> = out
        .into_iter()
        .map(|r| r.unwrap().unwrap_or_else(|e| panic!("{o:?}: {e}")))
        .collect();
    assert!(
        hashes.iter().all(|&h| h == hashes[0]),
        "replicas differ: {o:?}"
    );
}

#[test]
fn zero_matches_one_process_on_the_concatenated_batch_threads() {
    let cfg = |group, stage, overlap| ZeroConfig {
        group,
        stage,
        overlap,
        ..ZeroConfig::default()
    };
    let node2 = cfg(ShardGroup::Node, Stage::Two, Overlap::On);
    threads(4, 2, &opts(6, 1, node2.clone()));
    threads(
        4,
        2,
        &opts(4, 2, cfg(ShardGroup::Node, Stage::One, Overlap::Off)),
    );
    threads(
        3,
        3,
        &opts(4, 1, cfg(ShardGroup::World, Stage::Two, Overlap::Off)),
    );
    let clip = ZeroConfig {
        max_grad_norm: Some(0.05),
        ..node2
    };
    threads(4, 2, &opts(4, 2, clip));
}

#[test]
fn a_resumed_run_continues_the_interrupted_one_threads() {
    let dir = std::env::temp_dir().join(format!("oxccl-zero-mlp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = ZeroConfig {
        group: ShardGroup::Node,
        ..ZeroConfig::default()
    };
    let whole = opts(6, 1, cfg.clone());
    let first = run::Opts {
        steps: 3,
        save: Some(dir.clone()),
        ..whole.clone()
    };
    let rest = run::Opts {
        steps: 3,
        resume: Some(dir.clone()),
        ..whole.clone()
    };
    let run = |o: &run::Opts| {
        let out = spawn_world_on_nodes(4, 2, Config::default(), |c| {
            Ok(run::train(&c, o, |_, _| {}).map_err(|e| e.to_string()))
        });
        let mut t: Vec<run::Trained> = out.into_iter().map(|r| r.unwrap().unwrap()).collect();
        t.swap_remove(0)
    };
    let uninterrupted = run(&whole);
    run(&first);
    let resumed = run(&rest);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(resumed.steps, 6);
    assert_eq!(resumed.losses, uninterrupted.losses[3..]);
    assert_eq!(resumed.model, uninterrupted.model);
}

/// Plays one rank when started by `oxccl launch` (`OXCCL_TEST_ZERO` set to the steps; does
/// nothing otherwise): node-local ZeRO-2 with `--check`, then the model's hash compared across
/// the ranks.
pub(crate) fn play_rank() {
    let Ok(steps) = std::env::var("OXCCL_TEST_ZERO") else {
        return;
    };
    let comm = Communicator::from_env().expect("communicator from the environment");
    let o = opts(steps.parse().unwrap_or(5), 1, ZeroConfig::default());
    let r = train(&comm, &o).and_then(|h| {
        let mut v = [h, !h];
        comm.all_reduce(&mut v, oxccl::comm::ReduceOp::Max)
            .map_err(|e| e.to_string())?;
        (v == [h, !h])
            .then_some(())
            .ok_or_else(|| "replicas differ".to_string())
    });
    match r {
        Ok(()) => println!(
            "RESULT rank={} ok node={} shard={}",
            comm.rank(),
            comm.node_index(),
            comm.local_rank()
        ),
        Err(e) => {
            println!("RESULT rank={} FAILED {e}", comm.rank());
            std::process::exit(1);
        }
    }
}

#[test]
fn zero_matches_one_process_on_the_concatenated_batch_processes() {
    let out = common::launch_self(4, &[("OXCCL_TEST_ZERO", "5")]);
    common::assert_all_ok(&out, 4);
}
