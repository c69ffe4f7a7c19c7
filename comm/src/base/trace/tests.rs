//! Unit tests of the recorder and the dump files.

use super::*;
use crate::base::op::{Collective, OpDesc};
use crate::base::tuning::Algorithm;
use oxccl_kernels::{DType, ReduceOp};

fn coll(seq: u64) -> What {
    What::Coll {
        seq,
        desc: OpDesc {
            coll: Collective::AllReduce,
            dtype: DType::F32,
            op: ReduceOp::Sum,
            root: 0,
            count: 10,
        },
        algo: Algorithm::Ring,
        bytes: 40,
    }
}

fn owner() -> Owner {
    Owner {
        comm: "job/world1/split0/c1".into(),
        rank: 1,
        size: 2,
        root_comm: "job/world1".into(),
        root_rank: 3,
        node: "n0".into(),
    }
}

#[test]
fn keeps_the_last_records_in_order() {
    let r = Recorder::new(3, None, owner());
    for s in 0..5 {
        let id = r.begin(coll(s));
        r.end(id, None);
    }
    let d = r.snapshot("requested", None);
    assert_eq!(d.recorded, 5);
    let seqs: Vec<_> = d.records.iter().map(|x| x.seq).collect();
    assert_eq!(seqs, [Some(2), Some(3), Some(4)]);
    assert!(d.records.iter().all(|x| x.state == TraceState::Completed));
    assert!(d
        .records
        .windows(2)
        .all(|w| w[0].start_unix_ns <= w[1].start_unix_ns));
}

#[test]
fn off_records_nothing() {
    let r = Recorder::new(0, None, owner());
    assert_eq!(r.begin(coll(0)), None);
    assert!(r.snapshot("requested", None).records.is_empty());
}

#[test]
fn an_overwritten_record_is_not_ended_by_a_later_one() {
    let r = Recorder::new(1, None, owner());
    let first = r.begin(coll(0));
    let second = r.begin(coll(1));
    r.end(first, None);
    let d = r.snapshot("requested", None);
    assert_eq!(d.records[0].seq, Some(1));
    assert_eq!(d.records[0].state, TraceState::Running);
    r.end(second, Some(&Error::Io("x".into())));
    let d = r.snapshot("requested", None);
    assert_eq!(d.records[0].state, TraceState::Failed);
    assert_eq!(d.records[0].error.as_deref(), Some("i/o: x"));
}

#[test]
fn records_describe_collectives_and_point_to_point() {
    let r = Recorder::new(8, None, owner());
    let id = r.begin(coll(7));
    r.end(id, None);
    let p2p = |send_to, recv_from, sends, recvs| What::P2p {
        dtype: DType::I64,
        send_to,
        recv_from,
        sends,
        recvs,
        count: 4,
        bytes: 32,
    };
    for what in [
        p2p(Some((0, 2)), None, 1, 0),
        p2p(None, Some((0, 5)), 0, 1),
        p2p(Some((0, 3)), Some((0, 6)), 1, 1),
        p2p(None, None, 2, 3),
    ] {
        let id = r.begin(what);
        r.end(id, None);
    }
    let d = r.snapshot("requested", None);
    let ops: Vec<_> = d.records.iter().map(|x| x.op.as_str()).collect();
    assert_eq!(
        ops,
        [
            "all-reduce(count=10, dtype=float, op=sum)",
            "send(to=0 #2, count=4, dtype=int64)",
            "recv(from=0 #5, count=4, dtype=int64)",
            "send-recv(to=0 #3, from=0 #6, count=4, dtype=int64)",
            "batch-p2p(sends=2, recvs=3, count=4, dtype=int64)",
        ]
    );
    assert_eq!(d.records[0].algo.as_deref(), Some("ring"));
    assert_eq!(d.records[0].redop.as_deref(), Some("sum"));
    assert_eq!(d.records[0].signature(), d.records[0].op);
    assert_eq!(d.records[2].recv_from, Some((0, 5)));
    assert_eq!(d.records[1].seq, None);
}

#[test]
fn signatures_leave_out_per_rank_counts_only() {
    let r = Recorder::new(8, None, owner());
    let desc = |coll, count, root| OpDesc {
        coll,
        dtype: DType::F32,
        op: ReduceOp::Sum,
        root,
        count,
    };
    for d in [
        desc(Collective::AllToAllV, 12, 0),
        desc(Collective::GatherV, 7, 1),
        desc(Collective::AllGatherV, 9, 0xcdf6a515),
    ] {
        let id = r.begin(What::Coll {
            seq: 0,
            desc: d,
            algo: Algorithm::Ring,
            bytes: 4,
        });
        r.end(id, None);
    }
    let sigs: Vec<String> = r
        .snapshot("requested", None)
        .records
        .iter()
        .map(TraceRecord::signature)
        .collect();
    assert_eq!(
        sigs,
        [
            "all-to-all-v(dtype=float)",
            "gather-v(dtype=float, root=1)",
            "all-gather-v(count=9, dtype=float, counts-hash=cdf6a515)",
        ]
    );
}

#[test]
fn per_peer_message_counts_cover_every_peer() {
    let r = Recorder::new(4, None, owner());
    assert!(r.snapshot("requested", None).p2p_sent.is_empty());
    r.note_message(0, true, 1);
    r.note_message(0, true, 2);
    r.note_message(0, true, 3);
    r.note_message(5, false, 1); // not a rank of the communicator: ignored
    let d = r.snapshot("requested", None);
    assert_eq!((d.p2p_sent, d.p2p_recvd), (vec![3, 0], vec![0, 0]));
    let off = Recorder::new(0, None, owner());
    off.note_message(0, true, 1);
    assert!(off.snapshot("requested", None).p2p_sent.is_empty());
}

#[test]
fn inconsistent_files_are_refused() {
    let dir = std::env::temp_dir().join(format!("oxccl-trace-bad-{}", std::process::id()));
    let r = Recorder::new(2, None, owner());
    let id = r.begin(coll(0));
    r.end(id, None);
    let good = r.snapshot("requested", None);
    let path = good.write_to(&dir).unwrap();
    assert_eq!(TraceDump::read(&path).unwrap(), good);
    type Break = fn(&mut TraceDump);
    let cases: [(Break, &str); 6] = [
        (|d| d.rank = 2, "rank 2 of 2"),
        (|d| d.size = usize::MAX, "at most"),
        (|d| d.capacity = 0, "capacity 0"),
        (|d| d.recorded = 0, "1 records, 0 recorded"),
        (|d| d.p2p_sent = vec![1; 3], "3 and 0 peers"),
        (|d| d.format = "x".into(), "format"),
    ];
    for (bad, why) in cases {
        let mut d = good.clone();
        bad(&mut d);
        std::fs::write(&path, serde_json::to_vec(&d).unwrap()).unwrap();
        let e = TraceDump::read(&path).unwrap_err().to_string();
        assert!(
            e.contains(why) && e.contains(&*path.to_string_lossy()),
            "{e}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn concurrent_writes_leave_one_whole_file() {
    let dir = std::env::temp_dir().join(format!("oxccl-trace-race-{}", std::process::id()));
    let r = Recorder::new(64, None, owner());
    for s in 0..64 {
        let id = r.begin(coll(s));
        r.end(id, None);
    }
    let d = r.snapshot("requested", None);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..10 {
                    d.write_to(&dir).unwrap();
                }
            });
        }
    });
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
    assert_eq!(TraceDump::read(&dir.join(&names[0])).unwrap(), d);
    // A directory that cannot be made: an error naming it, nothing left behind.
    let file = dir.join("plain");
    std::fs::write(&file, b"x").unwrap();
    let e = d.write_to(&file.join("sub")).unwrap_err().to_string();
    assert!(e.contains("plain") && e.contains("rank 1"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn dumps_round_trip_through_a_file() {
    let dir = std::env::temp_dir().join(format!("oxccl-trace-unit-{}", std::process::id()));
    let r = Recorder::new(4, Some(dir.clone()), owner());
    let id = r.begin(coll(0));
    r.end(id, None);
    r.begin(coll(1));
    let e = Error::Io("boom".into());
    r.dump_if_set("failed", Some(&e));
    let path = dir.join(TraceDump::file_name("job/world1/split0/c1", 1));
    assert!(path.ends_with("job_world1_split0_c1.r1.json"), "{path:?}");
    let d = TraceDump::read(&path).unwrap();
    assert_eq!(d, {
        let mut want = r.snapshot("failed", Some(&e));
        want.dumped_unix_ns = d.dumped_unix_ns;
        want
    });
    assert_eq!(d.root_rank, 3);
    assert_eq!(d.records[1].state, TraceState::Running);
    assert_eq!(d.error.as_deref(), Some("i/o: boom"));
    // Nothing else is left in the directory (the temporary file was renamed).
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
    std::fs::write(&path, b"{\"format\": \"other\"}").unwrap();
    assert!(TraceDump::read(&path).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A reader snapshotting while the writer records: every snapshot is consistent (each record
/// decodes to what was written for its id, ids increase by one) and never waits.
#[test]
fn snapshots_while_recording_are_consistent() {
    let r = Recorder::new(64, None, owner());
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 0..200_000u64 {
                let id = r.begin(coll(i));
                r.end(id, None);
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        let mut snapshots = 0;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) || snapshots == 0 {
            let d = r.snapshot("requested", None);
            for w in d.records.windows(2) {
                assert!(w[0].id < w[1].id, "{:?} then {:?}", w[0].id, w[1].id);
            }
            for rec in &d.records {
                assert_eq!(rec.seq, Some(rec.id), "{rec:?}");
                assert_eq!(rec.op, "all-reduce(count=10, dtype=float, op=sum)");
            }
            snapshots += 1;
        }
        assert!(snapshots > 0);
    });
}

#[test]
fn records_keep_every_field_and_the_errors_of_failed_ones() {
    let r = Recorder::new(4, None, owner());
    let premul = What::Coll {
        seq: 9,
        desc: OpDesc {
            coll: Collective::ReduceScatterV,
            dtype: DType::BF16,
            op: ReduceOp::premul_sum(0.25),
            root: 0xabc,
            count: 77,
        },
        algo: Algorithm::Hierarchical,
        bytes: 1 << 20,
    };
    let id = r.begin(premul);
    r.end(id, Some(&Error::Io("first".into())));
    for s in 0..3 {
        let id = r.begin(coll(s));
        r.end(id, None);
    }
    let d = r.snapshot("requested", None);
    let f = &d.records[0];
    assert_eq!(
        (f.seq, f.coll.as_str(), f.dtype.as_str(), f.count, f.bytes),
        (Some(9), "reduce-scatter-v", "bfloat16", 77, 1 << 20)
    );
    assert_eq!(
        f.op,
        "reduce-scatter-v(count=77, dtype=bfloat16, op=premul_sum, counts-hash=00000abc)"
    );
    assert_eq!(
        (f.algo.as_deref(), f.clock_resolution_ns),
        (Some("hierarchical"), 1)
    );
    assert_eq!(
        (f.state, f.error.as_deref()),
        (TraceState::Failed, Some("i/o: first"))
    );
    assert!(d.records[1..]
        .iter()
        .all(|x| x.error.is_none() && x.clock_resolution_ns > 1));
    // Once the failed record leaves the ring, so does its error.
    let id = r.begin(coll(3));
    r.end(id, Some(&Error::Io("second".into())));
    let d = r.snapshot("requested", None);
    let errs: Vec<_> = d
        .records
        .iter()
        .filter_map(|x| x.error.as_deref())
        .collect();
    assert_eq!(errs, ["i/o: second"]);
}

#[test]
fn an_older_record_never_replaces_a_newer_one() {
    let dir = std::env::temp_dir().join(format!("oxccl-trace-order-{}", std::process::id()));
    let r = Recorder::new(4, None, owner());
    let mut older = r.snapshot("stalled", None);
    let newer = r.snapshot("closed", None);
    older.dumped_unix_ns = newer.dumped_unix_ns - 1;
    let path = newer.write_to(&dir).unwrap();
    assert_eq!(older.write_to(&dir).unwrap(), path);
    assert_eq!(TraceDump::read(&path).unwrap().reason, "closed");
    std::fs::remove_dir_all(&dir).unwrap();
}
