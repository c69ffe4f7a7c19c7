//! End-to-end tests of `oxccl perf` (the binary): table format, exact checks for every
//! collective, dtype and op, JSON and SVG output, running under `oxccl launch`, bad flags.

use std::path::PathBuf;
use std::process::{Command, Output};

const LAUNCHER_VARS: [&str; 5] = [
    "OXCCL_RANK",
    "RANK",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_RANK",
    "OXCCL_JOB_ID",
];

/// `oxccl` with no launcher in its environment and a bounded wait on every rank.
fn oxccl() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_oxccl"));
    for v in LAUNCHER_VARS {
        c.env_remove(v);
    }
    c.env("OXCCL_TIMEOUT", "60");
    c
}

fn run(args: &[&str]) -> (Output, String, String) {
    let out = oxccl().args(args).output().expect("run oxccl");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr)
}

/// The table rows (non-comment, non-empty lines), split into columns.
fn rows(stdout: &str) -> Vec<Vec<String>> {
    stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .collect()
}

/// Asserts a successful run whose every row has 0 wrong out of place, and 0 (or N/A where
/// oxccl has no in-place form) in place.
fn assert_all_correct(what: &str, out: &Output, stdout: &str, stderr: &str) -> Vec<Vec<String>> {
    assert!(
        out.status.success(),
        "{what}: {:?}\n{stdout}\n{stderr}",
        out.status
    );
    let rows = rows(stdout);
    assert!(!rows.is_empty(), "{what}: no rows\n{stdout}");
    for r in &rows {
        assert_eq!(r.len(), 13, "{what}: malformed row {r:?}");
        assert_eq!(r[8], "0", "{what}: out-of-place wrong in {r:?}");
        assert!(
            r[12] == "0" || r[12] == "N/A",
            "{what}: in-place wrong in {r:?}"
        );
    }
    assert!(
        stdout.contains("# Out of bounds values : 0 OK"),
        "{what}\n{stdout}"
    );
    rows
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("oxccl-perf-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn all_reduce_table_has_nccl_tests_shape() {
    let (out, stdout, stderr) = run(&[
        "perf",
        "all-reduce",
        "--np",
        "2",
        "-b",
        "8",
        "-e",
        "64K",
        "-f",
        "4",
        "-n",
        "2",
        "-w",
        "1",
    ]);
    let rows = assert_all_correct("all-reduce", &out, &stdout, &stderr);
    assert!(stdout.starts_with("# nThread 1 nGpus 1 minBytes 8 maxBytes 65536 step: 4(factor)"));
    assert!(stdout.contains("#  Rank  0 Group  0 Pid"), "{stdout}");
    assert!(stdout.contains("#  Rank  1 Group  0 Pid"), "{stdout}");
    assert!(stdout.contains("# Buffers rotate over"), "{stdout}");
    assert!(stdout.contains(
        "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong"
    ));
    assert!(stdout.contains(
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)"
    ));
    // nccl-tests' sweep: 8 x 4^k up to 64 KiB (65536 itself is not a step of it).
    let sizes: Vec<&str> = rows.iter().map(|r| r[0].as_str()).collect();
    assert_eq!(sizes, ["8", "32", "128", "512", "2048", "8192", "32768"]);
    for r in &rows {
        let size: usize = r[0].parse().unwrap();
        assert_eq!(r[1], (size / 4).to_string(), "{r:?}");
        assert_eq!(&r[2..5], ["float", "sum", "-1"], "{r:?}");
        let t: f64 = r[5].parse().unwrap();
        assert!(t > 0.0, "{r:?}");
    }
    assert!(stdout.contains("# Avg bus bandwidth    : "), "{stdout}");
}

#[test]
fn every_collective_dtype_and_op_checks_exactly() {
    // The CI requirement: `-c 1 -d all -o all` for every collective at small sizes reports
    // 0 wrong. 3 ranks, so sizes do not divide evenly and rounding down is exercised.
    let colls = [
        "all-reduce",
        "reduce-scatter",
        "all-gather",
        "broadcast",
        "reduce",
        "gather",
        "scatter",
        "all-to-all",
        "all-to-all-v",
        "all-gather-v",
        "reduce-scatter-v",
        "gather-v",
        "scatter-v",
        "send-recv",
    ];
    for coll in colls {
        let (out, stdout, stderr) = run(&[
            "perf", coll, "--np", "3", "-b", "8", "-e", "4K", "-f", "8", "-n", "1", "-w", "0",
            "-c", "1", "-d", "all", "-o", "all",
        ]);
        let rows = assert_all_correct(coll, &out, &stdout, &stderr);
        let with_op = matches!(
            coll,
            "all-reduce" | "reduce-scatter" | "reduce-scatter-v" | "reduce"
        );
        // 4 sizes x 12 dtypes (x 6 ops where there is an op: premul_sum included).
        assert_eq!(
            rows.len(),
            4 * 12 * if with_op { 6 } else { 1 },
            "{coll}\n{stdout}"
        );
        let in_place = matches!(
            coll,
            "all-reduce" | "reduce-scatter" | "all-gather" | "broadcast" | "reduce"
        );
        for r in &rows {
            assert_eq!(r[12] == "N/A", !in_place, "{coll}: {r:?}");
            assert_eq!(r[3] == "none", !with_op, "{coll}: {r:?}");
        }
    }
}

#[test]
fn blocking_calls_and_other_roots_check_exactly() {
    // -z 1 takes the blocking path (the default -z 0 the async one), and a root other than 0
    // exercises the rooted ones. `--rotate 0` makes every call reuse one buffer set, as the MPI
    // peer bench does.
    let colls = [
        "all-reduce",
        "reduce-scatter",
        "all-gather",
        "broadcast",
        "reduce",
        "gather",
        "scatter",
        "all-to-all",
        "all-to-all-v",
        "gather-v",
        "scatter-v",
    ];
    for coll in colls {
        let (out, stdout, stderr) = run(&[
            "perf",
            coll,
            "--np",
            "3",
            "-b",
            "8",
            "-e",
            "4K",
            "-f",
            "8",
            "-n",
            "2",
            "-w",
            "1",
            "-z",
            "1",
            "-d",
            "float,half,int8,uint64",
            "-o",
            "all",
            "-a",
            "3",
            "--rotate",
            "0",
        ]);
        assert_all_correct(coll, &out, &stdout, &stderr);
        assert!(
            stdout.contains("# Buffers: one set, reused by every call (--rotate 0)"),
            "{coll}\n{stdout}"
        );
    }
    // Another root, async calls, registered buffers (-R 1: moved into the async calls and
    // back; over shared memory they are any buffer).
    for coll in ["broadcast", "reduce", "gather", "scatter"] {
        let (out, stdout, stderr) = run(&[
            "perf",
            coll,
            "-R",
            "1",
            "--np",
            "3",
            "-b",
            "1K",
            "-e",
            "8K",
            "-r",
            "2",
            "-n",
            "1",
            "-w",
            "0",
            "-d",
            "bfloat16,int32",
            "-o",
            "avg",
        ]);
        let rows = assert_all_correct(coll, &out, &stdout, &stderr);
        assert!(rows.iter().all(|r| r[4] == "2"), "{coll}\n{stdout}");
        assert!(stdout.contains("# Buffers registered (-R 1)"), "{stdout}");
    }
}

#[test]
fn json_and_plot_are_written() {
    let json = tmp("rows.json");
    let svg = tmp("busbw.svg");
    let (out, stdout, stderr) = run(&[
        "perf",
        "all_gather",
        "--np",
        "2",
        "-b",
        "64",
        "-e",
        "16K",
        "-n",
        "2",
        "-w",
        "1",
        "-d",
        "float,double",
        "-N",
        "2",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let rows = assert_all_correct("json", &out, &stdout, &stderr);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).expect("valid JSON");
    let jrows = v["rows"].as_array().unwrap();
    assert_eq!(jrows.len(), rows.len());
    assert_eq!(jrows.len(), 2 * 2 * 9);
    assert_eq!(v["meta"]["collective"], "all-gather");
    assert_eq!(v["meta"]["nranks"], 2);
    assert_eq!(v["meta"]["ranks"].as_array().unwrap().len(), 2);
    assert_eq!(v["out_of_bounds"], 0);
    let r0 = &jrows[0];
    assert_eq!(r0["size"], 64);
    assert_eq!(r0["count"], 8);
    assert_eq!(r0["dtype"], "float");
    assert_eq!(r0["out_of_place"]["wrong"], 0);
    assert!(r0["out_of_place"]["busbw"].as_f64().unwrap() >= 0.0);
    assert_eq!(jrows.last().unwrap()["cycle"], 1);
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg"), "{}", &text[..text.len().min(200)]);
    assert!(text.contains("float"), "legend names the runs");
    let _ = std::fs::remove_dir_all(json.parent().unwrap());
}

/// `oxccl perf ARGS` as 2 ranks under `oxccl launch`.
fn launch_perf(args: &[&str]) -> (Output, String, String) {
    let exe = env!("CARGO_BIN_EXE_oxccl");
    let mut all = vec!["launch", "-n", "2", "--no-prefix", "--", exe, "perf"];
    all.extend_from_slice(args);
    run(&all)
}

#[test]
fn runs_as_ranks_under_oxccl_launch() {
    let (out, stdout, stderr) = launch_perf(&["broadcast", "-b", "8", "-e", "1K"]);
    let rows = assert_all_correct("launch", &out, &stdout, &stderr);
    assert_eq!(rows.len(), 8, "{stdout}");
    // Only rank 0 prints: one header.
    assert_eq!(
        stdout.matches("# Out of bounds values").count(),
        1,
        "{stdout}"
    );
    assert_eq!(stdout.matches("#  Rank ").count(), 2, "{stdout}");
    assert!(
        rows.iter().all(|r| r[3] == "none" && r[4] == "0"),
        "{stdout}"
    );
}

/// Registered outputs in processes started by `oxccl launch`, from the tuner's threshold (64
/// KiB of output) up: the mapped all-gather writes into the other process's output (rank 0
/// reports the bytes that landed) and every result checks.
#[test]
fn registered_all_gathers_write_across_processes() {
    let args = "all-gather -R 1 -b 64K -e 4M -f 4 -n 3 -w 1 -d int8,float64";
    let (out, stdout, stderr) = launch_perf(&args.split(' ').collect::<Vec<_>>());
    let rows = assert_all_correct("registered", &out, &stdout, &stderr);
    assert_eq!(rows.len(), 8, "{stdout}");
    let landed: u64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("# Registered buffers: "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no registered-buffer line\n{stdout}"));
    // 1 MiB and 4 MiB of output (half written by the peer), each timed and warmed up 4 times
    // out of place and 4 times in place, in two dtypes: at least that much landed.
    let least = 2 * 8 * ((1u64 << 20) + (4 << 20)) / 2;
    assert!(landed >= least, "{landed} < {least}\n{stdout}");
}

#[test]
fn the_send_thread_runs_between_processes_over_tcp() {
    // Two rank processes over TCP with OXCCL_SOCKET_SEND_THREAD=1: every size checked, and the
    // footer says how many of rank 0's exchanges sent from the thread (messages of 256 KiB and
    // more go there); off, the line is absent.
    for (set, want) in [("1", true), ("0", false)] {
        let out = oxccl()
            .env("OXCCL_SOCKET_SEND_THREAD", set)
            .args([
                "perf",
                "all-reduce",
                "--np",
                "2",
                "--transport",
                "tcp",
                "-b",
                "64K",
                "-e",
                "4M",
                "-f",
                "4",
                "-n",
                "3",
                "-w",
                "1",
            ])
            .output()
            .expect("run oxccl");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let what = format!("OXCCL_SOCKET_SEND_THREAD={set}");
        assert_all_correct(&what, &out, &stdout, &stderr);
        let line = stdout.lines().find(|l| l.starts_with("# Send thread on"));
        if want {
            let n: u64 = line
                .and_then(|l| l.split_whitespace().rev().nth(1))
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{what}: no send-thread line\n{stdout}"));
            assert!(n > 0, "{what}: the send thread never sent\n{stdout}");
        } else {
            assert!(line.is_none(), "{what}\n{stdout}");
        }
    }
}

#[test]
fn bad_flags_fail_clearly() {
    let cases: [(&[&str], &str); 12] = [
        (&["perf", "all-shuffle"], "unknown collective"),
        (
            &["perf", "all-reduce", "-b", "1M", "-e", "1K"],
            "larger than",
        ),
        (
            &["perf", "all-reduce", "-d", "float128"],
            "unknown datatype",
        ),
        (&["perf", "all-reduce", "-o", "xor"], "unknown op"),
        (&["perf", "all-reduce", "-e", "12Q"], "maxbytes"),
        (&["perf", "all-reduce", "--rotate", "lots"], "--rotate"),
        (&["perf", "broadcast", "--np", "2", "-r", "5"], "root"),
        (
            &["perf", "all-reduce", "--transport", "carrier-pigeon"],
            "--transport",
        ),
        (&["perf", "all-reduce", "--device", "tpu"], "--device"),
        (&["perf", "all-to-all-v", "--skew", "2"], "--skew"),
        (&["perf", "all-reduce", "-R", "2"], "--local_register"),
        (&["perf", "barrier"], "cannot measure barrier"),
    ];
    for (args, needle) in cases {
        let (out, stdout, stderr) = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stdout}{stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(stdout.is_empty(), "{args:?}: nothing measured: {stdout}");
    }
    let (out, _, stderr) = run(&["perf", "all-reduce", "-z", "2"]);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
}

#[test]
fn device_buffers_without_a_gpu_fail_clearly() {
    // Built without the feature: refused before any rank starts. Built with it (and no driver
    // here): every rank names the missing driver and the run fails; no panic either way.
    let (out, stdout, stderr) = run(&["perf", "all-reduce", "--np", "2", "--device", "cuda"]);
    #[cfg(feature = "cuda")]
    {
        if oxccl::kernels::cuda::driver_available() {
            return;
        }
        assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
        assert!(stderr.contains("no CUDA driver"), "{stderr}");
    }
    #[cfg(not(feature = "cuda"))]
    {
        assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
        assert!(
            stderr.contains("built without the `cuda` feature"),
            "{stderr}"
        );
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn huge_sweeps_and_rank_counts_are_refused() {
    let (out, stdout, stderr) = run(&["perf", "all-reduce", "-b", "1", "-e", "4G", "-i", "1"]);
    assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
    assert!(
        stderr.contains("-i/--stepbytes") && stderr.contains("10000"),
        "{stderr}"
    );
    let (out, stdout, stderr) = run(&["perf", "all-reduce", "--np", "5000"]);
    assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
    assert!(
        stderr.contains("--np 5000") && stderr.contains("4096"),
        "{stderr}"
    );
}

#[test]
fn np_in_a_slurm_batch_script_starts_the_ranks() {
    // sbatch sets SLURM_PROCID=0 and SLURM_NTASKS, yet srun started no task (no SLURM_STEP_ID):
    // an explicit --np must start its ranks instead of rank 0 waiting for 3 absent peers.
    let out = oxccl()
        .args([
            "perf",
            "all-reduce",
            "--np",
            "2",
            "-b",
            "8",
            "-e",
            "8",
            "-n",
            "1",
            "-w",
            "0",
        ])
        .env("OXCCL_TIMEOUT", "10")
        .env("SLURM_PROCID", "0")
        .env("SLURM_NTASKS", "4")
        .env("SLURM_JOB_ID", "4242")
        .env("SLURM_NODELIST", "localhost")
        .env_remove("SLURM_STEP_ID")
        .env_remove("SLURM_STEPID")
        .output()
        .expect("run oxccl");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let rows = assert_all_correct("sbatch --np 2", &out, &stdout, &stderr);
    assert_eq!(rows.len(), 1, "{stdout}");
    assert!(
        stderr.contains("warning") && stderr.contains("SLURM_PROCID=0"),
        "{stderr}"
    );
}
