//! Schedules as data: per-rank action lists.
//!
//! A schedule is made in three steps, each a pure function:
//! 1. the order in which each rank computes its forwards and backwards (the schedule's rule:
//!    [`ScheduleKind`]);
//! 2. the time each computation starts and ends when they run as soon as their inputs are
//!    there, for given costs ([`crate::timeline`]);
//! 3. the exchanges, derived from those times: one batch per rank and instant, holding every
//!    message the rank sends or receives at that instant ([`crate::timing::exchanges`]).
//!
//! The rank posts each batch to its communicator's line (asynchronously, in time order) and a
//! computation waits for the batch that brings its input. Because every batch holds only the
//! messages of one instant, and every message is in the sender's and the receiver's batch of
//! the same instant, the batches of an instant only wait for each other: no depth, no number of
//! micro-batches and no chunk count can deadlock them ([`crate::simulate`] checks each schedule
//! with rendezvous sends, the worst case).

use std::fmt;
use std::str::FromStr;

/// Which way a tensor travels: activations forward (to the next stage), gradients backward
/// (to the previous one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dir {
    /// Activations of a micro-batch, stage s to s + 1.
    Act,
    /// Gradients of a micro-batch's activations, stage s + 1 to s.
    Grad,
}

/// A micro-batch on one of this rank's model chunks. With `v` chunks per rank, chunk `c` of
/// rank `r` is the pipeline's stage `c * p + r` (Megatron's interleaving); with one chunk the
/// stage is the rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Step {
    /// The micro-batch.
    pub mb: usize,
    /// This rank's chunk (0 with one chunk per rank).
    pub chunk: usize,
}

/// One point-to-point operation: a send to or a receive from `peer` of micro-batch `mb`'s
/// tensors going `dir`. `chunk` is this rank's chunk: the one that produced what is sent, or
/// the one that consumes what is received.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// Send to `peer`.
    Send {
        /// The rank it goes to.
        peer: usize,
        /// Activations or gradients.
        dir: Dir,
        /// The micro-batch.
        mb: usize,
        /// This rank's chunk that produced it.
        chunk: usize,
    },
    /// Receive from `peer`.
    Recv {
        /// The rank it comes from.
        peer: usize,
        /// Activations or gradients.
        dir: Dir,
        /// The micro-batch.
        mb: usize,
        /// This rank's chunk that consumes it.
        chunk: usize,
    },
}

impl Op {
    /// The other rank.
    pub fn peer(&self) -> usize {
        match *self {
            Op::Send { peer, .. } | Op::Recv { peer, .. } => peer,
        }
    }
}

/// One step of a rank's list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// The forward of a micro-batch on a chunk.
    Forward(Step),
    /// The whole backward (input and weight gradients).
    Backward(Step),
    /// The input-gradient half of a split backward (B in the zero-bubble papers): what the
    /// previous stage waits for.
    BackwardInput(Step),
    /// The weight-gradient half (W): needs only this stage's own saved tensors.
    BackwardWeight(Step),
    /// Point-to-point operations posted together, as one batch, to the communicator's line:
    /// the rank goes on computing; a computation that needs a received tensor waits for it.
    Exchange(Vec<Op>),
}

impl Action {
    /// The computation's step, `None` for an exchange.
    pub fn step(&self) -> Option<Step> {
        match *self {
            Action::Forward(s)
            | Action::Backward(s)
            | Action::BackwardInput(s)
            | Action::BackwardWeight(s) => Some(s),
            Action::Exchange(_) => None,
        }
    }
}

/// The schedule's rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// GPipe: every forward, then every backward.
    GPipe,
    /// 1F1B (PipeDream-flush, Megatron's default): `p - r - 1` warm-up forwards on rank r,
    /// then one forward and one backward in turn, then the remaining backwards.
    OneFOneB,
    /// Megatron's interleaved 1F1B: `v` model chunks per rank, micro-batches taken in rounds of
    /// at least `p`, the bubble about `1/v` of 1F1B's.
    Interleaved,
    /// ZB-H1 (zero bubble, "Zero Bubble Pipeline Parallelism", Qi et al. 2023): 1F1B with each
    /// backward split into its input half (B) and weight half (W), rank r deferring its W's by
    /// r micro-batches to fill the cool-down; the bubble about a third of 1F1B's when F, B
    /// and W cost the same, at 1F1B's peak memory (p micro-batches).
    ZeroBubbleH1,
}

impl ScheduleKind {
    /// Every kind, in the order of the docs.
    pub const ALL: [ScheduleKind; 4] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::ZeroBubbleH1,
    ];

    /// The name on the command line: `gpipe`, `1f1b`, `interleaved`, `zb-h1`.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZeroBubbleH1 => "zb-h1",
        }
    }

    /// True when the schedule calls the split backward (B and W).
    pub fn splits_backward(self) -> bool {
        self == ScheduleKind::ZeroBubbleH1
    }

    /// The bubble fraction of the theory, for costs F, B, W (the whole backward is B + W):
    /// `(p - 1) / (m + p - 1)` for GPipe and 1F1B, `(p - 1) / (v m + p - 1)` for interleaved
    /// (m >= p), `(p - 1)(F + B - W) / (m (F + B + W) + (p - 1)(F + B - W))` for ZB-H1
    /// (m >= p; a third of 1F1B's when F = B = W).
    pub fn theory_bubble(self, p: usize, m: usize, v: usize, costs: Costs) -> f64 {
        let (p1, m) = ((p.max(1) - 1) as f64, m.max(1) as f64);
        match self {
            ScheduleKind::GPipe | ScheduleKind::OneFOneB => p1 / (m + p1),
            ScheduleKind::Interleaved => p1 / (v.max(1) as f64 * m + p1),
            ScheduleKind::ZeroBubbleH1 => {
                let (f, b, w) = (
                    f64::from(costs.forward),
                    f64::from(costs.backward_input),
                    f64::from(costs.weight),
                );
                let idle = p1 * (f + b - w).max(0.0);
                idle / (m * (f + b + w) + idle)
            }
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScheduleKind {
    type Err = ScheduleError;
    fn from_str(s: &str) -> Result<ScheduleKind, ScheduleError> {
        match s.to_ascii_lowercase().as_str() {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" | "one-f-one-b" => Ok(ScheduleKind::OneFOneB),
            "interleaved" | "interleaved-1f1b" => Ok(ScheduleKind::Interleaved),
            "zb-h1" | "zbh1" | "zero-bubble" => Ok(ScheduleKind::ZeroBubbleH1),
            _ => Err(ScheduleError(format!(
                "unknown schedule {s:?}: one of gpipe, 1f1b, interleaved, zb-h1"
            ))),
        }
    }
}

/// The cost of each computation, in any unit: what the timeline and the derived exchanges
/// assume. A whole backward costs `backward_input + weight`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Costs {
    /// A forward.
    pub forward: u32,
    /// The input-gradient half of a backward (B).
    pub backward_input: u32,
    /// The weight-gradient half (W).
    pub weight: u32,
}

impl Default for Costs {
    /// F = B = W = 1 (a whole backward costs twice a forward, the usual estimate).
    fn default() -> Costs {
        Costs {
            forward: 1,
            backward_input: 1,
            weight: 1,
        }
    }
}

impl Costs {
    /// The cost of one computation.
    pub fn of(&self, a: &Action) -> u64 {
        u64::from(match a {
            Action::Forward(_) => self.forward,
            Action::Backward(_) => self.backward_input + self.weight,
            Action::BackwardInput(_) => self.backward_input,
            Action::BackwardWeight(_) => self.weight,
            Action::Exchange(_) => 0,
        })
    }
}

/// A schedule that cannot be made: what was asked and why not.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("pipeline schedule: {0}")]
pub struct ScheduleError(pub String);

/// A schedule: `p` ranks, `v` chunks each (`p v` stages), `m` micro-batches; one action list
/// per rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// The rule it was made by.
    pub kind: ScheduleKind,
    /// Ranks.
    pub p: usize,
    /// Micro-batches per step.
    pub m: usize,
    /// Chunks per rank.
    pub v: usize,
    /// Each rank's actions, in order.
    pub ranks: Vec<Vec<Action>>,
}

impl Schedule {
    /// The schedule of `kind` for `p` ranks, `m` micro-batches and `v` chunks per rank (1
    /// except for [`ScheduleKind::Interleaved`]), its exchanges derived for equal costs.
    ///
    /// # Errors
    /// [`ScheduleError`] for `p`, `m` or `v` of 0, `v > 1` for another kind than interleaved, or
    /// interleaving on one rank.
    pub fn new(
        kind: ScheduleKind,
        p: usize,
        m: usize,
        v: usize,
    ) -> Result<Schedule, ScheduleError> {
        Schedule::with_costs(kind, p, m, v, Costs::default())
    }

    /// [`Schedule::new`] with the exchanges derived for `costs`.
    ///
    /// # Errors
    /// As [`Schedule::new`].
    pub fn with_costs(
        kind: ScheduleKind,
        p: usize,
        m: usize,
        v: usize,
        costs: Costs,
    ) -> Result<Schedule, ScheduleError> {
        if p == 0 || m == 0 || v == 0 {
            return Err(ScheduleError(format!(
                "{kind}: ranks ({p}), micro-batches ({m}) and chunks ({v}) must be at least 1"
            )));
        }
        if v > 1 && kind != ScheduleKind::Interleaved {
            return Err(ScheduleError(format!(
                "{kind} has one chunk per rank (asked for {v}); interleaved takes several"
            )));
        }
        if v > 1 && p == 1 {
            return Err(ScheduleError(format!(
                "interleaving {v} chunks needs at least 2 ranks"
            )));
        }
        let orders: Vec<Vec<Action>> = (0..p).map(|r| order(kind, p, m, v, r)).collect();
        let timeline = crate::timing::asap(p, v, &orders, costs).map_err(ScheduleError)?;
        let ranks = crate::timing::exchanges(p, v, &timeline);
        Ok(Schedule {
            kind,
            p,
            m,
            v,
            ranks,
        })
    }

    /// GPipe for `p` ranks and `m` micro-batches (`m` and `p` at least 1).
    pub fn gpipe(p: usize, m: usize) -> Schedule {
        Schedule::new(ScheduleKind::GPipe, p.max(1), m.max(1), 1).expect("valid by construction")
    }

    /// 1F1B for `p` ranks and `m` micro-batches (`m` and `p` at least 1).
    pub fn one_f_one_b(p: usize, m: usize) -> Schedule {
        Schedule::new(ScheduleKind::OneFOneB, p.max(1), m.max(1), 1).expect("valid by construction")
    }

    /// The pipeline's stage count, `p v`.
    pub fn stages(&self) -> usize {
        self.p * self.v
    }

    /// Rank `r`'s computations, in order, without the exchanges.
    pub fn computations(&self, r: usize) -> Vec<Action> {
        self.ranks.get(r).map_or_else(Vec::new, |l| {
            l.iter()
                .filter(|a| !matches!(a, Action::Exchange(_)))
                .cloned()
                .collect()
        })
    }
}

/// Rank `r`'s computation order under `kind`.
fn order(kind: ScheduleKind, p: usize, m: usize, v: usize, r: usize) -> Vec<Action> {
    let step = |mb| Step { mb, chunk: 0 };
    match kind {
        ScheduleKind::GPipe => (0..m)
            .map(|mb| Action::Forward(step(mb)))
            .chain((0..m).map(|mb| Action::Backward(step(mb))))
            .collect(),
        ScheduleKind::OneFOneB => {
            let f: Vec<Step> = (0..m).map(step).collect();
            one_f_one_b(&f, &f, (p - r - 1).min(m))
        }
        ScheduleKind::Interleaved => {
            let groups = rounds(p, m);
            let fs = interleaved_order(&groups, v, false);
            let bs = interleaved_order(&groups, v, true);
            let warmup = if v == 1 {
                p - r - 1
            } else {
                (v - 1) * groups[0].len() + 2 * (p - r - 1)
            };
            one_f_one_b(&fs, &bs, warmup.min(m * v))
        }
        ScheduleKind::ZeroBubbleH1 => zb_h1(p, m, r),
    }
}

/// Forwards `f` and backwards `b` (as many of each) in 1F1B order after `warmup` forwards.
fn one_f_one_b(f: &[Step], b: &[Step], warmup: usize) -> Vec<Action> {
    let mut out: Vec<Action> = f[..warmup].iter().map(|&s| Action::Forward(s)).collect();
    for (i, &s) in f[warmup..].iter().enumerate() {
        out.push(Action::Forward(s));
        out.push(Action::Backward(b[i]));
    }
    out.extend(b[f.len() - warmup..].iter().map(|&s| Action::Backward(s)));
    out
}

/// The micro-batches in rounds of at least `p` (one round of all of them when `m < p`), as
/// even as they can be: torch's interleaved schedule takes `m / (m / p)` per round; rounds
/// of unequal size let any `m` through.
fn rounds(p: usize, m: usize) -> Vec<Vec<usize>> {
    let n = (m / p).max(1);
    let (base, extra) = (m / n, m % n);
    let mut start = 0;
    (0..n)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let g = (start..start + len).collect();
            start += len;
            g
        })
        .collect()
}

/// The interleaved order of forwards (chunks up) or backwards (chunks down): round by round,
/// chunk by chunk, the round's micro-batches in order.
fn interleaved_order(groups: &[Vec<usize>], v: usize, backward: bool) -> Vec<Step> {
    let mut out = Vec::new();
    for g in groups {
        for k in 0..v {
            let chunk = if backward { v - 1 - k } else { k };
            out.extend(g.iter().map(|&mb| Step { mb, chunk }));
        }
    }
    out
}

/// ZB-H1 on rank `r`: 1F1B's forwards and input-gradient backwards, each weight-gradient
/// backward W(i) after B(i + r) (deferred by r micro-batches, so rank r holds at most p
/// micro-batches' activations), the deferred W's filling the cool-down after each B.
fn zb_h1(p: usize, m: usize, r: usize) -> Vec<Action> {
    let step = |mb| Step { mb, chunk: 0 };
    let warmup = (p - r - 1).min(m);
    let mut out: Vec<Action> = (0..warmup).map(|mb| Action::Forward(step(mb))).collect();
    let mut w = 0;
    for i in 0..m - warmup {
        out.push(Action::Forward(step(warmup + i)));
        out.push(Action::BackwardInput(step(i)));
        if i >= r {
            out.push(Action::BackwardWeight(step(w)));
            w += 1;
        }
    }
    for j in m - warmup..m {
        out.push(Action::BackwardInput(step(j)));
        if w + r <= j {
            out.push(Action::BackwardWeight(step(w)));
            w += 1;
        }
    }
    out.extend((w..m).map(|mb| Action::BackwardWeight(step(mb))));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_cover_every_micro_batch_once_with_at_least_p_each() {
        for p in 1..=8 {
            for m in 1..=40 {
                let g = rounds(p, m);
                let all: Vec<usize> = g.iter().flatten().copied().collect();
                assert_eq!(all, (0..m).collect::<Vec<_>>(), "p {p} m {m}");
                if m >= p {
                    assert!(g.iter().all(|g| g.len() >= p), "p {p} m {m}: {g:?}");
                }
            }
        }
    }

    #[test]
    fn zb_h1_defers_rank_r_weights_by_r_and_holds_at_most_p() {
        let (p, m) = (4, 8);
        for r in 0..p {
            let o = zb_h1(p, m, r);
            let (mut held, mut peak) = (0i32, 0);
            for a in &o {
                match a {
                    Action::Forward(_) => held += 1,
                    Action::BackwardWeight(_) => held -= 1,
                    _ => {}
                }
                peak = peak.max(held);
            }
            assert_eq!(peak, p as i32, "rank {r}");
            assert_eq!(o.len(), 3 * m);
        }
    }

    #[test]
    fn bad_sizes_are_refused_by_name() {
        let e = Schedule::new(ScheduleKind::OneFOneB, 4, 8, 2).unwrap_err();
        assert!(e.to_string().contains("1f1b has one chunk per rank"), "{e}");
        assert!(Schedule::new(ScheduleKind::GPipe, 0, 8, 1).is_err());
        assert!(Schedule::new(ScheduleKind::Interleaved, 1, 8, 2).is_err());
        assert!("zb-h2".parse::<ScheduleKind>().is_err());
        for k in ScheduleKind::ALL {
            assert_eq!(k.name().parse::<ScheduleKind>(), Ok(k));
        }
    }
}
