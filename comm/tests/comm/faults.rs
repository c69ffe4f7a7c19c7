//! Threaded tests of what is not plain data movement: mismatched calls, abort, deadlines, bad
//! arguments, async work, split, socket options (IPv6, several sockets), node ids.

use std::sync::Arc;
use std::time::{Duration, Instant};

use oxccl_comm::bootstrap::{MemStore, Store};
use oxccl_comm::config::{SocketFamily, TransportChoice};
use oxccl_comm::{harness::spawn_world, Communicator, Config, Error, ReduceOp, Result};

fn cfg(timeout_s: u64) -> Config {
    Config {
        timeout: Duration::from_secs(timeout_s),
        ..Config::default()
    }
}

/// Fault behaviour must not depend on the medium.
const TRANSPORTS: [TransportChoice; 2] = [TransportChoice::Tcp, TransportChoice::Shm];

fn tcfg(t: TransportChoice, timeout_s: u64) -> Config {
    Config {
        transport: t,
        ..cfg(timeout_s)
    }
}

/// Runs ranks with a config each (so node ids can differ).
fn spawn_cfgs<R: Send>(
    cfgs: Vec<Config>,
    f: impl Fn(Communicator) -> Result<R> + Sync,
) -> Vec<Result<R>> {
    let n = cfgs.len();
    let store: Arc<dyn Store> = Arc::new(MemStore::new());
    std::thread::scope(|s| {
        let hs: Vec<_> = cfgs
            .into_iter()
            .enumerate()
            .map(|(r, c)| {
                let store = store.clone();
                let f = &f;
                s.spawn(move || Communicator::init_with_config(r, n, store, c).and_then(f))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn count_mismatch_is_reported_on_every_rank() {
    for t in TRANSPORTS {
        count_mismatch_is_reported_on_every_rank_on(t);
    }
}

fn count_mismatch_is_reported_on_every_rank_on(t: TransportChoice) {
    let res = spawn_world(4, tcfg(t, 30), |c| {
        let n = if c.rank() == 2 { 10 } else { 20 };
        let mut v = vec![1.0f32; n];
        let first = c.all_reduce(&mut v, ReduceOp::Sum);
        Ok((first, c.barrier()))
    });
    for (rank, r) in res.into_iter().enumerate() {
        let (first, then) = r.unwrap();
        let e = first.expect_err("mismatched all-reduce must fail");
        assert!(matches!(e, Error::Mismatch { .. }), "rank {rank}: {e}");
        let msg = e.to_string();
        assert!(
            msg.contains("count=10") && msg.contains("count=20"),
            "rank {rank}: both sides described: {msg}"
        );
        assert!(then.is_err(), "rank {rank}: the communicator stays broken");
    }
}

/// Whichever rank finds a mismatch first, every rank's error says "this rank called" its own
/// call and names a rank whose call differs, with that rank's call (20 runs).
#[test]
fn a_mismatch_is_told_from_each_ranks_own_point_of_view() {
    for run in 0..20 {
        let t = TRANSPORTS[run % TRANSPORTS.len()];
        let res = spawn_world(4, tcfg(t, 30), |c| {
            let n = if c.rank() == 2 { 10 } else { 20 };
            Ok(c.all_reduce(&mut vec![1.0f32; n], ReduceOp::Sum))
        });
        for (rank, r) in res.into_iter().enumerate() {
            let e = r.unwrap().expect_err("mismatched all-reduce must fail");
            let Error::Mismatch {
                rank: me,
                peer,
                local,
                remote,
                ..
            } = &e
            else {
                panic!("run {run}, rank {rank}: {e}");
            };
            let (own, other) = if rank == 2 {
                ("count=10", "count=20")
            } else {
                ("count=20", "count=10")
            };
            assert_eq!(*me, rank, "run {run}: {e}");
            assert!(
                local.contains(own) && remote.contains(other),
                "run {run}, rank {rank}: {e}"
            );
            assert!(
                (rank == 2) != (*peer == 2),
                "run {run}, rank {rank}: the rank named must differ from this one: {e}"
            );
        }
    }
}

#[test]
fn different_collectives_and_roots_are_mismatches() {
    for t in TRANSPORTS {
        different_collectives_and_roots_are_mismatches_on(t);
    }
}

fn different_collectives_and_roots_are_mismatches_on(t: TransportChoice) {
    // Rank 1 broadcasts while the others all-reduce; then roots differ. A rank whose part was
    // only sending may finish its call and get the mismatch from its next one.
    for case in 0..3 {
        let res = spawn_world(4, tcfg(t, 30), |c| {
            let mut v = vec![c.rank() as i32; 100];
            let first = match (case, c.rank()) {
                (0, 1) => c.broadcast(&mut v, 0),
                (0, _) => c.all_reduce(&mut v, ReduceOp::Sum),
                (1, 3) => c.broadcast(&mut v, 3),
                (1, _) => c.broadcast(&mut v, 0),
                (_, 0) => c.all_reduce(&mut vec![0.0f64; 100], ReduceOp::Sum),
                (_, _) => c.all_reduce(&mut v, ReduceOp::Sum),
            };
            Ok(first.and_then(|_| c.barrier()))
        });
        for (rank, r) in res.into_iter().enumerate() {
            let e = r.unwrap().expect_err("mismatch must surface");
            assert!(
                matches!(e, Error::Mismatch { .. }),
                "case {case} rank {rank}: {e}"
            );
        }
    }
}

#[test]
fn abort_unblocks_a_pending_collective_and_tells_the_peers() {
    for t in TRANSPORTS {
        abort_unblocks_a_pending_collective_and_tells_the_peers_on(t);
    }
}

fn abort_unblocks_a_pending_collective_and_tells_the_peers_on(t: TransportChoice) {
    let t0 = Instant::now();
    let res = spawn_world(3, tcfg(t, 60), |c| {
        if c.rank() == 0 {
            // Nobody else calls this all-reduce; a watchdog aborts it.
            std::thread::scope(|s| {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(300));
                    c.abort();
                });
                let mut v = vec![0u8; 1 << 20];
                Ok(c.all_reduce(&mut v, ReduceOp::Max))
            })
        } else {
            // The peers call nothing until rank 0 has aborted; their next call must fail with
            // rank 0's cause, not hang.
            std::thread::sleep(Duration::from_millis(1000));
            Ok(c.barrier())
        }
    });
    for (rank, r) in res.into_iter().enumerate() {
        let e = r.unwrap().expect_err("aborted");
        assert!(matches!(e, Error::Aborted { .. }), "rank {rank}: {e}");
    }
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "abort must not wait for the deadline"
    );
}

#[test]
fn a_missing_peer_times_out_with_a_deadline() {
    for t in TRANSPORTS {
        a_missing_peer_times_out_with_a_deadline_on(t);
    }
}

fn a_missing_peer_times_out_with_a_deadline_on(t: TransportChoice) {
    let t0 = Instant::now();
    let res = spawn_world(2, tcfg(t, 1), |c| {
        if c.rank() == 0 {
            let e = c.barrier().expect_err("rank 1 never comes");
            assert!(matches!(e, Error::Timeout { .. }), "{e}");
        } else {
            std::thread::sleep(Duration::from_millis(2500));
        }
        Ok(())
    });
    res.into_iter().for_each(|r| r.unwrap());
    assert!(t0.elapsed() < Duration::from_secs(20));
}

#[test]
fn a_peer_that_leaves_early_is_lost() {
    for t in TRANSPORTS {
        a_peer_that_leaves_early_is_lost_on(t);
    }
}

fn a_peer_that_leaves_early_is_lost_on(t: TransportChoice) {
    let res = spawn_world(3, tcfg(t, 30), |c| {
        if c.rank() == 2 {
            return Ok(None); // drops its communicator: a goodbye, then closed sockets
        }
        std::thread::sleep(Duration::from_millis(200));
        let mut v = vec![1u64; 1000];
        Ok(Some(c.all_reduce(&mut v, ReduceOp::Sum)))
    });
    for r in res.into_iter().take(2) {
        let e = r.unwrap().unwrap().expect_err("rank 2 is gone");
        assert_eq!(e.lost_peer(), Some(2), "{e}");
    }
}

#[test]
fn bad_arguments_are_rejected_before_anything_is_sent() {
    let res = spawn_world(2, cfg(30), |c| {
        let e = c.reduce_scatter(&mut [0f32; 7], ReduceOp::Sum).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("divisible"),
            "{e}"
        );
        let e = c.all_gather_into(&[1u8; 3], &mut [0u8; 5]).unwrap_err();
        assert!(e.to_string().contains(&format!("rank {}", c.rank())), "{e}");
        assert!(c.broadcast(&mut [0i8; 3], 9).is_err());
        assert!(c.send(&[0u8; 1], c.rank()).is_err());
        assert!(c.all_to_all_into(&[0u32; 3], &mut [0u32; 3]).is_err());
        assert!(c
            .all_reduce_into(&[0u32; 3], &mut [0u32; 4], ReduceOp::Sum)
            .is_err());
        // The communicator still works.
        let mut v = vec![1i64; 5];
        c.all_reduce(&mut v, ReduceOp::Sum)?;
        assert_eq!(v, vec![2; 5]);
        Ok(())
    });
    res.into_iter().for_each(|r| r.unwrap());
}

#[test]
fn async_work_runs_in_issue_order_and_gives_buffers_back() {
    for t in TRANSPORTS {
        async_work_runs_in_issue_order_and_gives_buffers_back_on(t);
    }
}

fn async_work_runs_in_issue_order_and_gives_buffers_back_on(t: TransportChoice) {
    let res = spawn_world(3, tcfg(t, 30), |c| {
        let w1 = c.all_reduce_async(vec![1.0f32; 100_000], ReduceOp::Sum);
        let w2 = c.broadcast_async(vec![c.rank() as u32; 33], 2);
        // A blocking call issued after the async ones runs after them.
        let mut b = vec![c.rank() as i32; 6];
        c.all_reduce(&mut b, ReduceOp::Max)?;
        let w3 = c.all_gather_async(
            (0..3)
                .map(|r| if r == c.rank() { r as u8 } else { 0 })
                .collect::<Vec<u8>>(),
        );
        let w4 = c.reduce_scatter_async(vec![1u32; 9], ReduceOp::Sum);
        let v2 = w2.wait()?;
        let v1 = w1.wait()?;
        let v3 = match w3.wait_timeout(Duration::from_secs(20)) {
            Ok(r) => r?,
            Err(_) => panic!("all-gather did not finish"),
        };
        let v4 = w4.wait()?;
        assert!(v1.iter().all(|&x| x == 3.0));
        assert_eq!(v2, vec![2; 33]);
        assert_eq!(b, vec![2; 6]);
        assert_eq!(v3, vec![0, 1, 2]);
        let me = c.rank();
        assert_eq!(&v4[me * 3..me * 3 + 3], &[3, 3, 3]);
        let bad = c.reduce_scatter_async(vec![1u32; 10], ReduceOp::Sum);
        assert!(matches!(bad.wait(), Err(Error::InvalidArgument { .. })));
        Ok(())
    });
    res.into_iter().for_each(|r| r.unwrap());
}

#[test]
fn split_like_nccl_comm_split() {
    for t in TRANSPORTS {
        split_like_nccl_comm_split_on(t);
    }
}

fn split_like_nccl_comm_split_on(t: TransportChoice) {
    let res = spawn_world(6, tcfg(t, 30), |c| {
        let r = c.rank();
        // Ranks 0..5 by parity, reverse order by key; rank 5 stays out.
        let color = if r == 5 { None } else { Some((r % 2) as u32) };
        let sub = c.split(color, -(r as i64))?;
        let Some(sub) = sub else {
            assert_eq!(r, 5);
            return c.barrier();
        };
        let members: Vec<usize> = if r % 2 == 0 {
            vec![4, 2, 0]
        } else {
            vec![3, 1]
        };
        assert_eq!(sub.size(), members.len());
        assert_eq!(members[sub.rank()], r);
        // Sub-communicators and the parent progress independently: an async op on the sub
        // communicator stays in flight while the parent runs a blocking collective.
        let w = sub.all_reduce_async(vec![r as u64; 1000], ReduceOp::Sum);
        c.barrier()?;
        let v = w.wait()?;
        assert_eq!(v[0], members.iter().map(|&m| m as u64).sum::<u64>());
        let again = sub.split(Some(0), 0)?.expect("member");
        let mut x = [1u8];
        again.all_reduce(&mut x, ReduceOp::Sum)?;
        assert_eq!(x[0] as usize, members.len());
        Ok(())
    });
    res.into_iter().for_each(|r| r.unwrap());
}

/// Two "nodes" in one process: shared memory inside each, TCP across, in one communicator.
#[test]
fn node_ids_give_local_ranks_and_mixed_transports() {
    let cfgs: Vec<Config> = (0..5)
        .map(|r| Config {
            node_id: Some(format!("node{}", r % 2)),
            ..cfg(30)
        })
        .collect();
    let res = spawn_cfgs(cfgs, |c| {
        Ok((
            c.local_rank(),
            c.local_size(),
            c.node_index(),
            c.node_id().to_string(),
        ))
    });
    let want = [(0, 3, 0), (0, 2, 1), (1, 3, 0), (1, 2, 1), (2, 3, 0)];
    for (r, got) in res.into_iter().enumerate() {
        let (lr, ls, ni, id) = got.unwrap();
        assert_eq!((lr, ls, ni), want[r], "rank {r}");
        assert_eq!(id, format!("node{}", r % 2));
    }
}

#[test]
fn ipv6_sockets_slots_and_shared_memory_variants() {
    let have_v6 = std::net::TcpListener::bind("[::1]:0").is_ok();
    let mut variants = vec![
        Config {
            nsocks: 1,
            nslots: 1,
            slot_bytes: 64,
            ..cfg(60)
        },
        Config {
            nsocks: 3,
            nslots: 2,
            slot_bytes: 4096,
            ..cfg(60)
        },
        Config {
            nsocks: 4,
            nslots: 8,
            socket_buffer: 0,
            ..cfg(60)
        },
        Config {
            socket_ifname: Some("=lo".into()),
            socket_family: Some(SocketFamily::V4),
            ..cfg(60)
        },
    ];
    if have_v6 {
        variants.push(Config {
            socket_ifname: Some("lo".into()),
            socket_family: Some(SocketFamily::V6),
            ..cfg(60)
        });
    } else {
        eprintln!("note: no ::1 on this machine; IPv6 variant skipped");
    }
    for v in variants {
        let res = spawn_world(3, v.clone(), |c| {
            let mut x: Vec<f64> = (0..300_001).map(|i| (i % 7) as f64).collect();
            c.all_reduce(&mut x, ReduceOp::Sum)?;
            assert!(x
                .iter()
                .enumerate()
                .all(|(i, &v)| v == 3.0 * (i % 7) as f64));
            let mut out = vec![0u32; 3 * 1001];
            c.all_gather_into(&vec![c.rank() as u32; 1001], &mut out)?;
            assert!(out.iter().enumerate().all(|(i, &v)| v as usize == i / 1001));
            Ok(())
        });
        for r in res {
            r.unwrap_or_else(|e| panic!("{v:?}: {e}"));
        }
    }
}

#[test]
fn world_of_one_and_empty_buffers() {
    let res = spawn_world(1, cfg(5), |c| {
        let mut v = vec![2.5f32; 3];
        c.all_reduce(&mut v, ReduceOp::Avg)?;
        assert_eq!(v, vec![2.5; 3]);
        c.barrier()?;
        let mut e: Vec<u8> = Vec::new();
        c.all_reduce(&mut e, ReduceOp::Sum)?;
        Ok(())
    });
    res.into_iter().for_each(|r| r.unwrap());
}

#[test]
fn a_second_init_on_the_same_store_gets_a_fresh_communicator() {
    let store: Arc<dyn Store> = Arc::new(MemStore::new());
    for round in 0..3u32 {
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let store = store.clone();
                    s.spawn(move || -> Result<u32> {
                        let c = Communicator::init_with_config(r, 3, store, cfg(30))?;
                        let mut v = [round + r as u32];
                        c.all_reduce(&mut v, ReduceOp::Sum)?;
                        Ok(v[0])
                    })
                })
                .collect();
            for h in hs {
                assert_eq!(h.join().unwrap().unwrap(), 3 * round + 3);
            }
        });
    }
}

#[test]
fn window_and_slots_disagreeing_is_a_mismatch_not_a_hang() {
    // Rank 1's count makes the tuner pick the ring (slots) while rank 0 runs one-shot through
    // the shared-memory window: each waits where the other never writes unless they notice.
    let t0 = Instant::now();
    let res = spawn_world(2, tcfg(TransportChoice::Shm, 30), |c| {
        let n = if c.rank() == 0 { 4 } else { 1 << 20 };
        let mut v = vec![1.0f32; n];
        Ok(c.all_reduce(&mut v, ReduceOp::Sum))
    });
    for (rank, r) in res.into_iter().enumerate() {
        let e = r.unwrap().expect_err("mismatched all-reduce must fail");
        assert!(matches!(e, Error::Mismatch { .. }), "rank {rank}: {e}");
        let msg = e.to_string();
        assert!(
            msg.contains("count=4") && msg.contains("count=1048576"),
            "rank {rank}: both sides described: {msg}"
        );
    }
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "noticed, not timed out"
    );
    // Ranks forced onto different algorithms (OXCCL_ALGO differs per rank): refused on every
    // rank when the communicator is created, naming the variable, before any call can mispair.
    let algos = ["all-reduce=two-shot", "all-reduce=ring", "all-reduce=ring"];
    let cfgs = algos
        .iter()
        .map(|a| {
            let mut c = tcfg(TransportChoice::Shm, 30);
            c.algo = oxccl_comm::internal::tuning::AlgoOverride::parse(a).unwrap();
            c
        })
        .collect();
    let res = spawn_cfgs(cfgs, |c| {
        let mut v = vec![1u32; 100_000];
        Ok(c.all_reduce(&mut v, ReduceOp::Sum))
    });
    for (rank, r) in res.into_iter().enumerate() {
        let e = match r {
            Err(e) => e,
            Ok(_) => panic!("rank {rank}: different OXCCL_ALGO must fail at init"),
        };
        assert!(matches!(e, Error::Config(_)), "rank {rank}: {e}");
        assert!(e.to_string().contains("OXCCL_ALGO"), "rank {rank}: {e}");
    }
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "noticed, not timed out"
    );
}

#[test]
fn direct_algorithms_fail_cleanly_without_a_window() {
    // Over TCP there is no shared-memory window: forcing a direct algorithm is a clear error.
    let mut c = tcfg(TransportChoice::Tcp, 10);
    c.algo = oxccl_comm::internal::tuning::AlgoOverride::parse("all-reduce=one-shot").unwrap();
    for r in spawn_world(2, c, |c| {
        let mut v = vec![1u8; 10];
        Ok(c.all_reduce(&mut v, ReduceOp::Sum))
    }) {
        let e = r.unwrap().expect_err("no window over TCP");
        assert!(e.to_string().contains("shared memory"), "{e}");
    }
}

#[test]
fn ranks_with_different_staging_sizes_agree() {
    // Each rank sizes its staging halves from its own OXCCL_SHM_DIRECT_BYTES; the window uses
    // the smallest everywhere, so every rank picks the same algorithm and the same pieces.
    let sizes: [&[usize]; 2] = [&[4096, 65536, 1 << 20], &[1 << 20, 0, 8192]];
    let algos = ["", "all-reduce=one-shot", "all-reduce=two-shot"];
    for (sizes, algo) in sizes.iter().flat_map(|s| algos.iter().map(move |a| (s, a))) {
        let staged = !sizes.contains(&0);
        if !staged && !algo.is_empty() {
            continue; // forcing a direct algorithm without staging is an error (tested above)
        }
        let cfgs = sizes
            .iter()
            .map(|&d| {
                let mut c = tcfg(TransportChoice::Shm, 30);
                c.direct_bytes = d;
                c.algo = oxccl_comm::internal::tuning::AlgoOverride::parse(algo).unwrap();
                c
            })
            .collect();
        let res = spawn_cfgs(cfgs, |c| {
            let mut out = Vec::new();
            for n in [1usize, 100, 3000, 40_000] {
                let mut v: Vec<u32> = (0..n).map(|i| (i as u32) * 3 + c.rank() as u32).collect();
                c.all_reduce(&mut v, ReduceOp::Sum)?;
                out.push(v);
            }
            Ok(out)
        });
        for (rank, r) in res.into_iter().enumerate() {
            let got = r.unwrap_or_else(|e| panic!("{sizes:?} {algo:?} rank {rank}: {e}"));
            for v in got {
                for (i, x) in v.iter().enumerate() {
                    assert_eq!(*x, 9 * i as u32 + 3, "{sizes:?} {algo:?} rank {rank} [{i}]");
                }
            }
        }
    }
}
