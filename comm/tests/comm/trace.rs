//! The flight recorder on threaded ranks: what every rank records of the same calls, what a
//! failure and a close write to `OXCCL_TRACE_DIR`, and that recording can be turned off.
//! (`tests/oxccl/trace.rs` of the `oxccl` package runs `oxccl trace` on records of real processes.)

use std::path::PathBuf;
use std::time::Duration;

use oxccl_comm::config::TransportChoice;
use oxccl_comm::internal::trace::PRECISE_MIN_BYTES;
use oxccl_comm::{
    harness::spawn_world, Config, Error, OwnedP2pOp, ReduceOp, TraceDump, TraceRecord, TraceState,
};

fn cfg(t: TransportChoice) -> Config {
    Config {
        transport: t,
        timeout: Duration::from_secs(30),
        // One set of connections: extra channels (`OXCCL_SOCKET_CHANNELS=auto` over TCP where
        // ranks have CPUs to spare) are communicators of their own, with their own records.
        socket_channels: Some(1),
        ..Config::default()
    }
}

/// A fresh directory under the system's temporary one.
fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oxccl-trace-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Collectives, point-to-point and an async call on 3 ranks; every rank's record of them.
fn run_calls(t: TransportChoice) -> Vec<TraceDump> {
    let res = spawn_world(3, cfg(t), |c| {
        let (me, n) = (c.rank(), c.size());
        let mut small = vec![1.0f32; 16];
        c.all_reduce(&mut small, ReduceOp::Sum)?;
        let mut big = vec![me as u8; 256 << 10];
        c.broadcast(&mut big, 1)?;
        let mut all = vec![0u32; n];
        c.all_gather_into(&[me as u32], &mut all)?;
        let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
        let mut got = vec![0i64; 8];
        // Ring of sends: even ranks send first, odd ones receive first.
        if me % 2 == 0 {
            c.send(&[me as i64; 8], next)?;
            c.recv(&mut got, prev)?;
        } else {
            c.recv(&mut got, prev)?;
            c.send(&[me as i64; 8], next)?;
        }
        let ops = vec![
            OwnedP2pOp::Send {
                buf: vec![1.0f64; 4],
                peer: next,
            },
            OwnedP2pOp::Recv {
                buf: vec![0.0f64; 4],
                peer: prev,
            },
        ];
        c.batch_p2p_async(ops).wait()?;
        let v = c
            .all_reduce_async(vec![2.0f32; 100], ReduceOp::Max)
            .wait()?;
        assert_eq!(v[0], 2.0);
        Ok(c.trace())
    });
    res.into_iter().map(|r| r.unwrap()).collect()
}

fn check_calls(t: TransportChoice) {
    let dumps = run_calls(t);
    let sig = |d: &TraceDump| -> Vec<(Option<u64>, String)> {
        d.records
            .iter()
            .filter(|r| r.seq.is_some())
            .map(|r| (r.seq, r.signature()))
            .collect()
    };
    // The collectives: the same sequence numbers and calls on every rank.
    for d in &dumps {
        assert_eq!(sig(d), sig(&dumps[0]), "rank {} vs rank 0", d.rank);
        assert_eq!(
            (d.size, d.reason.as_str(), d.error.as_deref()),
            (3, "requested", None)
        );
        assert_eq!(d.recorded, d.records.len() as u64);
        assert!(d.records.iter().all(|r| r.state == TraceState::Completed));
        let ops: Vec<&str> = d.records.iter().map(|r| r.coll.as_str()).collect();
        let want = if d.rank % 2 == 0 {
            [
                "all-reduce",
                "broadcast",
                "all-gather",
                "send",
                "recv",
                "batch-p2p",
                "all-reduce",
            ]
        } else {
            [
                "all-reduce",
                "broadcast",
                "all-gather",
                "recv",
                "send",
                "batch-p2p",
                "all-reduce",
            ]
        };
        assert_eq!(ops, want, "rank {}", d.rank);
        let seqs: Vec<Option<u64>> = d.records.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, [Some(0), Some(1), Some(2), None, None, None, Some(3)]);
        assert!(d.records.windows(2).all(|w| w[0].id + 1 == w[1].id));
        let bcast = &d.records[1];
        assert_eq!(
            (bcast.root, bcast.bytes, bcast.op.as_str()),
            (
                Some(1),
                256 << 10,
                "broadcast(count=262144, dtype=uint8, root=1)"
            )
        );
        assert!(bcast.algo.is_some());
        // Message numbers of the single sends and receives (each the first to its peer).
        let send = d.records.iter().find(|r| r.coll == "send").unwrap();
        let recv = d.records.iter().find(|r| r.coll == "recv").unwrap();
        assert_eq!(send.send_to, Some(((d.rank + 1) % 3, 1)));
        assert_eq!(recv.recv_from, Some(((d.rank + 2) % 3, 1)));
        let batch = d.records.iter().find(|r| r.coll == "batch-p2p").unwrap();
        assert_eq!((batch.bytes, batch.send_to), (64, None));
        // Two messages to the next rank and two from the previous one (a send or receive, then
        // one in the batch), none to or from the third.
        let (next, prev) = ((d.rank + 1) % 3, (d.rank + 2) % 3);
        let mut want_sent = vec![0u64; 3];
        want_sent[next] = 2;
        let mut want_recvd = vec![0u64; 3];
        want_recvd[prev] = 2;
        assert_eq!((&d.p2p_sent, &d.p2p_recvd), (&want_sent, &want_recvd));
        // Exact clocks for large operations and for everything over TCP; the tick for small
        // ones between ranks that share memory.
        let exact = |r: &TraceRecord| r.clock_resolution_ns == 1;
        for r in &d.records {
            let want = t == TransportChoice::Tcp || r.bytes >= PRECISE_MIN_BYTES as u64;
            assert_eq!(exact(r), want, "{t:?} {r:?}");
        }
        // Start times do not go backwards beyond a tick, and durations are set.
        for w in d.records.windows(2) {
            let tick = w[0].clock_resolution_ns.max(w[1].clock_resolution_ns);
            assert!(w[1].start_unix_ns + tick >= w[0].start_unix_ns, "{w:?}");
        }
        assert!(d.records.iter().all(|r| r.duration_ns.is_some()));
    }
}

#[test]
fn every_rank_records_the_same_collectives_over_shm() {
    check_calls(TransportChoice::Shm);
}

#[test]
fn every_rank_records_the_same_collectives_over_tcp() {
    check_calls(TransportChoice::Tcp);
}

#[test]
fn off_records_nothing_and_keeps_the_last_n() {
    for (buffer, want) in [(0usize, 0usize), (2, 2)] {
        let res = spawn_world(
            2,
            Config {
                trace_buffer: buffer,
                ..cfg(TransportChoice::Shm)
            },
            |c| {
                for _ in 0..5 {
                    c.all_reduce(&mut [1u8; 4], ReduceOp::Sum)?;
                }
                Ok(c.trace())
            },
        );
        for d in res {
            let d = d.unwrap();
            assert_eq!(d.records.len(), want);
            assert_eq!(d.recorded, if buffer == 0 { 0 } else { 5 });
            if want > 0 {
                assert_eq!(d.records[0].seq, Some(3));
            }
        }
    }
}

/// Rank 2 leaves after two all-reduces; ranks 0 and 1 time out in the third. Ranks 0 and 1
/// write `failed` records (the third all-reduce failed), then `closed` ones over them; rank 2
/// writes a `closed` one whose last collective is the second.
#[test]
fn a_failure_and_a_close_write_records_to_the_trace_dir() {
    for t in [TransportChoice::Shm, TransportChoice::Tcp] {
        let dir = temp_dir(&format!("fail-{t:?}"));
        let c = Config {
            timeout: Duration::from_secs(2),
            trace_dir: Some(dir.clone()),
            ..cfg(t)
        };
        let res = spawn_world(3, c, |c| {
            let calls = if c.rank() == 2 { 2 } else { 3 };
            let mut r = Ok(());
            for _ in 0..calls {
                r = c.all_reduce(&mut [1.0f32; 64], ReduceOp::Sum);
                if r.is_err() {
                    break;
                }
            }
            // The failure's record is on disk before the communicator is dropped.
            let id = c.id().to_string();
            let on_disk = TraceDump::read(&dir.join(TraceDump::file_name(&id, c.rank())));
            Ok((r, on_disk.map(|d| d.reason)))
        });
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        assert_eq!(files.len(), 3, "{t:?}: {files:?}");
        for (rank, r) in res.into_iter().enumerate() {
            let (result, on_disk) = r.unwrap();
            let path = dir.join(&files[rank]);
            assert!(
                files[rank].ends_with(&format!(".r{rank}.json")),
                "{files:?}"
            );
            let d = TraceDump::read(&path).unwrap();
            assert_eq!(d.reason, "closed", "{t:?} rank {rank}");
            let last = d.records.last().unwrap();
            if rank == 2 {
                assert!(result.is_ok());
                assert!(on_disk.is_err(), "rank 2 wrote a record before closing");
                assert_eq!((last.seq, last.state), (Some(1), TraceState::Completed));
                assert_eq!(d.error, None);
            } else {
                let e = result.unwrap_err();
                assert!(
                    matches!(e, Error::Timeout { .. } | Error::PeerLost { .. }),
                    "{e}"
                );
                assert_eq!(on_disk.unwrap(), "failed", "{t:?} rank {rank}");
                assert_eq!((last.seq, last.state), (Some(2), TraceState::Failed));
                assert!(last.error.is_some() && d.error.is_some(), "{d:?}");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// A watchdog thread reads the record while the rank waits in an all-reduce for a late peer:
/// it sees the all-reduce running, and never waits for it.
#[test]
fn trace_shows_the_running_operation_without_waiting() {
    let res = spawn_world(2, cfg(TransportChoice::Shm), |c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1500));
            c.all_reduce(&mut [1u8; 4], ReduceOp::Sum)?;
            return Ok(None);
        }
        std::thread::scope(|s| {
            let watchdog = s.spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                let t0 = std::time::Instant::now();
                let d = c.trace();
                (d, t0.elapsed())
            });
            c.all_reduce(&mut [1u8; 4], ReduceOp::Sum)?;
            Ok(watchdog.join().ok())
        })
    });
    let (d, took) = res.into_iter().next().unwrap().unwrap().unwrap();
    assert!(took < Duration::from_millis(500), "trace() waited {took:?}");
    let last = d.records.last().unwrap();
    assert_eq!(
        (last.seq, last.state),
        (Some(0), TraceState::Running),
        "{d:?}"
    );
    assert_eq!(last.duration_ns, None);
}

/// A wait that stalls (no progress for a quarter of the time-out) writes the record at once:
/// rank 1, late by 2.5 s with a 4 s time-out, finds rank 0's record of the all-reduce it waits in
/// on disk before it joins.
#[test]
fn a_stalled_wait_writes_its_record_before_the_time_out() {
    let dir = temp_dir("stall");
    let c = Config {
        timeout: Duration::from_secs(4),
        trace_dir: Some(dir.clone()),
        ..cfg(TransportChoice::Shm)
    };
    let res = spawn_world(2, c, |c| {
        let seen = if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(2500));
            let path = dir.join(TraceDump::file_name(c.id(), 0));
            Some(TraceDump::read(&path))
        } else {
            None
        };
        c.all_reduce(&mut [1u8; 4], ReduceOp::Sum)?;
        Ok(seen)
    });
    let seen = res.into_iter().nth(1).unwrap().unwrap().unwrap();
    let d = seen.expect("rank 0's record was on disk while it waited");
    assert_eq!(d.reason, "stalled");
    let last = d.records.last().unwrap();
    assert_eq!(
        (last.seq, last.state),
        (Some(0), TraceState::Running),
        "{d:?}"
    );
    // Then both closed: the later records replaced it.
    for rank in 0..2 {
        let files: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(files.len(), 2);
        let id = &d.comm;
        let d = TraceDump::read(&dir.join(TraceDump::file_name(id, rank))).unwrap();
        assert_eq!(d.reason, "closed");
        assert_eq!(d.records.last().unwrap().state, TraceState::Completed);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn dump_trace_writes_where_asked() {
    let dir = temp_dir("dump");
    let res = spawn_world(2, cfg(TransportChoice::Shm), |c| {
        c.barrier()?;
        let path = c.dump_trace(&dir)?;
        Ok((path, c.id().to_string()))
    });
    for (rank, r) in res.into_iter().enumerate() {
        let (path, id) = r.unwrap();
        assert_eq!(path, dir.join(TraceDump::file_name(&id, rank)));
        let d = TraceDump::read(&path).unwrap();
        assert_eq!(
            (d.rank, d.comm.as_str(), d.reason.as_str()),
            (rank, id.as_str(), "requested")
        );
        assert_eq!(d.records[0].coll, "barrier");
    }
    // A path that cannot be a directory gives an error naming it.
    let file = dir.join("plain-file");
    std::fs::write(&file, b"x").unwrap();
    let res = spawn_world(1, cfg(TransportChoice::Shm), |c| {
        Ok(c.dump_trace(file.join("sub")))
    });
    let e = res
        .into_iter()
        .next()
        .unwrap()
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(e.contains("plain-file") && e.contains("rank 0"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
