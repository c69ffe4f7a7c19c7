//! examples/04_survive_a_lost_rank.rs: data-parallel steps that shrink a lost rank away and go
//! on. Ranks as threads (one node, and two simulated nodes: shared memory and TCP) and
//! as processes under `oxccl launch --keep-going` (this test binary: `rank_entry` does nothing
//! in a normal run and plays a rank when `OXCCL_TEST_SURVIVE` is set).

// Example 05 (loaded by `replace_example`) loads this file too, as a module of its own: this
// binary holds two copies of example 04's code, one for each test module that uses it.
#[path = "../../examples/04_survive_a_lost_rank.rs"]
#[allow(dead_code, clippy::duplicate_mod)]
mod survive;

use oxccl::comm::harness::{spawn_world, spawn_world_on_nodes};
use oxccl::comm::{Communicator, Config};

use crate::common;

fn expected_history(history: &[Vec<usize>]) -> bool {
    common::lost_member_2_at_step_3(history, &[0, 1, 3])
}

/// Rank 2 of 4 leaves at step 3 of 8; checks the survivors' histories and weights.
fn check_survivors(outcomes: Vec<Option<survive::Outcome>>) {
    assert!(outcomes[2].is_none(), "rank 2 must have left");
    let survivors: Vec<survive::Outcome> = [0, 1, 3]
        .iter()
        .map(|&r| outcomes[r].clone().expect("a survivor's outcome"))
        .collect();
    assert!(
        expected_history(&survivors[0].history),
        "{:?}",
        survivors[0].history
    );
    for o in &survivors {
        assert_eq!(o, &survivors[0], "every survivor ends the same");
        assert!(
            survive::matches_reference(o),
            "weights differ from the serial recomputation over {:?}",
            o.history
        );
    }
}

#[test]
fn survivors_go_on_as_threads() {
    let run = |c: Communicator| {
        let state = survive::State::start(c.size());
        survive::train(c, state, Some((2, 3)), 8, survive::Recovery::Shrink, || ())
    };
    let out: Vec<_> = spawn_world(4, Config::default(), run)
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    check_survivors(out);
    // Two simulated nodes of 2 (after the shrink node 1 holds one rank: a flat communicator).
    let out: Vec<_> = spawn_world_on_nodes(4, 2, Config::default(), run)
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    check_survivors(out);
    // Without a failure nothing changes.
    let healthy = |c: Communicator| {
        let state = survive::State::start(c.size());
        survive::train(c, state, None, 4, survive::Recovery::Shrink, || ())
    };
    for r in spawn_world(3, Config::default(), healthy) {
        let o = r.unwrap().expect("an outcome");
        assert!(o.history.iter().all(|h| h == &[0, 1, 2]));
        assert!(survive::matches_reference(&o));
    }
}

/// Plays one rank when started by `oxccl launch` from the test below: rank 2 exits with code 3
/// at step 3 (a crash, its communicator not closed), the others go on.
pub(crate) fn play_rank() {
    if std::env::var("OXCCL_TEST_SURVIVE").is_err() {
        return;
    }
    let comm = Communicator::from_env().expect("communicator from the environment");
    let me = comm.rank();
    let state = survive::State::start(comm.size());
    let crash = || std::process::exit(3);
    match survive::train(
        comm,
        state,
        Some((2, 3)),
        8,
        survive::Recovery::Shrink,
        crash,
    ) {
        Ok(Some(o)) if survive::matches_reference(&o) && expected_history(&o.history) => {
            println!("RESULT rank={me} ok")
        }
        other => {
            println!("RESULT rank={me} FAILED {other:?}");
            std::process::exit(1);
        }
    }
}

#[test]
fn survivors_go_on_under_oxccl_launch_keep_going() {
    let out = common::launch_self_with(4, &["--keep-going"], &[("OXCCL_TEST_SURVIVE", "1")]);
    let res = common::results(&out);
    assert_eq!(out.status.code(), Some(3), "{}", common::show(&out));
    for r in [0, 1, 3] {
        assert!(
            res.get(&r).is_some_and(|l| l.ends_with(" ok")),
            "rank {r}: {}",
            common::show(&out)
        );
    }
    assert!(!res.contains_key(&2), "{}", common::show(&out));
}
