//! [`DeviceZero`]: the sharded optimizer over CUDA device parameters (feature `cuda`): the same
//! shards, buckets, agreement and checkpoints as [`Zero`](crate::Zero), with the gradients'
//! buckets, the shard's gradient, the f32 master weights and the optimizer state in device
//! memory, every copy, collective and optimizer kernel enqueued on the trainer's stream (no host
//! synchronisation in a step but the agreement's host all-reduce). The optimizers are the
//! kernels crate's `oxccl_adamw_f32` and `oxccl_sgd_f32`, which do each element's arithmetic as
//! the host's [`AdamW`] and [`Sgd`] do.
//!
//! Its GPU test (`cargo test -p oxccl-zero --features cuda --test zero -- device --ignored`:
//! 2 and 4 ranks against DDP and the same optimizer) passed on an H200; the kernels' arithmetic
//! is also tested against the host's without one.

use std::sync::Arc;

use oxccl_comm::cuda::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, DriverError, ValidAsZeroBits,
};
use oxccl_comm::Communicator;
use oxccl_kernels::cuda::CudaKernels;

use crate::agree::agree;
use crate::elem::ParamElement;
use crate::error::{Result, ZeroError};
use crate::optim::{AdamW, Hyper, Sgd, ShardOptimizer};
use crate::shard::{Piece, ShardLayout};
use crate::zero::{groups, split, Stage, ZeroConfig};

mod step;

/// A parameter element type on the device: `f32`, `half::f16`, `half::bf16`.
pub trait DeviceParam: ParamElement + DeviceRepr + ValidAsZeroBits {
    /// `dst = src` widened to f32, on `stream`.
    #[doc(hidden)]
    fn widen(
        k: &CudaKernels,
        stream: &Arc<CudaStream>,
        dst: &mut CudaViewMut<'_, f32>,
        src: &CudaView<'_, Self>,
    ) -> std::result::Result<(), String>;
    /// `dst = src` rounded from f32, on `stream`.
    #[doc(hidden)]
    fn narrow(
        k: &CudaKernels,
        stream: &Arc<CudaStream>,
        dst: &mut CudaViewMut<'_, Self>,
        src: &CudaView<'_, f32>,
    ) -> std::result::Result<(), String>;
}

impl DeviceParam for f32 {
    fn widen(
        _: &CudaKernels,
        stream: &Arc<CudaStream>,
        dst: &mut CudaViewMut<'_, f32>,
        src: &CudaView<'_, f32>,
    ) -> std::result::Result<(), String> {
        stream.memcpy_dtod(src, dst).map_err(|e| format!("{e:?}"))
    }
    fn narrow(
        _: &CudaKernels,
        stream: &Arc<CudaStream>,
        dst: &mut CudaViewMut<'_, f32>,
        src: &CudaView<'_, f32>,
    ) -> std::result::Result<(), String> {
        stream.memcpy_dtod(src, dst).map_err(|e| format!("{e:?}"))
    }
}

macro_rules! half_param {
    ($t:ty) => {
        impl DeviceParam for $t {
            fn widen(
                k: &CudaKernels,
                stream: &Arc<CudaStream>,
                dst: &mut CudaViewMut<'_, f32>,
                src: &CudaView<'_, $t>,
            ) -> std::result::Result<(), String> {
                k.cast::<$t, f32>(stream, dst, src, 1.0)
                    .map_err(|e| e.to_string())
            }
            fn narrow(
                k: &CudaKernels,
                stream: &Arc<CudaStream>,
                dst: &mut CudaViewMut<'_, $t>,
                src: &CudaView<'_, f32>,
            ) -> std::result::Result<(), String> {
                k.cast::<f32, $t>(stream, dst, src, 1.0)
                    .map_err(|e| e.to_string())
            }
        }
    };
}
half_param!(half::f16);
half_param!(half::bf16);

/// The optimizers with a device kernel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DeviceOptimizer {
    /// [`AdamW`] (`oxccl_adamw_f32`).
    AdamW(AdamW),
    /// [`Sgd`] (`oxccl_sgd_f32`).
    Sgd(Sgd),
}

impl DeviceOptimizer {
    fn name(&self) -> &'static str {
        match self {
            DeviceOptimizer::AdamW(_) => "adamw",
            DeviceOptimizer::Sgd(_) => "sgd",
        }
    }

    fn names(&self) -> Vec<String> {
        match self {
            DeviceOptimizer::AdamW(o) => o.state_names(),
            DeviceOptimizer::Sgd(o) => o.state_names(),
        }
    }

    fn states(&self) -> usize {
        match self {
            DeviceOptimizer::AdamW(_) => 2,
            DeviceOptimizer::Sgd(s) => usize::from(s.momentum != 0.0),
        }
    }
}

/// The sharded optimizer on device parameters of `T` (see the module docs).
pub struct DeviceZero<T: DeviceParam> {
    rank: usize,
    world: usize,
    shard: Communicator,
    replica: Option<Communicator>,
    check: Communicator,
    /// This rank writes its shard's checkpoint file (it is in the first replica).
    writer: bool,
    stream: Arc<CudaStream>,
    kernels: Arc<CudaKernels>,
    layout: ShardLayout,
    stage: Stage,
    pieces: Vec<Piece>,
    hypers: Vec<Hyper>,
    opt: DeviceOptimizer,
    /// Per bucket: its f32 buffer (padded), gradients widened into it.
    buckets: Vec<CudaSlice<f32>>,
    /// A reduce-scatter's chunk before it is added to `grad`; a widened gradient before it is
    /// added to its bucket.
    chunk_tmp: CudaSlice<f32>,
    widen_tmp: CudaSlice<f32>,
    grad: CudaSlice<f32>,
    master: CudaSlice<f32>,
    /// One vector per state (AdamW: `exp_avg`, `exp_avg_sq`), `shard_len` each.
    state: Vec<CudaSlice<f32>>,
    /// A bucket's all-gather in `T`, and this rank's chunk of it.
    gather: CudaSlice<T>,
    mine: CudaSlice<T>,
    t: u64,
    accumulate: usize,
    micro: usize,
    given: Vec<bool>,
    pending: Vec<usize>,
    next: usize,
    fault: Option<String>,
    poisoned: Option<String>,
}

impl<T: DeviceParam> std::fmt::Debug for DeviceZero<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceZero")
            .field("rank", &self.rank)
            .field("group", &self.layout.group())
            .field("stage", &self.stage)
            .field("optimizer", &self.opt.name())
            .field("t", &self.t)
            .finish()
    }
}

fn device_err(rank: usize, op: &'static str, what: &str, e: impl std::fmt::Debug) -> ZeroError {
    ZeroError::InvalidArgument {
        rank,
        op,
        msg: format!("device: {what}: {e:?}"),
    }
}

/// The device buffers of a [`DeviceZero`], allocated (zeroed) on its stream.
struct Buffers<T: DeviceParam> {
    buckets: Vec<CudaSlice<f32>>,
    chunk_tmp: CudaSlice<f32>,
    widen_tmp: CudaSlice<f32>,
    grad: CudaSlice<f32>,
    master: CudaSlice<f32>,
    state: Vec<CudaSlice<f32>>,
    gather: CudaSlice<T>,
    mine: CudaSlice<T>,
}

impl<T: DeviceParam> Buffers<T> {
    fn new(
        stream: &Arc<CudaStream>,
        layout: &ShardLayout,
        states: usize,
    ) -> std::result::Result<Buffers<T>, DriverError> {
        let (n, g) = (layout.shard_len(), layout.group());
        let f = |len: usize| stream.alloc_zeros::<f32>(len.max(1));
        let t = |len: usize| stream.alloc_zeros::<T>(len.max(1));
        let sizes = layout.buckets().iter();
        let largest = sizes.clone().map(|b| b.padded(g)).max().unwrap_or(1);
        let chunk = sizes.clone().map(|b| b.chunk).max().unwrap_or(1);
        let widest = layout.lens().iter().copied().max().unwrap_or(1);
        Ok(Buffers {
            buckets: sizes
                .map(|b| f(b.padded(g)))
                .collect::<std::result::Result<_, _>>()?,
            chunk_tmp: f(chunk)?,
            widen_tmp: f(widest)?,
            grad: f(n)?,
            master: f(n)?,
            state: (0..states)
                .map(|_| f(n))
                .collect::<std::result::Result<_, _>>()?,
            gather: t(largest)?,
            mine: t(chunk)?,
        })
    }
}

impl<T: DeviceParam> DeviceZero<T> {
    /// As [`Zero::new`](crate::Zero::new) on device parameters whose gradients the trainer
    /// computes on `stream`: compares the parameters and settings between the ranks, broadcasts
    /// rank 0's `params` (on `stream`), and allocates the buffers and the shard's master
    /// weights (from the parameters) and state. Collective.
    ///
    /// # Errors
    /// As `Zero::new`; `InvalidArgument` for `max_grad_norm` (not on device yet) and for a
    /// failed allocation or kernel load (the message starts with `device:`).
    pub fn new(
        comm: &Communicator,
        stream: &Arc<CudaStream>,
        params: &mut [CudaViewMut<'_, T>],
        hypers: Vec<Hyper>,
        opt: DeviceOptimizer,
        cfg: ZeroConfig,
    ) -> Result<DeviceZero<T>> {
        let rank = comm.rank();
        let check = split(comm, 0, rank)?;
        let lens: Vec<usize> = params.iter().map(|p| p.len()).collect();
        let kernels = CudaKernels::new(stream.context());
        let fault = if hypers.len() != params.len() {
            Some(format!(
                "{} hyper-parameter sets for {} parameters",
                hypers.len(),
                params.len()
            ))
        } else if cfg.max_grad_norm.is_some() {
            Some("max_grad_norm is not available on device parameters yet".to_string())
        } else {
            kernels
                .as_ref()
                .err()
                .map(|e| format!("device: loading the kernels: {e}"))
        };
        let call = format!(
            "device parameters {lens:?} of {:?}, {hypers:?}, {:?}, stage {:?}, buckets of {}, \
             align {}, {opt:?}",
            T::DTYPE,
            cfg.group,
            cfg.stage,
            cfg.bucket_elems,
            cfg.align
        );
        agree(&check, rank, "new", &call, fault.as_deref())?;
        let kernels = kernels.map_err(|e| device_err(rank, "new", "loading the kernels", e))?;
        let (shard, replica) = groups(comm, cfg.group)?;
        let writer = replica.as_ref().is_none_or(|r| r.rank() == 0);
        let layout = ShardLayout::bucketed(&lens, shard.size(), cfg.align, cfg.bucket_elems);
        let sc = comm.on_stream(stream);
        for p in params.iter_mut().filter(|p| !p.is_empty()) {
            sc.broadcast(p, 0)?;
        }
        // Every rank learns of a rank that could not allocate, before any further collective.
        let bufs = Buffers::new(stream, &layout, opt.states());
        let fault = bufs
            .as_ref()
            .err()
            .map(|e| format!("device: allocating: {e:?}"));
        agree(&check, rank, "new", "device buffers", fault.as_deref())?;
        let bufs = bufs.map_err(|e| device_err(rank, "new", "allocating", e))?;
        let pieces = layout.pieces(shard.rank());
        let mut z = DeviceZero {
            rank,
            world: comm.size(),
            check,
            writer,
            stream: Arc::clone(stream),
            kernels: Arc::new(kernels),
            stage: cfg.stage,
            hypers,
            opt,
            buckets: bufs.buckets,
            chunk_tmp: bufs.chunk_tmp,
            widen_tmp: bufs.widen_tmp,
            grad: bufs.grad,
            master: bufs.master,
            state: bufs.state,
            gather: bufs.gather,
            mine: bufs.mine,
            t: 0,
            accumulate: 1,
            micro: 0,
            given: vec![false; lens.len()],
            pending: layout.buckets().iter().map(|b| b.params.len()).collect(),
            next: 0,
            fault: None,
            poisoned: None,
            pieces,
            layout,
            shard,
            replica,
        };
        z.masters_from(params)?;
        Ok(z)
    }

    /// The shard's master weights from `params` (widened to f32).
    fn masters_from(&mut self, params: &[CudaViewMut<'_, T>]) -> Result<()> {
        for pc in &self.pieces {
            let src = params[pc.param].slice(pc.param_offset..pc.param_offset + pc.len);
            let mut dst = self
                .master
                .slice_mut(pc.shard_offset..pc.shard_offset + pc.len);
            T::widen(&self.kernels, &self.stream, &mut dst, &src)
                .map_err(|e| device_err(self.rank, "new", "master weights", e))?;
        }
        Ok(())
    }
}
