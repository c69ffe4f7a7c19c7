//! The `/dev/shm` a communicator takes: 8 ranks under `oxccl launch` in a private mount
//! namespace whose `/dev/shm` is a 64 MiB tmpfs (Docker's default size), the bytes it holds
//! while the communicator lives measured and compared with docs/ENV.md's formula; and a
//! `/dev/shm` too small for the ranks: a clear error naming the bytes, never a `SIGBUS`.
//!
//! These need `unshare -m` and `mount` (root, or a user namespace that allows them): where the
//! namespace cannot be made, each test says so and checks nothing.

use std::process::{Command, Output};

use oxccl::{Communicator, ReduceOp};

use crate::common::{rank_cmd, show};

/// The variable naming this rank program (its value: the size of the test's tmpfs, for the
/// log).
pub const SHM: &str = "OXCCL_TEST_SHM";

/// The rank program: a communicator at the default settings, data through every ring and the
/// staging window, then rank 0 reports the bytes used in `/dev/shm` while every rank's
/// communicator is alive (`SHM used=B`), and every rank `SHM ok rank=R`. A communicator that
/// cannot be created prints `SHM initerr rank=R <error>` and exits with status 3.
pub fn play_rank() {
    let c = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            let rank = std::env::var("RANK").unwrap_or_default();
            println!("SHM initerr rank={rank} {e}");
            std::process::exit(3);
        }
    };
    let (n, me) = (c.size(), c.rank());
    // 4 MiB of all-reduce (the staging window, in pieces), then an all-to-all (every ring).
    let mut v = vec![1.0f32; 1 << 20];
    c.all_reduce(&mut v, ReduceOp::Sum).expect("all-reduce");
    assert!(v.iter().all(|&x| x == n as f32), "all-reduce");
    let count = 100_000;
    let inp: Vec<u32> = (0..count * n)
        .map(|k| (me * 1000 + k / count) as u32)
        .collect();
    let mut out = vec![0u32; count * n];
    c.all_to_all_into(&inp, &mut out).expect("all-to-all");
    assert!(
        out.iter()
            .enumerate()
            .all(|(k, &x)| x as usize == (k / count) * 1000 + me),
        "all-to-all"
    );
    c.barrier().expect("barrier");
    if me == 0 {
        println!("SHM used={}", used_bytes("/dev/shm"));
    }
    c.barrier().expect("barrier");
    println!("SHM ok rank={me}");
}

/// Bytes in use on the file system of `dir` (`stat -f`: blocks minus free blocks).
fn used_bytes(dir: &str) -> u64 {
    let out = Command::new("stat")
        .args(["-f", "-c", "%b %f %S", dir])
        .output()
        .expect("stat -f");
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Vec<u64> = text
        .split_whitespace()
        .map(|w| w.parse().expect("a number from stat"))
        .collect();
    (v[0] - v[1]) * v[2]
}

/// docs/ENV.md's formula: the bytes one rank of `n` on one node takes in `/dev/shm` at the
/// default settings, every rank of the communicator on that node.
fn documented_bytes_per_rank(n: usize) -> u64 {
    let (slot, nslots, ring_budget, direct) = (512u64 << 10, 4u64, 2u64 << 20, 1u64 << 20);
    let peers = n as u64 - 1;
    let fit = (ring_budget / (peers * nslots)) / 4096 * 4096;
    let s = slot.min(fit.max(4096));
    let ring = 3 * 128 + (nslots * 32).next_multiple_of(128) + nslots * s;
    let bytes = 512 + peers * ring + 2 * direct;
    bytes.next_multiple_of(4096)
}

/// `oxccl launch -n n --keep-going` (every rank runs to its end) of this binary's
/// [`play_rank`] in a private mount namespace whose `/dev/shm` is a fresh tmpfs of `size`
/// (`mount`'s syntax), or `None` where no such namespace can be made here.
fn launch_in_small_shm(n: usize, size: &str) -> Option<Output> {
    let probe = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg(format!("mount -t tmpfs -o size={size} oxccl-test /dev/shm"))
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        eprintln!("skipped: this machine cannot make a mount namespace (unshare -m + mount)");
        return None;
    }
    let script = format!("mount -t tmpfs -o size={size} oxccl-test /dev/shm && exec \"$@\"");
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", &script, "sh"])
        .arg(env!("CARGO_BIN_EXE_oxccl"))
        .args([
            "launch",
            "-n",
            &n.to_string(),
            "--timeout",
            "120",
            "--keep-going",
        ])
        .arg("--")
        .args(rank_cmd())
        .env(SHM, size)
        .env("OXCCL_TIMEOUT", "20")
        .env_remove("OXCCL_DEBUG")
        .env_remove("OXCCL_TRANSPORT")
        .output()
        .expect("running unshare");
    Some(out)
}

#[test]
fn eight_ranks_fit_dockers_64_mib_dev_shm_as_documented() {
    let Some(out) = launch_in_small_shm(8, "64m") else {
        return;
    };
    let all = show(&out);
    assert!(out.status.success(), "{all}");
    for r in 0..8 {
        assert!(all.contains(&format!("SHM ok rank={r}")), "rank {r}: {all}");
    }
    let used: u64 = all
        .lines()
        .find_map(|l| l.split_once("SHM used=").map(|(_, v)| v))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no SHM used line: {all}"));
    let want = 8 * documented_bytes_per_rank(8);
    assert_eq!(used, want, "measured against docs/ENV.md's formula");
    assert!(
        used <= 32 << 20,
        "{used} bytes for 8 ranks: more than 32 MiB"
    );
}

#[test]
fn a_dev_shm_too_small_is_an_error_naming_the_bytes_on_every_rank() {
    // 16 MiB holds 4 of the 8 ranks' segments: those that find no room say so, naming the
    // bytes; the others fail with that cause too (not a time-out), within a few seconds.
    let t0 = std::time::Instant::now();
    let Some(out) = launch_in_small_shm(8, "16m") else {
        return;
    };
    let all = show(&out);
    assert!(!out.status.success(), "{all}");
    let too_small = |l: &&str| l.contains("/dev/shm is too small") && l.contains("bytes are free");
    for r in 0..8 {
        let line = all
            .lines()
            .find(|l| l.contains(&format!("SHM initerr rank={r} ")))
            .unwrap_or_else(|| panic!("rank {r} has no error: {all}"));
        assert!(too_small(&line), "rank {r}: {all}");
    }
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(15),
        "took {:?}, a wait ran to its time-out: {all}",
        t0.elapsed()
    );
    assert!(!all.contains("SIGBUS") && !all.contains("signal"), "{all}");
}
