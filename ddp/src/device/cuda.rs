//! [`DeviceDdp`]: the device plan run with cudarc. Buckets are device buffers allocated on the
//! trainer's stream; gradients are copied (or added) into them on that stream; each full bucket's
//! all-reduce is enqueued on the reducer's communication stream after an event recorded on the
//! trainer's; `finish` makes the trainer's stream wait for an event recorded on the
//! communication stream. Nothing here waits on the host, except the step's small host
//! collectives (the rebuilt order after the first step, the used-parameter map) and what the
//! communicator's device calls themselves wait for (see oxccl-comm's `cuda` module).

use std::borrow::Borrow;
use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use oxccl_comm::cuda::cudarc::driver::{CudaEvent, CudaStream, CudaView, CudaViewMut};
use oxccl_comm::{Communicator, DType, ReduceOp};
use oxccl_kernels::cuda::CudaKernels;
use oxccl_kernels::{bf16, f16};

use super::device_hook;
use super::plan::{Ending, Event, Op, Planner, Queue};
use super::types::{DevBucket, DevGrad, DevGradMut, DeviceElement, DeviceParam};
use crate::agree::agree;
use crate::config::{DdpConfig, Step, UnevenInputs};
use crate::error::{DdpError, Result};
use crate::hooks::{CommHook, DeviceHook};
use crate::layout::ParamSpec;
use crate::reducer::settings;

/// The gradients one call hands over.
enum Grads<'g, 'a> {
    None,
    One(usize, &'g DevGrad<'a>),
    All(&'g mut [DevGradMut<'a>]),
}

/// Data-parallel gradient reducer over device gradients (see the crate docs, "On the GPU"):
/// the API of [`Ddp`](crate::Ddp), with gradients as cudarc buffers and every step enqueued on
/// the trainer's CUDA stream and a communication stream of its own.
pub struct DeviceDdp<C: Borrow<Communicator> = Communicator> {
    comm: C,
    trainer: Arc<CudaStream>,
    comm_stream: Arc<CudaStream>,
    planner: Planner,
    buckets: Vec<DevBucket>,
    /// Per bucket: the compressed copy sent on the wire (allocated on first use).
    wires: Vec<Option<DevBucket>>,
    events: HashMap<Event, CudaEvent>,
    kernels: Option<Arc<CudaKernels>>,
    /// What made an enqueueing call fail part-way: the streams may then lack work the plan
    /// counts on, so every later call refuses (as the host `Ddp` after a failed collective).
    failed: Option<String>,
}

impl<C: Borrow<Communicator>> std::fmt::Debug for DeviceDdp<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceDdp")
            .field("rank", &self.comm.borrow().rank())
            .field("params", &self.planner.specs.len())
            .field("buckets", &self.buckets.len())
            .finish()
    }
}

/// Allocates a zeroed bucket of `len` elements of `dtype` on `stream` (at least one element:
/// an empty parameter's bucket is never reduced).
fn alloc(
    stream: &Arc<CudaStream>,
    dtype: DType,
    len: usize,
) -> std::result::Result<DevBucket, String> {
    let n = len.max(1);
    let r = match dtype {
        DType::F32 => stream.alloc_zeros::<f32>(n).map(DevBucket::F32),
        DType::F64 => stream.alloc_zeros::<f64>(n).map(DevBucket::F64),
        DType::F16 => stream.alloc_zeros::<f16>(n).map(DevBucket::F16),
        DType::BF16 => stream.alloc_zeros::<bf16>(n).map(DevBucket::BF16),
        other => {
            return Err(format!(
                "{} gradients are not taken on device",
                other.short_name()
            ))
        }
    };
    r.map_err(|e| format!("allocating a bucket of {len} {}: {e:?}", dtype.short_name()))
}

impl<C: Borrow<Communicator>> DeviceDdp<C> {
    /// Sets up the reducer for `params` (device buffers of `f32`, `f64`, `f16` or `bf16`), whose
    /// gradients the trainer computes on `stream`: compares the parameter list and `cfg` between
    /// the ranks, broadcasts rank 0's values into every rank's `params` (on `stream`), and
    /// allocates the buckets. Collective. `cfg.overlap` is not consulted: buckets always launch
    /// as they fill (the GPU does the work). `cfg.uneven_inputs` is not available on device.
    ///
    /// # Errors
    /// `InvalidArgument` for settings or parameter lists that differ between ranks, zero bucket
    /// caps, or uneven inputs; `Device` if an allocation fails; the broadcast's errors.
    pub fn new(
        comm: C,
        stream: &Arc<CudaStream>,
        params: &mut [DeviceParam<'_>],
        cfg: DdpConfig,
    ) -> Result<DeviceDdp<C>> {
        let specs: Vec<(String, DType, usize)> = params
            .iter()
            .map(|p| (p.name.clone(), p.values.dtype(), p.values.len()))
            .collect();
        let ddp = DeviceDdp::without_broadcast(comm, stream, &specs, cfg)?;
        let sc = ddp.comm().on_stream(stream);
        for p in params.iter_mut().filter(|p| !p.values.is_empty()) {
            each!(DevGradMut, &mut p.values, v => sc.broadcast(v, 0))?;
        }
        Ok(ddp)
    }

    /// [`DeviceDdp::new`] for parameters the caller makes equal on every rank itself (candle's
    /// variables, which `oxccl-candle` broadcasts in their own storage): `params` lists each
    /// one's name, dtype and length. Compares the list and `cfg` between the ranks and allocates
    /// the buckets. Collective.
    ///
    /// # Errors
    /// As [`DeviceDdp::new`].
    pub fn without_broadcast(
        comm: C,
        stream: &Arc<CudaStream>,
        params: &[(String, DType, usize)],
        cfg: DdpConfig,
    ) -> Result<DeviceDdp<C>> {
        let c = comm.borrow();
        let rank = c.rank();
        let specs: Vec<ParamSpec> = params
            .iter()
            .map(|(name, dtype, len)| ParamSpec {
                name: name.clone(),
                len: *len,
                dtype: *dtype,
            })
            .collect();
        agree(c, "new", &settings(&specs, &cfg), &mut [])?;
        let planner = Planner::new(rank, specs, cfg);
        let cfg = &planner.cfg;
        if cfg.bucket_cap_bytes == 0 || cfg.first_bucket_bytes == 0 {
            let msg = "bucket caps must be positive";
            return Err(planner.invalid("new", msg));
        }
        if cfg.uneven_inputs != UnevenInputs::Off {
            let msg = "uneven_inputs is not available on device gradients (host Ddp only)";
            return Err(planner.invalid("new", msg));
        }
        let comm_stream = stream.context().new_stream().map_err(|e| {
            device(
                rank,
                "new",
                format!("creating the communication stream: {e:?}"),
            )
        })?;
        let buckets = planner
            .buckets()
            .iter()
            .map(|b| alloc(stream, b.dtype, b.len))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|m| device(rank, "new", m))?;
        Ok(DeviceDdp {
            comm,
            trainer: Arc::clone(stream),
            comm_stream,
            wires: buckets.iter().map(|_| None).collect(),
            buckets,
            planner,
            events: HashMap::new(),
            kernels: None,
            failed: None,
        })
    }

    /// The communicator.
    pub fn comm(&self) -> &Communicator {
        self.comm.borrow()
    }

    /// The trainer's stream (given to `new`): gradients are read there, averages are ready
    /// there after `finish`.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.trainer
    }

    /// The reducer's own stream, where the buckets' all-reduces run.
    pub fn comm_stream(&self) -> &Arc<CudaStream> {
        &self.comm_stream
    }

    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        self.planner.specs.len()
    }

    /// Parameter `p`'s name.
    pub fn param_name(&self, p: usize) -> Option<&str> {
        self.planner.specs.get(p).map(|s| s.name.as_str())
    }

    /// The index of the parameter named `name`.
    pub fn param_index(&self, name: &str) -> Option<usize> {
        self.planner.specs.iter().position(|s| s.name == name)
    }

    /// The configuration.
    pub fn config(&self) -> &DdpConfig {
        &self.planner.cfg
    }

    /// The parameters of each bucket, in launch order.
    pub fn bucket_params(&self) -> Vec<Vec<usize>> {
        self.planner
            .buckets()
            .iter()
            .map(|b| b.params.clone())
            .collect()
    }

    /// Synchronised steps so far.
    pub fn steps(&self) -> u64 {
        self.planner.steps()
    }

    /// With `find_unused_parameters`: the parameters no rank gave a gradient in the last step.
    pub fn unused_on_every_rank(&self) -> &[usize] {
        self.planner.unused_on_every_rank()
    }

    /// As [`Ddp::accumulate`](crate::Ddp::accumulate).
    ///
    /// # Errors
    /// `InvalidArgument` for `k == 0` or in the middle of a step.
    pub fn accumulate(&mut self, k: usize) -> Result<()> {
        self.usable("accumulate")?;
        if k > 1 {
            // Later micro-batches add on the device: load the kernels now, not in a step.
            self.kernels("accumulate")?;
        }
        self.planner.accumulate(k)
    }

    /// As [`Ddp::no_sync`](crate::Ddp::no_sync).
    pub fn no_sync(&mut self) -> DeviceNoSync<'_, C> {
        // Micro-batches after the first add on the device: load the kernels now, not in a step
        // (a failure is reported by the first addition that needs them).
        let _ = self.kernels("no_sync");
        let prev = self.planner.no_sync;
        self.planner.no_sync = true;
        DeviceNoSync { ddp: self, prev }
    }

    /// Replaces the all-reduce of each bucket: [`AllReduceAvg`](crate::AllReduceAvg) or
    /// [`CompressHook`](crate::CompressHook) (f32 buckets sent as f16 or bf16, converted by the
    /// kernels crate's conversion kernels on the communication stream).
    ///
    /// # Errors
    /// `InvalidArgument` for a hook that runs on host memory only (PowerSGD, post-local SGD),
    /// compression with `f64` parameters, or a call in the middle of a step.
    pub fn set_comm_hook(&mut self, hook: impl CommHook + 'static) -> Result<()> {
        self.usable("set_comm_hook")?;
        let h = device_hook(&hook, self.comm().rank())?;
        // The conversion kernels, loaded now (not in a step); whether every rank could is part
        // of the comparison, so that all refuse the hook alike.
        let loaded = match h {
            DeviceHook::Compress(_) => self.kernels("set_comm_hook").map(|_| ()),
            DeviceHook::Avg => Ok(()),
        };
        let word = crate::agree::fnv1a_str(hook.name());
        let s = crate::agree::Setting::described("the comm hook", word, hook.name().to_string());
        let mut failed = [u64::from(loaded.is_err())];
        agree(self.comm.borrow(), "set_comm_hook", &[s], &mut failed)?;
        loaded?;
        if failed[0] != 0 {
            let msg = "another rank could not load the conversion kernels the hook needs";
            return Err(self.planner.invalid("set_comm_hook", msg));
        }
        self.planner.set_hook(h)?;
        // Compressed copies of the old wire dtype go (freed on the communication stream).
        self.wires.iter_mut().for_each(|w| *w = None);
        Ok(())
    }

    /// Hands over parameter `param`'s gradient, computed on the trainer's stream: copied (or, in
    /// later micro-batches of a step, added) into its bucket on that stream; a bucket that fills
    /// (with every bucket before it launched) is all-reduced on the communication stream after
    /// an event. Returns once enqueued.
    ///
    /// # Errors
    /// `InvalidArgument` for an index out of range, a dtype or length that is not the
    /// parameter's, or a second gradient in one backward pass; `Device`; the collective's.
    pub fn grad_ready<'a>(&mut self, param: usize, grad: impl Into<DevGrad<'a>>) -> Result<()> {
        self.usable("grad_ready")?;
        let g = grad.into();
        let ops = self.planner.grad_ready(param, g.dtype(), g.len())?;
        self.apply("grad_ready", ops, Grads::One(param, &g))
    }

    /// Parameter `param`'s slot in its bucket (PyTorch's `gradient_as_bucket_view`): write the
    /// gradient there on the trainer's stream (`true`: overwrite; `false`: add to the earlier
    /// micro-batches' sum), then call [`DeviceDdp::grad_ready_in_place`]. Saves a copy.
    ///
    /// # Errors
    /// As [`Ddp::grad_slot`](crate::Ddp::grad_slot).
    pub fn grad_slot<T: DeviceElement>(
        &mut self,
        param: usize,
    ) -> Result<(CudaViewMut<'_, T>, bool)> {
        self.usable("grad_slot")?;
        let (ops, fresh) = self.planner.grad_slot(param, T::DTYPE)?;
        self.apply("grad_slot", ops, Grads::None)?;
        let (b, off, len) = self.planner.slot(param);
        let rank = self.comm().rank();
        let s = T::bucket_mut(&mut self.buckets[b])
            .ok_or_else(|| device(rank, "grad_slot", "bucket dtype".into()))?;
        Ok((s.slice_mut(off..off + len), fresh))
    }

    /// Declares that parameter `param`'s slot holds its gradient (as `grad_ready` after its copy).
    ///
    /// # Errors
    /// As [`Ddp::grad_ready_in_place`](crate::Ddp::grad_ready_in_place).
    pub fn grad_ready_in_place(&mut self, param: usize) -> Result<()> {
        self.usable("grad_ready_in_place")?;
        let ops = self.planner.grad_ready_in_place(param)?;
        self.apply("grad_ready_in_place", ops, Grads::None)
    }

    /// Ends a backward pass: in an accumulating micro-batch only counts it; otherwise zeros the
    /// slots of parameters without a gradient, launches the remaining buckets, and makes the
    /// trainer's stream wait for the communication stream (an event: the host does not wait for
    /// the GPU). Work enqueued on the trainer's stream afterwards (the optimizer step) sees the
    /// averages ([`DeviceDdp::grad`]). Collective.
    ///
    /// # Errors
    /// A failure of an earlier device collective ([`Communicator::device_async_error`]); the
    /// step's host collectives'; `UnusedParameters` as [`Ddp::finish`](crate::Ddp::finish).
    pub fn finish(&mut self) -> Result<Step> {
        self.usable("finish")?;
        let mut ops = Vec::new();
        let ending = self.planner.finish(&mut ops);
        self.apply("finish", ops, Grads::None)?;
        self.end(ending)
    }

    /// Every gradient at once (frameworks whose backward returns them all, candle's): copied
    /// into the buckets bucket by bucket, each all-reduced as soon as packed, and in a
    /// synchronising step the averages copied back into `grads` on the trainer's stream.
    /// `grads[p]` is parameter `p`'s gradient.
    ///
    /// # Errors
    /// `InvalidArgument` for a wrong count, dtype or length; as [`DeviceDdp::finish`].
    pub fn sync(&mut self, grads: &mut [DevGradMut<'_>]) -> Result<Step> {
        self.usable("sync")?;
        let given: Vec<(DType, usize)> = grads.iter().map(|g| (g.dtype(), g.len())).collect();
        let (ops, ending) = self.planner.sync(&given)?;
        self.apply("sync", ops, Grads::All(grads))?;
        self.end(ending)
    }

    /// Parameter `param`'s gradient in its bucket, for work on the trainer's stream: after a
    /// synchronised `finish()` or `sync()` the average, until the next backward pass.
    ///
    /// # Errors
    /// `InvalidArgument` for an index out of range, a `T` that is not the parameter's dtype, or
    /// a bucket being reduced.
    pub fn grad<T: DeviceElement>(&self, param: usize) -> Result<CudaView<'_, T>> {
        self.usable("grad")?;
        self.planner.check(param, "grad", T::DTYPE, None)?;
        self.planner.readable(param)?;
        let (b, off, len) = self.planner.slot(param);
        let s = T::bucket(&self.buckets[b])
            .ok_or_else(|| device(self.comm().rank(), "grad", "bucket dtype".into()))?;
        Ok(s.slice(off..off + len))
    }

    fn end(&mut self, ending: Ending) -> Result<Step> {
        match ending {
            Ending::Accumulated(step) => Ok(step),
            Ending::Synced { unused } => {
                if let Some(e) = self.comm().device_async_error() {
                    return Err(e.into());
                }
                self.planner.complete(self.comm.borrow(), unused)
            }
        }
    }

    fn kernels(&mut self, op: &'static str) -> Result<Arc<CudaKernels>> {
        if let Some(k) = &self.kernels {
            return Ok(Arc::clone(k));
        }
        let k = CudaKernels::new(self.trainer.context())
            .map_err(|e| device(self.comm().rank(), op, format!("loading the kernels: {e}")))?;
        let k = Arc::new(k);
        self.kernels = Some(Arc::clone(&k));
        Ok(k)
    }

    fn queue(&self, q: Queue) -> &Arc<CudaStream> {
        match q {
            Queue::Trainer => &self.trainer,
            Queue::Comm => &self.comm_stream,
        }
    }

    fn apply(&mut self, op: &'static str, ops: Vec<Op>, mut grads: Grads<'_, '_>) -> Result<()> {
        let rank = self.comm().rank();
        for o in ops {
            let r = self.apply_one(op, o, &mut grads).map_err(|e| match e {
                Failure::Ddp(e) => e,
                Failure::Msg(m) => device(rank, op, format!("{o:?}: {m}")),
            });
            if let Err(e) = r {
                // The plan moved on without this op: refuse every later call, and order the
                // trainer's stream after whatever the communication stream still holds.
                self.failed = Some(e.to_string());
                let _ = self.trainer.join(&self.comm_stream);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Refuses a call after an enqueueing call failed part-way.
    fn usable(&self, op: &'static str) -> Result<()> {
        match &self.failed {
            None => Ok(()),
            Some(m) => Err(device(
                self.comm().rank(),
                op,
                format!(
                    "an earlier call failed ({m}); this DeviceDdp is done with: make a new one"
                ),
            )),
        }
    }
}

/// What one op's failure was: an error already made, or a driver message to wrap.
enum Failure {
    Ddp(DdpError),
    Msg(String),
}

impl From<DdpError> for Failure {
    fn from(e: DdpError) -> Failure {
        Failure::Ddp(e)
    }
}

impl From<oxccl_comm::Error> for Failure {
    fn from(e: oxccl_comm::Error) -> Failure {
        Failure::Ddp(e.into())
    }
}

fn msg(e: impl std::fmt::Debug) -> Failure {
    Failure::Msg(format!("{e:?}"))
}

fn device(rank: usize, op: &'static str, msg: String) -> DdpError {
    DdpError::Device { rank, op, msg }
}

impl<C: Borrow<Communicator>> DeviceDdp<C> {
    fn apply_one(
        &mut self,
        op: &'static str,
        o: Op,
        grads: &mut Grads<'_, '_>,
    ) -> std::result::Result<(), Failure> {
        match o {
            Op::Relayout => {
                // The old buckets go first (freed on the trainer's stream, which waited for the
                // last step's reduces), so the two layouts never hold memory at once.
                self.buckets.clear();
                self.wires.clear();
                self.buckets = self
                    .planner
                    .buckets()
                    .iter()
                    .map(|b| alloc(&self.trainer, b.dtype, b.len))
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(Failure::Msg)?;
                self.wires = self.buckets.iter().map(|_| None).collect();
            }
            Op::CopyIn { param, add } => {
                let kernels = if add { Some(self.kernels(op)?) } else { None };
                let (b, off, len) = self.planner.slot(param);
                let src = match grads {
                    Grads::One(p, g) if *p == param => &**g,
                    Grads::All(all) => &all[param].as_grad(),
                    _ => return Err(Failure::Msg("no gradient given".into())),
                };
                copy_in(
                    &self.trainer,
                    &mut self.buckets[b],
                    off,
                    len,
                    src,
                    kernels.as_deref(),
                )?;
            }
            Op::Zero { param } => {
                let (b, off, len) = self.planner.slot(param);
                let s = &self.trainer;
                let slot = off..off + len;
                each!(DevBucket, &mut self.buckets[b], d => s.memset_zeros(&mut d.slice_mut(slot)))
                    .map_err(msg)?;
            }
            Op::Record { on, event } => {
                let stream = Arc::clone(self.queue(on));
                let ev = match self.events.entry(event) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::hash_map::Entry::Vacant(v) => {
                        v.insert(stream.context().new_event(None).map_err(msg)?)
                    }
                };
                ev.record(&stream).map_err(msg)?;
            }
            Op::Wait { on, event } => {
                let ev = self
                    .events
                    .get(&event)
                    .ok_or_else(|| Failure::Msg("never recorded".into()))?;
                self.queue(on).wait(ev).map_err(msg)?;
            }
            Op::Reduce { bucket, wire } => self.reduce(op, bucket, wire)?,
            Op::CopyOut { param } => {
                let (b, off, len) = self.planner.slot(param);
                let Grads::All(all) = grads else {
                    return Err(Failure::Msg("no gradient given".into()));
                };
                copy_out(&self.trainer, &self.buckets[b], off, len, &mut all[param])?;
            }
        }
        Ok(())
    }

    /// Bucket `b` averaged over the ranks on the communication stream; `wire`: through a
    /// compressed copy (scaled by 1/world, converted, summed, converted back).
    fn reduce(
        &mut self,
        op: &'static str,
        b: usize,
        wire: Option<DType>,
    ) -> std::result::Result<(), Failure> {
        let len = self.planner.buckets()[b].len;
        if len == 0 {
            return Ok(());
        }
        let Some(w) = wire else {
            let sc = self.comm.borrow().on_stream(&self.comm_stream);
            let (avg, all) = (ReduceOp::Avg, 0..len);
            each!(DevBucket, &mut self.buckets[b], s => sc.all_reduce(&mut s.slice_mut(all), avg))?;
            return Ok(());
        };
        let k = self.kernels(op)?;
        let cs = Arc::clone(&self.comm_stream);
        if self.wires[b].is_none() {
            self.wires[b] = Some(alloc(&cs, w, len).map_err(Failure::Msg)?);
        }
        let inv = 1.0 / self.comm.borrow().size() as f64;
        let sc = self.comm.borrow().on_stream(&cs);
        let (DevBucket::F32(s), Some(wb)) = (&mut self.buckets[b], self.wires[b].as_mut()) else {
            return Err(Failure::Msg(
                "compression of a bucket that is not f32".into(),
            ));
        };
        macro_rules! through {
            ($h:ty, $d:expr) => {{
                let mut d = $d.slice_mut(0..len);
                k.cast::<f32, $h>(&cs, &mut d, &s.slice(0..len), inv)
                    .map_err(msg)?;
                sc.all_reduce(&mut d, ReduceOp::Sum)?;
                k.cast::<$h, f32>(&cs, &mut s.slice_mut(0..len), &d, 1.0)
                    .map_err(msg)?;
            }};
        }
        match wb {
            DevBucket::F16(d) => through!(f16, d),
            DevBucket::BF16(d) => through!(bf16, d),
            _ => return Err(Failure::Msg("the wire is not f16 or bf16".into())),
        }
        Ok(())
    }
}

/// `bucket[off..off + len]` = (or +=, with `kernels`) `src`, on `stream`.
fn copy_in(
    stream: &Arc<CudaStream>,
    bucket: &mut DevBucket,
    off: usize,
    len: usize,
    src: &DevGrad<'_>,
    kernels: Option<&CudaKernels>,
) -> std::result::Result<(), Failure> {
    macro_rules! go {
        ($v:ident) => {
            if let (DevBucket::$v(b), DevGrad::$v(g)) = (&mut *bucket, src) {
                let mut dst = b.slice_mut(off..off + len);
                match kernels {
                    Some(k) => k.add_into(stream, &mut dst, g).map_err(msg)?,
                    None => stream.memcpy_dtod(g, &mut dst).map_err(msg)?,
                }
                return Ok(());
            }
        };
    }
    go!(F32);
    go!(F64);
    go!(F16);
    go!(BF16);
    Err(Failure::Msg(
        "the gradient's dtype is not its bucket's".into(),
    ))
}

/// `dst` = `bucket[off..off + len]`, on `stream`.
fn copy_out(
    stream: &Arc<CudaStream>,
    bucket: &DevBucket,
    off: usize,
    len: usize,
    dst: &mut DevGradMut<'_>,
) -> std::result::Result<(), Failure> {
    macro_rules! go {
        ($v:ident) => {
            if let (DevBucket::$v(b), DevGradMut::$v(d)) = (bucket, &mut *dst) {
                stream
                    .memcpy_dtod(&b.slice(off..off + len), d)
                    .map_err(msg)?;
                return Ok(());
            }
        };
    }
    go!(F32);
    go!(F64);
    go!(F16);
    go!(BF16);
    Err(Failure::Msg(
        "the gradient's dtype is not its bucket's".into(),
    ))
}

impl<C: Borrow<Communicator>> Drop for DeviceDdp<C> {
    fn drop(&mut self) {
        // Buckets are freed on the trainer's stream: order it after the communication stream
        // (a reducer dropped between a launch and its `finish`).
        let _ = self.trainer.join(&self.comm_stream);
    }
}

/// While it lives, micro-batches only accumulate ([`DeviceDdp::no_sync`]); derefs to the
/// reducer.
pub struct DeviceNoSync<'a, C: Borrow<Communicator>> {
    ddp: &'a mut DeviceDdp<C>,
    prev: bool,
}

impl<C: Borrow<Communicator>> Deref for DeviceNoSync<'_, C> {
    type Target = DeviceDdp<C>;
    fn deref(&self) -> &DeviceDdp<C> {
        self.ddp
    }
}

impl<C: Borrow<Communicator>> DerefMut for DeviceNoSync<'_, C> {
    fn deref_mut(&mut self) -> &mut DeviceDdp<C> {
        self.ddp
    }
}

impl<C: Borrow<Communicator>> Drop for DeviceNoSync<'_, C> {
    fn drop(&mut self) {
        self.ddp.planner.no_sync = self.prev;
    }
}
