//! Checkpoints: saved by a shard group of 4, resumed by groups of 2 and 1, equal to the run
//! that was not interrupted; consolidated offline into the whole state; refused on every rank
//! when they are not this optimizer's.

use std::path::{Path, PathBuf};

use oxccl_comm::harness::spawn_world_on_nodes;
use oxccl_zero::{consolidate, FullState, Overlap, ShardGroup, Stage};

use crate::{
    adamw, assert_close, fresh_states, init, reference_from, sgd, test_config, train, zero_on,
    Setup, LENS, PLAIN,
};

/// A directory of its own under the temporary directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("oxccl-zero-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const SAVED_AT: usize = 5;
const STEPS: usize = 8;

/// Trains `steps` on `world` ranks in one node, loading `load` first and saving to `save` after.
fn run(
    world: usize,
    stage: Stage,
    load: Option<&Path>,
    save: Option<&Path>,
    steps: std::ops::Range<usize>,
) -> Vec<Vec<f32>> {
    let setup = Setup {
        group: ShardGroup::Node,
        stage,
        bucket: 40,
        overlap: Overlap::Auto,
    };
    let out = spawn_world_on_nodes(world, world, test_config(), |comm| {
        let (mut zero, mut params) = zero_on::<f32>(&comm, setup, PLAIN, adamw);
        if let Some(dir) = load {
            let mut views: Vec<&mut [f32]> = params.iter_mut().map(|p| p.as_mut_slice()).collect();
            zero.load(dir, &mut views).unwrap();
            assert_eq!(zero.steps(), steps.start as u64);
        }
        train(&mut zero, comm.rank(), PLAIN, &mut params, steps.clone());
        if let Some(dir) = save {
            zero.save(dir).unwrap();
        }
        Ok(params)
    });
    let mut all: Vec<Vec<Vec<f32>>> = out.into_iter().map(|r| r.unwrap()).collect();
    all.swap_remove(0)
}

#[test]
fn a_checkpoint_of_4_shards_resumes_on_2_and_1_as_the_uninterrupted_run() {
    let dir = TempDir::new("resume");
    run(4, Stage::Two, None, Some(&dir.0), 0..SAVED_AT);
    // The reference: 4 ranks until the checkpoint, then the resumed world's.
    let mut opt = adamw();
    let mut params: Vec<Vec<f32>> = (0..LENS.len()).map(|p| init(0, p)).collect();
    let mut states = fresh_states(opt.as_ref());
    let mut worlds = [4; STEPS];
    reference_from(
        &worlds,
        PLAIN,
        opt.as_mut(),
        &mut params,
        &mut states,
        0..SAVED_AT,
    );
    // Offline: the whole state is the reference's, and survives a file of its own.
    let full = consolidate(&dir.0).unwrap();
    assert_eq!(
        (full.optimizer.as_str(), full.step),
        ("adamw", SAVED_AT as u64)
    );
    assert_eq!(full.state_names, ["exp_avg", "exp_avg_sq"]);
    let master: Vec<Vec<f32>> = full.params.iter().map(|p| p.master.clone()).collect();
    assert_close(&master, &params, "consolidated master weights");
    let state: Vec<Vec<f32>> = full.params.iter().map(|p| p.state.concat()).collect();
    assert_close(&state, &states, "consolidated AdamW state");
    let file = dir.0.join("full.safetensors");
    full.save(&file).unwrap();
    assert_eq!(FullState::load(&file).unwrap(), full);
    for world in [2, 1] {
        let (mut p, mut s) = (params.clone(), states.clone());
        worlds[SAVED_AT..].fill(world);
        reference_from(
            &worlds,
            PLAIN,
            opt.as_mut(),
            &mut p,
            &mut s,
            SAVED_AT..STEPS,
        );
        for stage in [Stage::One, Stage::Two] {
            let got = run(world, stage, Some(&dir.0), None, SAVED_AT..STEPS);
            assert_close(&got, &p, &format!("resumed on {world} ({stage:?})"));
        }
    }
}

#[test]
fn a_checkpoint_of_another_optimizer_or_none_fails_on_every_rank() {
    let dir = TempDir::new("refuse");
    run(2, Stage::Two, None, Some(&dir.0), 0..1);
    let setup = Setup {
        group: ShardGroup::Node,
        stage: Stage::One,
        bucket: 0,
        overlap: Overlap::Auto,
    };
    let missing = dir.0.join("nothing-here");
    let out = spawn_world_on_nodes(3, 3, test_config(), |comm| {
        let (mut zero, mut params) = zero_on::<f32>(&comm, setup, PLAIN, sgd);
        let mut views: Vec<&mut [f32]> = params.iter_mut().map(|p| p.as_mut_slice()).collect();
        let other = zero.load(&dir.0, &mut views).unwrap_err().to_string();
        let none = zero.load(&missing, &mut views).unwrap_err().to_string();
        Ok((other, none))
    });
    for (rank, r) in out.into_iter().enumerate() {
        let (other, none) = r.unwrap();
        assert!(
            other.starts_with(&format!("rank {rank}: zero load")),
            "{other}"
        );
        assert!(
            other.contains("a state of adamw [\"exp_avg\", \"exp_avg_sq\"] for sgd"),
            "{other}"
        );
        assert!(none.contains("nothing-here/zero.json"), "{none}");
    }
}
