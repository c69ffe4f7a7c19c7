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
//! rank's code (3). examples/05_replace_a_lost_rank.rs grows back to the full size instead, with
//! a replacement process.
//!
//! After a loss the survivors take rank 0's state (step, weights, history): the lost rank may
//! have sent its last data of a step to one survivor and not to another, so one finished the
//! step and the other did not. Kept simple on purpose: one failure at a time. A real trainer
//! would retry `shrink` with the union of the ranks lost (a second rank may die meanwhile).

use oxccl::comm::{Communicator, Error, ReduceOp, Result};

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

/// Where a run is: the members (numbered as at the start; replacements get the next numbers),
/// the weights and, for every finished step, the members whose gradients it averaged.
#[derive(Debug, Clone, PartialEq)]
pub struct State {
    /// The step to run next.
    pub step: usize,
    /// The next number a replacement gets.
    pub next_id: usize,
    /// The member numbers of the communicator's ranks, in rank order.
    pub members: Vec<usize>,
    /// The weights.
    pub w: Vec<f32>,
    /// The members of every finished step.
    pub history: Vec<Vec<usize>>,
}

impl State {
    /// The state at the start, on `size` ranks.
    pub fn start(size: usize) -> State {
        State {
            step: 0,
            next_id: size,
            members: (0..size).collect(),
            w: vec![0.0; DIM],
            history: Vec::new(),
        }
    }

    fn encode(&self) -> Vec<u64> {
        let mut v = vec![self.step as u64, self.next_id as u64];
        for list in std::iter::once(&self.members).chain(&self.history) {
            v.push(list.len() as u64);
            v.extend(list.iter().map(|&m| m as u64));
        }
        v
    }

    fn decode(v: &[u64], w: Vec<f32>) -> Option<State> {
        let mut it = v.iter().map(|&x| usize::try_from(x).ok());
        let (step, next_id) = (it.next()??, it.next()??);
        let mut lists = Vec::new();
        while let Some(n) = it.next() {
            lists.push(
                (0..n?)
                    .map(|_| it.next().flatten())
                    .collect::<Option<Vec<_>>>()?,
            );
        }
        let members = (!lists.is_empty()).then(|| lists.remove(0))?;
        Some(State {
            step,
            next_id,
            members,
            w,
            history: lists,
        })
    }
}

/// Hands `state` from rank 0 to every rank of `comm` (a replacement passes any state; it gets
/// rank 0's).
///
/// # Errors
/// Errors of the broadcasts; `InvalidArgument` if what came is not a state.
pub fn share_state(comm: &Communicator, state: &State) -> Result<State> {
    let mut encoded = state.encode();
    let mut len = [encoded.len() as u64];
    comm.broadcast(&mut len, 0)?;
    encoded.resize(len[0] as usize, 0);
    comm.broadcast(&mut encoded, 0)?;
    let mut w = state.w.clone();
    w.resize(DIM, 0.0);
    comm.broadcast(&mut w, 0)?;
    State::decode(&encoded, w).ok_or_else(|| Error::InvalidArgument {
        rank: comm.rank(),
        op: "share_state".into(),
        msg: format!("rank 0 sent {} words that are not a state", encoded.len()),
    })
}

/// What the others do when a rank is lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// Shrink it away and go on with one rank less.
    Shrink,
    /// Shrink it away, then grow back to the same size with a replacement process (which
    /// runs [`joined`]; examples/05_replace_a_lost_rank.rs).
    Replace,
}

/// Runs the steps up to `steps` from `state` on `comm`. The member numbered `fail.0` calls
/// `crash` at step `fail.1` and returns `None` (dropping its communicator, if `crash`
/// returns). When a rank is lost, the others recover as `recovery` says, then take rank 0's
/// state: a rank may have finished the step in which another lost a peer (the lost rank's last
/// data reached one but not the other), and this way they all go on from the same step.
///
/// # Errors
/// Any error other than a lost peer; errors of `shrink`, `grow` and of sharing the state.
pub fn train(
    mut comm: Communicator,
    mut state: State,
    fail: Option<(usize, usize)>,
    steps: usize,
    recovery: Recovery,
    crash: impl FnOnce(),
) -> Result<Option<Outcome>> {
    let mut crash = Some(crash);
    while state.step < steps {
        let (me, step) = (state.members[comm.rank()], state.step);
        if fail == Some((me, step)) {
            if let Some(crash) = crash.take() {
                crash();
            }
            return Ok(None);
        }
        let mut g = grad(me, step);
        match comm.all_reduce(&mut g, ReduceOp::Sum) {
            Ok(()) => {
                let n = state.members.len() as f32;
                for (w, g) in state.w.iter_mut().zip(&g) {
                    *w -= LR * g / n;
                }
                state.history.push(state.members.clone());
                state.step += 1;
            }
            Err(e) => {
                let Some(lost) = e.lost_peer() else {
                    return Err(e);
                };
                println!(
                    "member {me}: step {step}: member {} lost ({e}); {}",
                    state.members[lost],
                    match recovery {
                        Recovery::Shrink => "going on without it",
                        Recovery::Replace => "replacing it",
                    }
                );
                let t0 = std::time::Instant::now();
                let size = comm.size();
                comm = comm.shrink(&[lost])?;
                state.members.remove(lost);
                if recovery == Recovery::Replace {
                    comm = comm.grow(size)?;
                    state.members.push(state.next_id);
                    state.next_id += 1;
                }
                state = share_state(&comm, &state)?;
                println!(
                    "member {me}: recovered in {:.1} ms (shrink{}, state from rank 0)",
                    t0.elapsed().as_secs_f64() * 1e3,
                    if recovery == Recovery::Replace {
                        ", grow"
                    } else {
                        ""
                    }
                );
            }
        }
    }
    // Every rank must hold the same weights.
    let mut all = vec![0f32; DIM * comm.size()];
    comm.all_gather_into(&state.w, &mut all)?;
    if all.chunks(DIM).any(|other| other != state.w.as_slice()) {
        return Err(Error::InvalidArgument {
            rank: comm.rank(),
            op: "check".into(),
            msg: "the ranks' weights differ".into(),
        });
    }
    Ok(Some(Outcome {
        w: state.w,
        history: state.history,
    }))
}

/// A replacement: `comm` is the grown communicator it joined; takes the state from rank 0 and
/// runs the remaining steps.
///
/// # Errors
/// As [`train`].
pub fn joined(comm: Communicator, steps: usize) -> Result<Option<Outcome>> {
    let state = share_state(&comm, &State::start(0))?;
    train(comm, state, None, steps, Recovery::Replace, || ())
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

/// The number after `name` on the command line.
pub fn arg(name: &str) -> Option<usize> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1)?.parse().ok()
}

#[allow(dead_code)]
fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    oxccl::logging::init(); // OXCCL_DEBUG=info shows transports and algorithms
    let steps = arg("--steps").unwrap_or(8);
    let fail = arg("--fail-rank").map(|r| (r, arg("--fail-step").unwrap_or(3)));
    let comm = Communicator::from_env()?;
    let crash = crash(comm.rank(), fail);
    let state = State::start(comm.size());
    if let Some(o) = train(comm, state, fail, steps, Recovery::Shrink, crash)? {
        report(steps, &o)?;
    }
    Ok(())
}

/// The simulated crash of rank `me`: exits with code 3.
pub fn crash(me: usize, fail: Option<(usize, usize)>) -> impl FnOnce() {
    move || {
        eprintln!(
            "rank {me}: exiting at step {} (simulated crash)",
            fail.map_or(0, |f| f.1)
        );
        std::process::exit(3);
    }
}

/// Prints how the run ended; an error if the weights do not match the recomputation.
pub fn report(steps: usize, o: &Outcome) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let ok = matches_reference(o);
    let last = o.history.last().cloned().unwrap_or_default();
    println!(
        "{steps} steps, last on members {last:?}; weights {} the serial recomputation",
        if ok { "match" } else { "DO NOT match" }
    );
    if !ok {
        return Err("weights differ from the serial recomputation".into());
    }
    Ok(())
}
