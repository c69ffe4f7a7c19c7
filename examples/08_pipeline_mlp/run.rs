//! One rank of examples/08_pipeline_mlp.rs (and of the pipeline tests): the MLP cut into
//! `pipe` stages, run by a [`Pipeline`]; with more ranks than stages, a `pipe x data` grid in
//! which DDP averages each stage's gradients over its data replicas during the last
//! micro-batch's weight backward.

use std::cell::RefCell;
use std::error::Error;

use oxccl_comm::{Communicator, Topology};
use oxccl_ddp::{Ddp, DdpConfig, Param};
use oxccl_pipeline::{
    BoxError, Pipeline, PipelineConfig, ScheduleKind, Stage, Step, StepStats, Tensor,
};
use oxccl_zero::{Hyper, Sgd, Zero, ZeroConfig};

use super::model::{init, max_rel_diff, reference, sgd, zeros_like, Layers, MlpStage, Shape, Wire};

/// What to run.
#[derive(Clone, Debug)]
pub struct Opts {
    /// The model and micro-batch sizes (`shape.micro` micro-batches per step).
    pub shape: Shape,
    /// The schedule.
    pub kind: ScheduleKind,
    /// Model chunks per rank (interleaved).
    pub chunks: usize,
    /// Pipeline stages (ranks per pipeline); the world's other factor is data replicas.
    pub pipe: usize,
    /// Steps.
    pub steps: usize,
    /// Several tensors per stage output (f32 and f64).
    pub split: bool,
    /// Compare with one process on the whole batch after every step.
    pub check: bool,
    /// This world rank exits (as if killed) in the forward of this micro-batch of step 1.
    pub die: Option<(usize, usize)>,
    /// Exchange device tensors (feature `cuda`): each stage copies what it receives to the
    /// host, computes there, and hands its outputs over in device memory.
    pub device: bool,
    /// In a `pipe x data` grid, node-local ZeRO-2 (SGD) over each stage's replicas instead of
    /// DDP + SGD: the stage's gradients go to it in the last micro-batch's backward.
    pub zero: bool,
}

/// What a rank trained.
#[derive(Clone, Debug)]
pub struct Trained {
    /// The layers this rank holds.
    pub layers: Vec<usize>,
    /// The step's loss (the last stage's, over its replica's samples; 0 elsewhere).
    pub losses: Vec<f32>,
    /// Gradients applied at each step (every layer; only this rank's are filled); none with
    /// `zero` (ZeRO applies them shard by shard).
    pub grads: Vec<Layers>,
    /// The parameters after the last step.
    pub params: Layers,
    /// With `check`: the largest relative difference from the reference, over this rank's
    /// layers, gradients and parameters, every step.
    pub worst: f32,
    /// Each step's statistics.
    pub stats: Vec<StepStats>,
    /// How the pipeline's device payloads moved (`cuda_ipc` or `staged`; `None` on the host).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub device_path: Option<&'static str>,
}

/// A stage that exits the process in one forward (a killed stage).
struct Dying<'s, 'a> {
    inner: &'s mut MlpStage<'a>,
    at: Option<usize>,
}

impl Stage for Dying<'_, '_> {
    fn forward(&mut self, st: Step, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        if self.at == Some(st.mb) {
            eprintln!("stage exits in the forward of micro-batch {}", st.mb);
            std::process::exit(3);
        }
        self.inner.forward(st, inputs)
    }
    fn backward(&mut self, st: Step, grads: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        self.inner.backward(st, grads)
    }
    fn backward_input(&mut self, st: Step, grads: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        self.inner.backward_input(st, grads)
    }
    fn backward_weight(&mut self, st: Step) -> Result<(), BoxError> {
        self.inner.backward_weight(st)
    }
}

/// A stage whose tensors are device tensors on `stream` (the MLP computes on the host: this
/// checks the pipeline's device exchanges, not GPU arithmetic).
#[cfg(feature = "cuda")]
pub struct OnDevice<'s> {
    /// The host stage.
    pub inner: &'s mut dyn Stage,
    /// Where the device tensors are made and read.
    pub stream: std::sync::Arc<oxccl_comm::cuda::cudarc::driver::CudaStream>,
}

#[cfg(feature = "cuda")]
impl OnDevice<'_> {
    fn down(&self, ts: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        ts.iter()
            .map(|t| {
                if !t.is_device() {
                    return Err(format!("received {t:?} in host memory, not device").into());
                }
                t.to_host(&self.stream).map_err(Into::into)
            })
            .collect()
    }

    fn up(&self, ts: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        ts.iter()
            .map(|t| t.to_device(&self.stream).map_err(Into::into))
            .collect()
    }
}

#[cfg(feature = "cuda")]
impl Stage for OnDevice<'_> {
    fn forward(&mut self, st: Step, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        let host = self.down(inputs)?;
        let out = self.inner.forward(st, host)?;
        self.up(out)
    }
    fn backward(&mut self, st: Step, grads: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        let host = self.down(grads)?;
        let out = self.inner.backward(st, host)?;
        self.up(out)
    }
    fn backward_input(&mut self, st: Step, grads: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        let host = self.down(grads)?;
        let out = self.inner.backward_input(st, host)?;
        self.up(out)
    }
    fn backward_weight(&mut self, st: Step) -> Result<(), BoxError> {
        self.inner.backward_weight(st)
    }
}

/// The pipeline, on the host or (`o.device`) on the device with its stream.
#[cfg(feature = "cuda")]
type Device = Option<std::sync::Arc<oxccl_comm::cuda::cudarc::driver::CudaStream>>;
#[cfg(not(feature = "cuda"))]
type Device = Option<()>;

fn make_pipe<'c>(
    comm: &'c Communicator,
    cfg: PipelineConfig,
    o: &Opts,
) -> Result<(Pipeline<&'c Communicator>, Device), Box<dyn Error>> {
    if !o.device {
        return Ok((Pipeline::new(comm, cfg)?, None));
    }
    #[cfg(feature = "cuda")]
    {
        use oxccl_comm::cuda::cudarc::driver::CudaContext;
        if !oxccl_kernels::cuda::driver_available() {
            return Err(format!("rank {}: --device: no CUDA driver or device", comm.rank()).into());
        }
        let n = CudaContext::device_count()?.max(1) as usize;
        let stream = CudaContext::new(comm.rank() % n)?.new_stream()?;
        let pipe = Pipeline::new_on_device(comm, cfg, &stream)?;
        Ok((pipe, Some(stream)))
    }
    #[cfg(not(feature = "cuda"))]
    Err("device tensors need the `cuda` feature".into())
}

/// Runs one step of `stage` on `pipe`, on the device where `dev` has a stream.
fn step_on(
    pipe: &mut Pipeline<&Communicator>,
    dev: &Device,
    stage: &mut dyn Stage,
) -> Result<StepStats, oxccl_pipeline::PipelineError> {
    #[cfg(feature = "cuda")]
    if let Some(stream) = dev {
        return pipe.step(&mut OnDevice {
            inner: stage,
            stream: stream.clone(),
        });
    }
    let _ = dev;
    pipe.step(&mut &mut *stage)
}

/// The stage's parameters (weight and bias of each of `layers`, in order) as slices.
fn views_of<'p>(params: &'p mut Layers, layers: &[usize]) -> Vec<&'p mut [f32]> {
    params
        .iter_mut()
        .enumerate()
        .filter(|(l, _)| layers.contains(l))
        .flat_map(|(_, (w, b))| [w.as_mut_slice(), b.as_mut_slice()])
        .collect()
}

/// Node-local ZeRO-2 with plain SGD at `lr` over the stage's parameters, across its replicas.
fn sharded(
    data: &Communicator,
    params: &mut Layers,
    layers: &[usize],
    lr: f32,
) -> Result<Zero<f32>, Box<dyn Error>> {
    let mut views = views_of(params, layers);
    let hypers = vec![
        Hyper {
            lr,
            weight_decay: 0.0
        };
        views.len()
    ];
    let opt = Sgd {
        momentum: 0.0,
        dampening: 0.0,
        nesterov: false,
    };
    Ok(Zero::new(
        data,
        &mut views,
        hypers,
        Box::new(opt),
        ZeroConfig::default(),
    )?)
}

/// Trains `o.steps` steps on this rank of `world`.
///
/// # Errors
/// The pipeline's, DDP's or the grid's errors, and `--check` differences past 1e-5.
pub fn train(world: &Communicator, o: &Opts) -> Result<Trained, Box<dyn Error>> {
    if o.pipe == 0 || !world.size().is_multiple_of(o.pipe) {
        return Err(format!(
            "{} ranks do not make pipelines of {} stages",
            world.size(),
            o.pipe
        )
        .into());
    }
    let replicas = world.size() / o.pipe;
    if o.zero && replicas == 1 {
        return Err("ZeRO shards over data replicas: give fewer stages than ranks".into());
    }
    let topo;
    let (pipe_comm, data) = if replicas == 1 {
        (world, None)
    } else {
        topo = Topology::setup(world, &[("pipe", o.pipe), ("data", replicas)])?;
        (topo.group("pipe")?, Some(topo.group("data")?))
    };
    let (p, rank) = (pipe_comm.size(), pipe_comm.rank());
    let replica = data.map_or(0, Communicator::rank);
    let sh = &o.shape;
    let cfg = PipelineConfig {
        chunks: o.chunks,
        ..PipelineConfig::new(o.kind, sh.micro)
    };
    let (mut pipe, dev) = make_pipe(pipe_comm, cfg, o)?;
    let layers = MlpStage::new(sh, p, o.chunks, rank, 7).my_layers();
    // DDP over this stage's parameters, across the data replicas.
    let mut copy = init(sh, 7);
    let mut params: Vec<Param> = Vec::new();
    for (l, (w, b)) in copy.iter_mut().enumerate() {
        if layers.contains(&l) {
            params.push(Param::new(format!("layer{l}.weight"), w));
            params.push(Param::new(format!("layer{l}.bias"), b));
        }
    }
    let ddp = match data {
        Some(d) if !o.zero => Some(RefCell::new(Ddp::new(
            d,
            &mut params,
            DdpConfig::default(),
        )?)),
        _ => None,
    };
    drop(params);
    let zero = match data {
        Some(d) if o.zero => Some(RefCell::new(sharded(d, &mut copy, &layers, sh.lr)?)),
        _ => None,
    };
    let local =
        |global: usize| 2 * layers.iter().position(|&l| l == global / 2).unwrap_or(0) + global % 2;
    let want = o.check.then(|| reference(sh, o.steps, replicas));
    let mut stage = MlpStage::new(sh, p, o.chunks, rank, 7);
    stage.wire = if o.split { Wire::Split } else { Wire::One };
    let mut t = Trained {
        layers: layers.clone(),
        losses: Vec::new(),
        grads: Vec::new(),
        params: Vec::new(),
        worst: 0.0,
        stats: Vec::new(),
        device_path: None,
    };
    for step in 0..o.steps {
        // Replica d takes micro-batches d m .. (d + 1) m of the step's samples.
        stage.begin_step((step * replicas + replica) * sh.batch * sh.micro);
        if let Some(d) = &ddp {
            stage.on_grad = Some(Box::new(move |param, g| {
                d.borrow_mut()
                    .grad_ready(local(param), g)
                    .map_err(Into::into)
            }));
        }
        if let Some(z) = &zero {
            stage.on_grad = Some(Box::new(move |param, g| {
                z.borrow_mut()
                    .grad_ready(local(param), g)
                    .map_err(Into::into)
            }));
        }
        let die = o
            .die
            .filter(|&(r, _)| r == world.rank() && step == 1)
            .map(|(_, mb)| mb);
        let mut dying = Dying {
            inner: &mut stage,
            at: die,
        };
        let stats = step_on(&mut pipe, &dev, &mut dying)?;
        stage.on_grad = None;
        let mut g = stage.grads.clone();
        if let Some(d) = &ddp {
            let mut d = d.borrow_mut();
            d.finish()?;
            g = zeros_like(&stage.params);
            for &l in &layers {
                g[l].0 = d.grad::<f32>(local(2 * l))?.to_vec();
                g[l].1 = d.grad::<f32>(local(2 * l + 1))?.to_vec();
            }
        }
        if let Some(z) = &zero {
            // The optimizer is ZeRO's (its SGD on this rank's shard, then the all-gather): the
            // gradient it applied is not kept whole anywhere, so only parameters are compared.
            let mut views = views_of(&mut stage.params, &layers);
            z.borrow_mut().step(&mut views)?;
            g = Vec::new();
        } else {
            sgd(&mut stage.params, &g, sh.lr);
        }
        if let Some((wg, wp, _)) = &want {
            let pick = |x: &Layers| -> Layers { layers.iter().map(|&l| x[l].clone()).collect() };
            let grads = if g.is_empty() {
                0.0
            } else {
                max_rel_diff(&pick(&g), &pick(&wg[step]))
            };
            let d = grads.max(if step + 1 == o.steps {
                max_rel_diff(&pick(&stage.params), &pick(wp))
            } else {
                0.0
            });
            t.worst = t.worst.max(d);
            if d > 1e-5 {
                return Err(format!(
                    "rank {}: step {step}: {d:e} from the one-process run",
                    world.rank()
                )
                .into());
            }
        }
        if !g.is_empty() {
            t.grads.push(g);
        }
        t.losses.push(stage.loss);
        t.stats.push(stats);
    }
    t.params = stage.params.clone();
    #[cfg(feature = "cuda")]
    {
        t.device_path = pipe.comm().stats().device_path;
    }
    Ok(t)
}
