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
use oxccl_comm::bootstrap::{detect, Launcher};
use oxccl_comm::{Collective, DType, ReduceOp};

use crate::launch::{launch, Bind, JobEnd, LaunchConfig, MAX_NPROC_PER_NODE};

use bench::Average;
use sweep::{parse_size, step_from, Step};

/// Arguments of `oxccl perf` (nccl-tests' flags plus `--np`, `--transport`, `--algo`,
/// `--json`, `--plot`).
#[derive(Debug, Clone, Args)]
pub struct PerfArgs {
    /// Collective: all-reduce, reduce-scatter, all-gather, broadcast, reduce, gather, scatter,
    /// all-to-all, send-recv, all-to-all-v, all-gather-v, reduce-scatter-v, gather-v,
    /// scatter-v (nccl-tests names such as all_reduce or allreduce work too).
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

    /// Reduction: sum, prod, min, max, avg, premul_sum (also mulsum: rank r multiplies its input
    /// by 1 on even ranks, 2 on odd ones, before the sum), or all (premul_sum not included with
    /// --device cuda; ignored by collectives without an op).
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

    /// 1: blocking calls; 0: async calls waited every iteration (every collective but
    /// send-recv; in place and out of place).
    #[arg(short = 'z', long = "blocking", value_name = "0/1", default_value_t = 0,
          value_parser = clap::value_parser!(u8).range(0..=1))]
    pub blocking: u8,

    /// Time reported: 0 rank 0's, 1 mean over ranks, 2 minimum, 3 maximum.
    #[arg(short = 'a', long = "average", value_name = "0-3", default_value_t = 1,
          value_parser = clap::value_parser!(u8).range(0..=3))]
    pub average: u8,

    /// Start this many local ranks, 1 to 4096 [default: available cores, 2 to 8]. Under a
    /// launcher (oxccl launch, torchrun, srun, mpirun) every process is one rank and --np is not
    /// needed; an --np equal to the launcher's world size is accepted. An --np that differs from
    /// it, or given in a Slurm batch script (SLURM_PROCID set but no SLURM_STEP_ID: not a task
    /// started by srun), wins like torchrun's --nproc-per-node: this process starts --np local
    /// ranks itself and ignores the launcher's variables, with a warning naming them.
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

    /// all-to-all-v: how uneven the blocks are, from 0 (all equal, as all-to-all) to 1: the
    /// block a rank sends the rank k places after it holds `per x (1 + F x (1 - 2k/(n-1)))`
    /// elements, rounded in pairs so every rank still sends and receives `size` bytes
    /// (`per = size / n` elements). all-gather-v, reduce-scatter-v, gather-v and scatter-v:
    /// rank k's shard has that many elements (the full buffer stays `size` bytes).
    #[arg(long, value_name = "F", default_value_t = 0.5)]
    pub skew: f64,

    /// With --np: bind rank i to the i-th CPU (core, as mpirun does by default), to the i-th
    /// block of CPUs / np CPUs (block), or not (none) [default: block when the ranks have two
    /// CPUs each or more, core when they have one each, else none]; ignored under a launcher.
    #[arg(long, value_name = "none|core|block")]
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
    /// `--skew` (the `-v` collectives).
    pub skew: f64,
}

/// What `-o all` runs: every operation, `premul_sum` with the factors of
/// [`data::premul_factor`].
const PERF_OPS: [ReduceOp; 6] = [
    ReduceOp::Sum,
    ReduceOp::Prod,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Avg,
    ReduceOp::premul_sum(1.0),
];

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
            &PERF_OPS,
            "op",
            "sum, prod, min, max, avg, premul_sum",
            |s| s.parse().ok(),
        )?;
        let ops = if coll.reduces() {
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
        let uneven = [
            Collective::AllToAllV,
            Collective::AllGatherV,
            Collective::ReduceScatterV,
            Collective::GatherV,
            Collective::ScatterV,
        ];
        if uneven.contains(&coll) && cuda {
            return Err(format!(
                "oxccl perf {coll} runs on host buffers only (--device host)"
            ));
        }
        // Over CUDA IPC (the default on one node) a premul_sum is refused: `-o all` leaves it
        // out on device buffers, `-o premul_sum` still asks for it (staged with
        // OXCCL_CUDA_IPC=0).
        let mut ops = ops;
        if cuda && a.op.trim().eq_ignore_ascii_case("all") {
            ops.retain(|o| o.and_then(ReduceOp::factor).is_none());
        }
        if !(0.0..=1.0).contains(&a.skew) {
            return Err(format!("--skew {}: expected 0 to 1", a.skew));
        }
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
            skew: a.skew,
        })
    }

    /// Checks what depends on the rank count.
    ///
    /// # Errors
    /// A root outside the ranks, or send-recv on one rank.
    pub fn check_ranks(&self, root: usize, n: usize) -> Result<(), String> {
        if self.coll.has_root() && root >= n {
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

/// The rank variables of the launchers `oxccl perf` runs under.
const RANK_VARS: [&str; 4] = ["OXCCL_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"];

/// The launchers' rank and world-size variables, as named in warnings.
const LAUNCHER_VARS: [&str; 8] = [
    "OXCCL_RANK",
    "OXCCL_WORLD_SIZE",
    "RANK",
    "WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
];

/// How this process takes part in the run.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Role {
    /// One rank of a job a launcher started; `warning`: why the job may never assemble.
    Rank { warning: Option<String> },
    /// The parent that starts `--np` local ranks; `ignored`: the launcher variables an explicit
    /// `--np` overrides, and why.
    Parent { ignored: Option<String> },
}

type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Decides the [`Role`] from `--np` and the environment (`get`).
///
/// Without launcher variables this process is the parent. With them and no `--np`, it is a
/// rank. With them and an explicit `--np`, it is a rank only when the launcher's world size is
/// `--np` and the launcher really started it as a rank; otherwise `--np` wins (as torchrun's
/// `--nproc-per-node` does): the launcher's variables are ignored, with a warning.
fn role(np: Option<usize>, get: Lookup<'_>) -> Role {
    let set = |k: &str| get(k).filter(|v| !v.trim().is_empty());
    if !RANK_VARS.iter().any(|k| set(k).is_some()) {
        return Role::Parent { ignored: None };
    }
    let found: Vec<String> = LAUNCHER_VARS
        .iter()
        .filter_map(|k| set(k).map(|v| format!("{k}={v}")))
        .collect();
    let found = found.join(", ");
    let info = detect(get);
    let batch = info
        .as_ref()
        .is_ok_and(|i| slurm_batch_script(get, &i.launcher));
    let Some(np) = np else {
        let warning = match (&info, batch) {
            (Ok(i), true) if i.world_size > 1 => Some(format!(
                "{found} are set but SLURM_STEP_ID is not: this looks like a Slurm batch script, \
                 not a task started by srun, so rank {} may wait (up to OXCCL_TIMEOUT) for {} \
                 peers that never start; start the ranks with srun, or give --np N to start N \
                 local ranks here",
                i.rank,
                i.world_size - 1
            )),
            _ => None,
        };
        return Role::Rank { warning };
    };
    let why = match &info {
        Ok(_) if batch => "SLURM_STEP_ID is not set, so this is a Slurm batch script, not a \
                           task started by srun"
            .to_owned(),
        Ok(i) if i.world_size == np => return Role::Rank { warning: None },
        Ok(i) => format!(
            "they describe a job of {} ranks, not {np} (to run as one of those ranks, leave out \
             --np)",
            i.world_size
        ),
        Err(e) => format!("they do not describe a whole job ({e})"),
    };
    Role::Parent {
        ignored: Some(format!(
            "--np {np} was given but launcher variables are set ({found}); {why}: starting {np} \
             local ranks here and ignoring them"
        )),
    }
}

/// Whether the Slurm variables come from a batch script (`sbatch`), where `SLURM_PROCID` is 0
/// and `SLURM_NTASKS` the allocation's task count although srun started no task: srun sets
/// `SLURM_STEP_ID` in every task it starts.
fn slurm_batch_script(get: Lookup<'_>, launcher: &Launcher) -> bool {
    let set = |k: &str| get(k).is_some_and(|v| !v.trim().is_empty());
    *launcher == Launcher::Slurm && !set("SLURM_STEP_ID") && !set("SLURM_STEPID")
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
        .unwrap_or_else(|| default_bind(np, oxccl_comm::affinity::allowed_cpus().len()));
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

    fn role_in(np: Option<usize>, vars: &[(&str, &str)]) -> Role {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        role(np, &|k| {
            vars.iter()
                .find(|(name, _)| name == k)
                .map(|(_, v)| v.clone())
        })
    }

    const SBATCH: [(&str, &str); 4] = [
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_JOB_ID", "77"),
        ("SLURM_NODELIST", "node1"),
    ];

    fn ignored(r: &Role) -> &str {
        match r {
            Role::Parent { ignored: Some(w) } => w,
            other => panic!("expected a parent overriding the launcher, got {other:?}"),
        }
    }

    /// `-o all` on device buffers leaves premul_sum out (refused over CUDA IPC); `-o premul_sum`
    /// keeps it, and host buffers keep it in `all`.
    #[cfg(feature = "cuda")]
    #[test]
    fn device_all_ops_leave_premul_sum_out() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            perf: PerfArgs,
        }
        let ops = |args: &[&str]| {
            let cli = Cli::try_parse_from(["perf", "all-reduce"].iter().chain(args)).unwrap();
            Plan::from_args(&cli.perf).unwrap().ops
        };
        let premul = Some(ReduceOp::premul_sum(1.0));
        let device = ops(&["--device", "cuda", "-o", "all"]);
        assert_eq!(device.len(), 5);
        assert!(!device.contains(&premul), "{device:?}");
        assert_eq!(ops(&["--device", "cuda", "-o", "premul_sum"]), vec![premul]);
        assert!(ops(&["-o", "all"]).contains(&premul));
    }

    #[test]
    fn no_launcher_makes_a_parent() {
        assert_eq!(role_in(None, &[]), Role::Parent { ignored: None });
        assert_eq!(role_in(Some(4), &[]), Role::Parent { ignored: None });
        assert_eq!(
            role_in(Some(4), &[("RANK", " ")]),
            Role::Parent { ignored: None }
        );
    }

    #[test]
    fn an_explicit_np_in_a_batch_script_starts_the_ranks() {
        // sbatch: SLURM_PROCID=0 and SLURM_NTASKS are set, but srun started nothing.
        for np in [2, 4] {
            let r = role_in(Some(np), &SBATCH);
            let w = ignored(&r);
            assert!(
                w.contains("SLURM_PROCID=0") && w.contains("SLURM_NTASKS=4"),
                "{w}"
            );
            assert!(
                w.contains("batch script") && w.contains(&format!("--np {np}")),
                "{w}"
            );
        }
        // Without --np it stays a rank, but says why it may wait for peers.
        match role_in(None, &SBATCH) {
            Role::Rank { warning: Some(w) } => {
                assert!(w.contains("SLURM_STEP_ID") && w.contains("srun"), "{w}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_np_that_matches_the_launcher_is_a_rank() {
        let mut srun = SBATCH.to_vec();
        srun.push(("SLURM_STEP_ID", "0"));
        assert_eq!(role_in(Some(4), &srun), Role::Rank { warning: None });
        assert_eq!(role_in(None, &srun), Role::Rank { warning: None });
        let oxccl = [
            ("OXCCL_RANK", "1"),
            ("OXCCL_WORLD_SIZE", "2"),
            ("OXCCL_STORE", "127.0.0.1:5"),
        ];
        assert_eq!(role_in(Some(2), &oxccl), Role::Rank { warning: None });
        // The ranks a parent started in a batch script: oxccl's variables come first.
        let mut child = SBATCH.to_vec();
        child.extend([
            ("OXCCL_RANK", "1"),
            ("OXCCL_WORLD_SIZE", "2"),
            ("OXCCL_STORE", "127.0.0.1:5"),
        ]);
        assert_eq!(role_in(Some(2), &child), Role::Rank { warning: None });
    }

    #[test]
    fn an_np_that_contradicts_the_launcher_wins_with_a_warning() {
        let mut srun = SBATCH.to_vec();
        srun.push(("SLURM_STEP_ID", "0"));
        let w = ignored(&role_in(Some(2), &srun)).to_owned();
        assert!(w.contains("job of 4 ranks, not 2"), "{w}");
        let torch = [("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "h")];
        let r = role_in(
            Some(3),
            &[torch[0], torch[1], torch[2], ("MASTER_PORT", "9")],
        );
        assert!(ignored(&r).contains("RANK=0, WORLD_SIZE=1"), "{r:?}");
        // RANK without WORLD_SIZE is no whole job.
        let r = role_in(Some(2), &[("RANK", "0")]);
        assert!(ignored(&r).contains("do not describe a whole job"), "{r:?}");
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
