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
//! exit code. Each rank builds `Communicator::from_env()`; rank 0 prints.
//!
//! Modules: `sweep` (sizes, geometry, busbw factors), `format` (the text table), `data`
//! (exact check patterns), `bench` (buffers, calls, timing), `rank` (the rank side),
//! `progress` (the terminal progress line), `report` (JSON and SVG).

mod bench;
mod data;
#[cfg(feature = "cuda")]
mod device;
mod format;
mod progress;
mod rank;
mod report;
mod sweep;

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use clap::Args;
use oxccl_comm::{Collective, DType, ReduceOp};

use crate::launch::{launch, Bind, JobEnd, LaunchConfig};

pub use format::{Measure, Row};
pub use sweep::{busbw_factor, geometry, parse_size, step_from, sweep, Geometry, Step};

pub use bench::Average;

/// Arguments of `oxccl perf` (nccl-tests' flags plus `--np`, `--transport`, `--algo`,
/// `--json`, `--plot`).
#[derive(Debug, Clone, Args)]
pub struct PerfArgs {
    /// Collective: all-reduce, reduce-scatter, all-gather, broadcast, reduce, gather, scatter,
    /// all-to-all, send-recv (nccl-tests names such as all_reduce or allreduce work too).
    #[arg(value_name = "COLLECTIVE")]
    pub collective: String,

    /// Smallest size in bytes (K/M/G suffixes).
    #[arg(
        short = 'b',
        long = "minbytes",
        value_name = "BYTES",
        default_value = "8"
    )]
    pub minbytes: String,

    /// Largest size in bytes (K/M/G suffixes).
    #[arg(
        short = 'e',
        long = "maxbytes",
        value_name = "BYTES",
        default_value = "64M"
    )]
    pub maxbytes: String,

    /// Multiply the size by this factor at each step [default: 2].
    #[arg(short = 'f', long = "stepfactor", value_name = "F")]
    pub stepfactor: Option<u64>,

    /// Add this many bytes at each step (used when -f is not given, or is 1).
    #[arg(short = 'i', long = "stepbytes", value_name = "BYTES")]
    pub stepbytes: Option<String>,

    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", value_name = "N", default_value_t = 20)]
    pub iters: u32,

    /// Untimed warm-up iterations per size.
    #[arg(
        short = 'w',
        long = "warmup_iters",
        visible_alias = "warmup-iters",
        value_name = "N",
        default_value_t = 5
    )]
    pub warmup_iters: u32,

    /// Run the whole sweep this many times (0: until interrupted).
    #[arg(
        short = 'N',
        long = "run_cycles",
        visible_alias = "run-cycles",
        value_name = "N",
        default_value_t = 1
    )]
    pub run_cycles: u32,

    /// Check results (0: off, 1: one checked call per size and placement).
    #[arg(short = 'c', long = "check", value_name = "0/1", default_value_t = 1)]
    pub check: u32,

    /// Reduction: sum, prod, min, max, avg, or all (ignored by collectives without one).
    #[arg(short = 'o', long = "op", value_name = "OP", default_value = "sum")]
    pub op: String,

    /// Data type: float, double, half, bfloat16, int8, uint8, int32, uint32, int64, uint64,
    /// f8e4m3, f8e5m2 (or f32, bf16, ...; a comma list), or all.
    #[arg(
        short = 'd',
        long = "datatype",
        value_name = "TYPE",
        default_value = "float"
    )]
    pub datatype: String,

    /// Root rank of broadcast, reduce, gather, scatter.
    #[arg(short = 'r', long = "root", value_name = "RANK", default_value_t = 0)]
    pub root: usize,

    /// 1: blocking calls; 0: async calls waited every iteration where oxccl has them
    /// (all-reduce, reduce-scatter, all-gather, broadcast).
    #[arg(short = 'z', long = "blocking", value_name = "0/1", default_value_t = 0,
          value_parser = clap::value_parser!(u8).range(0..=1))]
    pub blocking: u8,

    /// Time reported: 0 rank 0's, 1 mean over ranks, 2 minimum, 3 maximum.
    #[arg(short = 'a', long = "average", value_name = "0-3", default_value_t = 1,
          value_parser = clap::value_parser!(u8).range(0..=3))]
    pub average: u8,

    /// Start this many local ranks [default: available cores, 2 to 8]; ignored under a
    /// launcher (oxccl launch, torchrun, srun, mpirun).
    #[arg(long = "np", value_name = "N")]
    pub np: Option<usize>,

    /// Transport for the ranks (sets OXCCL_TRANSPORT): auto, tcp or shm.
    #[arg(long, value_name = "auto|tcp|shm")]
    pub transport: Option<String>,

    /// Algorithm override for the ranks (sets OXCCL_ALGO).
    #[arg(long, value_name = "SPEC")]
    pub algo: Option<String>,

    /// Rank 0 writes every row and the run's metadata to this JSON file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,

    /// Rank 0 draws busbw against size (SVG).
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,

    /// Rotate buffer sets until their inputs and outputs cover this many bytes (K/M/G
    /// suffixes; 2 to 64 sets), so caches do not flatter small sizes; 0: one set, reused by
    /// every call, as nccl-tests and the OpenMPI peer bench do [default: 64M].
    #[arg(long = "rotate", value_name = "BYTES")]
    pub rotate: Option<String>,

    /// Where the buffers live: host memory, or CUDA device memory (`cuda`: needs a build with
    /// `--features cuda`; rank i uses GPU `local_rank % device count`, calls are enqueued on a
    /// stream of its own and each timing ends at a stream synchronize).
    #[arg(long, value_name = "host|cuda", default_value = "host")]
    pub device: String,

    /// With --np: bind rank i to the i-th CPU (core, as mpirun does by default) or not (none)
    /// [default: core when the ranks have a CPU each, else none]; ignored under a launcher.
    #[arg(long, value_name = "none|core")]
    pub bind: Option<Bind>,
}

/// The validated run.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The collective.
    pub coll: Collective,
    /// `-b`, `-e`.
    pub min: u64,
    /// Largest size.
    pub max: u64,
    /// The step.
    pub step: Step,
    /// Every nominal size.
    pub sizes: Vec<u64>,
    /// Data types, in order.
    pub dtypes: Vec<DType>,
    /// Reductions (`[None]` for collectives without one).
    pub ops: Vec<Option<ReduceOp>>,
    /// Time combination over ranks.
    pub average: Average,
    /// `--rotate`: bytes of input + output the buffer sets of a size cover (0: one set).
    pub rotate_bytes: usize,
    /// `--device cuda`: buffers in GPU memory.
    pub cuda: bool,
}

fn parse_list<T>(
    s: &str,
    all: &[T],
    what: &str,
    names: &str,
    p: impl Fn(&str) -> Option<T>,
) -> Result<Vec<T>, String>
where
    T: Copy + PartialEq,
{
    if s.trim().eq_ignore_ascii_case("all") {
        return Ok(all.to_vec());
    }
    let mut out = Vec::new();
    for part in s.split(',') {
        let v = p(part)
            .ok_or_else(|| format!("unknown {what} {:?}; expected {names} or all", part.trim()))?;
        if !out.contains(&v) {
            out.push(v);
        }
    }
    Ok(out)
}

impl Plan {
    /// Checks every flag (without a communicator).
    ///
    /// # Errors
    /// A message for the first bad flag.
    pub fn from_args(a: &PerfArgs) -> Result<Plan, String> {
        let coll = Collective::parse(&a.collective).map_err(|e| e.to_string())?;
        if !sweep::supported(coll) {
            return Err(format!("oxccl perf cannot measure {coll}"));
        }
        let min = parse_size(&a.minbytes).map_err(|e| format!("-b/--minbytes: {e}"))?;
        let max = parse_size(&a.maxbytes).map_err(|e| format!("-e/--maxbytes: {e}"))?;
        let stepbytes = match &a.stepbytes {
            Some(s) => Some(parse_size(s).map_err(|e| format!("-i/--stepbytes: {e}"))?),
            None => None,
        };
        let step = step_from(a.stepfactor, stepbytes)?;
        let rotate_bytes = match &a.rotate {
            None => bench::ROTATE_BYTES,
            Some(r) => {
                let v = parse_size(r).map_err(|e| format!("--rotate: {e}"))?;
                usize::try_from(v).map_err(|_| format!("--rotate {r}: too large"))?
            }
        };
        let sizes = sweep::sweep(min, max, step)?;
        if a.iters == 0 {
            return Err("-n/--iters must be at least 1".into());
        }
        let dtypes = parse_list(
            &a.datatype,
            &DType::ALL,
            "datatype",
            "float, double, half, bfloat16, int8, uint8, int32, uint32, int64, uint64, f8e4m3, \
             f8e5m2",
            |s| s.parse().ok(),
        )?;
        let ops = parse_list(
            &a.op,
            &ReduceOp::ALL,
            "op",
            "sum, prod, min, max, avg",
            |s| s.parse().ok(),
        )?;
        let ops = if sweep::has_op(coll) {
            ops.into_iter().map(Some).collect()
        } else {
            vec![None]
        };
        if let Some(t) = &a.transport {
            if !matches!(t.to_ascii_lowercase().as_str(), "auto" | "tcp" | "shm") {
                return Err(format!("--transport {t:?}: expected auto, tcp or shm"));
            }
        }
        if let Some(spec) = &a.algo {
            oxccl_comm::tuning::AlgoOverride::parse(spec).map_err(|e| format!("--algo: {e}"))?;
        }
        let cuda = match a.device.trim().to_ascii_lowercase().as_str() {
            "host" | "cpu" => false,
            "cuda" | "gpu" if cfg!(feature = "cuda") => true,
            "cuda" | "gpu" => {
                return Err(
                    "--device cuda: this oxccl was built without the `cuda` feature \
                            (cargo build --release --features cuda)"
                        .into(),
                )
            }
            d => return Err(format!("--device {d:?}: expected host or cuda")),
        };
        let average = match a.average {
            0 => Average::Rank0,
            2 => Average::Min,
            3 => Average::Max,
            _ => Average::Mean,
        };
        Ok(Plan {
            coll,
            min,
            max,
            step,
            sizes,
            dtypes,
            ops,
            average,
            rotate_bytes,
            cuda,
        })
    }

    /// Checks what depends on the rank count.
    ///
    /// # Errors
    /// A root outside the ranks, or send-recv on one rank.
    pub fn check_ranks(&self, root: usize, n: usize) -> Result<(), String> {
        if sweep::has_root(self.coll) && root >= n {
            return Err(format!(
                "-r/--root {root} is not a rank (there are {n} ranks)"
            ));
        }
        if self.coll == Collective::SendRecv && n < 2 {
            return Err("send-recv needs at least 2 ranks".into());
        }
        Ok(())
    }
}

/// Writes one `oxccl perf: ...` line to stderr (never panics on a closed stderr).
fn note(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "oxccl perf: {msg}");
}

/// Whether a launcher started this process as one rank of a job.
pub fn under_launcher() -> bool {
    ["OXCCL_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"]
        .iter()
        .any(|k| std::env::var_os(k).is_some_and(|v| !v.is_empty()))
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
    let plan = match Plan::from_args(&args) {
        Ok(p) => p,
        Err(e) => {
            note(&format!("error: {e}"));
            return 2;
        }
    };
    if under_launcher() {
        rank::rank_main(&args, &plan)
    } else {
        parent(&args, &plan)
    }
}

/// The `--np` parent: re-executes this binary on `np` local ranks and waits for the job.
fn parent(args: &PerfArgs, plan: &Plan) -> u8 {
    let np = args.np.unwrap_or_else(default_np);
    if np == 0 {
        note("error: --np must be at least 1");
        return 2;
    }
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
    cfg.bind = args.bind.unwrap_or_else(|| {
        if np <= oxccl_comm::affinity::allowed_cpus().len() {
            Bind::Core
        } else {
            Bind::None
        }
    });
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
                JobEnd::Success | JobEnd::RankFailed(_) => {}
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
