//! The reading of flight records: one section per communicator.
//!
//! - **Who dumped**: every rank's reason and error (ranks with the same one grouped), and the
//!   ranks that left no record (killed, or not writing records).
//! - **Collectives**: the first sequence number at which ranks called different collectives; the
//!   furthest collective any rank reached, which ranks are in it (and how late each entered),
//!   and which never got there, with their last collective and anything they did after it.
//! - **Point-to-point**: operations still running or failed, and for a single send or receive
//!   waiting on a peer, how many messages that peer sent or took.
//! - **Timing**: over the collectives every rank completed with exact clocks, who arrived last
//!   how often and how late, the time each rank spent inside them (ranks that wait long are
//!   waiting for the others), and durations per collective.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use oxccl_comm::affinity::encode_cpus;
use oxccl_comm::{TraceDump, TraceRecord, TraceState};

/// `1500` -> `1.50 us`, and so on up to seconds.
fn dur(ns: u64) -> String {
    let f = ns as f64;
    if ns < 1_000 {
        format!("{ns} ns")
    } else if ns < 1_000_000 {
        format!("{:.2} us", f / 1e3)
    } else if ns < 1_000_000_000 {
        format!("{:.2} ms", f / 1e6)
    } else {
        format!("{:.2} s", f / 1e9)
    }
}

fn bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// `rank 3` or `ranks 0-2,5`.
fn ranks(list: &[usize]) -> String {
    if list.len() == 1 {
        format!("rank {}", list[0])
    } else {
        format!("ranks {}", encode_cpus(list))
    }
}

/// What every rank reports after a communicator's first error: `another rank failed first`.
const ECHO: &str = "communicator aborted: another rank failed first: ";

/// The rank whose error broke the communicator and that error, from rank `rank`'s report of it
/// (`rank R: <error>`, or `rank R: communicator aborted: another rank failed first: rank F:
/// <error>`): equal on every rank, so ranks group.
fn cause(text: &str, rank: usize) -> (usize, &str) {
    let own = text.strip_prefix(&format!("rank {rank}: ")).unwrap_or(text);
    let Some(echo) = own.strip_prefix(ECHO) else {
        return (rank, own);
    };
    let first = echo
        .strip_prefix("rank ")
        .and_then(|t| t.split_once(": "))
        .and_then(|(n, rest)| Some((n.parse().ok()?, rest)));
    first.unwrap_or((rank, echo))
}

/// An operation's error without its rank and its parenthesised detail (stall reports differ
/// from rank to rank): `all-reduce: timed out after 3s`. The detail is in the communicator's
/// error, printed once.
fn short(text: &str, rank: usize) -> &str {
    let (_, e) = cause(text, rank);
    e.split_once(" (").map_or(e, |(head, _)| head)
}

/// A duration as the record's clock can tell it: the coarse clock's reads are a tick apart.
fn timed(ns: u64, r: &TraceRecord) -> String {
    let tick = r.clock_resolution_ns;
    if tick <= 1 {
        dur(ns)
    } else if ns < tick {
        format!("under {} (the clock tick)", dur(tick))
    } else {
        format!("about {}", dur(ns))
    }
}

fn state(r: &TraceRecord, rank: usize, dumped: u64) -> String {
    match r.state {
        TraceState::Completed => format!("completed in {}", timed(r.duration_ns.unwrap_or(0), r)),
        TraceState::Failed => format!(
            "failed after {}: {}",
            timed(r.duration_ns.unwrap_or(0), r),
            short(r.error.as_deref().unwrap_or("?"), rank)
        ),
        TraceState::Running => format!(
            "still running {} after it started",
            timed(dumped.saturating_sub(r.start_unix_ns), r)
        ),
    }
}

/// Reads the dumps of every communicator in them; one section each, in id order.
pub fn analyze(dumps: &[TraceDump]) -> String {
    let mut by_comm: BTreeMap<&str, BTreeMap<usize, &TraceDump>> = BTreeMap::new();
    for d in dumps {
        let slot = by_comm
            .entry(&d.comm)
            .or_default()
            .entry(d.rank)
            .or_insert(d);
        // Several dumps of one rank (a failure, then the close): the latest says the most.
        if d.dumped_unix_ns > slot.dumped_unix_ns {
            *slot = d;
        }
    }
    let mut out = String::new();
    for (comm, ranks) in by_comm {
        let ranked: Vec<&TraceDump> = ranks.into_values().collect();
        section(&mut out, comm, &ranked);
    }
    out
}

fn section(out: &mut String, comm: &str, dumps: &[&TraceDump]) {
    let size = dumps.iter().map(|d| d.size).max().unwrap_or(0);
    let have: BTreeSet<usize> = dumps.iter().map(|d| d.rank).collect();
    let missing: Vec<usize> = (0..size).filter(|r| !have.contains(r)).collect();
    let _ = writeln!(
        out,
        "communicator {comm} ({size} ranks): records of {}{}",
        ranks(&have.iter().copied().collect::<Vec<_>>()),
        if missing.is_empty() {
            String::new()
        } else {
            format!(
                "; none of {} (killed, or not writing records)",
                ranks(&missing)
            )
        }
    );
    who_dumped(out, dumps);
    collectives(out, dumps, &missing);
    point_to_point(out, dumps);
    timing(out, dumps);
    out.push('\n');
}

/// Why each rank wrote its record (ranks grouped), then the communicator's error once per
/// distinct cause.
fn who_dumped(out: &mut String, dumps: &[&TraceDump]) {
    let mut reasons: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    let mut causes: BTreeMap<(usize, &str), Vec<usize>> = BTreeMap::new();
    for d in dumps {
        reasons.entry(&d.reason).or_default().push(d.rank);
        if let Some(e) = &d.error {
            causes.entry(cause(e, d.rank)).or_default().push(d.rank);
        }
    }
    let why: Vec<String> = reasons
        .into_iter()
        .map(|(r, list)| {
            let what = match r {
                "failed" => {
                    "failed (wrote it at the failure; the process ended before it closed \
                             the communicator)"
                }
                "closed" => "closed the communicator",
                "requested" => "wrote it on request",
                other => other,
            };
            format!("{} {what}", ranks(&list))
        })
        .collect();
    let _ = writeln!(out, "  {}", why.join("; "));
    for ((first, e), list) in causes {
        let _ = writeln!(
            out,
            "  error (on {}): rank {first} failed first: {e}",
            ranks(&list)
        );
    }
    let nodes: BTreeSet<&str> = dumps.iter().map(|d| d.node.as_str()).collect();
    let kept: u64 = dumps.iter().map(|d| d.records.len() as u64).sum();
    let recorded: u64 = dumps.iter().map(|d| d.recorded).sum();
    let _ = writeln!(
        out,
        "  {} node(s); {kept} of the {recorded} operations recorded are kept (the last {} per rank)",
        nodes.len(),
        dumps.iter().map(|d| d.capacity).max().unwrap_or(0)
    );
}

fn colls(d: &TraceDump) -> impl Iterator<Item = &TraceRecord> {
    d.records.iter().filter(|r| r.seq.is_some())
}

/// A rank's furthest collective record.
fn last(d: &TraceDump) -> Option<&TraceRecord> {
    colls(d).max_by_key(|r| r.seq)
}

fn collectives(out: &mut String, dumps: &[&TraceDump], missing: &[usize]) {
    // The first sequence number at which two ranks' calls differ.
    let mut calls: BTreeMap<u64, BTreeMap<String, (Vec<usize>, &str)>> = BTreeMap::new();
    for d in dumps {
        for r in colls(d) {
            let e = calls.entry(r.seq.unwrap_or(0)).or_default();
            e.entry(r.signature())
                .or_insert((Vec::new(), &r.op))
                .0
                .push(d.rank);
        }
    }
    if let Some((seq, groups)) = calls.iter().find(|(_, g)| g.len() > 1) {
        let parts: Vec<String> = groups
            .values()
            .map(|(list, op)| format!("{} called {op}", ranks(list)))
            .collect();
        let _ = writeln!(out, "  MISMATCH at collective #{seq}: {}", parts.join("; "));
    }

    let Some(front) = dumps.iter().filter_map(|d| last(d)?.seq).max() else {
        let _ = writeln!(out, "  no collectives recorded");
        return;
    };
    let at_front: Vec<(&TraceDump, &TraceRecord)> = dumps
        .iter()
        .filter_map(|d| last(d).filter(|r| r.seq == Some(front)).map(|r| (*d, r)))
        .collect();
    let op = &at_front[0].1.op;
    let all_done = at_front
        .iter()
        .all(|(_, r)| r.state == TraceState::Completed);
    let behind: Vec<&TraceDump> = dumps
        .iter()
        .copied()
        .filter(|d| last(d).and_then(|r| r.seq) != Some(front))
        .collect();
    if all_done && behind.is_empty() && missing.is_empty() {
        let _ = writeln!(
            out,
            "  collectives: every rank completed #{front} {op}, the last one recorded"
        );
        return;
    }
    let _ = writeln!(out, "  furthest collective: #{front} {op}");
    let mut by_state: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (d, r) in &at_front {
        let s = match r.state {
            TraceState::Failed => {
                format!(
                    "failed: {}",
                    short(r.error.as_deref().unwrap_or("?"), d.rank)
                )
            }
            s => s.name().to_string(),
        };
        by_state.entry(s).or_default().push(d.rank);
    }
    for (s, list) in by_state {
        let _ = writeln!(out, "    {} in it: {s}", ranks(&list));
    }
    // How late each rank entered it (the arrival that the others waited for).
    let latest = at_front.iter().max_by_key(|(_, r)| r.start_unix_ns);
    if let (true, Some((d, r))) = (at_front.len() > 1, latest) {
        let first = at_front
            .iter()
            .map(|(_, r)| r.start_unix_ns)
            .min()
            .unwrap_or(0);
        let late = r.start_unix_ns - first;
        let tick = at_front
            .iter()
            .map(|(_, r)| r.clock_resolution_ns)
            .max()
            .unwrap_or(1);
        if late > tick {
            let _ = writeln!(
                out,
                "    rank {} entered it last, {} after the first",
                d.rank,
                dur(late)
            );
        }
    }
    let entered = at_front
        .iter()
        .map(|(_, r)| r.start_unix_ns)
        .min()
        .unwrap_or(0);
    for d in behind {
        let Some(r) = last(d) else {
            let _ = writeln!(
                out,
                "    rank {} never reached it: no collective recorded{}",
                d.rank,
                after_last(d, None)
            );
            continue;
        };
        let tick = r.clock_resolution_ns.max(at_front[0].1.clock_resolution_ns);
        let gap = entered.abs_diff(r.start_unix_ns);
        let when = if gap <= tick && tick > 1 {
            format!(
                "within a clock tick ({}) of the first rank's entry into #{front}",
                dur(tick)
            )
        } else if r.start_unix_ns <= entered {
            format!("{} before the first rank entered #{front}", dur(gap))
        } else {
            format!("{} after the first rank entered #{front}", dur(gap))
        };
        let _ = writeln!(
            out,
            "    rank {} never reached it: its last collective is #{} {} ({}; started {when}){}",
            d.rank,
            r.seq.unwrap_or(0),
            r.op,
            state(r, d.rank, d.dumped_unix_ns),
            after_last(d, Some(r.id))
        );
    }
    if !missing.is_empty() {
        let _ = writeln!(
            out,
            "    {} left no record: look at their output and exit status",
            ranks(missing)
        );
    }
}

/// What rank `d` did after its record `after` (its last collective): point-to-point operations.
fn after_last(d: &TraceDump, after: Option<u64>) -> String {
    let later: Vec<&TraceRecord> = d
        .records
        .iter()
        .filter(|r| r.seq.is_none() && after.is_none_or(|a| r.id > a))
        .collect();
    match later.last() {
        None => String::new(),
        Some(r) => format!(
            "; then {} point-to-point operation(s), the last {} ({})",
            later.len(),
            r.op,
            state(r, d.rank, d.dumped_unix_ns)
        ),
    }
}

fn point_to_point(out: &mut String, dumps: &[&TraceDump]) {
    let open: Vec<(&TraceDump, &TraceRecord)> = dumps
        .iter()
        .flat_map(|d| {
            d.records
                .iter()
                .filter(|r| r.seq.is_none() && r.state != TraceState::Completed)
                .map(move |r| (*d, r))
        })
        .collect();
    if open.is_empty() {
        return;
    }
    let _ = writeln!(out, "  point-to-point not completed:");
    let of = |rank: usize| dumps.iter().find(|d| d.rank == rank);
    for (d, r) in open {
        let _ = writeln!(
            out,
            "    rank {}: {} {}",
            d.rank,
            r.op,
            state(r, d.rank, d.dumped_unix_ns)
        );
        // The peer's side: how many messages it sent to / took from this rank.
        if let Some((peer, n)) = r.recv_from {
            let sent = of(peer).map(|p| {
                p.records
                    .iter()
                    .filter_map(|x| x.send_to.filter(|s| s.0 == d.rank).map(|s| s.1))
                    .max()
                    .unwrap_or(0)
            });
            match sent {
                Some(m) if m < n => {
                    let _ = writeln!(
                        out,
                        "      rank {peer} sent it {m} message(s) (as far as its record goes): \
                         message #{n} was never sent"
                    );
                }
                None => {
                    let _ = writeln!(out, "      rank {peer} left no record");
                }
                _ => {}
            }
        }
        if let Some((peer, n)) = r.send_to {
            let taken = of(peer).map(|p| {
                p.records
                    .iter()
                    .filter_map(|x| x.recv_from.filter(|s| s.0 == d.rank).map(|s| s.1))
                    .max()
                    .unwrap_or(0)
            });
            match taken {
                Some(m) if m < n => {
                    let _ = writeln!(
                        out,
                        "      rank {peer} posted {m} receive(s) from it (as far as its record \
                         goes): message #{n} has no receive"
                    );
                }
                None => {
                    let _ = writeln!(out, "      rank {peer} left no record");
                }
                _ => {}
            }
        }
    }
}

/// Per rank: how often it arrived last, its summed lateness, and its time inside collectives.
#[derive(Default, Clone)]
struct RankTiming {
    last: usize,
    late_ns: u64,
    inside_ns: u64,
}

fn timing(out: &mut String, dumps: &[&TraceDump]) {
    if dumps.len() < 2 {
        return;
    }
    // Collectives every dumped rank completed, by sequence number, with their records in rank
    // order.
    let mut by_seq: BTreeMap<u64, Vec<&TraceRecord>> = BTreeMap::new();
    for d in dumps {
        for r in colls(d).filter(|r| r.state == TraceState::Completed) {
            by_seq.entry(r.seq.unwrap_or(0)).or_default().push(r);
        }
    }
    by_seq.retain(|_, v| v.len() == dumps.len());
    let coarse = by_seq
        .values()
        .filter(|v| v.iter().any(|r| r.clock_resolution_ns > 1))
        .count();
    let tick = dumps
        .iter()
        .flat_map(|d| d.records.iter().map(|r| r.clock_resolution_ns))
        .max()
        .unwrap_or(1);
    by_seq.retain(|_, v| v.iter().all(|r| r.clock_resolution_ns <= 1));
    if by_seq.is_empty() {
        if coarse > 0 {
            let _ = writeln!(
                out,
                "  timing: the {coarse} collective(s) every rank completed were timed to the \
                 {} clock tick only (small ones between ranks that share memory), not compared",
                dur(tick)
            );
        }
        return;
    }
    let (lo, hi) = (
        by_seq.keys().next().copied().unwrap_or(0),
        by_seq.keys().last().copied().unwrap_or(0),
    );
    let n = by_seq.len();
    let mut per = vec![RankTiming::default(); dumps.len()];
    for recs in by_seq.values() {
        let first = recs.iter().map(|r| r.start_unix_ns).min().unwrap_or(0);
        let mut last_i = 0;
        for (i, r) in recs.iter().enumerate() {
            per[i].late_ns += r.start_unix_ns - first;
            per[i].inside_ns += r.duration_ns.unwrap_or(0);
            if r.start_unix_ns > recs[last_i].start_unix_ns {
                last_i = i;
            }
        }
        per[last_i].last += 1;
    }
    let _ = writeln!(
        out,
        "  timing of the {n} collective(s) every rank completed, #{lo}..#{hi}{}:",
        if coarse > 0 {
            format!(
                " ({coarse} more timed to the {} tick only are left out)",
                dur(tick)
            )
        } else {
            String::new()
        }
    );
    let nodes: BTreeSet<&str> = dumps.iter().map(|d| d.node.as_str()).collect();
    if nodes.len() > 1 {
        let _ = writeln!(
            out,
            "    (the ranks are on {} nodes: arrival times compare their clocks, which may \
             disagree by more than the gaps shown)",
            nodes.len()
        );
    }
    let mut order: Vec<usize> = (0..dumps.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse((per[i].last, per[i].late_ns)));
    let shown = order.len().min(8);
    let rows: Vec<String> = order[..shown]
        .iter()
        .map(|&i| {
            format!(
                "rank {}: last in {} ({:.0}%), {} late on average, {} inside",
                dumps[i].rank,
                per[i].last,
                100.0 * per[i].last as f64 / n as f64,
                dur(per[i].late_ns / n as u64),
                dur(per[i].inside_ns)
            )
        })
        .collect();
    for row in rows {
        let _ = writeln!(out, "    {row}");
    }
    if order.len() > shown {
        let _ = writeln!(out, "    ... {} more ranks", order.len() - shown);
    }
    // A straggler: last in most collectives, and later than the others' whole time inside
    // would explain by chance.
    let top = &per[order[0]];
    if n >= 3 && top.last * 2 > n && dumps.len() > 1 {
        let others_inside: u64 =
            order[1..].iter().map(|&i| per[i].inside_ns).sum::<u64>() / (dumps.len() as u64 - 1);
        if others_inside > top.inside_ns {
            let _ = writeln!(
                out,
                "    rank {} arrives last in most collectives and spends the least time inside \
                 them: the others wait for it (look at what it does between collectives)",
                dumps[order[0]].rank
            );
        }
    }
    // Durations per collective (every rank's records).
    let mut kinds: BTreeMap<&str, Vec<(u64, u64)>> = BTreeMap::new();
    for recs in by_seq.values() {
        for r in recs {
            kinds
                .entry(&r.coll)
                .or_default()
                .push((r.duration_ns.unwrap_or(0), r.bytes));
        }
    }
    for (coll, mut v) in kinds {
        v.sort_unstable();
        let median = v[v.len() / 2].0;
        let max = v.last().map_or(0, |x| x.0);
        let total_bytes: u64 = v.iter().map(|x| x.1).sum::<u64>() / dumps.len() as u64;
        let _ = writeln!(
            out,
            "    {coll}: {} call(s), {} per rank, median {}, longest {}",
            v.len() / dumps.len(),
            bytes(total_bytes),
            dur(median),
            dur(max)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn dump(rank: usize, size: usize, records: Vec<TraceRecord>) -> TraceDump {
        TraceDump {
            format: oxccl_comm::trace::FORMAT.into(),
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
            text.contains("rank 2 never reached it: its last collective is #9 all-reduce"),
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
        assert!(text.contains("none of rank 1 (killed"), "{text}");
        assert!(text.contains("rank 1 left no record"), "{text}");
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
    }

    #[test]
    fn point_to_point_waits_name_the_missing_message() {
        let p2p = |id, send_to, recv_from, state| TraceRecord {
            seq: None,
            coll: "recv".into(),
            op: "p2p".into(),
            send_to,
            recv_from,
            state,
            duration_ns: (state != TraceState::Running).then_some(MS),
            ..coll(id, 0, "recv", 5000, None)
        };
        let dumps = vec![
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
        let text = analyze(&dumps);
        assert!(text.contains("rank 1: p2p still running 5.00 s"), "{text}");
        assert!(
            text.contains("rank 0 sent it 2 message(s) (as far as its record goes): message #3 was never sent"),
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
}
