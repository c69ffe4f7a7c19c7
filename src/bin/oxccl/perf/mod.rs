//! `oxccl perf`: oxccl's nccl-tests. Sweeps message sizes for one collective and prints
//! nccl-tests' table (size, count, type, redop, root, then time / algbw / busbw / #wrong out of
//! place and in place), with the same size conventions and bus-bandwidth factors.
//!
//! ```text
//! oxccl perf all-reduce --np 4 -b 8 -e 64M -f 2          # starts 4 local ranks itself
//! oxccl launch -n 4 -- oxccl perf all_reduce -d all       # one process per rank (also mpirun, srun)
//! oxccl perf reduce-scatter -c 1 -d all -o all --json out.json --plot out.svg
//! ```
//!
//! Without a launcher in the environment (`OXCCL_RANK`, `RANK`, `SLURM_PROCID`,
//! `OMPI_COMM_WORLD_RANK` all unset) the process is a parent: it re-executes its own binary with
//! the same arguments on `--np` ranks through [`crate::launch::launch`] and exits with the job's
//! exit code. Each rank builds `Communicator::from_env()`; rank 0 prints. An explicit `--np` also
//! makes a parent, with a warning naming the launcher variables it ignores, when it differs from
//! the launcher's world size or the variables come from a Slurm batch script (`SLURM_PROCID`
//! without `SLURM_STEP_ID`); `--np` is 1 to [`MAX_NPROC_PER_NODE`].
//!
//! Modules: `args` (the command line), `plan` (the checked flags), `role` (rank or parent),
//! `sweep` (sizes, geometry, busbw factors), `format` (the text table), `data` (exact check
//! patterns), `bench` (buffers, calls, timing), `device` (CUDA buffers), `rank` (the rank side),
//! `progress` (the terminal progress line), `report` (JSON and SVG).

mod args;
mod bench;
mod data;
#[cfg(feature = "cuda")]
mod device;
mod format;
mod plan;
mod progress;
mod rank;
mod report;
mod role;
mod sweep;

use std::ffi::OsString;
use std::io::{IsTerminal, Write};

use crate::launch::{launch, Bind, JobEnd, LaunchConfig, MAX_NPROC_PER_NODE};

pub use args::PerfArgs;
use plan::Plan;
use role::{role, Role};

/// Writes one `oxccl perf: ...` line to stderr (never panics on a closed stderr).
fn note(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "oxccl perf: {msg}");
}

/// Checks an explicit `--np`.
fn check_np(np: Option<usize>) -> Result<(), String> {
    match np {
        Some(0) => Err("--np must be at least 1".into()),
        Some(n) if n > MAX_NPROC_PER_NODE => Err(format!(
            "--np {n} is too large: at most {MAX_NPROC_PER_NODE} local ranks are supported"
        )),
        _ => Ok(()),
    }
}

/// The default `--np`: the available cores, at least 2 and at most 8.
pub fn default_np() -> usize {
    std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(2, 8)
}

/// Runs `oxccl perf` and returns the process exit code: 0 success, 1 a failed check or an
/// error on a rank, 2 bad arguments, else the launcher's code.
pub fn run(args: PerfArgs) -> u8 {
    let plan = match Plan::from_args(&args).and_then(|p| check_np(args.np).map(|()| p)) {
        Ok(p) => p,
        Err(e) => {
            note(&format!("error: {e}"));
            return 2;
        }
    };
    match role(args.np, &|k| std::env::var(k).ok()) {
        Role::Rank { warning } => {
            if let Some(w) = warning {
                note(&format!("warning: {w}"));
            }
            rank::rank_main(&args, &plan)
        }
        Role::Parent { ignored } => {
            if let Some(w) = &ignored {
                note(&format!("warning: {w}"));
            }
            parent(&args, &plan, ignored.is_some())
        }
    }
}

/// The `--np` parent: re-executes this binary on `np` local ranks and waits for the job.
/// `overriding`: launcher variables are present and ignored.
fn parent(args: &PerfArgs, plan: &Plan, overriding: bool) -> u8 {
    let np = args.np.unwrap_or_else(default_np);
    if let Err(e) = plan.check_ranks(args.root, np) {
        note(&format!("error: {e}"));
        return 2;
    }
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            note(&format!(
                "error: cannot find this program to start the ranks: {e}"
            ));
            return 1;
        }
    };
    let argv: Vec<OsString> = std::env::args_os().skip(1).collect();
    let mut cfg = LaunchConfig::new(np, exe, argv);
    cfg.prefix_output = false;
    if overriding {
        // Not the launcher's OXCCL_JOB_ID: other processes of that job may do the same, and
        // their ranks must not share shared-memory segment names with ours.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        cfg.job_id = Some(format!("perf-{}-{nanos}", std::process::id()));
    }
    cfg.bind = args
        .bind
        .unwrap_or_else(|| default_bind(np, oxccl_comm::internal::affinity::allowed_cpus().len()));
    cfg.forward_signals = true;
    if let Some(t) = &args.transport {
        cfg.env
            .push(("OXCCL_TRANSPORT".into(), t.to_ascii_lowercase().into()));
    }
    if let Some(a) = &args.algo {
        cfg.env.push(("OXCCL_ALGO".into(), a.into()));
    }
    if std::io::stderr().is_terminal() {
        cfg.env.push((progress::PROGRESS_ENV.into(), "1".into()));
    }
    match launch(&cfg) {
        Ok(outcome) => {
            let code = outcome.exit_code();
            match &outcome.end {
                // The launcher has already reported the failed rank.
                JobEnd::Success | JobEnd::RankFailed(_) | JobEnd::NodeFailed(_) => {}
                JobEnd::Interrupted { .. } => {
                    note(&format!("interrupted; exiting with code {code}"))
                }
                JobEnd::TimedOut { .. } => note(&format!("timed out; exiting with code {code}")),
            }
            u8::try_from(code).unwrap_or(1)
        }
        Err(e) => {
            note(&format!("error: cannot start the ranks: {e}"));
            u8::try_from(e.exit_code()).unwrap_or(1)
        }
    }
}

/// `oxccl perf --np`'s binding when `--bind` is not given, for `np` ranks on `cpus` allowed CPUs:
/// a block of CPUs per rank where each gets two or more, so that the threads a rank runs beside
/// its own (the progress thread of async and staged device operations, the threads of TCP
/// channels and the send thread) have CPUs of their own; one CPU each where there is one per rank
/// (two unbound ranks may otherwise share a core for a whole run); else none. On the lent
/// 16-core H100 machine, with a core each, staged device calls whose streams waited on the GPU
/// ran at one per scheduler tick (0.6-0.8 ms at 8 B, against 24 us with blocks), and 2 ranks
/// with 4 TCP channels used about 2 CPUs' worth of the wall time, as with 1.
fn default_bind(np: usize, cpus: usize) -> Bind {
    if np >= 1 && cpus >= 2 * np {
        Bind::Block
    } else if np <= cpus {
        Bind::Core
    } else {
        Bind::None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_get_a_block_of_cpus_where_there_are_two_each() {
        assert!(matches!(default_bind(2, 16), Bind::Block));
        assert!(matches!(default_bind(8, 16), Bind::Block));
        assert!(matches!(default_bind(2, 2), Bind::Core));
        assert!(matches!(default_bind(3, 5), Bind::Core));
        assert!(matches!(default_bind(4, 2), Bind::None));
        assert!(matches!(default_bind(2, 0), Bind::None));
    }

    #[test]
    fn np_must_be_in_range() {
        assert!(check_np(None).is_ok());
        assert!(check_np(Some(1)).is_ok());
        assert!(check_np(Some(MAX_NPROC_PER_NODE)).is_ok());
        assert!(check_np(Some(0)).unwrap_err().contains("--np"));
        let e = check_np(Some(MAX_NPROC_PER_NODE + 1)).unwrap_err();
        assert!(e.contains("--np") && e.contains("4096"), "{e}");
    }
}
