//! Channels (`OXCCL_SOCKET_CHANNELS`, `Config::socket_channels`): a communicator with TCP peers
//! keeps more sets of connections, each driven by a thread of its own, and cuts large
//! all-reduces, broadcasts and reduces across them. Every form of all-reduce with them against a
//! serial reference (in place, out of place, async; several types and operations; sizes that use
//! 1, 2 and 3 channels, lengths that are not whole cache lines), broadcast and reduce in place
//! and out of place, over TCP and across simulated nodes, with
//! the count of cut operations checked; and their failures: mismatched calls, a lost peer, a
//! missing peer and `abort` end in errors on every rank, never a hang; ranks that disagree on
//! the setting fail at init. `auto` and the node's rank count it shares with `OXCCL_SPIN=auto`
//! (groups count every rank of their node).

use std::time::{Duration, Instant};

use half::bf16;
use oxccl_comm::config::TransportChoice;
use oxccl_comm::harness::{spawn_world, spawn_world_on_nodes, spawn_world_with};
use oxccl_comm::{Communicator, Config, Error, ReduceOp, Result};

const MIB: usize = 1 << 20;

fn cfg(channels: usize, timeout_s: u64) -> Config {
    Config {
        transport: TransportChoice::Tcp,
        socket_channels: Some(channels),
        timeout: Duration::from_secs(timeout_s),
        ..Config::default()
    }
}

/// Small integers: every sum is exact in every type used here, whatever the order.
fn val(rank: usize, i: usize) -> usize {
    (rank * 31 + i * 17) % 11
}

fn check<T: PartialEq + std::fmt::Debug + Copy>(
    what: &str,
    rank: usize,
    got: &[T],
    want: impl Fn(usize) -> T,
) {
    for (i, &g) in got.iter().enumerate() {
        let w = want(i);
        assert!(
            g == w,
            "{what}: rank {rank}, element {i} of {}: got {g:?}, want {w:?}",
            got.len()
        );
    }
}

/// Every form of all-reduce on `len` f32 elements, broadcast and reduce in place and out of
/// place, and all-reduces of f64 average, i32 max and bf16 sum on about as many bytes: 11 cut
/// operations when `len` f32 are cut.
fn all_reduces(c: &Communicator, len: usize) -> Result<()> {
    let (rank, n) = (c.rank(), c.size());
    let sum = |i: usize| (0..n).map(|r| val(r, i) as f32).sum::<f32>();
    let mine: Vec<f32> = (0..len).map(|i| val(rank, i) as f32).collect();

    let mut v = mine.clone();
    c.all_reduce(&mut v, ReduceOp::Sum)?;
    check("all_reduce", rank, &v, sum);

    let mut out = vec![0f32; len];
    c.all_reduce_into(&mine, &mut out, ReduceOp::Sum)?;
    check("all_reduce_into", rank, &out, sum);

    let v = c.all_reduce_async(mine.clone(), ReduceOp::Sum).wait()?;
    check("all_reduce_async", rank, &v, sum);

    let (i, o) = c
        .all_reduce_into_async(mine.clone(), vec![0f32; len], ReduceOp::Sum)
        .wait()?;
    assert_eq!(i, mine, "rank {rank}: the input changed");
    check("all_reduce_into_async", rank, &o, sum);

    let half = len / 2;
    let mut d: Vec<f64> = (0..half).map(|i| val(rank, i) as f64).collect();
    c.all_reduce(&mut d, ReduceOp::Avg)?;
    check("all_reduce f64 avg", rank, &d, |i| {
        (0..n).map(|r| val(r, i) as f64).sum::<f64>() / n as f64
    });

    let mut m: Vec<i32> = (0..len).map(|i| val(rank, i) as i32 - 5).collect();
    c.all_reduce(&mut m, ReduceOp::Max)?;
    check("all_reduce i32 max", rank, &m, |i| {
        (0..n).map(|r| val(r, i) as i32 - 5).max().unwrap_or(0)
    });

    // Broadcast and reduce, cut alike.
    let mut b = if rank == 1 {
        mine.clone()
    } else {
        vec![0f32; len]
    };
    c.broadcast(&mut b, 1)?;
    check("broadcast", rank, &b, |i| val(1, i) as f32);
    let mut out = vec![0f32; len];
    c.broadcast_into(&mine, &mut out, 0)?;
    check("broadcast_into", rank, &out, |i| val(0, i) as f32);
    let mut out = vec![0f32; len];
    c.reduce_into(&mine, &mut out, ReduceOp::Sum, n - 1)?;
    if rank == n - 1 {
        check("reduce", rank, &out, sum);
    }
    let mut v = mine.clone();
    c.reduce(&mut v, ReduceOp::Max, 0)?;
    if rank == 0 {
        check("reduce_in_place max", rank, &v, |i| {
            (0..n).map(|r| val(r, i) as f32).fold(0.0, f32::max)
        });
    }

    let mut b: Vec<bf16> = (0..2 * len + 3)
        .map(|i| bf16::from_f32(val(rank, i) as f32))
        .collect();
    c.all_reduce(&mut b, ReduceOp::Sum)?;
    check("all_reduce bf16", rank, &b, |i| bf16::from_f32(sum(i)));
    Ok(())
}

/// The sizes: 3 MiB + 12 bytes (3 channels of 3, or 2 of 2; not whole lines), 2.5 MiB (2
/// channels), 1 MiB (whole), 4 KiB (whole).
const LENS: [usize; 4] = [(3 * MIB + 12) / 4, 5 * MIB / 8, MIB / 4, 1024];

#[test]
fn every_all_reduce_over_tcp_across_channels() {
    for (n, k) in [(2, 3), (3, 2), (4, 4)] {
        let res = spawn_world(n, cfg(k, 60), |c| {
            assert_eq!(c.stats().channel_ops, Some(0), "rank {}", c.rank());
            for len in LENS {
                all_reduces(&c, len)?;
            }
            Ok(c.stats().channel_ops)
        });
        for (rank, r) in res.into_iter().enumerate() {
            let used = r.unwrap_or_else(|e| panic!("{n} ranks, {k} channels: rank {rank}: {e}"));
            // Per size of at least 2 MiB, 11 cut: 4 forms of all-reduce in f32, 2 of broadcast
            // and 2 of reduce, the f64 average (half the elements, the same bytes), i32 and
            // bf16 (twice the elements plus 3).
            assert_eq!(used, Some(2 * 11), "{n} ranks, {k} channels: rank {rank}");
        }
    }
}

#[test]
fn with_the_send_thread_and_a_pre_multiplied_sum() {
    // Each channel's part then sends from the send thread, waiting for it on the channel's own
    // thread.
    let c = Config {
        socket_send_thread: Some(true),
        ..cfg(3, 60)
    };
    let res = spawn_world(3, c, |c| {
        all_reduces(&c, LENS[0])?;
        // Each rank's input times 0.5: exact for these small integers.
        let (rank, n) = (c.rank(), c.size());
        let mut v: Vec<f32> = (0..LENS[0]).map(|i| val(rank, i) as f32).collect();
        c.all_reduce(&mut v, ReduceOp::premul_sum(0.5))?;
        check("all_reduce premul", rank, &v, |i| {
            (0..n).map(|r| val(r, i) as f32 * 0.5).sum::<f32>()
        });
        Ok((c.stats().channel_ops, c.stats().send_thread_exchanges))
    });
    for (rank, r) in res.into_iter().enumerate() {
        let (cut, sent) = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(cut, Some(12), "rank {rank}");
        assert!(
            sent.unwrap_or(0) > 0,
            "rank {rank}: the send thread never ran"
        );
    }
}

#[test]
fn hierarchical_nodes_cut_their_all_reduces_too() {
    let c = Config {
        transport: TransportChoice::Auto,
        ..cfg(2, 60)
    };
    // 2 nodes x 2 ranks: each channel is a hierarchical communicator of its own.
    let res = spawn_world_on_nodes(4, 2, c, |c| {
        assert!(c.is_hierarchical());
        all_reduces(&c, LENS[0])?;
        Ok(c.stats().channel_ops)
    });
    for (rank, r) in res.into_iter().enumerate() {
        let used = r.unwrap_or_else(|e| panic!("2 x 2: rank {rank}: {e}"));
        assert_eq!(used, Some(11), "2 x 2: rank {rank}");
    }
}

#[test]
fn without_tcp_peers_or_with_one_channel_there_are_none() {
    let shm = Config {
        transport: TransportChoice::Shm,
        ..cfg(4, 30)
    };
    let one = cfg(1, 30);
    for c in [shm, one] {
        let res = spawn_world(2, c, |c| {
            all_reduces(&c, LENS[0])?;
            Ok(c.stats().channel_ops)
        });
        for r in res {
            assert_eq!(r.unwrap(), None);
        }
    }
}

/// What `OXCCL_SOCKET_CHANNELS=auto` should pick for `ranks` ranks of this process on one node
/// over TCP that share it with `node_ranks` in all.
fn auto_for(ranks: usize, node_ranks: usize) -> usize {
    let cpus = oxccl_comm::internal::affinity::usable_cpus();
    let members: Vec<_> = (0..ranks)
        .map(|_| oxccl_comm::internal::affinity::NodeMember {
            cpus: &cpus,
            node_ranks,
            node_cpus: 0,
        })
        .collect();
    let share = oxccl_comm::internal::affinity::node_share(&members);
    oxccl_comm::internal::affinity::auto_channels(&[share], ranks - 1)
}

#[test]
fn auto_gives_each_rank_a_channel_per_two_cpus() {
    // 2 ranks of this process over TCP: as many channels as the rule gives for this machine's
    // CPUs (1 on 2 cores, 4 on 16), and the cut all-reduces right whatever it picks.
    let auto = Config {
        socket_channels: None,
        ..cfg(1, 60)
    };
    let want = auto_for(2, 0);
    let res = spawn_world(2, auto, |c| {
        all_reduces(&c, LENS[0])?;
        Ok((c.stats().channels, c.stats().channel_ops))
    });
    for (rank, r) in res.into_iter().enumerate() {
        let (k, ops) = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(k, want, "rank {rank}: channels");
        assert_eq!(ops, (want > 1).then_some(11), "rank {rank}: cut operations");
    }
}

#[test]
fn auto_counts_every_rank_of_the_node_in_groups_and_given_counts() {
    // 2 nodes x 2 ranks, then groups of one rank per node ({0, 2}, {1, 3}): each group's node
    // still runs the world's 2 ranks (the group inherits that count), so it picks what the
    // world picks, not what one rank alone on the node would.
    let auto = Config {
        transport: TransportChoice::Auto,
        socket_channels: None,
        ..cfg(1, 60)
    };
    let want = auto_for(2, 0);
    let res = spawn_world_on_nodes(4, 2, auto.clone(), |c| {
        let world = c.stats().channels;
        let g = c.split(Some((c.rank() % 2) as u32), 0)?.expect("a color");
        all_reduces(&g, LENS[0])?;
        Ok((world, g.stats().channels, g.config().node_ranks))
    });
    for (rank, r) in res.into_iter().enumerate() {
        let got = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(got, (want, want, Some(2)), "rank {rank}");
    }
    // 64 ranks on the node, as `Config::node_ranks` says: a CPU or less each, one channel.
    let crowded = Config {
        transport: TransportChoice::Tcp,
        node_ranks: Some(64),
        ..auto
    };
    let res = spawn_world(2, crowded, |c| Ok(c.stats().channels));
    for (rank, r) in res.into_iter().enumerate() {
        let k = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(k, auto_for(2, 64), "rank {rank}");
        let cpus = oxccl_comm::internal::affinity::usable_cpus().len();
        if cpus < 4 * 64 {
            assert_eq!(k, 1, "rank {rank}: {cpus} CPUs");
        }
    }
}

#[test]
fn groups_count_every_rank_of_their_node_to_spin() {
    // 4 ranks of one node on as many CPUs as this process has: a group of 2 of them spins only
    // where the world does (a CPU for each of the node's 4 ranks), not where 2 alone would.
    let cpus = oxccl_comm::internal::affinity::usable_cpus().len();
    let res = spawn_world(4, Config::default(), |c| {
        let g = c.split(Some((c.rank() / 2) as u32), 0)?.expect("a color");
        Ok((c.stats().spins, g.stats().spins, g.config().node_ranks))
    });
    for (rank, r) in res.into_iter().enumerate() {
        let got = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(
            got,
            (cpus >= 4, cpus >= 4, Some(4)),
            "rank {rank}: {cpus} CPUs"
        );
    }
}

#[test]
fn ranks_with_different_channel_counts_fail_at_init() {
    let res = spawn_world_with(2, |rank| cfg(1 + rank, 10), |_| Ok(()));
    for (rank, r) in res.into_iter().enumerate() {
        let e = r.expect_err("the settings differ").to_string();
        assert!(e.contains("OXCCL_SOCKET_CHANNELS"), "rank {rank}: {e}");
    }
}

/// A failure that must reach every rank through its own connections: not a time-out.
fn not_a_timeout(what: &str, rank: usize, e: &Error) {
    assert!(
        !matches!(e, Error::Timeout { .. }),
        "{what}: rank {rank}: {e}"
    );
}

#[test]
fn mismatched_all_reduces_fail_on_every_rank_without_waiting_out_the_deadline() {
    // Rank 1 sums 4 MiB where rank 0 sums 3 MiB: both cut, with parts of different lengths
    // on every channel.
    let res = spawn_world(2, cfg(3, 60), |c| {
        let len = if c.rank() == 0 { 3 * MIB / 4 } else { MIB };
        let mut v = vec![1f32; len];
        Ok(c.all_reduce(&mut v, ReduceOp::Sum))
    });
    for (rank, r) in res.into_iter().enumerate() {
        let e = r.unwrap().expect_err("the calls differ");
        not_a_timeout("mismatch", rank, &e);
        // Whichever channel found it, the error names the calls as made.
        let text = e.to_string();
        assert!(
            matches!(e, Error::Mismatch { seq: 0, .. }),
            "rank {rank}: {text}"
        );
        assert!(
            text.contains("count=786432") || text.contains("count=1048576"),
            "{text}"
        );
    }
}

#[test]
fn a_rank_that_cuts_against_one_that_does_not_is_a_mismatch_on_both() {
    // 1 MiB stays whole on rank 0; 4 MiB is cut on rank 1, whose channels never hear from
    // rank 0's: its own part finds the mismatch and stops them.
    let res = spawn_world(2, cfg(2, 60), |c| {
        let len = if c.rank() == 0 { MIB / 4 } else { MIB };
        let mut v = vec![1f32; len];
        Ok(c.all_reduce(&mut v, ReduceOp::Sum))
    });
    for (rank, r) in res.into_iter().enumerate() {
        let e = r.unwrap().expect_err("the calls differ");
        not_a_timeout("cut against whole", rank, &e);
        assert!(
            matches!(e, Error::Mismatch { seq: 0, .. }),
            "rank {rank}: {e}"
        );
    }
}

#[test]
fn a_peer_lost_during_a_cut_all_reduce_is_an_error_on_the_others() {
    let res = spawn_world(3, cfg(3, 60), |c| {
        let mut v = vec![1f32; 3 * MIB / 4];
        c.all_reduce(&mut v, ReduceOp::Sum)?;
        if c.rank() == 2 {
            // Drops its communicator (every channel's connections) while the others start
            // the next one.
            return Ok(None);
        }
        let mut big = vec![1f32; 4 * MIB];
        Ok(Some(c.all_reduce(&mut big, ReduceOp::Sum)))
    });
    for (rank, r) in res.into_iter().take(2).enumerate() {
        let e = r.unwrap().unwrap().expect_err("rank 2 is gone");
        assert_eq!(e.lost_peer(), Some(2), "rank {rank}: {e}");
    }
}

#[test]
fn a_missing_peer_times_out_and_abort_ends_a_cut_all_reduce() {
    // Rank 1 never calls: rank 0's cut all-reduce times out after 3 s on every channel.
    let res = spawn_world(2, cfg(3, 3), |c| {
        if c.rank() == 0 {
            let mut v = vec![1f32; MIB];
            let e = c
                .all_reduce(&mut v, ReduceOp::Sum)
                .expect_err("rank 1 never comes");
            assert!(matches!(e, Error::Timeout { rank: 0, .. }), "{e}");
            assert_eq!(c.stats().channel_ops, Some(1));
        } else {
            std::thread::sleep(Duration::from_millis(6000));
        }
        Ok(())
    });
    res.into_iter().for_each(|r| r.unwrap());

    // Rank 1 never calls either; rank 0 aborts its own pending all-reduce from another thread.
    let res = spawn_world(2, cfg(3, 60), |c| {
        if c.rank() == 0 {
            let t0 = Instant::now();
            std::thread::scope(|s| {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(300));
                    c.abort();
                });
                let mut v = vec![1f32; MIB];
                let e = c.all_reduce(&mut v, ReduceOp::Sum).expect_err("aborted");
                assert!(matches!(e, Error::Aborted { .. }), "{e}");
            });
            // Well inside the 60 s deadline: the abort, not a time-out, ended it.
            assert!(t0.elapsed() < Duration::from_secs(30));
        } else {
            std::thread::sleep(Duration::from_millis(1500));
        }
        Ok(())
    });
    res.into_iter().for_each(|r| r.unwrap());
}
