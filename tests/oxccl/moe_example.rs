//! The mixture-of-experts exchange of examples/03_moe_dispatch.rs (`all_to_all_v` there and
//! back, with uneven and empty blocks): ranks as threads on one node and on two simulated nodes,
//! and ranks as processes started by `oxccl launch` (this test binary: `rank_entry` does nothing
//! in a normal run and plays a rank when `OXCCL_TEST_MOE` is set).

#[path = "../../examples/03_moe_dispatch.rs"]
#[allow(dead_code)]
mod moe;

use oxccl::comm::harness::{spawn_world, spawn_world_on_nodes};
use oxccl::comm::{Communicator, Config};

use crate::common;

/// Runs the exchange for several batch sizes; every rank checks its own tokens. Returns the
/// token counts of the first one.
fn exchange(comm: &Communicator) -> Result<(Vec<usize>, Vec<usize>), String> {
    let mut first = None;
    for tokens in [40, 0, 1, 700] {
        let r = moe::dispatch_combine(comm, tokens).map_err(|e| e.to_string())?;
        first.get_or_insert((r.sent, r.received));
    }
    Ok(first.unwrap())
}

#[test]
fn moe_exchange_as_threads() {
    for n in [1, 3, 4] {
        let out = spawn_world(n, Config::default(), |c| Ok(exchange(&c)));
        let counts: Vec<_> = out.into_iter().map(|r| r.unwrap().unwrap()).collect();
        // What rank i sent rank j is what rank j received from rank i.
        for (i, (sent, _)) in counts.iter().enumerate() {
            for (j, (_, received)) in counts.iter().enumerate() {
                assert_eq!(sent[j], received[i], "{n} ranks: {i} -> {j}");
            }
            assert_eq!(sent.iter().sum::<usize>(), 40);
        }
        if n == 4 {
            // The router is uneven: the blocks differ in size, and some are empty.
            let all: Vec<usize> = counts.iter().flat_map(|(s, _)| s.clone()).collect();
            assert!(all.contains(&0), "{all:?}");
            assert!(
                all.iter().max() > all.iter().filter(|&&c| c > 0).min(),
                "{all:?}"
            );
        }
    }
    let out = spawn_world_on_nodes(4, 2, Config::default(), |c| Ok(exchange(&c)));
    for r in out {
        r.unwrap().unwrap();
    }
}

/// Plays one rank when started by `oxccl launch` from the test below (`OXCCL_TEST_MOE` set;
/// does nothing otherwise).
pub(crate) fn play_rank() {
    if std::env::var("OXCCL_TEST_MOE").is_err() {
        return;
    }
    let comm = Communicator::from_env().expect("communicator from the environment");
    match exchange(&comm) {
        Ok(_) => println!("RESULT rank={} ok", comm.rank()),
        Err(e) => {
            println!("RESULT rank={} FAILED {e}", comm.rank());
            std::process::exit(1);
        }
    }
}

#[test]
fn moe_exchange_as_processes() {
    let out = common::launch_self(3, &[("OXCCL_TEST_MOE", "1")]);
    common::assert_all_ok(&out, 3);
}
