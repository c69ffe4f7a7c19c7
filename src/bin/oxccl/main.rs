//! `oxccl`: the oxccl command-line tool.
//!
//! ```text
//! oxccl launch -n 4 -- python train.py --lr 3e-4
//! oxccl launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 -n 8 -- ./train
//! ```
//!
//! See [`launch`](mod@launch) for the environment every rank gets and the exit-code contract,
//! [`perf`] for `oxccl perf`, [`trace`] for `oxccl trace` and [`pipeline`] for `oxccl pipeline`;
//! `oxccl topo` is in this file.

mod launch;
mod perf;
mod pipeline;
mod trace;

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use launch::{launch, Bind, JobEnd, LaunchConfig};

/// oxccl: collective communication for Rust trainers.
#[derive(Debug, Parser)]
#[command(name = "oxccl", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Start the ranks of a job on this node and supervise them (like torchrun).
    ///
    /// Every rank gets OXCCL_RANK, OXCCL_WORLD_SIZE, OXCCL_LOCAL_RANK, OXCCL_LOCAL_WORLD_SIZE,
    /// OXCCL_STORE, OXCCL_JOB_ID, ... (and torchrun's RANK, WORLD_SIZE, MASTER_ADDR, ...).
    /// If a rank fails, all ranks are stopped and the launcher exits non-zero.
    #[command(arg_required_else_help = true)]
    Launch(LaunchArgs),

    /// Measure a collective like nccl-tests: time, algbw, busbw and #wrong for a sweep of sizes.
    ///
    /// Starts --np local ranks itself, or runs as one rank under oxccl launch, torchrun, srun or
    /// mpirun. Example: oxccl perf all-reduce --np 4 -b 8 -e 64M -d all -o all.
    Perf(Box<perf::PerfArgs>),

    /// Print the process groups of a placement, in creation order (no communicator needed).
    ///
    /// Example: oxccl topo --world 16 pipe:2 tensor:2 data:4 --ranks-per-node 8. The list goes
    /// from outermost to innermost (the last dimension gets consecutive ranks); a 'model' group is
    /// added when 'tensor' or 'pipe' is present. Same rule as oxccl::comm::Topology::setup.
    #[command(arg_required_else_help = true)]
    Topo(TopoArgs),

    /// Read the flight records ranks write (OXCCL_TRACE_DIR) and say what they show.
    ///
    /// Which rank fell behind or called a different collective, where every rank was when the
    /// job stopped, which point-to-point message never came, and who the others waited for.
    /// Example: OXCCL_TRACE_DIR=/tmp/t oxccl launch -n 4 -- ./train; oxccl trace /tmp/t.
    #[command(arg_required_else_help = true)]
    Trace(trace::TraceArgs),

    /// Print or draw a pipeline schedule's timeline, its bubble and the simulator's verdict.
    ///
    /// Schedules: gpipe, 1f1b, interleaved (-v chunks per rank), zb-h1. No communicator needed.
    /// Example: oxccl pipeline --schedule interleaved -p 4 -m 8 -v 2 --plot timeline.svg.
    Pipeline(pipeline::PipelineArgs),
}

#[derive(Debug, Args)]
struct TopoArgs {
    /// Dimensions, outermost first, as NAME:SIZE (e.g. pipe:2 tensor:2 data:4).
    #[arg(value_name = "NAME:SIZE", required = true)]
    dims: Vec<String>,

    /// World size, at most 1048576 [default: the product of the sizes].
    #[arg(long, value_name = "N")]
    world: Option<usize>,

    /// Ranks per node (numbered node by node, as oxccl launch does): marks which groups stay
    /// inside one node.
    #[arg(long, value_name = "R")]
    ranks_per_node: Option<usize>,

    /// Also print the mixture-of-experts groups (moe_ep, moe_dp) split from each data group with
    /// this expert-parallel size.
    #[arg(long, value_name = "EP")]
    moe_ep: Option<usize>,
}

/// The largest world `oxccl topo` prints (its plan and text grow with the world).
const MAX_TOPO_WORLD: usize = 1 << 20;

/// The world `oxccl topo` plans for: `--world`, else the product of the sizes; an error when the
/// product does not fit in a `usize` or the world is larger than [`MAX_TOPO_WORLD`].
fn topo_world(dims: &[(String, usize)], world: Option<usize>) -> Result<usize, String> {
    let list = || {
        let words: Vec<String> = dims.iter().map(|(n, s)| format!("{n}:{s}")).collect();
        words.join(" ")
    };
    let product = dims
        .iter()
        .try_fold(1usize, |p, (_, s)| p.checked_mul(*s))
        .ok_or_else(|| {
            format!(
                "the sizes {} multiply to more than {} ranks",
                list(),
                usize::MAX
            )
        })?;
    match world {
        Some(w) if w > MAX_TOPO_WORLD => Err(format!(
            "--world {w} is too large: oxccl topo prints at most {MAX_TOPO_WORLD} ranks"
        )),
        Some(w) => Ok(w),
        None if product > MAX_TOPO_WORLD => Err(format!(
            "the sizes {} multiply to {product} ranks, too many: oxccl topo prints at most \
             {MAX_TOPO_WORLD} ranks",
            list()
        )),
        None => Ok(product),
    }
}

fn run_topo(args: TopoArgs) -> u8 {
    use oxccl_comm::topology;
    let result = topology::parse_dims(&args.dims).and_then(|dims| {
        let world = topo_world(&dims, args.world).map_err(oxccl_comm::Error::Config)?;
        let dims: Vec<(&str, usize)> = dims.iter().map(|(n, s)| (n.as_str(), *s)).collect();
        let mut plans = topology::plan_groups(0, world, &dims)?;
        if let Some(ep) = args.moe_ep {
            let data = plans.iter().find(|p| p.name == "data").ok_or_else(|| {
                oxccl_comm::Error::Config("--moe-ep needs a 'data' dimension".into())
            })?;
            let moe = topology::plan_moe(0, data, ep)?;
            plans.extend(moe);
        }
        Ok(topology::render(&plans, args.ranks_per_node))
    });
    match result {
        Ok(text) => {
            use std::io::Write as _;
            let _ = std::io::stdout().lock().write_all(text.as_bytes());
            0
        }
        Err(e) => {
            let msg = e.to_string();
            // The plan is not a rank's: drop the "rank 0: " label.
            let msg = msg.strip_prefix("rank 0: ").unwrap_or(&msg);
            let _ = std::io::Write::write_fmt(
                &mut std::io::stderr(),
                format_args!("oxccl topo: {msg}\n"),
            );
            2
        }
    }
}

#[derive(Debug, Args)]
struct LaunchArgs {
    /// Ranks (processes) to start on this node, 1 to 4096.
    #[arg(
        short = 'n',
        long = "nproc-per-node",
        visible_alias = "np",
        value_name = "N"
    )]
    nproc_per_node: usize,

    /// Number of nodes in the job. With more than one, the launchers keep in touch through the
    /// store: a failure on one node stops every node, and node 0 waits for the others to finish.
    #[arg(long, value_name = "M", default_value_t = 1)]
    nnodes: usize,

    /// Index of this node (0..M); node 0 hosts the rendezvous store.
    #[arg(long, value_name = "K", default_value_t = 0)]
    node_rank: usize,

    /// Address of node 0 (host name, IPv4 or IPv6 literal).
    #[arg(long, value_name = "A", default_value = "127.0.0.1")]
    master_addr: String,

    /// Port of the store on node 0 [default: 0 = any free port, only with --nnodes 1].
    #[arg(long, value_name = "P")]
    master_port: Option<u16>,

    /// Restart all ranks up to R times when one fails (with several nodes, every node restarts
    /// its ranks; give every node the same R).
    #[arg(long, value_name = "R", default_value_t = 0)]
    max_restarts: u32,

    /// A failed rank does not stop the others (on any node; give it to every node): they may
    /// shrink their communicators and go on. Exits with this node's first failed rank's code once
    /// every rank is done. Not with --max-restarts.
    #[arg(long)]
    keep_going: bool,

    /// Start up to N replacement processes for failed ranks on this node (implies --keep-going):
    /// a replacement gets the failed rank's variables plus OXCCL_JOIN=1, and joins when the
    /// survivors grow their communicator back (Communicator::shrink, then ::grow). Not with
    /// --max-restarts.
    #[arg(long, value_name = "N", default_value_t = 0)]
    respawn: u32,

    /// Do not prefix the ranks' output lines with "[RANK] ".
    #[arg(long)]
    no_prefix: bool,

    /// Kill the job (exit code 124) if it runs longer than this many seconds.
    #[arg(long, value_name = "SECONDS", value_parser = parse_seconds)]
    timeout: Option<Duration>,

    /// Base of OXCCL_JOB_ID (each attempt appends "-r<attempt>") [default: $OXCCL_JOB_ID, else
    /// "<pid>-<unix time>" on one node, "mn-<master port>" on several].
    #[arg(long, value_name = "ID")]
    job_id: Option<String>,

    /// Bind ranks to CPUs: none (the default, as torchrun), core (local rank i on the i-th CPU
    /// this launcher may use, as mpirun --bind-to core; for single-threaded ranks), or block
    /// (local rank i on the i-th block of CPUs / nproc of them; for ranks with threads, DDP's).
    #[arg(long, value_name = "none|core|block", default_value = "none")]
    bind: Bind,

    /// Ranks write their communicators' flight records to DIR (sets OXCCL_TRACE_DIR). When a rank
    /// fails (here or on another node), the others get 1 s to fail on their own and write their
    /// records before they are terminated; then the launcher prints what `oxccl trace DIR` reads
    /// from this node's records of this launch.
    #[arg(long, value_name = "DIR")]
    trace_dir: Option<std::path::PathBuf>,

    /// The command to run on every rank, and its arguments.
    #[arg(value_name = "CMD", required = true, trailing_var_arg = true, num_args = 1..)]
    command: Vec<OsString>,
}

/// Like `eprintln!("oxccl launch: ...")`, without panicking on a closed stderr.
macro_rules! note {
    ($($arg:tt)*) => {{
        use ::std::io::Write as _;
        let _ = ::std::writeln!(
            ::std::io::stderr().lock(),
            "oxccl launch: {}",
            ::std::format_args!($($arg)*)
        );
    }};
}

fn parse_seconds(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|e| format!("not a number of seconds: {e}"))?;
    if !secs.is_finite() || secs <= 0.0 {
        return Err("must be a positive number of seconds".into());
    }
    Duration::try_from_secs_f64(secs).map_err(|e| e.to_string())
}

fn run_launch(args: LaunchArgs) -> u8 {
    let mut command = args.command.into_iter();
    let program = command.next().unwrap_or_default();
    let mut cfg = LaunchConfig::new(args.nproc_per_node, program, command);
    cfg.nnodes = args.nnodes;
    cfg.node_rank = args.node_rank;
    cfg.master_addr = args.master_addr;
    cfg.master_port = args.master_port.unwrap_or(0);
    cfg.max_restarts = args.max_restarts;
    cfg.keep_going = args.keep_going;
    cfg.respawn = args.respawn;
    cfg.prefix_output = !args.no_prefix;
    cfg.timeout = args.timeout;
    cfg.job_id = args.job_id;
    cfg.bind = args.bind;
    cfg.forward_signals = true;
    if let Some(dir) = &args.trace_dir {
        cfg.env
            .push(("OXCCL_TRACE_DIR".into(), dir.as_os_str().to_owned()));
        // Ranks learn of a failure within milliseconds; let them write their records.
        cfg.failure_settle = Duration::from_secs(1);
    }

    let started = std::time::SystemTime::now();
    let code = match launch(&cfg) {
        Ok(outcome) => {
            let code = outcome.exit_code();
            match &outcome.end {
                JobEnd::Success => {}
                JobEnd::RankFailed(f) => note!(
                    "job failed after {} attempt(s): {f}; exiting with code {code}",
                    outcome.attempts
                ),
                JobEnd::NodeFailed(f) => {
                    note!("job failed on another node: {f}; exiting with code {code}")
                }
                JobEnd::Interrupted { .. } => {
                    note!("job interrupted; exiting with code {code}")
                }
                JobEnd::TimedOut { after } => note!(
                    "job timed out after {}s; exiting with code {code}",
                    after.as_secs_f64()
                ),
            }
            code
        }
        Err(e) => {
            note!("error: {e}");
            e.exit_code()
        }
    };
    if let (Some(dir), true) = (&args.trace_dir, code != 0) {
        print_trace(dir, started);
    }
    u8::try_from(code).unwrap_or(1)
}

/// After a failed job: what this node's flight records in `dir` written since `started` show
/// (`oxccl trace DIR`; older records of other jobs are left out).
fn print_trace(dir: &std::path::Path, started: std::time::SystemTime) {
    let (mut dumps, problems) = trace::load(&[dir.to_path_buf()]);
    for p in problems {
        note!("--trace-dir: skipped {p}");
    }
    let since = started
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    dumps.retain(|d| d.dumped_unix_ns >= since);
    if dumps.is_empty() {
        note!(
            "--trace-dir: no flight records of this job in {} (no communicator failed or closed)",
            dir.display()
        );
        return;
    }
    note!(
        "flight records in {} (oxccl trace {} reads them again):",
        dir.display(),
        dir.display()
    );
    use std::io::Write as _;
    let _ = std::io::stderr()
        .lock()
        .write_all(trace::analyze(&dumps).as_bytes());
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    oxccl_comm::logging::init();
    ExitCode::from(match cli.command {
        Cmd::Launch(args) => run_launch(args),
        Cmd::Perf(args) => perf::run(*args),
        Cmd::Topo(args) => run_topo(args),
        Cmd::Trace(args) => trace::run(args),
        Cmd::Pipeline(args) => pipeline::run(args),
    })
}
