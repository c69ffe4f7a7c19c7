//! [`launch`] called directly (the `oxccl launch` command line is tested through the binary in
//! `tests/oxccl/launch.rs`): outcomes, exit codes and the cleanup after a failed start.

use std::time::{SystemTime, UNIX_EPOCH};

use super::*;

#[test]
fn library_api_reports_outcomes() {
    let mut cfg = LaunchConfig::new(2, "sh", ["-c", "test \"$OXCCL_WORLD_SIZE\" = 2"]);
    let ok = launch(&cfg).unwrap();
    assert_eq!(ok.end, JobEnd::Success);
    assert_eq!((ok.attempts, ok.exit_code()), (1, 0));

    cfg.args = vec!["-c".into(), "exit $((OXCCL_LOCAL_RANK + 6))".into()];
    let failed = launch(&cfg).unwrap();
    let JobEnd::RankFailed(f) = &failed.end else {
        panic!("{failed:?}")
    };
    assert!(matches!(f.termination, Termination::Exited(6 | 7)), "{f:?}");
    assert_eq!(failed.exit_code(), f.termination.exit_code());

    cfg.nnodes = 2;
    assert_eq!(launch(&cfg).unwrap_err().exit_code(), 2);
}

#[test]
fn a_rank_that_cannot_start_leaves_no_segments() {
    // A stale segment of the attempt (as a rank started before the failing one could leave).
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let job = format!("spawnfail-shm-{}-{nanos}", std::process::id());
    let prefix = oxccl_comm::internal::shm::job_prefix(&format!("{job}-r0"));
    let stale =
        std::path::Path::new(oxccl_comm::internal::shm::SHM_DIR).join(format!("{prefix}stale"));
    std::fs::write(&stale, b"x").unwrap();
    let mut cfg = LaunchConfig::new(2, "/nonexistent/oxccl-no-such-cmd", Vec::<String>::new());
    cfg.job_id = Some(job);
    let err = launch(&cfg).unwrap_err();
    let left = stale.exists();
    let _ = std::fs::remove_file(&stale);
    assert_eq!(err.exit_code(), 127, "{err}");
    assert!(!left, "{} was left behind", stale.display());
}
