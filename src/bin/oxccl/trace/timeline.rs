//! `oxccl trace --last N`: the last operations of every rank, one line each, on a time line
//! shared by the ranks of a communicator: when each started and how long it took. For a DDP
//! step, when each bucket's all-reduce started and how long it ran beside backward.

use std::fmt::Write as _;

use oxccl_comm::{TraceDump, TraceRecord};

use super::analyze::latest_by_comm;
use super::text::{bytes, state};

/// A rank's last `n` records.
fn tail(d: &TraceDump, n: usize) -> &[TraceRecord] {
    &d.records[d.records.len().saturating_sub(n)..]
}

/// The last `n` records of every rank, communicator by communicator (in id order, ranks in
/// order; of several dumps of a rank, the latest). Starts are given after the earliest start
/// listed for the communicator; a start the coarse clock read (small operations between ranks
/// that share memory) is marked `~`.
pub fn timeline(dumps: &[TraceDump], n: usize) -> String {
    let mut out = String::new();
    for (comm, ranks) in latest_by_comm(dumps) {
        let Some(t0) = ranks
            .values()
            .flat_map(|d| tail(d, n).iter().map(|r| r.start_unix_ns))
            .min()
        else {
            let _ = writeln!(out, "communicator {comm}: no operation recorded");
            continue;
        };
        let _ = writeln!(
            out,
            "communicator {comm}: the last {n} operations of each rank, started at + ms after \
             the earliest of them"
        );
        for (rank, d) in &ranks {
            let _ = writeln!(out, "  rank {rank}");
            for r in tail(d, n) {
                let coarse = if r.clock_resolution_ns > 1 { "~" } else { " " };
                let start = r.start_unix_ns.saturating_sub(t0) as f64 / 1e6;
                let _ = writeln!(
                    out,
                    "    {coarse}+{start:9.2} ms  {:>10}  {}{}  {}",
                    bytes(r.bytes),
                    r.op,
                    r.algo
                        .as_deref()
                        .map(|a| format!(" [{a}]"))
                        .unwrap_or_default(),
                    state(r, d.rank, d.dumped_unix_ns)
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use oxccl_comm::TraceState;

    const MS: u64 = 1_000_000;

    fn rec(id: u64, start_ms: u64, dur_ms: Option<u64>, bytes: u64, tick: u64) -> TraceRecord {
        TraceRecord {
            id,
            seq: Some(id),
            coll: "all-reduce".into(),
            op: format!("all-reduce(count={}, dtype=float, op=avg)", bytes / 4),
            dtype: "float".into(),
            count: bytes / 4,
            redop: Some("avg".into()),
            root: None,
            algo: Some("two-shot".into()),
            bytes,
            send_to: None,
            recv_from: None,
            start_unix_ns: 1_000_000 * MS + start_ms * MS,
            duration_ns: dur_ms.map(|d| d * MS),
            clock_resolution_ns: tick,
            state: if dur_ms.is_some() {
                TraceState::Completed
            } else {
                TraceState::Running
            },
            error: None,
        }
    }

    fn dump(comm: &str, rank: usize, records: Vec<TraceRecord>) -> TraceDump {
        TraceDump {
            format: oxccl_comm::internal::trace::FORMAT.into(),
            comm: comm.into(),
            rank,
            size: 2,
            root_comm: comm.into(),
            root_rank: rank,
            node: "n0".into(),
            pid: 100 + rank as u32,
            reason: "closed".into(),
            error: None,
            dumped_unix_ns: 1_000_000 * MS + 100 * MS,
            capacity: 2000,
            recorded: records.len() as u64,
            p2p_sent: Vec::new(),
            p2p_recvd: Vec::new(),
            records,
        }
    }

    #[test]
    fn the_last_operations_of_each_rank_on_one_time_line() {
        let dumps = vec![
            // Rank 1 first: ranks are listed in order whatever the order of the files.
            dump(
                "job/world",
                1,
                vec![
                    rec(0, 0, Some(1), 4 << 20, 1),
                    rec(1, 12, Some(3), 4 << 20, 1),
                    rec(2, 16, None, 4 << 20, 1),
                ],
            ),
            dump(
                "job/world",
                0,
                vec![
                    rec(0, 1, Some(1), 4 << 20, 1),
                    rec(1, 10, Some(5), 4 << 20, 1),
                    rec(2, 20, Some(0), 16, 4 * MS),
                ],
            ),
        ];
        let text = timeline(&dumps, 2);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 7, "{text}");
        assert!(lines[0].contains("job/world") && lines[0].contains("last 2"));
        assert_eq!(lines[1].trim(), "rank 0");
        // The first record of each rank is left out; times count from rank 0's start at 10 ms.
        assert!(lines[2].contains("+     0.00 ms") && lines[2].contains("completed in 5.00 ms"));
        assert!(lines[2].contains("4 MiB") && lines[2].contains("[two-shot]"));
        assert!(
            lines[3].trim_start().starts_with("~+    10.00 ms"),
            "{text}"
        );
        assert!(lines[3].contains("under 4.00 ms"), "{text}");
        assert_eq!(lines[4].trim(), "rank 1");
        assert!(lines[5].contains("+     2.00 ms") && lines[5].contains("completed in 3.00 ms"));
        assert!(lines[6].contains("+     6.00 ms") && lines[6].contains("still running 84.00 ms"));
        assert!(!text.contains("1.00 ms"), "{text}");
    }

    #[test]
    fn a_communicator_without_records_says_so() {
        let text = timeline(&[dump("job/empty", 0, Vec::new())], 5);
        assert_eq!(text.trim(), "communicator job/empty: no operation recorded");
    }
}
