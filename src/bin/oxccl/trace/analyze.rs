//! The reading of flight records: one section per communicator.
//!
//! - **Who wrote a record**: every rank's reason (ranks grouped), the error that broke the
//!   communicator and who reported it first, the ranks that left no record, and the world ranks
//!   of a communicator split from the world.
//! - **Collectives**: the first sequence number at which ranks called different collectives; the
//!   furthest collective any rank reached, which ranks are in it (and how late the last entered),
//!   and which never got there, with their last collective and what they did after it.
//! - **Point-to-point**: operations still running or failed, and for a single send or receive
//!   waiting on a peer, how many messages that peer began to send it or to take from it.
//! - **Timing**: over the collectives every rank completed with exact clocks, who arrived last
//!   how often and how late, the time each rank spent inside them (ranks that wait long are
//!   waiting for the others), and durations per collective.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use oxccl_comm::internal::trace::MAX_RANKS;
use oxccl_comm::{TraceDump, TraceRecord, TraceState};

use super::text::{bytes, cause, dur, ranks, short, state};

/// Most lines a list of ranks or operations gets in a section (the rest are counted).
const LINES_MAX: usize = 16;

/// Every communicator's dumps (in id order), one per rank (in order): of several dumps of one
/// rank (a failure, then the close), the latest, which says the most.
pub(super) fn latest_by_comm(dumps: &[TraceDump]) -> BTreeMap<&str, BTreeMap<usize, &TraceDump>> {
    let mut by_comm: BTreeMap<&str, BTreeMap<usize, &TraceDump>> = BTreeMap::new();
    for d in dumps {
        let slot = by_comm
            .entry(&d.comm)
            .or_default()
            .entry(d.rank)
            .or_insert(d);
        if d.dumped_unix_ns > slot.dumped_unix_ns {
            *slot = d;
        }
    }
    by_comm
}

/// Reads the dumps of every communicator in them; one section each, in id order.
pub fn analyze(dumps: &[TraceDump]) -> String {
    let mut out = String::new();
    for (comm, ranks) in latest_by_comm(dumps) {
        let ranked: Vec<&TraceDump> = ranks.into_values().collect();
        section(&mut out, comm, &ranked);
    }
    out
}

fn section(out: &mut String, comm: &str, dumps: &[&TraceDump]) {
    let size = dumps
        .iter()
        .map(|d| d.size)
        .max()
        .unwrap_or(0)
        .min(MAX_RANKS);
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
                "; none of {} (on another node's directory, killed, or not writing records)",
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

/// Why each rank wrote its record (ranks grouped), the communicator's error once per distinct
/// cause, how much was kept, and the world ranks of a split communicator.
fn who_dumped(out: &mut String, dumps: &[&TraceDump]) {
    let mut reasons: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    let mut causes: BTreeMap<(usize, String), Vec<usize>> = BTreeMap::new();
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
                    "wrote it when the communicator failed and never closed it (the process \
                     ended first, or is still running)"
                }
                "closed" => "closed the communicator",
                "stalled" => {
                    "wrote it while waiting without progress (a quarter of OXCCL_TIMEOUT), and \
                     nothing since"
                }
                "requested" => "wrote it on request",
                other => other,
            };
            format!("{} {what}", ranks(&list))
        })
        .collect();
    let _ = writeln!(out, "  {}", why.join("; "));
    for ((first, e), list) in causes.iter().take(LINES_MAX) {
        let _ = writeln!(
            out,
            "  error (on {}), first reported by rank {first}: {e}",
            ranks(list)
        );
    }
    if causes.len() > LINES_MAX {
        let _ = writeln!(out, "  ... {} more errors", causes.len() - LINES_MAX);
    }
    let nodes: BTreeSet<&str> = dumps.iter().map(|d| d.node.as_str()).collect();
    let kept: u64 = dumps.iter().map(|d| d.records.len() as u64).sum();
    let recorded: u64 = dumps
        .iter()
        .map(|d| d.recorded)
        .fold(0, u64::saturating_add);
    let _ = writeln!(
        out,
        "  {} node(s); {kept} of the {recorded} operations recorded are kept (the last {} per rank)",
        nodes.len(),
        dumps.iter().map(|d| d.capacity).max().unwrap_or(0)
    );
    if let Some(d) = dumps.iter().find(|d| d.root_comm != d.comm) {
        let map: Vec<String> = dumps
            .iter()
            .take(LINES_MAX)
            .map(|d| format!("{}={}", d.rank, d.root_rank))
            .collect();
        let _ = writeln!(
            out,
            "  ranks of {} here: {}{}",
            d.root_comm,
            map.join(", "),
            if dumps.len() > LINES_MAX { ", ..." } else { "" }
        );
    }
}

fn colls(d: &TraceDump) -> impl Iterator<Item = &TraceRecord> {
    d.records.iter().filter(|r| r.seq.is_some())
}

/// A rank's furthest collective record.
fn last(d: &TraceDump) -> Option<&TraceRecord> {
    colls(d).max_by_key(|r| r.seq)
}

fn collectives(out: &mut String, dumps: &[&TraceDump], missing: &[usize]) {
    mismatch(out, dumps);
    let Some(front) = dumps.iter().filter_map(|d| last(d)?.seq).max() else {
        let _ = writeln!(
            out,
            "  no collectives among the records kept{}",
            if missing.is_empty() {
                ""
            } else {
                " (of the ranks that left one)"
            }
        );
        return;
    };
    let at_front: Vec<(&TraceDump, &TraceRecord)> = dumps
        .iter()
        .filter_map(|d| last(d).filter(|r| r.seq == Some(front)).map(|r| (*d, r)))
        .collect();
    let behind: Vec<&TraceDump> = dumps
        .iter()
        .copied()
        .filter(|d| last(d).and_then(|r| r.seq) != Some(front))
        .collect();
    let Some((_, first_rec)) = at_front.first() else {
        return;
    };
    let op = &first_rec.op;
    let all_done = at_front
        .iter()
        .all(|(_, r)| r.state == TraceState::Completed);
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
    let nodes: BTreeSet<&str> = dumps.iter().map(|d| d.node.as_str()).collect();
    let skew = if nodes.len() > 1 {
        " (clocks of different nodes)"
    } else {
        ""
    };
    // How late the last rank entered it (the arrival the others waited for).
    let first = at_front
        .iter()
        .map(|(_, r)| r.start_unix_ns)
        .min()
        .unwrap_or(0);
    let tick = at_front
        .iter()
        .map(|(_, r)| r.clock_resolution_ns)
        .max()
        .unwrap_or(1);
    if let Some((d, r)) = at_front.iter().max_by_key(|(_, r)| r.start_unix_ns) {
        let late = r.start_unix_ns - first;
        if at_front.len() > 1 && late > tick {
            let _ = writeln!(
                out,
                "    rank {} entered it last, {} after the first{skew}",
                d.rank,
                dur(late)
            );
        }
    }
    // The ranks that never got there, grouped by where they stopped (a group of one gets the
    // times too).
    let mut groups: BTreeMap<String, (Vec<usize>, String)> = BTreeMap::new();
    for d in behind {
        let (key, detail) = match last(d) {
            None => {
                let key = format!(
                    "no collective among its last {} records{}",
                    d.records.len(),
                    after_last(d, None, false)
                );
                (key.clone(), key)
            }
            Some(r) => {
                let gap = first.abs_diff(r.start_unix_ns);
                let tick = r.clock_resolution_ns.max(tick);
                let when = if gap <= tick && tick > 1 {
                    format!(
                        "within a clock tick ({}) of the first entry into #{front}",
                        dur(tick)
                    )
                } else if r.start_unix_ns <= first {
                    format!("{} before the first entry into #{front}{skew}", dur(gap))
                } else {
                    format!("{} after the first entry into #{front}{skew}", dur(gap))
                };
                let head = format!("last collective #{} {}", r.seq.unwrap_or(0), r.op);
                let key = format!(
                    "{head} ({}){}",
                    r.state.name(),
                    after_last(d, Some(r.id), false)
                );
                let detail = format!(
                    "{head} ({}; started {when}){}",
                    state(r, d.rank, d.dumped_unix_ns),
                    after_last(d, Some(r.id), true)
                );
                (key, detail)
            }
        };
        let g = groups.entry(key).or_insert((Vec::new(), detail));
        g.0.push(d.rank);
    }
    let n = groups.len();
    for (key, (list, detail)) in groups.into_iter().take(LINES_MAX) {
        let text = if list.len() == 1 { detail } else { key };
        let _ = writeln!(out, "    {} never reached it: {text}", ranks(&list));
    }
    if n > LINES_MAX {
        let _ = writeln!(out, "    ... {} more groups of ranks", n - LINES_MAX);
    }
    if !missing.is_empty() {
        let _ = writeln!(
            out,
            "    {} left no record here: look at their output and exit status",
            ranks(missing)
        );
    }
}

/// The first sequence number at which ranks' calls differ.
fn mismatch(out: &mut String, dumps: &[&TraceDump]) {
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
            .take(LINES_MAX)
            .map(|(list, op)| format!("{} called {op}", ranks(list)))
            .collect();
        let _ = writeln!(out, "  MISMATCH at collective #{seq}: {}", parts.join("; "));
    }
}

/// What rank `d` did after its record `after` (its last collective): point-to-point operations,
/// the last one's state with its times when `times` is set.
fn after_last(d: &TraceDump, after: Option<u64>, times: bool) -> String {
    let later: Vec<&TraceRecord> = d
        .records
        .iter()
        .filter(|r| r.seq.is_none() && after.is_none_or(|a| r.id > a))
        .collect();
    let Some(r) = later.last() else {
        return String::new();
    };
    let how = match (times, r.state) {
        (true, _) => state(r, d.rank, d.dumped_unix_ns),
        (false, TraceState::Failed) => {
            format!(
                "failed: {}",
                short(r.error.as_deref().unwrap_or("?"), d.rank)
            )
        }
        (false, s) => s.name().to_string(),
    };
    format!(
        "; then {} point-to-point operation(s), the last {} ({how})",
        later.len(),
        r.op
    )
}

/// What the peer of a waiting single send or receive did: `wanted` message `n` between this
/// rank `me` and `peer`, counted by the peer's per-peer counts (`taken` false: messages the
/// peer began to send to `me`; true: receives it began from `me`).
fn peer_side(dumps: &[&TraceDump], me: usize, peer: usize, n: u64, taken: bool) -> Option<String> {
    let Some(p) = dumps.iter().find(|d| d.rank == peer) else {
        return Some(format!("rank {peer} left no record here"));
    };
    let counts = if taken { &p.p2p_recvd } else { &p.p2p_sent };
    let m = counts.get(me).copied().unwrap_or(0);
    (m < n).then(|| {
        if taken {
            format!("rank {peer} began {m} receive(s) from it in all: message #{n} has no receive")
        } else {
            format!("rank {peer} began {m} send(s) to it in all: message #{n} was never sent")
        }
    })
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
    for (d, r) in open.iter().take(LINES_MAX) {
        let _ = writeln!(
            out,
            "    rank {}: {} {}",
            d.rank,
            r.op,
            state(r, d.rank, d.dumped_unix_ns)
        );
        let sides = [
            r.recv_from
                .and_then(|(p, n)| peer_side(dumps, d.rank, p, n, false)),
            r.send_to
                .and_then(|(p, n)| peer_side(dumps, d.rank, p, n, true)),
        ];
        for line in sides.into_iter().flatten() {
            let _ = writeln!(out, "      {line}");
        }
    }
    if open.len() > LINES_MAX {
        let _ = writeln!(out, "    ... {} more", open.len() - LINES_MAX);
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
    let (Some(&lo), Some(&hi)) = (by_seq.keys().next(), by_seq.keys().last()) else {
        if coarse > 0 {
            let _ = writeln!(
                out,
                "  timing: the {coarse} collective(s) every rank completed were timed to the \
                 {} clock tick only (small ones between ranks that share memory), not compared",
                dur(tick)
            );
        }
        return;
    };
    let n = by_seq.len();
    let mut per = vec![RankTiming::default(); dumps.len()];
    for recs in by_seq.values() {
        let first = recs.iter().map(|r| r.start_unix_ns).min().unwrap_or(0);
        let mut last_i = 0;
        for (i, r) in recs.iter().enumerate() {
            per[i].late_ns = per[i].late_ns.saturating_add(r.start_unix_ns - first);
            per[i].inside_ns = per[i].inside_ns.saturating_add(r.duration_ns.unwrap_or(0));
            if r.start_unix_ns > recs[last_i].start_unix_ns {
                last_i = i;
            }
        }
        per[last_i].last += 1;
    }
    let left_out = if coarse > 0 {
        format!(
            " ({coarse} more timed to the {} tick only are left out)",
            dur(tick)
        )
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "  timing of the {n} collective(s) every rank completed, #{lo}..#{hi}{left_out}:"
    );
    let nodes: BTreeSet<&str> = dumps.iter().map(|d| d.node.as_str()).collect();
    if nodes.len() > 1 {
        let _ = writeln!(
            out,
            "    (the ranks are on {} nodes: arrival times compare their clocks, which may \
             disagree by more than the gaps shown; the time inside does not depend on them)",
            nodes.len()
        );
    }
    let mut order: Vec<usize> = (0..dumps.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse((per[i].last, per[i].late_ns)));
    for &i in order.iter().take(8) {
        let _ = writeln!(
            out,
            "    rank {}: last in {} ({:.0}%), {} late on average, {} inside",
            dumps[i].rank,
            per[i].last,
            100.0 * per[i].last as f64 / n as f64,
            dur(per[i].late_ns / n as u64),
            dur(per[i].inside_ns)
        );
    }
    if order.len() > 8 {
        let _ = writeln!(out, "    ... {} more ranks", order.len() - 8);
    }
    // A straggler: last in most collectives, and inside them less than the others (they wait
    // for it there).
    let top = &per[order[0]];
    let others: u64 = order[1..]
        .iter()
        .map(|&i| per[i].inside_ns)
        .fold(0, u64::saturating_add)
        / (dumps.len() as u64 - 1);
    if n >= 3 && top.last * 2 > n && others > top.inside_ns {
        let _ = writeln!(
            out,
            "    rank {} arrives last in most collectives and spends the least time inside \
             them: the others wait for it (look at what it does between collectives)",
            dumps[order[0]].rank
        );
    }
    // Durations per collective (every rank's records).
    let mut kinds: BTreeMap<&str, Vec<(u64, u64)>> = BTreeMap::new();
    for r in by_seq.values().flatten() {
        kinds
            .entry(&r.coll)
            .or_default()
            .push((r.duration_ns.unwrap_or(0), r.bytes));
    }
    for (coll, mut v) in kinds {
        v.sort_unstable();
        let median = v[v.len() / 2].0;
        let max = v.last().map_or(0, |x| x.0);
        let per_rank = v.iter().map(|x| x.1).fold(0, u64::saturating_add) / dumps.len() as u64;
        let _ = writeln!(
            out,
            "    {coll}: {} call(s), {} per rank, median {}, longest {}",
            v.len() / dumps.len(),
            bytes(per_rank),
            dur(median),
            dur(max)
        );
    }
}

#[cfg(test)]
mod tests;
