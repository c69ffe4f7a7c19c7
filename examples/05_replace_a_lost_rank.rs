//! Data-parallel steps that replace a lost rank: when a rank dies, the others `shrink` it away,
//! `grow` the communicator back to its size with a replacement process that the launcher started
//! in its place, hand that process the state (step, weights, history) and redo the step at full
//! size. The job keeps its size without a restart from a checkpoint.
//!
//! The steps are those of examples/04_survive_a_lost_rank.rs. Rank `--fail-rank` exits (code 3)
//! at step `--fail-step`; `oxccl launch --respawn 1` leaves the others running and starts the
//! replacement, with the failed rank's variables and `OXCCL_JOIN=1`, so its
//! `Communicator::from_env` joins the grown communicator:
//!
//! ```sh
//! cargo build --release --bin oxccl --example 05_replace_a_lost_rank
//! target/release/oxccl launch -n 4 --respawn 1 -- \
//!     target/release/examples/05_replace_a_lost_rank --fail-rank 2 --fail-step 3
//! ```
//!
//! Every rank, the replacement included, checks its weights against a serial recomputation over
//! the ranks that took part in each step (the replacement counts as a new member, numbered 4),
//! and that all hold the same weights. The failure was replaced, so the launcher exits with 0.
//!
//! The training code is example 04's (`train` with `Recovery::Replace`, and `joined` for the
//! replacement). Kept simple on purpose, like example 04: one failure at a time, and the launcher
//! must have a replacement left (`grow` times out otherwise).

#[path = "04_survive_a_lost_rank.rs"]
#[allow(dead_code)]
mod survive;

use oxccl::comm::Communicator;
pub use survive::{arg, crash, joined, matches_reference, train, Outcome, Recovery, State};

#[allow(dead_code)]
fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    oxccl::logging::init(); // OXCCL_DEBUG=info shows transports and algorithms
    let steps = arg("--steps").unwrap_or(8);
    let fail = arg("--fail-rank").map(|r| (r, arg("--fail-step").unwrap_or(3)));
    // With OXCCL_JOIN=1 (a replacement `oxccl launch --respawn` started) this joins the
    // communicator the others grow.
    let comm = Communicator::from_env()?;
    let outcome = if comm.joined() {
        println!(
            "replacement: joined as rank {} of {}",
            comm.rank(),
            comm.size()
        );
        joined(comm, steps)?
    } else {
        let crash = crash(comm.rank(), fail);
        let state = State::start(comm.size());
        train(comm, state, fail, steps, Recovery::Replace, crash)?
    };
    if let Some(o) = outcome {
        survive::report(steps, &o)?;
    }
    Ok(())
}
