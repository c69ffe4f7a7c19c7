//! The validated run: every flag of [`PerfArgs`] checked and turned into sizes, data types and
//! operations ([`Plan`]), before any rank starts.

use oxccl_comm::{Collective, DType, ReduceOp};

use super::bench::{self, Average};
use super::sweep::{self, parse_size, step_from, Step};
use super::PerfArgs;

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
    /// `-R 1`: host buffers registered.
    pub register: bool,
}

/// What `-o all` runs: every operation, `premul_sum` with the factors of
/// [`super::data::premul_factor`].
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
            if !matches!(
                t.to_ascii_lowercase().as_str(),
                "auto" | "tcp" | "shm" | "rdma"
            ) {
                return Err(format!(
                    "--transport {t:?}: expected auto, tcp, shm or rdma"
                ));
            }
        }
        if let Some(spec) = &a.algo {
            oxccl_comm::internal::tuning::AlgoOverride::parse(spec)
                .map_err(|e| format!("--algo: {e}"))?;
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
        if a.local_register == 1 && cuda {
            return Err(
                "-R 1 registers host buffers; with --device cuda it is not supported".into(),
            );
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
            register: a.local_register == 1,
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

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;

    /// `-o all` runs premul_sum on device buffers too (over CUDA IPC and staged alike).
    #[test]
    fn device_all_ops_include_premul_sum() {
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
        assert_eq!(device.len(), 6);
        assert!(device.contains(&premul), "{device:?}");
        assert_eq!(ops(&["--device", "cuda", "-o", "premul_sum"]), vec![premul]);
        assert_eq!(device, ops(&["-o", "all"]));
    }
}
