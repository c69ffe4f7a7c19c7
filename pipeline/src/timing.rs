//! When each computation of a schedule runs, and the exchanges derived from it.
//!
//! [`timeline`] runs each rank's computations in order, each as soon as its inputs are there
//! (the previous stage's forward, the next stage's input gradient, this stage's own forward or
//! input gradient), for given [`Costs`], with no time for the transfers. [`exchanges`] puts
//! every message in one batch of its sender and one of its receiver, both at the instant it is
//! produced, and inserts each batch into the rank's list before the first computation still
//! running after that instant.

use std::collections::{BTreeMap, HashMap};

use crate::schedule::{Action, Costs, Dir, Op, Schedule, ScheduleKind};

/// Each rank's computations with their start and end, in the units of the [`Costs`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timeline {
    /// Per rank: (computation, start, end), in order.
    pub ranks: Vec<Vec<(Action, u64, u64)>>,
    /// When the last computation ends.
    pub total: u64,
}

impl Timeline {
    /// The fraction of the ranks' time spent idle: `1 - busy / (ranks x total)`.
    pub fn bubble(&self) -> f64 {
        if self.total == 0 || self.ranks.is_empty() {
            return 0.0;
        }
        let busy: u64 = self
            .ranks
            .iter()
            .flat_map(|r| r.iter().map(|(_, s, e)| e - s))
            .sum();
        1.0 - busy as f64 / (self.total as f64 * self.ranks.len() as f64)
    }
}

/// The timeline of `s`'s computations for `costs`.
///
/// # Errors
/// A message naming the ranks that cannot go on when the orders wait on each other (no
/// schedule made by [`Schedule::new`] does).
pub fn timeline(s: &Schedule, costs: Costs) -> Result<Timeline, String> {
    let orders: Vec<Vec<Action>> = (0..s.p).map(|r| s.computations(r)).collect();
    asap(s.p, s.v, &orders, costs)
}

/// What a computation produces, for the dependencies: a stage's forward output, its input
/// gradient, or its weight gradient.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Made {
    Fwd,
    InputGrad,
    WeightGrad,
}

/// What `a` (on `stage` of `stages`) needs first, as (what, stage, micro-batch).
fn needs(a: &Action, stage: usize, stages: usize) -> Vec<(Made, usize, usize)> {
    match a {
        Action::Forward(st) if stage > 0 => vec![(Made::Fwd, stage - 1, st.mb)],
        Action::Backward(st) | Action::BackwardInput(st) => {
            let mut v = vec![(Made::Fwd, stage, st.mb)];
            if stage + 1 < stages {
                v.push((Made::InputGrad, stage + 1, st.mb));
            }
            v
        }
        Action::BackwardWeight(st) => vec![(Made::InputGrad, stage, st.mb)],
        _ => Vec::new(),
    }
}

fn made(a: &Action) -> Vec<Made> {
    match a {
        Action::Forward(_) => vec![Made::Fwd],
        Action::Backward(_) => vec![Made::InputGrad, Made::WeightGrad],
        Action::BackwardInput(_) => vec![Made::InputGrad],
        Action::BackwardWeight(_) => vec![Made::WeightGrad],
        Action::Exchange(_) => Vec::new(),
    }
}

/// Runs the computation orders as soon as possible (see the module docs).
pub(crate) fn asap(
    p: usize,
    v: usize,
    orders: &[Vec<Action>],
    costs: Costs,
) -> Result<Timeline, String> {
    let stages = p * v;
    let mut done: HashMap<(Made, usize, usize), u64> = HashMap::new();
    let mut pc = vec![0usize; p];
    let mut free = vec![0u64; p];
    let mut out: Vec<Vec<(Action, u64, u64)>> = vec![Vec::new(); p];
    loop {
        let mut moved = false;
        for r in 0..p {
            while let Some(a) = orders[r].get(pc[r]) {
                let Some(st) = a.step() else {
                    pc[r] += 1;
                    continue;
                };
                let stage = st.chunk * p + r;
                let mut start = free[r];
                let mut ready = true;
                for n in needs(a, stage, stages) {
                    match done.get(&n) {
                        Some(&t) => start = start.max(t),
                        None => ready = false,
                    }
                }
                if !ready {
                    break;
                }
                let end = start + costs.of(a).max(1);
                for w in made(a) {
                    done.insert((w, stage, st.mb), end);
                }
                out[r].push((a.clone(), start, end));
                free[r] = end;
                pc[r] += 1;
                moved = true;
            }
        }
        if (0..p).all(|r| pc[r] == orders[r].len()) {
            break;
        }
        if !moved {
            let stuck: Vec<String> = (0..p)
                .filter_map(|r| orders[r].get(pc[r]).map(|a| format!("rank {r} at {a:?}")))
                .collect();
            return Err(format!(
                "the computation orders wait on each other: {}",
                stuck.join("; ")
            ));
        }
    }
    let total = free.iter().copied().max().unwrap_or(0);
    Ok(Timeline { ranks: out, total })
}

/// The order of two messages on one link, the same on both ends: direction, micro-batch,
/// the sender's stage.
fn message_key(op: &Op, rank: usize, p: usize) -> (Dir, usize, usize) {
    match *op {
        Op::Send { dir, mb, chunk, .. } => (dir, mb, chunk * p + rank),
        Op::Recv { dir, mb, chunk, .. } => {
            let stage = chunk * p + rank;
            let from = match dir {
                Dir::Act => stage - 1,
                Dir::Grad => stage + 1,
            };
            (dir, mb, from)
        }
    }
}

/// The action lists: each rank's computations with the batches of the module docs inserted.
pub(crate) fn exchanges(p: usize, v: usize, tl: &Timeline) -> Vec<Vec<Action>> {
    let stages = p * v;
    let mut batches: Vec<BTreeMap<u64, Vec<Op>>> = vec![BTreeMap::new(); p];
    for (r, list) in tl.ranks.iter().enumerate() {
        for (a, _, end) in list {
            let Some(st) = a.step() else { continue };
            let stage = st.chunk * p + r;
            let (dir, to) = match a {
                Action::Forward(_) if stage + 1 < stages => (Dir::Act, stage + 1),
                Action::Backward(_) | Action::BackwardInput(_) if stage > 0 => {
                    (Dir::Grad, stage - 1)
                }
                _ => continue,
            };
            let (peer, peer_chunk) = (to % p, to / p);
            if peer == r {
                continue; // one rank: handed over in memory
            }
            let mb = st.mb;
            batches[r].entry(*end).or_default().push(Op::Send {
                peer,
                dir,
                mb,
                chunk: st.chunk,
            });
            batches[peer].entry(*end).or_default().push(Op::Recv {
                peer: r,
                dir,
                mb,
                chunk: peer_chunk,
            });
        }
    }
    let mut out = Vec::with_capacity(p);
    for (r, list) in tl.ranks.iter().enumerate() {
        let mut actions = Vec::new();
        let mut pending = std::mem::take(&mut batches[r]).into_iter().peekable();
        for (a, _, end) in list {
            // Every batch of an instant before this computation's end goes before it.
            while let Some((t, _)) = pending.peek() {
                if *t >= *end {
                    break;
                }
                let (_, ops) = pending.next().expect("peeked");
                actions.push(Action::Exchange(sorted(ops, r, p)));
            }
            actions.push(a.clone());
        }
        actions.extend(pending.map(|(_, ops)| Action::Exchange(sorted(ops, r, p))));
        out.push(actions);
    }
    out
}

fn sorted(mut ops: Vec<Op>, rank: usize, p: usize) -> Vec<Op> {
    ops.sort_by_key(|o| {
        (
            o.peer(),
            matches!(o, Op::Recv { .. }),
            message_key(o, rank, p),
        )
    });
    ops
}

/// The bubble fraction of `kind`'s timeline for `p`, `m`, `v` and `costs`.
///
/// # Errors
/// As [`Schedule::with_costs`].
pub fn bubble(
    kind: ScheduleKind,
    p: usize,
    m: usize,
    v: usize,
    costs: Costs,
) -> Result<f64, crate::ScheduleError> {
    let s = Schedule::with_costs(kind, p, m, v, costs)?;
    timeline(&s, costs)
        .map(|t| t.bubble())
        .map_err(crate::ScheduleError)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bubbles_meet_the_theory() {
        let c = Costs::default();
        for p in 2..=8 {
            for m in [p, 2 * p, 3 * p + 1, 4 * p] {
                for (kind, v) in [
                    (ScheduleKind::GPipe, 1),
                    (ScheduleKind::OneFOneB, 1),
                    (ScheduleKind::Interleaved, 2),
                    (ScheduleKind::Interleaved, 3),
                    (ScheduleKind::ZeroBubbleH1, 1),
                ] {
                    let got = bubble(kind, p, m, v, c).unwrap();
                    let want = kind.theory_bubble(p, m, v, c);
                    assert!(
                        (got - want).abs() < 1e-9,
                        "{kind} p {p} m {m} v {v}: bubble {got} theory {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn zb_h1_is_a_third_of_1f1b_when_f_b_and_w_cost_the_same() {
        let c = Costs::default();
        let one = bubble(ScheduleKind::OneFOneB, 4, 64, 1, c).unwrap();
        let zb = bubble(ScheduleKind::ZeroBubbleH1, 4, 64, 1, c).unwrap();
        assert!((zb / one - 1.0 / 3.0).abs() < 0.02, "{zb} / {one}");
    }
}
