//! 03_moe_dispatch: the token exchange of a mixture-of-experts layer with `all_to_all_v`.
//!
//! Every rank holds a batch of tokens and two experts. A router sends each token to one expert,
//! so every rank sends every other a different number of tokens (sometimes none). The layer:
//!
//! 1. sorts the tokens by the rank of their expert and counts them per rank;
//! 2. `all_to_all` of the counts: every rank learns how many tokens it will receive from each;
//! 3. `all_to_all_v` of the tokens (dispatch), each token followed by its expert's index;
//! 4. runs its experts on what it received;
//! 5. `all_to_all_v` back with the counts swapped (combine), and puts the tokens back in order.
//!
//! Every token's result is checked against the expert applied locally; a wrong one ends the
//! program with a message and a non-zero exit code. Run it on 4 local ranks:
//!
//! ```text
//! cargo build --release --example 03_moe_dispatch && cargo run --release --bin oxccl -- launch -n 4 -- target/release/examples/03_moe_dispatch
//! ```
//!
//! In a model with expert parallelism the exchange runs on the expert-parallel group
//! (`Topology::setup_moe`, group `moe_ep`) instead of the whole world.

use oxccl::comm::Communicator;

/// Features per token.
pub const DIM: usize = 8;
/// Experts on every rank.
pub const EXPERTS_PER_RANK: usize = 2;

/// Token `t` of rank `rank`: small integers, so every result below is exact in f32.
pub fn token(rank: usize, t: usize) -> [f32; DIM] {
    std::array::from_fn(|k| ((rank * 31 + t * 7 + k * 3) % 17) as f32)
}

/// The router: a fixed, uneven choice of expert for token `t` of rank `rank`: low experts
/// (counted from one past the rank's own first expert) are picked more often, so every rank
/// sends every other a different share, and small batches leave some pairs with nothing.
pub fn route(rank: usize, t: usize, experts: usize) -> usize {
    let h = (rank as u64 * 0x9e37_79b9 + t as u64 * 0x85eb_ca6b) % 1000;
    let skewed = (h as usize * h as usize / 1000) * experts / 1000;
    (skewed + rank * EXPERTS_PER_RANK + 1) % experts
}

/// Expert `e`: `x * (e + 1) + e`, element by element.
pub fn expert(e: usize, x: &[f32]) -> Vec<f32> {
    x.iter().map(|v| v * (e + 1) as f32 + e as f32).collect()
}

/// What one rank saw: tokens sent to and received from every rank.
pub struct Report {
    /// Tokens this rank sent to each rank (itself included).
    pub sent: Vec<usize>,
    /// Tokens this rank received from each rank.
    pub received: Vec<usize>,
}

/// One forward pass of the exchange for `tokens` tokens per rank; checks every result.
pub fn dispatch_combine(
    comm: &Communicator,
    tokens: usize,
) -> Result<Report, Box<dyn std::error::Error>> {
    let (rank, n) = (comm.rank(), comm.size());
    let experts = n * EXPERTS_PER_RANK;
    let row = DIM + 1; // the features, then the expert's index

    // 1. Route and sort by destination rank (stable, so the order inside a block is kept).
    let mut order: Vec<(usize, usize)> =
        (0..tokens).map(|t| (route(rank, t, experts), t)).collect();
    order.sort_by_key(|&(e, _)| e / EXPERTS_PER_RANK);
    let mut sent = vec![0usize; n];
    let mut send_buf = Vec::with_capacity(tokens * row);
    for &(e, t) in &order {
        sent[e / EXPERTS_PER_RANK] += 1;
        send_buf.extend_from_slice(&token(rank, t));
        send_buf.push(e as f32);
    }

    // 2. Counts: rank j learns sent[j] of every rank.
    let counts: Vec<u64> = sent.iter().map(|&c| c as u64).collect();
    let mut theirs = vec![0u64; n];
    comm.all_to_all_into(&counts, &mut theirs)?;
    let received: Vec<usize> = theirs.iter().map(|&c| c as usize).collect();

    // 3. Dispatch: counts in f32 elements, a row per token.
    let send_counts: Vec<usize> = sent.iter().map(|c| c * row).collect();
    let recv_counts: Vec<usize> = received.iter().map(|c| c * row).collect();
    let mut recv_buf = vec![0f32; recv_counts.iter().sum()];
    comm.all_to_all_v_into(&send_buf, &send_counts, &mut recv_buf, &recv_counts)?;

    // 4. The experts of this rank, on every received token (the index stays in the row).
    for r in recv_buf.chunks_exact_mut(row) {
        let e = r[DIM] as usize;
        if e / EXPERTS_PER_RANK != rank {
            return Err(format!("rank {rank}: received a token for expert {e}").into());
        }
        let y = expert(e, &r[..DIM]);
        r[..DIM].copy_from_slice(&y);
    }

    // 5. Combine: the same blocks go back, so the counts are swapped.
    let mut back = vec![0f32; send_buf.len()];
    comm.all_to_all_v_into(&recv_buf, &recv_counts, &mut back, &send_counts)?;
    for (&(e, t), r) in order.iter().zip(back.chunks_exact(row)) {
        let want = expert(e, &token(rank, t));
        if r[..DIM] != want[..] || r[DIM] as usize != e {
            return Err(format!(
                "rank {rank}: token {t} (expert {e}) came back as {:?}, expected {want:?}",
                &r[..DIM]
            )
            .into());
        }
    }
    Ok(Report { sent, received })
}

#[allow(dead_code)] // a test includes this file for `dispatch_combine`
fn main() -> Result<(), Box<dyn std::error::Error>> {
    oxccl::logging::init(); // OXCCL_DEBUG=info shows transports and algorithms
    let comm = Communicator::from_env()?;
    let tokens = 1000;
    for step in 0..3 {
        let report = dispatch_combine(&comm, tokens)?;
        if step == 0 {
            println!(
                "rank {}: sent {:?} tokens, received {:?}",
                comm.rank(),
                report.sent,
                report.received
            );
        }
    }
    comm.barrier()?;
    if comm.rank() == 0 {
        println!(
            "moe dispatch/combine ok: {} ranks x {tokens} tokens x 3 steps",
            comm.size()
        );
    }
    Ok(())
}
