//! Flight records of real processes: a job under `oxccl launch --trace-dir` in which one rank
//! waits for a message that never comes while the others wait for it in an all-reduce; the
//! launcher's reading and `oxccl trace DIR` name the rank and the message.

use std::process::Command;

use crate::common::{rank_cmd, show, SCENARIO};

#[test]
fn trace_dir_names_the_rank_that_never_reached_the_collective() {
    let dir = std::env::temp_dir().join(format!("oxccl-trace-launch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .args(["launch", "-n", "4", "--timeout", "120", "--trace-dir"])
        .arg(&dir)
        .arg("--")
        .args(rank_cmd())
        .env(SCENARIO, "trace-hang")
        .env("OXCCL_TIMEOUT", "3")
        .env_remove("OXCCL_DEBUG")
        .env_remove("OXCCL_TRACE_BUFFER")
        .output()
        .expect("running oxccl launch");
    let all = show(&out);
    assert_eq!(out.status.code(), Some(3), "{all}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    // What the launcher prints after the failure, and what `oxccl trace` prints.
    let reading = Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .arg("trace")
        .arg(&dir)
        .output()
        .expect("running oxccl trace");
    assert!(reading.status.success(), "{}", show(&reading));
    let stdout = String::from_utf8_lossy(&reading.stdout);
    for text in [&*stderr, &*stdout] {
        for want in [
            "(4 ranks): records of ranks 0-3",
            "first reported by rank ",
            "furthest collective: #3 all-reduce(count=1024, dtype=float, op=sum)",
            "rank 1 never reached it: last collective #2 all-reduce(count=1024, dtype=float, \
             op=sum) (completed in",
            "then 1 point-to-point operation(s), the last recv(from=2 #1, count=16, \
             dtype=uint8) (failed after",
            "rank 1: recv(from=2 #1, count=16, dtype=uint8) failed after",
            "rank 2 began 0 send(s) to it in all: message #1 was never sent",
        ] {
            assert!(
                text.contains(want),
                "missing {want:?} in:\n{text}\n---\n{all}"
            );
        }
        // Ranks 0, 2 and 3 are in the all-reduce, failed (each with the error it saw first).
        let mut failed = Vec::new();
        for line in text.lines().filter(|l| l.contains(" in it: failed: ")) {
            let list = line.trim_start().split(" in it").next().unwrap_or("");
            let list = list
                .trim_start_matches("ranks ")
                .trim_start_matches("rank ");
            failed.extend(oxccl::comm::internal::affinity::decode_cpus(list).unwrap_or_default());
        }
        failed.sort_unstable();
        assert_eq!(failed, [0, 2, 3], "{text}");
    }
    assert!(stderr.contains("flight records in"), "{all}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn trace_without_records_says_so() {
    let dir = std::env::temp_dir().join(format!("oxccl-trace-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("junk.json"), b"not json").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_oxccl"))
        .arg("trace")
        .arg(&dir)
        .output()
        .expect("running oxccl trace");
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("skipped") && err.contains("junk.json") && err.contains("no flight records"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
