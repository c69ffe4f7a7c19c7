//! The rank side: communicator, preamble, the (cycle, dtype, op, size) loops, rank 0's output.

use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use oxccl_comm::{Communicator, Element, Error, ReduceOp};

use super::bench::{has_async, sets_for, Average, Bench, Spec};
use super::data::{rank_op, Pattern};
use super::format::{header, row_line, Measure, Row, Totals};
use super::progress::Progress;
use super::report::{write_json, write_plot, Meta, RankInfo};
use super::sweep::{busbw_factor, geometry, Step};
use super::{note, PerfArgs, Plan};

/// What the loops hand each finished row to: totals, rank 0's table, the kept rows.
struct Sink {
    is0: bool,
    keep: bool,
    rows: Vec<Row>,
    totals: Totals,
    progress: Progress,
    step: u64,
    total_steps: Option<u64>,
}

impl Sink {
    fn start(&mut self, what: String) {
        self.step += 1;
        let of = self
            .total_steps
            .map_or_else(|| self.step.to_string(), |t| format!("{}/{t}", self.step));
        self.progress.set(format!("{what} ({of})"));
    }

    fn emit(&mut self, row: Row) {
        self.totals.add(&row);
        if self.is0 {
            let line = row_line(&row);
            self.progress.print(|| out(&[line]));
        }
        if self.keep {
            self.rows.push(row);
        }
    }
}

/// Prints lines on stdout and flushes (rows appear as they are measured, like nccl-tests).
fn out(lines: &[String]) {
    let mut o = std::io::stdout().lock();
    for l in lines {
        let _ = writeln!(o, "{l}");
    }
    let _ = o.flush();
}

/// This process's rank as the launcher gave it, for error messages before a communicator exists.
fn env_rank() -> String {
    ["OXCCL_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"]
        .iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
        .unwrap_or_else(|| "?".into())
}

/// The transport the ranks were configured with (`OXCCL_TRANSPORT`).
fn transport_label(comm: &Communicator) -> String {
    format!("{:?}", comm.config().transport).to_ascii_lowercase()
}

/// The GPU this rank's device buffers use (`--device cuda`).
#[cfg(feature = "cuda")]
fn device_ordinal(comm: &Communicator) -> Result<usize, Error> {
    super::device::ordinal_for(comm)
}

#[cfg(not(feature = "cuda"))]
fn device_ordinal(comm: &Communicator) -> Result<usize, Error> {
    Err(Error::InvalidArgument {
        rank: comm.rank(),
        op: "perf".into(),
        msg: "--device cuda needs a build with the cuda feature".into(),
    })
}

/// Runs one rank; returns the exit code.
pub fn rank_main(args: &PerfArgs, plan: &Plan) -> u8 {
    // Under a launcher the flags still apply; set before the communicator reads them (no other
    // thread exists yet).
    if let Some(t) = &args.transport {
        std::env::set_var("OXCCL_TRANSPORT", t.to_ascii_lowercase());
    }
    if let Some(a) = &args.algo {
        std::env::set_var("OXCCL_ALGO", a);
    }
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            note(&format!("rank {}: error: {e}", env_rank()));
            return 1;
        }
    };
    if let Err(e) = plan.check_ranks(args.root, comm.size()) {
        if comm.rank() == 0 {
            note(&format!("error: {e}"));
        }
        return 2;
    }
    match run_all(&comm, args, plan) {
        // Every rank knows the totals; rank 0 alone reports failed checks in its exit code.
        Ok(failed) => u8::from(failed > 0 && comm.rank() == 0),
        Err(e) => {
            note(&format!("rank {}: error: {e}", comm.rank()));
            1
        }
    }
}

/// Everything on every rank; returns the number of failed checks.
fn run_all(comm: &Communicator, args: &PerfArgs, plan: &Plan) -> Result<u64, Error> {
    let (rank, n) = (comm.rank(), comm.size());
    let mut pids = vec![0u64; n];
    comm.all_gather_into(&[u64::from(std::process::id())], &mut pids)?;
    // GPU ordinal of every rank (-1: host buffers).
    let mine: i64 = if plan.cuda {
        device_ordinal(comm)? as i64
    } else {
        -1
    };
    let mut ordinals = vec![0i64; n];
    comm.all_gather_into(&[mine], &mut ordinals)?;
    let nodes = comm.node_ids();
    let meta = Meta {
        oxccl_version: env!("CARGO_PKG_VERSION").into(),
        collective: plan.coll.name().into(),
        nranks: n,
        ranks: (0..n)
            .map(|r| RankInfo {
                rank: r,
                pid: pids[r],
                node: nodes[r].to_owned(),
                device: match ordinals[r] {
                    d if d >= 0 => format!("cuda:{d}"),
                    _ => "host".into(),
                },
            })
            .collect(),
        transport: transport_label(comm),
        algo: std::env::var("OXCCL_ALGO").ok().filter(|s| !s.is_empty()),
        minbytes: plan.min,
        maxbytes: plan.max,
        stepfactor: match plan.step {
            Step::Factor(f) => f,
            Step::Bytes(_) => 0,
        },
        stepbytes: match plan.step {
            Step::Bytes(b) => b,
            Step::Factor(_) => 0,
        },
        warmup_iters: args.warmup_iters,
        iters: args.iters,
        run_cycles: args.run_cycles,
        check: args.check != 0,
        blocking: args.blocking != 0,
        average: args.average,
        root: args.root,
        rotate_bytes: plan.rotate_bytes,
        registered: plan.register,
        unix_time: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    };
    let is0 = rank == 0;
    if is0 {
        out(&preamble(plan, &meta));
        out(&header());
    }
    let spec = Spec {
        coll: plan.coll,
        root: args.root,
        blocking: args.blocking != 0,
        iters: args.iters,
        warmup: args.warmup_iters,
        check: args.check != 0,
        average: plan.average,
        rotate_bytes: plan.rotate_bytes,
        cuda: plan.cuda,
        skew: plan.skew,
        register: plan.register,
    };
    let per_cycle = (plan.dtypes.len() * plan.ops.len() * plan.sizes.len()) as u64;
    let mut sink = Sink {
        is0,
        keep: is0 && (args.json.is_some() || args.plot.is_some()),
        rows: Vec::new(),
        totals: Totals::default(),
        progress: Progress::new(is0),
        step: 0,
        total_steps: (args.run_cycles > 0).then(|| per_cycle * u64::from(args.run_cycles)),
    };
    let mut cycle = 0u32;
    while args.run_cycles == 0 || cycle < args.run_cycles {
        for &dt in &plan.dtypes {
            oxccl_kernels::with_dtype!(dt, run_dtype(comm, &spec, plan, cycle, &mut sink))?;
        }
        cycle = cycle.wrapping_add(1);
    }
    let totals = sink.totals;
    drop(sink.progress);
    if is0 {
        let stats = comm.stats();
        if let Some(n) = stats.send_thread_exchanges {
            out(&[format!(
                "# Send thread on (OXCCL_SOCKET_SEND_THREAD): rank 0 sent from it in {n} exchanges"
            )]);
        }
        if let Some(n) = stats.channel_ops {
            out(&[format!(
                "# {} channels (OXCCL_SOCKET_CHANNELS={}): rank 0 cut {n} operations across them",
                stats.channels,
                comm.config()
                    .socket_channels
                    .map_or_else(|| "auto".to_owned(), |k| k.to_string())
            )]);
        }
        if plan.register {
            out(&[format!(
                "# Registered buffers: {} bytes landed straight in rank 0's, written by peers \
                 (RDMA, or the mapped all-gather over shared memory), {} sent straight from them",
                stats.registered_recv_bytes, stats.registered_bytes
            )]);
        }
        out(&totals.footer());
        #[cfg(feature = "cuda")]
        if let Some(path) = comm.stats().device_path {
            out(&[format!(
                "# Device collectives ran {}",
                match path {
                    "cuda_ipc" => "over CUDA IPC (device memory read across ranks)",
                    _ => "staged through pinned host memory",
                }
            )]);
        }
        let mut failed_output = false;
        if let Some(p) = &args.json {
            if let Err(e) = write_json(p, &meta, &sink.rows, totals.failed, totals.avg_busbw()) {
                note(&format!("rank 0: cannot write --json: {e}"));
                failed_output = true;
            }
        }
        if let Some(p) = &args.plot {
            let title = format!("oxccl perf {}, {n} ranks: busbw", plan.coll);
            if let Err(e) = write_plot(p, &title, &sink.rows) {
                note(&format!("rank 0: cannot write --plot: {e}"));
                failed_output = true;
            }
        }
        if failed_output {
            return Ok(totals.failed.max(1));
        }
    }
    Ok(totals.failed)
}

/// One dtype: every op, every size, out of place then in place.
fn run_dtype<T: Element>(
    comm: &Communicator,
    spec: &Spec,
    plan: &Plan,
    cycle: u32,
    sink: &mut Sink,
) -> Result<(), Error> {
    let n = comm.size();
    let ts = T::DTYPE.size();
    let factor = busbw_factor(spec.coll, n);
    let mut bench = Bench::<T>::new(comm, spec.clone(), &plan.sizes)?;
    for &op in &plan.ops {
        let pat = Pattern::<T>::new(n, op);
        bench.fill_inputs(&pat)?;
        let red = op.map_or(ReduceOp::Sum, |o| rank_op(o, comm.rank()));
        let redop = op.map_or("none", |o| o.name());
        for &size in &plan.sizes {
            let g = geometry(spec.coll, size, ts, n);
            sink.start(format!(
                "{} {} {redop} {} B",
                spec.coll,
                T::DTYPE.name(),
                g.bytes
            ));
            let (t, w) = bench.measure(&g, false, red, &pat)?;
            let oop = Measure::new(g.bytes, t, factor, w);
            let ip = if bench.in_place() {
                let (t, w) = bench.measure(&g, true, red, &pat)?;
                Some(Measure::new(g.bytes, t, factor, w))
            } else {
                None
            };
            sink.emit(Row {
                cycle,
                collective: spec.coll.name().into(),
                dtype: T::DTYPE.name().into(),
                redop: redop.into(),
                root: if spec.coll.has_root() {
                    spec.root as i64
                } else {
                    -1
                },
                size: g.bytes,
                count: g.count,
                out_of_place: oop,
                in_place: ip,
            });
        }
    }
    Ok(())
}

/// nccl-tests' preamble, plus oxccl's settings and the rank list.
fn preamble(plan: &Plan, m: &Meta) -> Vec<String> {
    let step = match plan.step {
        Step::Factor(f) => format!("{f}(factor)"),
        Step::Bytes(b) => format!("{b}(bytes)"),
    };
    let mut l = vec![format!(
        "# nThread 1 nGpus 1 minBytes {} maxBytes {} step: {step} warmup iters: {} iters: {} agg iters: 1 validation: {} graph: 0",
        m.minbytes, m.maxbytes, m.warmup_iters, m.iters, u8::from(m.check)
    )];
    let nnodes = {
        let mut v: Vec<&str> = m.ranks.iter().map(|r| r.node.as_str()).collect();
        v.sort_unstable();
        v.dedup();
        v.len()
    };
    l.push(format!(
        "# oxccl {} perf {}: {} ranks on {nnodes} node(s), transport {}, algo {}",
        m.oxccl_version,
        m.collective,
        m.nranks,
        m.transport,
        m.algo.as_deref().unwrap_or("auto (tuner)")
    ));
    if let Some(r) = m.ranks.iter().find(|r| r.device != "host") {
        l.push(format!(
            "# Device buffers ({}...): each call is enqueued on the rank's CUDA stream (over CUDA \
             IPC inside a node, else staged through pinned host memory: see the last line); each \
             timing ends at a stream synchronize",
            r.device
        ));
    } else if m.blocking {
        l.push(
            "# Blocking Enabled: blocking calls, each returns when the collective is complete"
                .into(),
        );
    } else if has_async(plan.coll) {
        l.push("# Async calls: each iteration issues the *_async call and waits for it".into());
    } else {
        l.push(format!(
            "# Blocking calls ({} has no async form)",
            m.collective
        ));
    }
    let how = match plan.average {
        Average::Rank0 => "rank 0's",
        Average::Mean => "the mean over ranks of the",
        Average::Min => "the minimum over ranks of the",
        Average::Max => "the maximum over ranks of the",
    };
    l.push(format!(
        "# time: {how} per-call time of {} back-to-back calls after {} warm-up calls and a barrier",
        m.iters, m.warmup_iters
    ));
    let ts = plan.dtypes.first().map_or(4, |d| d.size());
    let ks: Vec<usize> = plan
        .sizes
        .iter()
        .map(|&s| {
            sets_for(
                plan.rotate_bytes,
                geometry(plan.coll, s, ts, m.nranks).bytes,
            )
        })
        .collect();
    let (kmin, kmax) = (
        ks.iter().min().copied().unwrap_or(2),
        ks.iter().max().copied().unwrap_or(2),
    );
    let k = if kmin == kmax {
        kmin.to_string()
    } else {
        format!("{kmin}..{kmax}")
    };
    if plan.rotate_bytes == 0 {
        l.push("# Buffers: one set, reused by every call (--rotate 0)".into());
    } else {
        l.push(format!(
            "# Buffers rotate over {k} sets (per size: enough for {} of input + output, 2 to 64)",
            super::report::human_bytes(plan.rotate_bytes as f64)
        ));
    }
    if plan.register {
        l.push(
            "# Buffers registered (-R 1): in shared memory that peers on the node map (the \
             mapped all-gather writes into them); over RDMA sent from and received into directly"
                .into(),
        );
    }
    l.push("#".into());
    l.push("# Using devices".into());
    for r in &m.ranks {
        l.push(format!(
            "#  Rank {:>2} Group {:>2} Pid {:>6} on {:>10} device {:>6} (transport {})",
            r.rank, 0, r.pid, r.node, r.device, m.transport
        ));
    }
    l.push("#".into());
    l
}
