//! The CUDA path of [`CandleDdp`](crate::CandleDdp) (feature `cuda`): variables and gradients
//! stay in device memory. The variables are broadcast in their own storage (an in-place op on
//! candle's stream); each step's gradients go into oxccl's device buckets with `grad_ready` (one
//! device-to-device copy each, on candle's stream, the buckets' all-reduces on a communication
//! stream as they fill), and the averages come back as new tensors copied from the buckets.
//! No copy goes through the host.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::op::BackpropOp;
use candle_core::{
    CpuStorage, CudaDevice, CudaStorage, DType, InplaceOp1, Layout, Storage, Tensor, Var,
};
use half::{bf16, f16};
use oxccl_comm::cuda::cudarc::driver::CudaStream;
use oxccl_comm::Communicator;
use oxccl_ddp::{DdpConfig, DeviceDdp, Step};

use crate::{Error, Result};

/// Runs `$body` with `$t` the Rust type of candle dtype `$dt` (those DDP reduces), or returns
/// `$other`.
macro_rules! with_float {
    ($dt:expr, $t:ident => $body:expr, $other:expr) => {
        match $dt {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            DType::F16 => {
                type $t = f16;
                $body
            }
            DType::BF16 => {
                type $t = bf16;
                $body
            }
            _ => $other,
        }
    };
}

fn oxccl_dtype(rank: usize, op: &'static str, name: &str, dt: DType) -> Result<oxccl_comm::DType> {
    with_float!(dt, T => Ok(<T as oxccl_comm::Element>::DTYPE), Err(Error::InvalidArgument {
        rank,
        op,
        msg: format!("variable {name} is {dt:?}: DDP averages f32, f64, f16 and bf16"),
    }))
}

fn candle_err(rank: usize, op: &'static str, source: candle_core::Error) -> Error {
    Error::Candle { rank, op, source }
}

/// The device of variables that all live on one CUDA device.
pub(crate) fn device_of(rank: usize, vars: &[(String, Var)]) -> Result<Option<CudaDevice>> {
    let Some((_, first)) = vars.first() else {
        return Ok(None);
    };
    let candle_core::Device::Cuda(dev) = first.as_tensor().device() else {
        return Ok(None);
    };
    for (name, v) in vars {
        if !v
            .as_tensor()
            .device()
            .same_device(first.as_tensor().device())
        {
            return Err(Error::InvalidArgument {
                rank,
                op: "new",
                msg: format!(
                    "variable {name} is on {:?}, the first on {:?}: every variable must be on \
                     one device",
                    v.as_tensor().device().location(),
                    first.as_tensor().device().location()
                ),
            });
        }
    }
    Ok(Some(dev.clone()))
}

/// Broadcasts a CUDA tensor's elements from rank 0, in its own storage.
struct Broadcast<'a> {
    comm: &'a Communicator,
    stream: Arc<CudaStream>,
}

impl InplaceOp1 for Broadcast<'_> {
    fn name(&self) -> &'static str {
        "oxccl-broadcast"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        Err(candle_core::Error::Msg(
            "oxccl-broadcast: a CPU tensor on the CUDA path".into(),
        ))
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let (a, b) = layout.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg("oxccl-broadcast: a variable that is not contiguous".into())
        })?;
        if a == b {
            return Ok(()); // as DeviceDdp::new: empty parameters are not broadcast
        }
        let sc = self.comm.on_stream(&self.stream);
        let r = with_float!(s.dtype(), T => {
            sc.broadcast(&mut s.as_cuda_slice_mut::<T>()?.slice_mut(a..b), 0)
        }, return Err(candle_core::Error::Msg("oxccl-broadcast: dtype".into())));
        r.map_err(|e| candle_core::Error::Msg(e.to_string()))
    }
}

/// The device reducer of `vars` (on `dev`), after setting every variable to rank 0's value.
pub(crate) fn new(
    comm: Communicator,
    vars: &[(String, Var)],
    cfg: DdpConfig,
    dev: &CudaDevice,
) -> Result<DeviceDdp> {
    let rank = comm.rank();
    let mut specs = Vec::with_capacity(vars.len());
    for (name, v) in vars {
        let t = v.as_tensor();
        specs.push((
            name.clone(),
            oxccl_dtype(rank, "new", name, t.dtype())?,
            t.elem_count(),
        ));
    }
    let stream = dev.cuda_stream();
    let ddp = DeviceDdp::without_broadcast(comm, &stream, &specs, cfg)?;
    let op = Broadcast {
        comm: ddp.comm(),
        stream,
    };
    for (_, v) in vars {
        v.as_tensor()
            .inplace_op1(&op)
            .map_err(|e| candle_err(rank, "new", e))?;
    }
    Ok(ddp)
}

/// A step on the device: every gradient handed to `ddp` (last variable first, the order
/// backward produces them in), then `finish`, then the averages put into `grads`.
pub(crate) fn sync(
    ddp: &mut DeviceDdp,
    dev: &CudaDevice,
    vars: &[(String, Var)],
    grads: &mut GradStore,
    find_unused: bool,
) -> Result<Step> {
    let rank = ddp.comm().rank();
    // Every gradient checked (and made contiguous) before the first is handed over, so a bad
    // one fails the call before any bucket launches and the next step starts clean.
    let mut given: Vec<(usize, &str, Tensor)> = Vec::with_capacity(vars.len());
    for (p, (name, v)) in vars.iter().enumerate().rev() {
        let Some(g) = grads.get(v.as_tensor()) else {
            if find_unused {
                continue; // reduced as zeros by finish()
            }
            return Err(crate::no_gradient(rank, name));
        };
        crate::check_grad(rank, name, v.as_tensor(), g)?;
        let g = g.contiguous().map_err(|e| candle_err(rank, "sync", e))?;
        let (st, layout) = g.storage_and_layout();
        if !matches!(&*st, Storage::Cuda(_)) || layout.contiguous_offsets().is_none() {
            return Err(Error::InvalidArgument {
                rank,
                op: "sync",
                msg: format!("the gradient of {name} is not a contiguous CUDA tensor"),
            });
        }
        drop(st);
        given.push((p, name, g));
    }
    for (p, name, g) in &given {
        let (st, layout) = g.storage_and_layout();
        let bad = |what: &str| Error::InvalidArgument {
            rank,
            op: "sync",
            msg: format!("the gradient of {name}: {what}"),
        };
        let (Storage::Cuda(cs), Some((a, b))) = (&*st, layout.contiguous_offsets()) else {
            return Err(bad("not a contiguous CUDA tensor"));
        };
        with_float!(cs.dtype(), T => {
            let s = cs.as_cuda_slice::<T>().map_err(|e| candle_err(rank, "sync", e))?;
            ddp.grad_ready(*p, s.slice(a..b))?
        }, return Err(bad("a dtype DDP does not average")));
    }
    let step = ddp.finish()?;
    if let Step::Synced { .. } = step {
        let stream = dev.cuda_stream();
        for (p, (_, v)) in vars.iter().enumerate() {
            let t = v.as_tensor();
            let storage = with_float!(t.dtype(), T => {
                let avg = ddp.grad::<T>(p)?;
                let out = stream.clone_dtod(&avg).map_err(|e| Error::InvalidArgument {
                    rank,
                    op: "sync",
                    msg: format!("copying an average: {e:?}"),
                })?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }, continue);
            let avg =
                Tensor::from_storage(Storage::Cuda(storage), t.shape(), BackpropOp::none(), false);
            grads.insert(t, avg);
        }
    }
    Ok(step)
}
