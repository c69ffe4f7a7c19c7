//! A simulator of schedules: every rank runs its list in rounds; computations finish in the
//! round they start, and a point-to-point operation finishes when its peer has the matching
//! one posted (rendezvous: a send waits for its receive, as large messages do). It finds
//! deadlocks (no rank can move and some are not done), computations whose input has not
//! arrived, sends of data not computed yet, and micro-batches a rank never computes.

use std::collections::HashSet;

use crate::schedule::{Action, Dir, Op, Schedule};

/// What went wrong in a simulated schedule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    /// No rank can move; each waiting rank and the action it waits in.
    #[error("deadlock: {}", .0.iter().map(|(r, a)| format!("rank {r} waits in {a:?}")).collect::<Vec<_>>().join("; "))]
    Deadlock(Vec<(usize, Action)>),
    /// An action whose input is not there yet (a forward before its activations arrived, a
    /// backward before its forward or its gradient, a send of what is not computed).
    #[error("rank {rank}: {action:?} before {needs}")]
    Early {
        /// The rank.
        rank: usize,
        /// The action.
        action: Action,
        /// What it needs.
        needs: String,
    },
    /// A rank finished without computing a micro-batch's forward or backward.
    #[error("rank {rank} never runs the {what} of micro-batch {mb}")]
    Missing {
        /// The rank.
        rank: usize,
        /// `forward` or `backward`.
        what: &'static str,
        /// The micro-batch.
        mb: usize,
    },
}

/// When each action finished: `rounds[r][i]` is the round of rank r's action i.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timeline {
    /// Per rank, per action.
    pub rounds: Vec<Vec<usize>>,
    /// Rounds until every rank was done.
    pub total: usize,
}

/// One rank's progress.
#[derive(Default)]
struct Rank {
    pc: usize,
    /// Which operations of the current exchange have met their peer's.
    matched: Vec<bool>,
    received: HashSet<(Dir, usize)>,
    forwards: HashSet<usize>,
    backwards: HashSet<usize>,
    rounds: Vec<usize>,
}

/// Runs `s` (see the module docs).
///
/// # Errors
/// The first problem found ([`SimError`]).
pub fn simulate(s: &Schedule) -> Result<Timeline, SimError> {
    let p = s.ranks.len();
    let mut st: Vec<Rank> = (0..p).map(|_| Rank::default()).collect();
    let mut round = 0;
    loop {
        round += 1;
        let mut moved = false;
        // Computations.
        for (r, rank) in st.iter_mut().enumerate() {
            let Some(a) = s.ranks[r].get(rank.pc) else {
                continue;
            };
            match *a {
                Action::Forward(mb) => {
                    if r > 0 && !rank.received.contains(&(Dir::Act, mb)) {
                        return Err(early(r, a, format!("the activations of {mb} arrived")));
                    }
                    rank.forwards.insert(mb);
                }
                Action::Backward(mb) => {
                    if !rank.forwards.contains(&mb) {
                        return Err(early(r, a, format!("the forward of {mb}")));
                    }
                    if r + 1 < p && !rank.received.contains(&(Dir::Grad, mb)) {
                        return Err(early(r, a, format!("the gradient of {mb} arrived")));
                    }
                    rank.backwards.insert(mb);
                }
                Action::Exchange(_) => continue,
            }
            rank.pc += 1;
            rank.rounds.push(round);
            moved = true;
        }
        // Exchanges: each send meets the peer's receive if the peer has it posted now.
        for r in 0..p {
            let Some(Action::Exchange(ops)) = s.ranks[r].get(st[r].pc) else {
                continue;
            };
            if st[r].matched.len() != ops.len() {
                st[r].matched = vec![false; ops.len()];
            }
            for (i, op) in ops.iter().enumerate() {
                let Op::Send { peer, dir, mb } = *op else {
                    continue;
                };
                if st[r].matched[i] {
                    continue;
                }
                let have = match dir {
                    Dir::Act => st[r].forwards.contains(&mb),
                    Dir::Grad => st[r].backwards.contains(&mb),
                };
                if !have {
                    let a = &s.ranks[r][st[r].pc];
                    return Err(early(
                        r,
                        a,
                        format!("computing what it sends ({dir:?} of {mb})"),
                    ));
                }
                let want = Op::Recv { peer: r, dir, mb };
                let Some(Action::Exchange(theirs)) =
                    s.ranks.get(peer).and_then(|l| l.get(st[peer].pc))
                else {
                    continue;
                };
                if st[peer].matched.len() != theirs.len() {
                    st[peer].matched = vec![false; theirs.len()];
                }
                if let Some(j) = theirs.iter().position(|o| *o == want) {
                    if !st[peer].matched[j] {
                        st[peer].matched[j] = true;
                        st[r].matched[i] = true;
                        st[peer].received.insert((dir, mb));
                    }
                }
            }
        }
        for (r, rank) in st.iter_mut().enumerate() {
            if let Some(Action::Exchange(ops)) = s.ranks[r].get(rank.pc) {
                if rank.matched.len() == ops.len() && rank.matched.iter().all(|&m| m) {
                    rank.pc += 1;
                    rank.matched.clear();
                    rank.rounds.push(round);
                    moved = true;
                }
            }
        }
        let done = (0..p).all(|r| st[r].pc == s.ranks[r].len());
        if done {
            break;
        }
        if !moved {
            let waiting = (0..p)
                .filter_map(|r| s.ranks[r].get(st[r].pc).map(|a| (r, a.clone())))
                .collect();
            return Err(SimError::Deadlock(waiting));
        }
    }
    for (r, rank) in st.iter().enumerate() {
        for mb in 0..s.m {
            if !rank.forwards.contains(&mb) {
                return Err(SimError::Missing {
                    rank: r,
                    what: "forward",
                    mb,
                });
            }
            if !rank.backwards.contains(&mb) {
                return Err(SimError::Missing {
                    rank: r,
                    what: "backward",
                    mb,
                });
            }
        }
    }
    Ok(Timeline {
        rounds: st.into_iter().map(|r| r.rounds).collect(),
        total: round,
    })
}

fn early(rank: usize, action: &Action, needs: String) -> SimError {
    SimError::Early {
        rank,
        action: action.clone(),
        needs,
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_forward_before_its_input_and_a_send_before_its_receive_are_found() {
        let send = |peer| {
            Action::Exchange(vec![Op::Send {
                peer,
                dir: Dir::Act,
                mb: 0,
            }])
        };
        let recv = |peer| {
            Action::Exchange(vec![Op::Recv {
                peer,
                dir: Dir::Act,
                mb: 0,
            }])
        };
        // Stage 1 computes its forward before receiving stage 0's activations.
        let s = Schedule {
            p: 2,
            m: 1,
            ranks: vec![
                vec![Action::Forward(0), send(1)],
                vec![Action::Forward(0), recv(0)],
            ],
        };
        assert!(matches!(simulate(&s), Err(SimError::Early { rank: 1, .. })));
        // One rank that sends to itself before posting the receive waits forever.
        let s = Schedule {
            p: 1,
            m: 0,
            ranks: vec![vec![Action::Forward(0), send(0), recv(0)]],
        };
        assert!(matches!(simulate(&s), Err(SimError::Deadlock(_))));
    }

    #[test]
    fn unbatched_steady_state_deadlocks_where_batched_does_not() {
        // 1F1B with each exchange of the steady state split in two (send, then receive):
        // stage 0 sends activations while stage 1 sends gradients, both rendezvous.
        let good = Schedule::one_f_one_b(2, 4);
        let split: Vec<Vec<Action>> = good
            .ranks
            .iter()
            .map(|l| {
                l.iter()
                    .flat_map(|a| match a {
                        Action::Exchange(ops) => {
                            ops.iter().map(|o| Action::Exchange(vec![*o])).collect()
                        }
                        other => vec![other.clone()],
                    })
                    .collect()
            })
            .collect();
        let bad = Schedule {
            ranks: split,
            ..good.clone()
        };
        assert!(simulate(&good).is_ok());
        assert!(
            matches!(simulate(&bad), Err(SimError::Deadlock(_))),
            "{:?}",
            simulate(&bad)
        );
    }

    #[test]
    fn a_missing_backward_is_named() {
        let mut s = Schedule::gpipe(2, 2);
        let last = s.ranks[1]
            .iter()
            .rposition(|a| *a == Action::Backward(1))
            .unwrap();
        s.ranks[1].remove(last);
        s.ranks[1].retain(|a| !matches!(a, Action::Exchange(o) if o.contains(&Op::Send { peer: 0, dir: Dir::Grad, mb: 1 })));
        s.ranks[0].retain(|a| !matches!(a, Action::Exchange(o) if o.contains(&Op::Recv { peer: 1, dir: Dir::Grad, mb: 1 })));
        s.ranks[0].retain(|a| *a != Action::Backward(1));
        assert_eq!(
            simulate(&s),
            Err(SimError::Missing {
                rank: 0,
                what: "backward",
                mb: 1
            })
        );
    }

    proptest! {
        /// GPipe and 1F1B finish at depths 2 to 8 for 1 to 4p micro-batches (fewer than the
        /// stages included), every rank computing every forward and backward.
        #[test]
        fn gpipe_and_1f1b_finish_at_any_depth(
            (p, m) in (2usize..=8).prop_flat_map(|p| (Just(p), 1..=4 * p)),
        ) {
            for s in [Schedule::gpipe(p, m), Schedule::one_f_one_b(p, m)] {
                let t = simulate(&s);
                prop_assert!(t.is_ok(), "p {} m {}: {:?}", p, m, t);
            }
        }
    }
}
