use proptest::prelude::*;

use super::*;
use crate::schedule::{ScheduleKind, Step};

fn st(mb: usize) -> Step {
    Step { mb, chunk: 0 }
}

fn one(op: Op) -> Action {
    Action::Exchange(vec![op])
}

#[test]
fn a_forward_before_its_input_and_a_send_before_its_computation_are_found() {
    let send = Op::Send {
        peer: 1,
        dir: Dir::Act,
        mb: 0,
        chunk: 0,
    };
    let mut s = Schedule::gpipe(2, 1);
    // Stage 1 computes its forward before posting the receive of its activations.
    s.ranks[1].retain(|a| *a != Action::Forward(st(0)));
    s.ranks[1].insert(0, Action::Forward(st(0)));
    assert!(
        matches!(simulate(&s), Err(SimError::Early { rank: 1, .. })),
        "{:?}",
        simulate(&s)
    );
    // Stage 0 sends before computing.
    let mut s = Schedule::gpipe(2, 1);
    s.ranks[0].retain(|a| !matches!(a, Action::Exchange(o) if o.contains(&send)));
    s.ranks[0].insert(0, one(send));
    assert!(matches!(simulate(&s), Err(SimError::Early { rank: 0, .. })));
}

#[test]
fn split_exchanges_deadlock_where_batched_ones_do_not() {
    // 1F1B at depth 2: in the steady state stage 0 sends activations at the instant stage 1
    // sends gradients. Split into a send and then a receive, both sends wait at the heads of
    // their lines for receives queued behind the peer's own send.
    let good = Schedule::one_f_one_b(2, 4);
    let split: Vec<Vec<Action>> = good
        .ranks
        .iter()
        .map(|l| {
            l.iter()
                .flat_map(|a| match a {
                    Action::Exchange(ops) => ops.iter().map(|o| one(*o)).collect(),
                    other => vec![other.clone()],
                })
                .collect()
        })
        .collect();
    assert!(
        good.ranks
            .iter()
            .flatten()
            .any(|a| matches!(a, Action::Exchange(o) if o.len() > 1)),
        "1F1B at depth 2 has two-way exchanges"
    );
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
fn two_ends_ordering_a_link_differently_are_named() {
    let mut s = Schedule::gpipe(2, 2);
    // Stage 1 receives micro-batch 1's activations before micro-batch 0's.
    let recvs: Vec<usize> = s.ranks[1]
        .iter()
        .enumerate()
        .filter(|(_, a)| matches!(a, Action::Exchange(o) if matches!(o[0], Op::Recv { dir: Dir::Act, .. })))
        .map(|(i, _)| i)
        .collect();
    s.ranks[1].swap(recvs[0], recvs[1]);
    assert!(
        matches!(
            simulate(&s),
            Err(SimError::Order {
                from: 0,
                to: 1,
                index: 0,
                ..
            })
        ),
        "{:?}",
        simulate(&s)
    );
}

#[test]
fn a_missing_weight_gradient_is_named() {
    let mut s = Schedule::new(ScheduleKind::ZeroBubbleH1, 2, 2, 1).unwrap();
    s.ranks[0].retain(|a| *a != Action::BackwardWeight(st(1)));
    assert_eq!(
        simulate(&s),
        Err(SimError::Missing {
            rank: 0,
            what: "weight gradient",
            mb: 1,
            chunk: 0
        })
    );
}

proptest! {
    /// Every schedule finishes at depths 2 to 8, for 1 to 4p micro-batches (fewer than the
    /// ranks included) and 1 to 3 chunks per rank, every stage computing every micro-batch,
    /// both ends of every link agreeing on its order.
    #[test]
    fn every_schedule_finishes_at_any_depth(
        (p, m) in (2usize..=8).prop_flat_map(|p| (Just(p), 1..=4 * p)),
        v in 1usize..=3,
    ) {
        for kind in ScheduleKind::ALL {
            let v = if kind == ScheduleKind::Interleaved { v } else { 1 };
            let s = Schedule::new(kind, p, m, v).unwrap();
            let t = simulate(&s);
            prop_assert!(t.is_ok(), "{} p {} m {} v {}: {:?}", kind, p, m, v, t);
        }
    }
}

/// Each exchange of `s` as two batches in a row with the same operations: the headers, then
/// the payloads in a batch of their own (how tensors in device memory would travel: comm's
/// device batches cannot hold host headers).
fn two_phase(s: &Schedule) -> Schedule {
    let ranks = s
        .ranks
        .iter()
        .map(|l| {
            l.iter()
                .flat_map(|a| match a {
                    Action::Exchange(_) => vec![a.clone(), a.clone()],
                    other => vec![other.clone()],
                })
                .collect()
        })
        .collect();
    Schedule { ranks, ..s.clone() }
}

proptest! {
    /// Every schedule still finishes, in every case of the proptest above, when each exchange
    /// runs as two batches in a row (headers, then payloads).
    #[test]
    fn every_schedule_finishes_with_payloads_in_a_batch_after_the_headers(
        (p, m) in (2usize..=8).prop_flat_map(|p| (Just(p), 1..=4 * p)),
        v in 1usize..=3,
    ) {
        for kind in ScheduleKind::ALL {
            let v = if kind == ScheduleKind::Interleaved { v } else { 1 };
            let s = two_phase(&Schedule::new(kind, p, m, v).unwrap());
            let t = simulate(&s);
            prop_assert!(t.is_ok(), "{} p {} m {} v {}: {:?}", kind, p, m, v, t);
        }
    }
}

#[test]
fn one_rank_hands_its_chunks_over_in_memory() {
    for kind in [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::ZeroBubbleH1,
    ] {
        let s = Schedule::new(kind, 1, 3, 1).unwrap();
        assert!(s.ranks[0].iter().all(|a| !matches!(a, Action::Exchange(_))));
        simulate(&s).unwrap();
    }
}
