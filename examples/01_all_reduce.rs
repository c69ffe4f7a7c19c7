//! 01_all_reduce: the first oxccl program. Every rank joins the job, all-reduces a vector (sum and
//! average), runs an async all-reduce, a broadcast, and an all-reduce on a sub-communicator made
//! by splitting the ranks into even and odd ones. Every result is checked; a wrong one ends the
//! program with a message and a non-zero exit code.
//!
//! Run it on 4 local ranks:
//!
//! ```text
//! cargo build --release --example 01_all_reduce && cargo run --release --bin oxccl -- launch -n 4 -- target/release/examples/01_all_reduce
//! ```
//!
//! Add `OXCCL_DEBUG=info` in front of the command to see the connections each rank opens and the
//! algorithm each collective picked. The same binary runs under torchrun, `srun` or `mpirun`
//! (see docs/ENV.md).

use oxccl::comm::{Communicator, ReduceOp};

/// Returns an error naming the rank, the operation and the first wrong element.
fn check<T: PartialEq + std::fmt::Debug>(
    rank: usize,
    what: &str,
    got: &[T],
    want: impl Fn(usize) -> T,
) -> Result<(), Box<dyn std::error::Error>> {
    for (i, g) in got.iter().enumerate() {
        let w = want(i);
        if *g != w {
            return Err(
                format!("rank {rank}: {what}: element {i} is {g:?}, expected {w:?}").into(),
            );
        }
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    oxccl::logging::init(); // OXCCL_DEBUG=info shows transports and algorithms
                            // Rank, world size and the rendezvous store come from the launcher's variables.
    let comm = Communicator::from_env()?;
    let (rank, n) = (comm.rank(), comm.size());
    println!(
        "rank {rank} of {n}: local rank {} of {} on node {:?} (node index {})",
        comm.local_rank(),
        comm.local_size(),
        comm.node_id(),
        comm.node_index()
    );

    // Blocking all-reduce, in place. Rank r contributes (r + 1) + (i % 10) at index i.
    let count = 1 << 20; // 4 MiB of f32
    let input: Vec<f32> = (0..count)
        .map(|i| (rank + 1) as f32 + (i % 10) as f32)
        .collect();
    let ranks_sum = (n * (n + 1) / 2) as f32; // sum of (r + 1) over all ranks

    let mut sum = input.clone();
    comm.all_reduce(&mut sum, ReduceOp::Sum)?;
    check(rank, "all-reduce sum", &sum, |i| {
        ranks_sum + (n * (i % 10)) as f32
    })?;

    let mut avg = input;
    comm.all_reduce(&mut avg, ReduceOp::Avg)?;
    check(rank, "all-reduce avg", &avg, |i| {
        (ranks_sum + (n * (i % 10)) as f32) / n as f32
    })?;
    println!(
        "rank {rank}: all-reduce of {count} floats ok: sum[0..3] = {:?}, avg[0..3] = {:?}",
        &sum[..3],
        &avg[..3]
    );

    // Async all-reduce: the Work owns the buffer while the communicator's progress thread runs
    // the collective; wait() hands it back reduced. The caller is free in between.
    let work = comm.all_reduce_async(vec![rank as i64; 1000], ReduceOp::Sum);
    let local_work: i64 = (0..1000i64).sum(); // something to do meanwhile
    let total = work.wait()?;
    let want = (n * (n - 1) / 2) as i64;
    check(rank, "async all-reduce", &total, |_| want)?;
    println!(
        "rank {rank}: async all-reduce ok: {} (computed {local_work} meanwhile)",
        total[0]
    );

    // Broadcast from rank 0.
    let mut params = if rank == 0 {
        vec![0.5f64, 1.5, 2.5, 3.5]
    } else {
        vec![0.0; 4]
    };
    comm.broadcast(&mut params, 0)?;
    check(rank, "broadcast", &params, |i| i as f64 + 0.5)?;
    println!("rank {rank}: broadcast ok: {params:?}");

    // Split into even and odd ranks (like ncclCommSplit: color = group, key = order inside it)
    // and all-reduce the world ranks inside each group.
    let color = (rank % 2) as u32;
    let Some(sub) = comm.split(Some(color), rank as i64)? else {
        return Err(format!("rank {rank}: split with a color returned no communicator").into());
    };
    let mut v = vec![rank as u32; 8];
    sub.all_reduce(&mut v, ReduceOp::Sum)?;
    let want: u32 = (0..n).filter(|r| r % 2 == rank % 2).map(|r| r as u32).sum();
    check(rank, "sub-communicator all-reduce", &v, |_| want)?;
    println!(
        "rank {rank}: {} group: sub rank {} of {}, sum of world ranks = {}",
        if color == 0 { "even" } else { "odd" },
        sub.rank(),
        sub.size(),
        v[0]
    );

    // Every rank reaches the barrier only if all its checks passed (a rank that fails closes its
    // connections and the others get PeerLost here).
    comm.barrier()?;
    if rank == 0 {
        println!("all checks passed on all {n} ranks");
    }
    Ok(())
}
