//! The pipeline's benchmarks (docs/PERF.md, "Pipeline"): the bubble of each schedule with stage
//! computations of known duration against its theory, and the cost of the pipeline's exchanges
//! against plain send/recv of the same bytes.

use std::error::Error;
use std::time::{Duration, Instant};

use oxccl_comm::{Communicator, ReduceOp};
use oxccl_pipeline::{
    BoxError, Costs, Pipeline, PipelineConfig, ScheduleKind, Stage, Step, Tensor,
};

/// A stage whose forward, input-gradient and weight-gradient backwards wait `f`, `b` and `w`
/// with the CPU idle (as a stage whose work runs on an accelerator) and send `bytes`, in the
/// tensors it received before when it has some (so that the benchmark times the exchanges,
/// not the allocation of fresh outputs).
struct Timed {
    f: Duration,
    b: Duration,
    w: Duration,
    bytes: usize,
    spare: Vec<Tensor>,
    /// The first and the last stage (whose backward and forward outputs go nowhere).
    ends: (bool, bool),
}

impl Timed {
    fn new(comm: &Communicator, f: Duration, b: Duration, w: Duration, bytes: usize) -> Timed {
        let ends = (comm.rank() == 0, comm.rank() + 1 == comm.size());
        Timed {
            f,
            b,
            w,
            bytes,
            spare: Vec::new(),
            ends,
        }
    }

    /// Keeps `input` for later outputs; an output unless it would go `nowhere`.
    fn out(&mut self, input: Vec<Tensor>, nowhere: bool) -> Vec<Tensor> {
        self.spare.extend(input);
        if nowhere {
            return Vec::new();
        }
        let fresh = || {
            // Written once, so that its pages are mapped here and not in an exchange.
            Tensor::new(&[self.bytes], &vec![1u8; self.bytes]).expect("sized")
        };
        vec![self.spare.pop().unwrap_or_else(fresh)]
    }
}

fn wait(d: Duration) {
    if !d.is_zero() {
        std::thread::sleep(d);
    }
}

impl Stage for Timed {
    fn forward(&mut self, _: Step, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        wait(self.f);
        Ok(self.out(inputs, self.ends.1))
    }
    fn backward(&mut self, _: Step, grads: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        wait(self.b + self.w);
        Ok(self.out(grads, self.ends.0))
    }
    fn backward_input(&mut self, _: Step, grads: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        wait(self.b);
        Ok(self.out(grads, self.ends.0))
    }
    fn backward_weight(&mut self, _: Step) -> Result<(), BoxError> {
        wait(self.w);
        Ok(())
    }
}

/// One schedule's bubble: measured on every rank, and its theory.
#[derive(Clone, Debug)]
pub struct Bubble {
    /// `1 - compute / step` (compute averaged over the ranks, the step the slowest rank's),
    /// median over the steps.
    pub measured: f64,
    pub theory: f64,
    /// Median step, the slowest rank's.
    pub step: Duration,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs `rounds` steps (after one warm-up) of `kind` with stage times `f`, `b`, `w` (ms) and
/// `bytes` per message; every rank's bubble averaged.
///
/// # Errors
/// The pipeline's.
pub fn bubble(
    comm: &Communicator,
    kind: ScheduleKind,
    chunks: usize,
    micro: usize,
    fbw: [u32; 3],
    bytes: usize,
    rounds: usize,
) -> Result<Bubble, Box<dyn Error>> {
    let ms = |x: u32| Duration::from_millis(u64::from(x));
    // With v chunks a stage is 1/v of the rank's work: the same model cut finer.
    let per = |x: u32| ms(x) / chunks as u32;
    let costs = Costs {
        forward: fbw[0],
        backward_input: fbw[1],
        weight: fbw[2],
    };
    let mut pipe = Pipeline::new(
        comm,
        PipelineConfig {
            chunks,
            costs,
            ..PipelineConfig::new(kind, micro)
        },
    )?;
    let mut stage = Timed::new(comm, per(fbw[0]), per(fbw[1]), per(fbw[2]), bytes);
    pipe.step(&mut stage)?;
    let (mut bubbles, mut steps) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        comm.barrier()?;
        let s = pipe.step(&mut stage)?;
        // The step spans from the common start to the last rank's end: every rank's idle
        // time within it is bubble (as in the theory).
        let mut v = [s.compute.as_secs_f64(), s.wall.as_secs_f64()];
        comm.all_reduce(&mut v[..1], ReduceOp::Sum)?;
        comm.all_reduce(&mut v[1..], ReduceOp::Max)?;
        bubbles.push(1.0 - v[0] / comm.size() as f64 / v[1]);
        steps.push(v[1]);
    }
    Ok(Bubble {
        measured: median(bubbles),
        theory: kind.theory_bubble(comm.size(), micro, chunks, costs),
        step: Duration::from_secs_f64(median(steps)),
    })
}

/// Time per message of the pipeline's exchanges and of plain send/recv, same bytes, same pattern.
#[derive(Clone, Copy, Debug)]
pub struct Exchange {
    pub pipeline: Duration,
    pub plain: Duration,
}

/// On 2 ranks: GPipe over `micro` micro-batches with no computation (every message `bytes`:
/// `micro` activations one way, then `micro` gradients back; the step's time less the stage's
/// own) against the same messages as `send`/`recv` calls; medians of `rounds` rounds,
/// interleaved.
///
/// # Errors
/// The pipeline's and the communicator's; a world that is not 2 ranks.
pub fn exchange(
    comm: &Communicator,
    micro: usize,
    bytes: usize,
    rounds: usize,
) -> Result<Exchange, Box<dyn Error>> {
    if comm.size() != 2 {
        return Err("the exchange benchmark runs on 2 ranks".into());
    }
    let mut pipe = Pipeline::new(comm, PipelineConfig::new(ScheduleKind::GPipe, micro))?;
    let mut stage = Timed::new(comm, Duration::ZERO, Duration::ZERO, Duration::ZERO, bytes);
    // One buffer per micro-batch, as the pipeline's tensors: each message its own memory.
    let mut bufs = vec![vec![1u8; bytes]; micro];
    let plain = |bufs: &mut Vec<Vec<u8>>| -> Result<Duration, Box<dyn Error>> {
        comm.barrier()?;
        let t = Instant::now();
        for dir in 0..2 {
            for buf in bufs.iter_mut() {
                if comm.rank() == dir {
                    comm.send(&buf[..], 1 - dir)?;
                } else {
                    comm.recv(&mut buf[..], dir)?;
                }
            }
        }
        Ok(t.elapsed())
    };
    pipe.step(&mut stage)?;
    plain(&mut bufs)?;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        comm.barrier()?;
        let s = pipe.step(&mut stage)?;
        // The stage's own time (making its outputs) is not the exchanges'.
        a.push((s.wall - s.compute).as_secs_f64());
        b.push(plain(&mut bufs)?.as_secs_f64());
    }
    let msgs = (2 * micro) as f64;
    Ok(Exchange {
        pipeline: Duration::from_secs_f64(median(a) / msgs),
        plain: Duration::from_secs_f64(median(b) / msgs),
    })
}
