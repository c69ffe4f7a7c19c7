//! How long creating a communicator takes: starts N processes of itself with torchrun's
//! variables (rank 0 hosts the store, all on this machine), each timing
//! `Communicator::from_env()`, and prints the slowest rank's time per repetition.
//!
//! ```sh
//! cargo run --release -p oxccl-comm --example init_time -- 8 5   # 8 ranks, 5 repetitions
//! ```
use std::process::{Command, Stdio};
use std::time::Instant;

fn main() {
    if let Ok(rank) = std::env::var("RANK") {
        let t0 = Instant::now();
        let c = oxccl_comm::Communicator::from_env().expect("communicator from the environment");
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        c.barrier().expect("barrier");
        println!("{rank} {ms:.2}");
        return;
    }
    let arg = |i: usize, default: usize| {
        std::env::args()
            .nth(i)
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let (n, reps) = (arg(1, 4), arg(2, 5));
    let me = std::env::current_exe().expect("this program's path");
    for rep in 0..reps {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let ranks: Vec<_> = (0..n)
            .map(|r| {
                Command::new(&me)
                    .env("RANK", r.to_string())
                    .env("WORLD_SIZE", n.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .stdout(Stdio::piped())
                    .spawn()
                    .expect("starting a rank")
            })
            .collect();
        let slowest = ranks
            .into_iter()
            .filter_map(|k| k.wait_with_output().ok())
            .filter_map(|o| {
                let s = String::from_utf8_lossy(&o.stdout).into_owned();
                s.split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<f64>().ok())
            })
            .fold(0.0f64, f64::max);
        println!("ranks={n} rep={rep} slowest_init_ms={slowest:.2}");
    }
}
