//! Data-parallel steps that survive a lost rank: when a rank dies, the others get `PeerLost`
//! naming it, `shrink` it away and redo the step with one rank less, instead of restarting the
//! job from a checkpoint.
//!
//! Every step all-reduces each rank's gradient and applies the average to the weights. Rank
//! `--fail-rank` exits (code 3) at step `--fail-step`; the launcher must leave the others
//! running, which `oxccl launch --keep-going` does (a plain launch stops every rank when one
//! fails, as torchrun does):
//!
//! ```sh
//! cargo build --release --bin oxccl --example 04_survive_a_lost_rank
//! target/release/oxccl launch -n 4 --keep-going -- \
//!     target/release/examples/04_survive_a_lost_rank --fail-rank 2 --fail-step 3
//! ```
//!
//! Each survivor checks its weights against a serial recomputation over the ranks that took part
//! in each step, and that every survivor holds the same weights; the launcher exits with the lost
//! rank's code (3).
//!
//! Kept simple on purpose: one failure at a time, before the step's all-reduce (so no survivor
//! has finished the step another redoes). A real trainer would retry `shrink` with the union of
//! the ranks lost (a second rank may die meanwhile) and agree on the step to redo after it, e.g.
//! with an all-reduce (min) of each survivor's last finished step.

use oxccl::comm::{Communicator, ReduceOp, Result};

/// Weights per rank.
pub const DIM: usize = 1000;
/// Learning rate.
pub const LR: f32 = 0.5;

/// The gradient of the rank that was rank `orig` at the start, at `step`: small integers.
pub fn grad(orig: usize, step: usize) -> Vec<f32> {
    (0..DIM)
        .map(|i| ((orig * 31 + step * 7 + i) % 11) as f32 - 5.0)
        .collect()
}

/// What a surviving rank ends with.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The weights.
    pub w: Vec<f32>,
    /// For every step, the ranks (numbered as at the start) whose gradients it averaged.
    pub history: Vec<Vec<usize>>,
}

/// Runs `steps` steps on `comm` (the whole job at the start). The rank numbered `fail.0` at the
/// start calls `crash` at step `fail.1` and returns `None` (dropping its communicator, if
/// `crash` returns). The others return their outcome.
///
/// # Errors
/// Any error other than a lost peer, and errors of `shrink`.
pub fn train(
    mut comm: Communicator,
    fail: Option<(usize, usize)>,
    steps: usize,
    crash: impl FnOnce(),
) -> Result<Option<Outcome>> {
    let me = comm.rank();
    // The ranks of `comm`, numbered as at the start.
    let mut members: Vec<usize> = (0..comm.size()).collect();
    let mut w = vec![0f32; DIM];
    let mut history = Vec::with_capacity(steps);
    let mut crash = Some(crash);
    for step in 0..steps {
        if fail == Some((me, step)) {
            if let Some(crash) = crash.take() {
                crash();
            }
            return Ok(None);
        }
        let g = loop {
            let mut g = grad(me, step);
            match comm.all_reduce(&mut g, ReduceOp::Sum) {
                Ok(()) => break g,
                Err(e) => {
                    let Some(lost) = e.lost_peer() else {
                        return Err(e);
                    };
                    println!(
                        "rank {me}: step {step}: rank {} lost ({e}); going on without it",
                        members[lost]
                    );
                    comm = comm.shrink(&[lost])?;
                    members.remove(lost);
                }
            }
        };
        let n = members.len() as f32;
        for (w, g) in w.iter_mut().zip(&g) {
            *w -= LR * g / n;
        }
        history.push(members.clone());
    }
    // Every survivor must hold the same weights.
    let mut all = vec![0f32; DIM * comm.size()];
    comm.all_gather(&w, &mut all)?;
    if all.chunks(DIM).any(|other| other != w.as_slice()) {
        return Err(oxccl::comm::Error::InvalidArgument {
            rank: me,
            op: "check".into(),
            msg: "the survivors' weights differ".into(),
        });
    }
    Ok(Some(Outcome { w, history }))
}

/// The weights `history` gives, computed serially in `f64`.
pub fn reference(history: &[Vec<usize>]) -> Vec<f64> {
    let mut w = vec![0f64; DIM];
    for (step, ranks) in history.iter().enumerate() {
        let mut sum = vec![0f64; DIM];
        for &r in ranks {
            for (s, g) in sum.iter_mut().zip(grad(r, step)) {
                *s += f64::from(g);
            }
        }
        for (w, s) in w.iter_mut().zip(&sum) {
            *w -= f64::from(LR) * s / ranks.len() as f64;
        }
    }
    w
}

/// Whether `w` matches [`reference`] within `f32` rounding.
pub fn matches_reference(o: &Outcome) -> bool {
    let want = reference(&o.history);
    o.w.iter()
        .zip(&want)
        .all(|(&got, &want)| (f64::from(got) - want).abs() <= 1e-4 * want.abs().max(1.0))
}

fn arg(name: &str) -> Option<usize> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1)?.parse().ok()
}

#[allow(dead_code)]
fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let steps = arg("--steps").unwrap_or(8);
    let fail = arg("--fail-rank").map(|r| (r, arg("--fail-step").unwrap_or(3)));
    let comm = Communicator::from_env()?;
    let me = comm.rank();
    let crash = || {
        eprintln!(
            "rank {me}: exiting at step {} (simulated crash)",
            fail.map_or(0, |f| f.1)
        );
        std::process::exit(3);
    };
    if let Some(o) = train(comm, fail, steps, crash)? {
        let ok = matches_reference(&o);
        println!(
            "rank {me}: {steps} steps, last on {} ranks {:?}; weights {} the serial \
             recomputation",
            o.history.last().map_or(0, Vec::len),
            o.history.last().cloned().unwrap_or_default(),
            if ok { "match" } else { "DO NOT match" }
        );
        if !ok {
            return Err("weights differ from the serial recomputation".into());
        }
    }
    Ok(())
}
