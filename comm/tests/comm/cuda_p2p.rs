//! Device sends and receives over CUDA IPC (feature `cuda`) on a real GPU: after
//! `StreamComm::connect`, batches both ways round a ring of 2 to 4 rank threads, messages from
//! empty to many inbox chunks long (4 KiB slots: 2 KiB chunks), sends to the rank itself, and
//! single sends and receives, checked byte for byte; with flags met on the host (the default for
//! threads) and by the p2p kernels on the device; a length that differs (within a chunk, and by
//! whole chunks) and a receive never posted, named instead of hung. Ignored without a GPU, like `cuda.rs`:
//!
//! ```text
//! cargo test -p oxccl-comm --features cuda --test comm -- cuda_p2p --ignored --test-threads 1
//! ```

use std::sync::Arc;
use std::time::Duration;

use oxccl_comm::cuda::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use oxccl_comm::harness::spawn_world;
use oxccl_comm::{Buf, BufMut, Communicator, Config, P2pView, Result};
use oxccl_kernels::cuda::gpu_or_skip;

// `gated`: between two host barriers where flags are met on the device and ranks are threads
// (no rank's driver call may wait for the context while a peer's kernel spins).
use super::cuda::{call_error, gated};

/// Message lengths: empty, one byte, around one 2 KiB chunk, several chunks, and many.
const SIZES: [usize; 7] = [0, 1, 2047, 2048, 2049, 5 * 2048 + 3, 100_000];

fn stream() -> Arc<CudaStream> {
    let ctx = CudaContext::new(0).expect("a CUDA context on device 0");
    ctx.new_stream().expect("stream")
}

/// What rank `from` sends with tag `tag`: bytes that differ by sender, tag and position.
fn pattern(from: usize, tag: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i * 7 + from * 31 + tag * 101) as u8)
        .collect()
}

fn cfg(host_barrier: Option<bool>) -> Config {
    Config {
        cuda_ipc: Some(true),
        cuda_ipc_slot: 4096,
        cuda_ipc_host_barrier: host_barrier,
        timeout: Duration::from_secs(20),
        ..Config::from_env().expect("OXCCL_* variables")
    }
}

/// One rank: every size both ways round the ring and to itself in one batch, then a single
/// send and receive; returns the messages that arrived wrong.
fn ring_batches(comm: &Communicator, gate: bool) -> Result<Vec<String>> {
    let s = stream();
    let (r, n) = (comm.rank(), comm.size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let path = comm.on_stream(&s).connect()?;
    assert_eq!(path, "cuda_ipc", "rank {r}");
    let mut bad = Vec::new();
    for len in SIZES {
        let up = |v: Vec<u8>| s.clone_htod(&v).expect("upload");
        let (a, b, me) = (
            up(pattern(r, 0, len)),
            up(pattern(r, 1, len)),
            up(pattern(r, 2, len)),
        );
        let nines = || up(vec![9u8; len]);
        let (mut from_prev, mut from_next, mut from_me) = (nines(), nines(), nines());
        gated(comm, gate, || {
            comm.buffers().batch_p2p(vec![
                P2pView::Send {
                    buf: Buf::device(&a, &s),
                    peer: next,
                },
                P2pView::Recv {
                    buf: BufMut::device(&mut from_prev, &s),
                    peer: prev,
                },
                P2pView::Send {
                    buf: Buf::device(&me, &s),
                    peer: r,
                },
                P2pView::Send {
                    buf: Buf::device(&b, &s),
                    peer: prev,
                },
                P2pView::Recv {
                    buf: BufMut::device(&mut from_next, &s),
                    peer: next,
                },
                P2pView::Recv {
                    buf: BufMut::device(&mut from_me, &s),
                    peer: r,
                },
            ])
        })?;
        s.synchronize().expect("stream");
        let mut check = |what: &str, got: &CudaSlice<u8>, want: Vec<u8>| {
            if s.clone_dtoh(got).expect("download") != want {
                bad.push(format!("{len} B {what}"));
            }
        };
        check("from the previous rank", &from_prev, pattern(prev, 0, len));
        check("from the next rank", &from_next, pattern(next, 1, len));
        check("from itself", &from_me, pattern(r, 2, len));
    }
    // A single send and receive round the ring (even ranks send first).
    let len = 3 * 2048 + 5;
    let a = s.clone_htod(&pattern(r, 3, len)).expect("upload");
    let mut got = s.clone_htod(&vec![9u8; len]).expect("upload");
    gated(comm, gate, || {
        let dev = comm.on_stream(&s);
        if r % 2 == 0 {
            dev.send(&a, next)?;
            dev.recv(&mut got, prev)
        } else {
            dev.recv(&mut got, prev)?;
            dev.send(&a, next)
        }
    })?;
    s.synchronize().expect("stream");
    if s.clone_dtoh(&got).expect("download") != pattern(prev, 3, len) {
        bad.push("send/recv".into());
    }
    if let Some(e) = comm.device_async_error() {
        return Err(e);
    }
    assert_eq!(comm.stats().device_path, Some("cuda_ipc"), "rank {r}");
    Ok(bad)
}

fn ring_world(n: usize, host_barrier: Option<bool>) {
    let gate = host_barrier == Some(false);
    let results = spawn_world(n, cfg(host_barrier), move |comm| ring_batches(&comm, gate));
    for (rank, r) in results.into_iter().enumerate() {
        let bad = r.unwrap_or_else(|e| panic!("{n} ranks, rank {rank}: {e}"));
        assert!(bad.is_empty(), "{n} ranks, rank {rank}: wrong: {bad:?}");
    }
}

#[test]
#[ignore = "needs a GPU: cargo test -p oxccl-comm --features cuda --test comm -- cuda_p2p --ignored --test-threads 1"]
fn cuda_p2p_ring_batches_of_every_size_over_ipc_two_three_and_four_ranks() {
    if gpu_or_skip() {
        for n in [2, 3, 4] {
            ring_world(n, None);
        }
    }
}

#[test]
#[ignore = "needs a GPU: cargo test -p oxccl-comm --features cuda --test comm -- cuda_p2p --ignored --test-threads 1"]
fn cuda_p2p_ring_batches_with_flags_on_the_device() {
    if gpu_or_skip() {
        ring_world(2, Some(false));
        ring_world(3, Some(false));
    }
}

/// Rank 0 sends `sent` bytes to rank 1, which receives `want` bytes (`None`: posts nothing);
/// each rank's error, from the call or after synchronising.
fn fault(host_barrier: Option<bool>, sent: usize, want: Option<usize>) -> Vec<String> {
    let c = Config {
        timeout: Duration::from_secs(2),
        ..cfg(host_barrier)
    };
    let results = spawn_world(2, c, move |comm| {
        let s = stream();
        comm.on_stream(&s).connect()?;
        let data = s.alloc_zeros::<u8>(sent.max(1)).expect("device memory");
        let mut into = s
            .alloc_zeros::<u8>(want.unwrap_or(0).max(1))
            .expect("device memory");
        let r = if comm.rank() == 0 {
            let v = data.slice(..sent);
            comm.on_stream(&s).send(&v, 1)
        } else if let Some(w) = want {
            let mut v = into.slice_mut(..w);
            comm.on_stream(&s).recv(&mut v, 0)
        } else {
            Ok(())
        };
        s.synchronize()
            .expect("the stream finishes: every wait has a deadline");
        Ok(call_error(&comm, r).1)
    });
    results
        .into_iter()
        .map(|r| r.expect("connect works"))
        .collect()
}

#[test]
#[ignore = "needs a GPU: cargo test -p oxccl-comm --features cuda --test comm -- cuda_p2p --ignored --test-threads 1"]
fn cuda_p2p_a_length_that_differs_and_a_missing_receive_are_named() {
    if !gpu_or_skip() {
        return;
    }
    for host_barrier in [None, Some(false)] {
        // 3000 bytes sent (chunks of 2048 and 952), 1000 expected: the receiver finds chunk 1
        // 2048 bytes long.
        let e = fault(host_barrier, 3000, Some(1000));
        assert!(
            e[1].contains("mismatch") && e[1].contains("rank 0") && e[1].contains("length"),
            "{host_barrier:?}: {e:?}"
        );
        // Two whole chunks sent, one expected: every chunk the receiver takes has the length it
        // expects, but the message ends elsewhere.
        let e = fault(host_barrier, 4096, Some(2048));
        assert!(
            e[1].contains("mismatch") && e[1].contains("rank 0") && e[1].contains("chunk"),
            "{host_barrier:?}: {e:?}"
        );
        // Five chunks sent, no receive: the third waits for the first to be taken.
        let e = fault(host_barrier, 5 * 2048, None);
        assert!(
            e[0].contains("rank 1 did not take chunk 1"),
            "{host_barrier:?}: {e:?}"
        );
        assert!(e[1].is_empty(), "{host_barrier:?}: {e:?}");
    }
}

/// Ranks that are threads of one process, set up over CUDA IPC and used, then dropped one after
/// another by one thread (as a program that made every rank calls `ncclCommDestroy` in a loop):
/// no drop waits for a peer that has not been dropped yet. A drop that did would wait for the
/// peers up to the time-out (60 s here), per rank.
#[test]
#[ignore = "needs a GPU: cargo test -p oxccl-comm --features cuda --test comm -- cuda_p2p --ignored --test-threads 1"]
fn cuda_p2p_ranks_dropped_one_after_another_by_one_thread_do_not_wait() {
    if !gpu_or_skip() {
        return;
    }
    let c = Config {
        timeout: Duration::from_secs(60),
        ..cfg(None)
    };
    let comms: Vec<Communicator> = spawn_world(3, c, |comm| {
        let s = stream();
        assert_eq!(comm.on_stream(&s).connect()?, "cuda_ipc");
        let mut d = s.clone_htod(&[1.0f32; 256]).expect("upload");
        comm.on_stream(&s)
            .all_reduce(&mut d, oxccl_comm::ReduceOp::Sum)?;
        s.synchronize().expect("stream");
        Ok(comm)
    })
    .into_iter()
    .collect::<Result<_>>()
    .expect("three ranks over CUDA IPC");
    let start = std::time::Instant::now();
    for c in comms {
        drop(c);
    }
    let took = start.elapsed();
    assert!(
        took < Duration::from_secs(30),
        "dropping three ranks one after another took {took:?}: a drop waited for its peers"
    );
}
