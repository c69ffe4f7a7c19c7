//! The reading of hand-made dumps: each finding, and what must not be claimed.

use super::*;

const MS: u64 = 1_000_000;

fn dump(rank: usize, size: usize, records: Vec<TraceRecord>) -> TraceDump {
    TraceDump {
        format: oxccl_comm::internal::trace::FORMAT.into(),
        comm: "job/world1".into(),
        rank,
        size,
        root_comm: "job/world1".into(),
        root_rank: rank,
        node: "n0".into(),
        pid: 100 + rank as u32,
        reason: "closed".into(),
        error: None,
        dumped_unix_ns: 10_000 * MS,
        capacity: 2000,
        recorded: records.len() as u64,
        p2p_sent: Vec::new(),
        p2p_recvd: Vec::new(),
        records,
    }
}

fn coll(id: u64, seq: u64, coll: &str, start_ms: u64, dur_ms: Option<u64>) -> TraceRecord {
    TraceRecord {
        id,
        seq: Some(seq),
        coll: coll.into(),
        op: format!("{coll}(count=256, dtype=float, op=sum)"),
        dtype: "float".into(),
        count: 256,
        redop: Some("sum".into()),
        root: None,
        algo: Some("ring".into()),
        bytes: 1 << 20,
        send_to: None,
        recv_from: None,
        start_unix_ns: start_ms * MS,
        duration_ns: dur_ms.map(|d| d * MS),
        clock_resolution_ns: 1,
        state: if dur_ms.is_some() {
            TraceState::Completed
        } else {
            TraceState::Running
        },
        error: None,
    }
}

/// Rank 2 computes 30 ms longer than the others before each of 10 all-reduces, then stops
/// before the 11th, in which the others wait.
fn straggler() -> Vec<TraceDump> {
    (0..4)
        .map(|rank| {
            let mut recs: Vec<TraceRecord> = (0..10)
                .map(|s| {
                    let begin = s * 100;
                    let start = if rank == 2 {
                        begin + 30
                    } else {
                        begin + rank as u64
                    };
                    coll(s, s, "all-reduce", start, Some(begin + 31 - start))
                })
                .collect();
            if rank != 2 {
                recs.push(coll(10, 10, "all-reduce", 1000, None));
            }
            dump(rank, 4, recs)
        })
        .collect()
}

#[test]
fn names_the_rank_that_never_reached_the_collective_and_the_straggler() {
    let text = analyze(&straggler());
    assert!(
        text.contains("furthest collective: #10 all-reduce"),
        "{text}"
    );
    assert!(text.contains("ranks 0-1,3 in it: running"), "{text}");
    assert!(
        text.contains("rank 2 never reached it: last collective #9 all-reduce"),
        "{text}"
    );
    assert!(
        text.contains("rank 2: last in 10 (100%), 30.00 ms late on average"),
        "{text}"
    );
    assert!(
        text.contains("rank 2 arrives last in most collectives"),
        "{text}"
    );
    assert!(
        text.contains("all-reduce: 10 call(s), 10 MiB per rank"),
        "{text}"
    );
    assert!(!text.contains("MISMATCH"), "{text}");
}

#[test]
fn ranks_that_stopped_at_the_same_place_are_one_line() {
    let mut dumps = straggler();
    for d in &mut dumps[..2] {
        d.records.pop();
    }
    let text = analyze(&dumps);
    assert!(text.contains("rank 3 in it: running"), "{text}");
    let behind: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("never reached it"))
        .collect();
    assert_eq!(behind.len(), 1, "{text}");
    assert!(
        behind[0].contains("ranks 0-2 never reached it: last collective #9 all-reduce"),
        "{text}"
    );
}

#[test]
fn finds_the_first_mismatch() {
    let mut dumps = straggler();
    let r = &mut dumps[3].records[4];
    r.coll = "broadcast".into();
    r.op = "broadcast(count=256, dtype=float, root=0)".into();
    r.redop = None;
    r.root = Some(0);
    let text = analyze(&dumps);
    assert!(
        text.contains(
            "MISMATCH at collective #4: ranks 0-2 called all-reduce(count=256, dtype=float, \
             op=sum); rank 3 called broadcast(count=256, dtype=float, root=0)"
        ),
        "{text}"
    );
}

#[test]
fn per_rank_counts_of_v_collectives_are_no_mismatch() {
    let mut dumps = straggler();
    for (i, d) in dumps.iter_mut().enumerate() {
        let r = &mut d.records[4];
        r.coll = "all-to-all-v".into();
        r.op = format!("all-to-all-v(count={}, dtype=float)", 10 + i);
    }
    assert!(!analyze(&dumps).contains("MISMATCH"));
}

#[test]
fn a_clean_run_says_so_and_missing_ranks_are_named() {
    let mut dumps = straggler();
    for d in &mut dumps {
        d.records.truncate(10);
    }
    let text = analyze(&dumps);
    assert!(
        text.contains("every rank completed #9 all-reduce"),
        "{text}"
    );
    dumps.remove(1);
    let text = analyze(&dumps);
    assert!(
        text.contains("none of rank 1 (on another node's directory, killed"),
        "{text}"
    );
    assert!(text.contains("rank 1 left no record here"), "{text}");
}

#[test]
fn a_late_entry_into_the_furthest_collective_is_shown() {
    let mut dumps = straggler();
    dumps[2]
        .records
        .push(coll(10, 10, "all-reduce", 8000, None));
    let text = analyze(&dumps);
    assert!(text.contains("ranks 0-3 in it: running"), "{text}");
    assert!(
        text.contains("rank 2 entered it last, 7.00 s after the first"),
        "{text}"
    );
    // On several nodes the gap compares their clocks, and the reading says so.
    dumps[2].node = "n1".into();
    let text = analyze(&dumps);
    assert!(
        text.contains("7.00 s after the first (clocks of different nodes)"),
        "{text}"
    );
}

fn p2p(
    id: u64,
    send_to: Option<(usize, u64)>,
    recv_from: Option<(usize, u64)>,
    state: TraceState,
) -> TraceRecord {
    TraceRecord {
        seq: None,
        coll: "recv".into(),
        op: "p2p".into(),
        send_to,
        recv_from,
        state,
        duration_ns: (state != TraceState::Running).then_some(MS),
        ..coll(id, 0, "recv", 5000, None)
    }
}

#[test]
fn point_to_point_waits_name_the_missing_message_from_the_peers_counts() {
    let mut dumps = vec![
        dump(
            0,
            2,
            vec![
                p2p(0, Some((1, 1)), None, TraceState::Completed),
                p2p(1, Some((1, 2)), None, TraceState::Completed),
            ],
        ),
        dump(
            1,
            2,
            vec![
                p2p(0, None, Some((0, 1)), TraceState::Completed),
                p2p(1, None, Some((0, 2)), TraceState::Completed),
                p2p(2, None, Some((0, 3)), TraceState::Running),
            ],
        ),
    ];
    dumps[0].p2p_sent = vec![0, 2];
    dumps[0].p2p_recvd = vec![0, 0];
    let text = analyze(&dumps);
    assert!(text.contains("rank 1: p2p still running 5.00 s"), "{text}");
    assert!(
        text.contains("rank 0 began 2 send(s) to it in all: message #3 was never sent"),
        "{text}"
    );
    // A peer that sent the message in a batch (its records carry no message numbers) counts
    // it all the same: nothing is claimed then.
    dumps[0].p2p_sent = vec![0, 3];
    let text = analyze(&dumps);
    assert!(!text.contains("never sent"), "{text}");
    // A peer that left no record.
    let text = analyze(&dumps[1..]);
    assert!(text.contains("rank 0 left no record here"), "{text}");
}

#[test]
fn a_waiting_send_names_the_missing_receive() {
    let mut dumps = vec![
        dump(0, 2, vec![p2p(0, Some((1, 1)), None, TraceState::Running)]),
        dump(1, 2, vec![]),
    ];
    dumps[0].p2p_sent = vec![0, 1];
    dumps[0].p2p_recvd = vec![0, 0];
    let text = analyze(&dumps);
    assert!(
        text.contains("rank 1 began 0 receive(s) from it in all: message #1 has no receive"),
        "{text}"
    );
}

#[test]
fn the_first_error_is_attributed_once() {
    let mut dumps = straggler();
    let timeout = "all-reduce: timed out after 3s (waiting for rank 2; stall reports: ...)";
    for d in &mut dumps {
        d.error = Some(if d.rank == 1 {
            format!("rank 1: {timeout}")
        } else {
            format!(
                "rank {}: communicator aborted: another rank failed first: rank 1: {timeout}",
                d.rank
            )
        });
    }
    let text = analyze(&dumps);
    let errors: Vec<&str> = text.lines().filter(|l| l.contains("error (on")).collect();
    assert_eq!(
        errors,
        [format!(
            "  error (on ranks 0-3), first reported by rank 1: {timeout}"
        )],
        "{text}"
    );
}

#[test]
fn split_communicators_show_their_world_ranks() {
    let mut dumps = straggler();
    for d in &mut dumps {
        d.comm = "job/world1/split0/c1".into();
        d.root_rank = 2 * d.rank + 1;
    }
    let text = analyze(&dumps);
    assert!(
        text.contains("ranks of job/world1 here: 0=1, 1=3, 2=5, 3=7"),
        "{text}"
    );
}

#[test]
fn coarse_timed_collectives_are_not_compared() {
    let mut dumps = straggler();
    for d in &mut dumps {
        for r in &mut d.records {
            r.clock_resolution_ns = 4 * MS;
        }
    }
    let text = analyze(&dumps);
    assert!(
        text.contains("timed to the 4.00 ms clock tick only"),
        "{text}"
    );
    assert!(!text.contains("late on average"), "{text}");
}

#[test]
fn absurd_values_do_not_panic() {
    let mut dumps = straggler();
    dumps[0].size = usize::MAX;
    dumps[1].records[0].start_unix_ns = u64::MAX;
    dumps[1].records[0].duration_ns = Some(u64::MAX);
    dumps[1].recorded = u64::MAX;
    let text = analyze(&dumps);
    assert!(text.contains("communicator job/world1"), "{text}");
}
