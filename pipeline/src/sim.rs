//! A simulator of schedules, with the semantics of oxccl's communicator: each rank posts its
//! exchanges to a line that runs them one after another, in the background; an exchange ends
//! when every operation in it has met its peer's, and a send meets its receive only when both
//! exchanges are at the head of their lines (rendezvous: a send waits for its receive, as large
//! messages do). A computation waits for the exchange that brings its input.
//!
//! It finds deadlocks (nothing can move and some rank is not done), computations whose input
//! is neither there nor on its way, sends of what is not computed yet, the two ends of a link
//! ordering its messages differently (the communicator matches them by order), and
//! computations a stage never runs.

use std::collections::{HashSet, VecDeque};

use crate::schedule::{Action, Dir, Op, Schedule};

/// What went wrong in a simulated schedule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    /// No rank can move; each waiting rank and what it waits in.
    #[error("deadlock: {}", .0.iter().map(|(r, a)| format!("rank {r} waits in {a}")).collect::<Vec<_>>().join("; "))]
    Deadlock(Vec<(usize, String)>),
    /// An action whose input is neither there nor in an exchange already posted (a forward
    /// before its activations are received, a backward before its forward, a send of what is
    /// not computed).
    #[error("rank {rank}: {action:?} before {needs}")]
    Early {
        /// The rank.
        rank: usize,
        /// The action.
        action: Action,
        /// What it needs.
        needs: String,
    },
    /// The sender and the receiver of a link order its messages differently.
    #[error("link {from} -> {to}: message {index} is {sent} on the sender and {received} on the receiver")]
    Order {
        /// The sending rank.
        from: usize,
        /// The receiving rank.
        to: usize,
        /// The message's index on the link.
        index: usize,
        /// What the sender sends there.
        sent: String,
        /// What the receiver takes there.
        received: String,
    },
    /// A stage finished without computing a micro-batch's forward or backward.
    #[error("rank {rank} never runs the {what} of micro-batch {mb} on chunk {chunk}")]
    Missing {
        /// The rank.
        rank: usize,
        /// `forward`, `input gradient` or `weight gradient`.
        what: &'static str,
        /// The micro-batch.
        mb: usize,
        /// The chunk.
        chunk: usize,
    },
}

/// A posted exchange: its operations and which have met their peer's.
struct Posted {
    ops: Vec<Op>,
    matched: Vec<bool>,
}

/// One rank's progress.
#[derive(Default)]
struct Rank {
    pc: usize,
    line: VecDeque<Posted>,
    received: HashSet<(Dir, usize, usize)>,
    forwards: HashSet<(usize, usize)>,
    input_grads: HashSet<(usize, usize)>,
    weight_grads: HashSet<(usize, usize)>,
}

/// Where an input of a computation is.
enum Input {
    Here,
    Coming,
    Nowhere,
}

/// Runs `s` (see the module docs); returns the number of rounds it took.
///
/// # Errors
/// The first problem found ([`SimError`]).
pub fn simulate(s: &Schedule) -> Result<usize, SimError> {
    check_order(s)?;
    let p = s.ranks.len();
    let mut st: Vec<Rank> = (0..p).map(|_| Rank::default()).collect();
    let mut round = 0;
    loop {
        round += 1;
        let mut moved = false;
        for (r, x) in st.iter_mut().enumerate() {
            moved |= run_rank(s, r, x)?;
        }
        moved |= match_heads(s, &mut st);
        if st
            .iter()
            .enumerate()
            .all(|(r, x)| x.pc == s.ranks[r].len() && x.line.is_empty())
        {
            break;
        }
        if !moved {
            let waiting = st
                .iter()
                .enumerate()
                .filter_map(|(r, x)| match s.ranks[r].get(x.pc) {
                    Some(a) => Some((r, format!("{a:?}"))),
                    None if !x.line.is_empty() => {
                        Some((r, format!("its line: {:?}", x.line[0].ops)))
                    }
                    None => None,
                })
                .collect();
            return Err(SimError::Deadlock(waiting));
        }
    }
    check_complete(s, &st)?;
    Ok(round)
}

/// Runs rank `r`'s actions until one must wait; true when any ran.
fn run_rank(s: &Schedule, r: usize, x: &mut Rank) -> Result<bool, SimError> {
    let (p, stages) = (s.p, s.stages());
    let mut moved = false;
    while let Some(a) = s.ranks[r].get(x.pc) {
        if let Action::Exchange(ops) = a {
            for op in ops {
                if let Op::Send { dir, mb, chunk, .. } = *op {
                    let have = match dir {
                        Dir::Act => x.forwards.contains(&(mb, chunk)),
                        Dir::Grad => x.input_grads.contains(&(mb, chunk)),
                    };
                    if !have {
                        return Err(early(r, a, format!("computing what it sends ({op:?})")));
                    }
                }
            }
            x.line.push_back(Posted {
                ops: ops.clone(),
                matched: vec![false; ops.len()],
            });
        } else {
            let st = a.step().expect("a computation");
            let (mb, c) = (st.mb, st.chunk);
            let stage = c * p + r;
            let mut inputs = Vec::new();
            match a {
                Action::Forward(_) if stage > 0 => {
                    inputs.push((
                        input(x, p, r, Dir::Act, stage - 1, mb, c),
                        "its activations",
                    ));
                }
                Action::Backward(_) | Action::BackwardInput(_) => {
                    if !x.forwards.contains(&(mb, c)) {
                        return Err(early(r, a, format!("the forward of {mb}")));
                    }
                    if stage + 1 < stages {
                        inputs.push((input(x, p, r, Dir::Grad, stage + 1, mb, c), "its gradient"));
                    }
                }
                Action::BackwardWeight(_) if !x.input_grads.contains(&(mb, c)) => {
                    return Err(early(r, a, format!("the input gradient of {mb}")));
                }
                _ => {}
            }
            for (i, what) in inputs {
                match i {
                    Input::Here => {}
                    Input::Coming => return Ok(moved),
                    Input::Nowhere => {
                        return Err(early(r, a, format!("{what} are received or posted")));
                    }
                }
            }
            match a {
                Action::Forward(_) => {
                    x.forwards.insert((mb, c));
                }
                Action::Backward(_) => {
                    x.input_grads.insert((mb, c));
                    x.weight_grads.insert((mb, c));
                }
                Action::BackwardInput(_) => {
                    x.input_grads.insert((mb, c));
                }
                _ => {
                    x.weight_grads.insert((mb, c));
                }
            }
        }
        x.pc += 1;
        moved = true;
    }
    Ok(moved)
}

/// Whether rank `r`'s chunk `c` has the `dir` tensor of micro-batch `mb` from stage `from`.
fn input(x: &Rank, p: usize, r: usize, dir: Dir, from: usize, mb: usize, c: usize) -> Input {
    if from % p == r {
        let have = match dir {
            Dir::Act => x.forwards.contains(&(mb, from / p)),
            Dir::Grad => x.input_grads.contains(&(mb, from / p)),
        };
        return if have { Input::Here } else { Input::Nowhere };
    }
    if x.received.contains(&(dir, mb, c)) {
        return Input::Here;
    }
    let want = Op::Recv {
        peer: from % p,
        dir,
        mb,
        chunk: c,
    };
    if x.line.iter().any(|b| b.ops.contains(&want)) {
        Input::Coming
    } else {
        Input::Nowhere
    }
}

/// Matches the sends of every line's head exchange with their peers' heads and completes the
/// heads whose operations all met theirs; true when anything matched or completed.
fn match_heads(s: &Schedule, st: &mut [Rank]) -> bool {
    let (p, mut moved) = (s.p, false);
    for r in 0..st.len() {
        let Some(head) = st[r].line.front() else {
            continue;
        };
        let sends: Vec<(usize, Op)> = head
            .ops
            .iter()
            .enumerate()
            .filter(|(i, o)| !head.matched[*i] && matches!(o, Op::Send { .. }))
            .map(|(i, o)| (i, *o))
            .collect();
        for (i, op) in sends {
            let Op::Send {
                peer,
                dir,
                mb,
                chunk,
            } = op
            else {
                continue;
            };
            let stage = chunk * p + r;
            let to = if dir == Dir::Act {
                stage + 1
            } else {
                stage - 1
            };
            let want = Op::Recv {
                peer: r,
                dir,
                mb,
                chunk: to / p,
            };
            let Some(theirs) = st.get_mut(peer).and_then(|x| x.line.front_mut()) else {
                continue;
            };
            if let Some(j) =
                (0..theirs.ops.len()).find(|&j| !theirs.matched[j] && theirs.ops[j] == want)
            {
                theirs.matched[j] = true;
                st[r].line[0].matched[i] = true;
                moved = true;
            }
        }
    }
    for x in st.iter_mut() {
        if x.line.front().is_some_and(|h| h.matched.iter().all(|&m| m)) {
            let done = x.line.pop_front().expect("a head");
            for op in done.ops {
                if let Op::Recv { dir, mb, chunk, .. } = op {
                    x.received.insert((dir, mb, chunk));
                }
            }
            moved = true;
        }
    }
    moved
}

/// The sender's message at each index of a link equals the receiver's.
fn check_order(s: &Schedule) -> Result<(), SimError> {
    let p = s.p;
    let id = |r: usize, op: &Op| -> (usize, usize, String) {
        match *op {
            Op::Send {
                peer,
                dir,
                mb,
                chunk,
            } => (
                r,
                peer,
                format!("{dir:?} of {mb} from stage {}", chunk * p + r),
            ),
            Op::Recv {
                peer,
                dir,
                mb,
                chunk,
            } => {
                let stage = chunk * p + r;
                let from = if dir == Dir::Act {
                    stage.wrapping_sub(1)
                } else {
                    stage + 1
                };
                (peer, r, format!("{dir:?} of {mb} from stage {from}"))
            }
        }
    };
    let mut sent: std::collections::BTreeMap<(usize, usize), Vec<String>> = Default::default();
    let mut taken: std::collections::BTreeMap<(usize, usize), Vec<String>> = Default::default();
    for (r, list) in s.ranks.iter().enumerate() {
        for a in list {
            if let Action::Exchange(ops) = a {
                for op in ops {
                    let (from, to, what) = id(r, op);
                    let side = if matches!(op, Op::Send { .. }) {
                        &mut sent
                    } else {
                        &mut taken
                    };
                    side.entry((from, to)).or_default().push(what);
                }
            }
        }
    }
    let links: HashSet<(usize, usize)> = sent.keys().chain(taken.keys()).copied().collect();
    for (from, to) in links {
        let (a, b) = (sent.get(&(from, to)), taken.get(&(from, to)));
        let (a, b) = (a.map_or(&[][..], |v| &v[..]), b.map_or(&[][..], |v| &v[..]));
        for index in 0..a.len().max(b.len()) {
            let (x, y) = (a.get(index), b.get(index));
            if x != y {
                let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "nothing".into());
                return Err(SimError::Order {
                    from,
                    to,
                    index,
                    sent: show(x),
                    received: show(y),
                });
            }
        }
    }
    Ok(())
}

/// Every stage ran every micro-batch's forward, input gradient and weight gradient.
fn check_complete(s: &Schedule, st: &[Rank]) -> Result<(), SimError> {
    for (rank, x) in st.iter().enumerate() {
        for chunk in 0..s.v {
            for mb in 0..s.m {
                for (set, what) in [
                    (&x.forwards, "forward"),
                    (&x.input_grads, "input gradient"),
                    (&x.weight_grads, "weight gradient"),
                ] {
                    if !set.contains(&(mb, chunk)) {
                        return Err(SimError::Missing {
                            rank,
                            what,
                            mb,
                            chunk,
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

fn early(rank: usize, action: &Action, needs: String) -> SimError {
    SimError::Early {
        rank,
        action: action.clone(),
        needs,
    }
}

#[cfg(test)]
mod tests;
