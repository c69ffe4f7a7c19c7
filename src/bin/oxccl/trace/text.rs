//! How the reading of flight records words things: durations, sizes, rank lists, errors.

use oxccl_comm::internal::affinity::encode_cpus;
use oxccl_comm::{TraceRecord, TraceState};

/// `1500` -> `1.50 us`, and so on up to seconds.
pub fn dur(ns: u64) -> String {
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

/// `1048576` -> `1 MiB`; sizes that are not whole KiB, MiB or GiB in bytes.
pub fn bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// `rank 3` or `ranks 0-2,5`.
pub fn ranks(list: &[usize]) -> String {
    if list.len() == 1 {
        format!("rank {}", list[0])
    } else {
        format!("ranks {}", encode_cpus(list))
    }
}

/// What every rank reports after a communicator's first error: `another rank failed first`.
const ECHO: &str = "communicator aborted: another rank failed first: ";

/// `rank N: rest` -> `(N, rest)`.
fn leading_rank(text: &str) -> Option<(usize, &str)> {
    let (n, rest) = text.strip_prefix("rank ")?.split_once(": ")?;
    Some((n.parse().ok()?, rest))
}

/// The rank that first reported the error that broke the communicator, and that error in words
/// equal on every rank, from rank `rank`'s text of it. The forms a rank reports:
/// - its own error, `rank R: <error>`, or a mismatch that another rank published, which keeps
///   the publisher's `rank P: collective mismatch ...`;
/// - `rank R: communicator aborted: another rank failed first: rank P: <error>`;
/// - `rank R: peer rank L lost during <op>: reported by rank P: <how>` (the publisher's own:
///   `rank P: peer rank L lost during <op>: <how>`), both worded `peer rank L lost: <how>`.
pub fn cause(text: &str, rank: usize) -> (usize, String) {
    let (mut first, mut rest) = leading_rank(text).unwrap_or((rank, text));
    if let Some(echo) = rest.strip_prefix(ECHO) {
        (first, rest) = leading_rank(echo).unwrap_or((first, echo));
    }
    let lost = rest
        .strip_prefix("peer rank ")
        .and_then(|t| t.split_once(" lost during "))
        .and_then(|(peer, t)| Some((peer, t.split_once(": ")?.1)));
    if let Some((peer, how)) = lost {
        let (reporter, how) = how
            .strip_prefix("reported by ")
            .and_then(leading_rank)
            .unwrap_or((first, how));
        return (reporter, format!("peer rank {peer} lost: {how}"));
    }
    (first, rest.to_string())
}

/// An operation's error without ranks and without its parenthesised detail (stall reports
/// differ from rank to rank): `all-reduce: timed out after 3s`. The detail is in the
/// communicator's error, printed once.
pub fn short(text: &str, rank: usize) -> String {
    let (_, e) = cause(text, rank);
    match e.split_once(" (") {
        Some((head, _)) => head.to_string(),
        None => e,
    }
}

/// A duration as the record's clock can tell it: the coarse clock's reads are a tick apart.
pub fn timed(ns: u64, r: &TraceRecord) -> String {
    let tick = r.clock_resolution_ns;
    if tick <= 1 {
        dur(ns)
    } else if ns < tick {
        format!("under {} (the clock tick)", dur(tick))
    } else {
        format!("about {}", dur(ns))
    }
}

/// `completed in 1.20 ms`, `failed after 3.00 s: <short error>`, `still running 2.00 s after
/// it started` (as of the dump at `dumped`).
pub fn state(r: &TraceRecord, rank: usize, dumped: u64) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_group_across_the_forms_ranks_report() {
        let timeout = "all-reduce: timed out after 3s (waiting for rank 1)";
        assert_eq!(cause(&format!("rank 3: {timeout}"), 3), (3, timeout.into()));
        assert_eq!(
            cause(&format!("rank 0: {ECHO}rank 3: {timeout}"), 0),
            (3, timeout.into())
        );
        // A published mismatch keeps its publisher's rank on every rank.
        let mismatch = "collective mismatch at op #4: this rank called a, rank 2 called b";
        assert_eq!(
            cause(&format!("rank 1: {mismatch}"), 3),
            (1, mismatch.into())
        );
        // Peer lost: the noticing rank's own words and the others' echo group together.
        let own = "rank 2: peer rank 1 lost during all-reduce: process exited";
        let echo = "rank 0: peer rank 1 lost during collective: reported by rank 2: process exited";
        let want = (2, "peer rank 1 lost: process exited".to_string());
        assert_eq!(cause(own, 2), want);
        assert_eq!(cause(echo, 0), want);
        assert_eq!(
            short(&format!("rank 0: {ECHO}rank 3: {timeout}"), 0),
            "all-reduce: timed out after 3s"
        );
        assert_eq!(cause("no rank here", 5), (5, "no rank here".into()));
    }

    #[test]
    fn sizes_and_durations() {
        assert_eq!(dur(999), "999 ns");
        assert_eq!(dur(1_500), "1.50 us");
        assert_eq!(dur(20_160_000), "20.16 ms");
        assert_eq!(dur(7_000_000_000), "7.00 s");
        assert_eq!(bytes(768 << 10), "768 KiB");
        assert_eq!(bytes(3 << 30), "3 GiB");
        assert_eq!(bytes(1000), "1000 B");
        assert_eq!(ranks(&[0, 1, 2, 5]), "ranks 0-2,5");
        assert_eq!(ranks(&[4]), "rank 4");
    }
}
