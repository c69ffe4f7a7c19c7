//! examples/05_replace_a_lost_rank.rs: data-parallel steps that shrink a lost rank away and grow
//! back with a replacement. Ranks as threads (one node, and two simulated nodes: shared memory
//! and TCP) with the replacement a joining thread, and as processes under
//! `oxccl launch --respawn 1` (this test binary: `rank_entry` does nothing in a normal run and
//! plays a rank, or the replacement, when `OXCCL_TEST_REPLACE` is set).

#[path = "../../examples/05_replace_a_lost_rank.rs"]
#[allow(dead_code)]
mod replace;

use std::process::Command;

use oxccl::comm::harness::spawn_world_and_joiners;
use oxccl::comm::{Communicator, Config};

use crate::common;

fn expected_history(history: &[Vec<usize>]) -> bool {
    common::lost_member_2_at_step_3(history, &[0, 1, 3, 4])
}

fn check(outcome: &replace::Outcome, first: &replace::Outcome) {
    assert!(expected_history(&outcome.history), "{:?}", outcome.history);
    assert_eq!(outcome, first, "every rank ends the same");
    assert!(
        replace::matches_reference(outcome),
        "weights differ from the serial recomputation over {:?}",
        outcome.history
    );
}

#[test]
fn a_lost_rank_is_replaced_as_threads() {
    for per_node in [4, 2] {
        let cfg_of = |i: usize| Config {
            node_id: Some(format!("node{}", i.min(3) / per_node)),
            ..Config::default()
        };
        let out: Vec<_> = spawn_world_and_joiners(
            4,
            1,
            cfg_of,
            |c| {
                let state = replace::State::start(c.size());
                replace::train(c, state, Some((2, 3)), 8, replace::Recovery::Replace, || ())
            },
            |_, store, cfg| replace::joined(Communicator::join_with_config(store, cfg)?, 8),
        )
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{per_node} ranks per node: {e}")))
        .collect();
        assert!(out[2].is_none(), "member 2 must have left");
        let first = out[0].clone().expect("rank 0's outcome");
        for i in [0, 1, 3, 4] {
            check(out[i].as_ref().expect("an outcome"), &first);
        }
    }
}

/// Plays one rank, or the replacement (`OXCCL_JOIN=1`), when started by `oxccl launch` from
/// the test below: rank 2 exits with code 3 at step 3, the launcher starts its replacement.
pub(crate) fn play_rank() {
    if std::env::var("OXCCL_TEST_REPLACE").is_err() {
        return;
    }
    let launched_as: usize = std::env::var("OXCCL_RANK").unwrap().parse().unwrap();
    let comm = Communicator::from_env().expect("communicator from the environment");
    let joining = comm.joined();
    let got = if joining {
        replace::joined(comm, 8)
    } else {
        let state = replace::State::start(comm.size());
        let crash = || std::process::exit(3);
        replace::train(
            comm,
            state,
            Some((2, 3)),
            8,
            replace::Recovery::Replace,
            crash,
        )
    };
    match got {
        Ok(Some(o)) if replace::matches_reference(&o) && expected_history(&o.history) => {
            println!("RESULT rank={launched_as} ok joined={joining}")
        }
        other => {
            println!("RESULT rank={launched_as} FAILED {other:?}");
            std::process::exit(1);
        }
    }
}

#[test]
fn a_lost_rank_is_replaced_under_oxccl_launch_respawn() {
    let out = Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .args([
            "launch",
            "-n",
            "4",
            "--respawn",
            "1",
            "--timeout",
            "120",
            "--",
        ])
        .args(common::rank_cmd())
        .env("OXCCL_TEST_REPLACE", "1")
        .env("OXCCL_TIMEOUT", "60")
        .env_remove("OXCCL_DEBUG")
        .output()
        .expect("running oxccl launch");
    // The failure was replaced: the launcher exits with 0, and "rank 2" is its replacement.
    common::assert_all_ok(&out, 4);
    let res = common::results(&out);
    assert_eq!(res[&2], "2 ok joined=true", "{}", common::show(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rank 2 (pid") && stderr.contains("--respawn: starting a replacement"),
        "{}",
        common::show(&out)
    );
}

/// The same across two launchers on loopback (nodes `node0` and `node1`, 2 ranks each): rank 2,
/// on node 1, is replaced by node 1's launcher and joins through the store on node 0.
#[test]
fn a_lost_rank_is_replaced_across_two_launchers() {
    let port = common::free_port().to_string();
    let nodes: Vec<_> = (0..2)
        .map(|k| {
            Command::new(env!("CARGO_BIN_EXE_oxccl"))
                .args(["launch", "--nnodes", "2", "--node-rank", &k.to_string()])
                .args(["--master-port", &port, "-n", "2", "--respawn", "1"])
                .args(["--timeout", "120", "--"])
                .args(common::rank_cmd())
                .env("OXCCL_TEST_REPLACE", "1")
                .env("OXCCL_NODE_ID", format!("node{k}"))
                .env("OXCCL_TIMEOUT", "60")
                .env_remove("OXCCL_DEBUG")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("starting a launcher")
        })
        .collect();
    let outs: Vec<_> = nodes
        .into_iter()
        .map(|c| c.wait_with_output().expect("a launcher's output"))
        .collect();
    for (k, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "node {k}: {}", common::show(out));
    }
    let res0 = common::results(&outs[0]);
    let res1 = common::results(&outs[1]);
    for r in [0, 1] {
        assert!(
            res0[&r].starts_with(&format!("{r} ok joined=false")),
            "{res0:?}"
        );
    }
    assert_eq!(res1[&2], "2 ok joined=true", "{}", common::show(&outs[1]));
    assert!(res1[&3].starts_with("3 ok joined=false"), "{res1:?}");
}
