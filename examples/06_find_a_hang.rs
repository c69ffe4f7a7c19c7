//! A job that hangs on purpose, and the flight recorder that finds out why.
//!
//! Every rank runs steps of "compute, then all-reduce the gradient". Rank `--slow-rank` (default
//! 2) computes `--slow-ms` (default 20) longer than the others, so they wait for it in every
//! all-reduce; at step `--hang-step` (default 3) rank `--hang-rank` (default 1) waits for a
//! message from its neighbour that the neighbour never sends (a bug), while the others enter the
//! step's all-reduce. Every rank fails after `OXCCL_TIMEOUT` and writes its communicator's flight
//! record; `oxccl launch --trace-dir` prints what the records show: who never reached the
//! all-reduce and what it waited for, and who the others waited for before:
//!
//! ```sh
//! cargo build --release --bin oxccl --example 06_find_a_hang
//! OXCCL_TIMEOUT=5 target/release/oxccl launch -n 4 --trace-dir /tmp/oxccl-trace -- \
//!     target/release/examples/06_find_a_hang
//! target/release/oxccl trace /tmp/oxccl-trace    # the same reading, again
//! ```

use std::time::Duration;

use oxccl::comm::{Communicator, ReduceOp};

fn arg(name: &str) -> Option<usize> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1)?.parse().ok()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    oxccl::logging::init(); // OXCCL_DEBUG=info shows transports and algorithms
    let comm = Communicator::from_env()?;
    let (me, n) = (comm.rank(), comm.size());
    let slow = arg("--slow-rank").unwrap_or(2);
    let slow_ms = arg("--slow-ms").unwrap_or(20) as u64;
    let hang = arg("--hang-rank").unwrap_or(1);
    let hang_step = arg("--hang-step").unwrap_or(3);
    // 256 KiB of gradients: large enough for the recorder's exact clock.
    let mut grad = vec![1.0f32; 1 << 16];
    for step in 0..hang_step + 2 {
        let compute = if me == slow { 5 + slow_ms } else { 5 };
        std::thread::sleep(Duration::from_millis(compute));
        if step == hang_step && me == hang && n > 1 {
            let mut token = [0u8; 8];
            comm.recv(&mut token, (me + 1) % n)?;
        }
        comm.all_reduce(&mut grad, ReduceOp::Avg)?;
        println!("rank {me}: step {step} done");
    }
    Ok(())
}
