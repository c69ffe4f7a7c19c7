//! `oxccl perf`'s command line: nccl-tests' flags plus `--np`, `--transport`, `--algo`,
//! `--json`, `--plot`, `--rotate`, `--device`, `--skew`, `--bind` and `-R`.

use std::path::PathBuf;

use clap::Args;

use crate::launch::Bind;

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
    /// by 1 on even ranks, 2 on odd ones, before the sum), or all (ignored by collectives
    /// without an op).
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

    /// 1: the host buffers are registered (`Registered`, NCCL's `ncclCommRegister`, as
    /// nccl-tests' -R 1): over RDMA, large messages leave straight from them and land straight
    /// in them; other transports use them as any buffer. Host buffers only.
    #[arg(short = 'R', long = "local_register", visible_alias = "local-register",
          value_name = "0/1", default_value_t = 0,
          value_parser = clap::value_parser!(u8).range(0..=1))]
    pub local_register: u8,

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

    /// Transport for the ranks (sets OXCCL_TRANSPORT): auto, tcp, shm or rdma (shared memory
    /// inside a node, RDMA verbs between nodes: needs a build with the feature `rdma` and a
    /// verbs device on every node, else an error naming what is missing).
    #[arg(long, value_name = "auto|tcp|shm|rdma")]
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
