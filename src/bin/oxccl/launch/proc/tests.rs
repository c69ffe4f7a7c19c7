//! The start and the supervision of an attempt, with `sh` ranks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::*;
use crate::launch::Termination;

fn specs(ranks: std::ops::Range<usize>) -> Vec<RankSpec> {
    ranks
        .map(|rank| RankSpec {
            rank,
            local_rank: rank,
            env: vec![("OXCCL_RANK", rank.to_string())],
        })
        .collect()
}

fn cfg(script: &str) -> LaunchConfig {
    let mut cfg = LaunchConfig::new(1, "sh", ["-c", script]);
    cfg.prefix_output = false;
    cfg
}

/// Signals with a flag for SIGTERM (no handler is installed).
fn sigterm_flag() -> (Signals, Arc<AtomicBool>) {
    Signals::flag_only(libc::SIGTERM)
}

fn ctx(signals: Option<&Signals>, deadline: Option<Instant>) -> SupervisorCtx<'_> {
    SupervisorCtx {
        signals,
        deadline,
        failure_grace: Duration::from_secs(30),
        signal_grace: Duration::from_secs(30),
        failure_settle: Duration::ZERO,
        nodes: None,
        keep_going: false,
    }
}

#[test]
fn a_pending_signal_stops_the_start() {
    let (signals, flag) = sigterm_flag();
    flag.store(true, Ordering::SeqCst);
    let ctx = ctx(Some(&signals), None);
    let mut job = Job::spawn(&cfg("exec sleep 30"), specs(0..4), None, &ctx).unwrap();
    assert_eq!(job.ranks.len(), 0, "ranks were started despite the signal");
    assert_eq!(job.supervise(&ctx), AttemptEnd::Interrupted(libc::SIGTERM));
    job.finish();
}

#[test]
fn the_deadline_stops_the_start() {
    let ctx = ctx(None, Some(Instant::now()));
    let mut job = Job::spawn(&cfg("exec sleep 30"), specs(0..4), None, &ctx).unwrap();
    assert_eq!(job.ranks.len(), 0, "ranks were started after the deadline");
    assert_eq!(job.supervise(&ctx), AttemptEnd::TimedOut);
    job.finish();
}

#[test]
fn a_failed_rank_stops_the_start() {
    let ctx = ctx(None, None);
    let cfg = cfg("if [ \"$OXCCL_RANK\" = 0 ]; then exit 3; fi; exec sleep 30");
    let mut job = Job::new(None, 3);
    job.start(&cfg, specs(0..1), &ctx).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while job.ranks[0].status.is_none() {
        assert!(Instant::now() < deadline, "rank 0 did not exit");
        thread::sleep(Duration::from_millis(5));
        job.reap();
    }
    job.start(&cfg, specs(1..3), &ctx).unwrap();
    assert_eq!(job.ranks.len(), 1, "ranks were started after rank 0 failed");
    match job.supervise(&ctx) {
        AttemptEnd::Failed(f) => {
            assert_eq!((f.rank, f.termination), (0, Termination::Exited(3)))
        }
        other => panic!("{other:?}"),
    }
    job.finish();
}

/// With a settle time the other ranks end on their own after a failure (here: exit 0 after
/// 2 s, standing for the time a rank takes to notice the failure and write its flight
/// record); without one they are terminated at once.
#[test]
fn the_others_get_the_settle_time_to_end_on_their_own() {
    // Rank 0 fails only once rank 1 has started (the starting loop stops starting ranks after a
    // failure, which a loaded machine may reach before rank 1 otherwise).
    let started = std::env::temp_dir().join(format!("oxccl-settle-{}", std::process::id()));
    let script = format!(
        "if [ \"$OXCCL_RANK\" = 0 ]; then for i in $(seq 600); do [ -e {f} ] && break; \
         sleep 0.05; done; exit 3; fi; touch {f}; sleep 2; exit 0",
        f = started.display()
    );
    for (settle, want) in [
        (Duration::from_secs(20), Termination::Exited(0)),
        (
            Duration::ZERO,
            Termination::Signaled {
                signal: libc::SIGTERM,
                core_dumped: false,
            },
        ),
    ] {
        let ctx = SupervisorCtx {
            failure_settle: settle,
            ..ctx(None, None)
        };
        let _ = std::fs::remove_file(&started);
        let mut job = Job::spawn(&cfg(&script), specs(0..2), None, &ctx).unwrap();
        match job.supervise(&ctx) {
            AttemptEnd::Failed(f) => assert_eq!(f.rank, 0),
            other => panic!("{other:?}"),
        }
        let st = job.ranks[1].status.expect("rank 1 reaped");
        assert_eq!(Termination::from_status(st), want, "settle {settle:?}");
        job.finish();
    }
    let _ = std::fs::remove_file(&started);
}

#[test]
fn a_signal_while_stopping_after_a_spawn_error_is_the_outcome() {
    let (signals, flag) = sigterm_flag();
    let ctx = ctx(Some(&signals), None);
    let mut job = Job::new(None, 2);
    // Rank 0 ignores SIGTERM, so stopping it takes the whole (30 s) grace period unless the
    // launcher gets a signal meanwhile.
    job.start(&cfg("trap '' TERM; exec sleep 30"), specs(0..1), &ctx)
        .unwrap();
    // Wait until the trap is in place (SigIgn has SIGTERM's bit).
    let status = format!("/proc/{}/status", job.ranks[0].pid);
    let term_bit = 1u64 << (libc::SIGTERM - 1);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ignored = std::fs::read_to_string(&status)
            .ok()
            .and_then(|s| {
                let line = s.lines().find(|l| l.starts_with("SigIgn:"))?.to_owned();
                u64::from_str_radix(line.trim_start_matches("SigIgn:").trim(), 16).ok()
            })
            .unwrap_or(0);
        if ignored & term_bit != 0 {
            break;
        }
        assert!(Instant::now() < deadline, "rank 0 never ignored SIGTERM");
        thread::sleep(Duration::from_millis(5));
    }
    let setter = {
        let flag = Arc::clone(&flag);
        thread::spawn(move || {
            thread::sleep(Duration::from_millis(200));
            flag.store(true, Ordering::SeqCst);
        })
    };
    let missing = LaunchConfig::new(1, "/nonexistent/oxccl-no-such-cmd", Vec::<String>::new());
    let started = job.start(&missing, specs(1..2), &ctx);
    setter.join().unwrap();
    assert!(
        started.is_ok(),
        "the signal was dropped: {:?}",
        started.err()
    );
    assert_eq!(job.supervise(&ctx), AttemptEnd::Interrupted(libc::SIGTERM));
    assert!(job.ranks.iter().all(RankProc::gone));
    job.finish();
}
