//! oxccl-candle: data-parallel training of [candle](https://github.com/huggingface/candle)
//! models on oxccl. [`CandleDdp`] wraps a model's [`Var`]s: it broadcasts rank 0's weights when
//! it is made, so every replica starts alike, and averages the gradients of each step's
//! [`GradStore`] across the ranks through [`oxccl_ddp::Ddp::sync`] (buckets, launched as they
//! are packed), so every rank's optimizer applies the same update.
//!
//! ```no_run
//! use candle_core::{DType, Device, Tensor, Var};
//! use oxccl_candle::CandleDdp;
//! use oxccl_comm::Communicator;
//! use oxccl_ddp::DdpConfig;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let comm = Communicator::from_env()?; // under `oxccl launch -n 4 -- trainer`
//! let w = Var::randn(0f32, 1.0, (8, 1), &Device::Cpu)?; // each rank draws its own...
//! let mut ddp = CandleDdp::new(comm, vec![("w".into(), w.clone())], DdpConfig::default())?;
//! // ...and now holds rank 0's.
//! for _step in 0..10 {
//!     let x = Tensor::randn(0f32, 1.0, (16, 8), &Device::Cpu)?; // this rank's batch
//!     let loss = x.matmul(w.as_tensor())?.sqr()?.mean_all()?;
//!     let mut grads = loss.backward()?;
//!     ddp.sync(&mut grads)?; // now the mean over the ranks' batches
//!     let g = grads.get(w.as_tensor()).expect("w has a gradient");
//!     w.set(&(w.as_tensor() - (g * 0.1)?)?)?; // or candle_nn's optimizers: opt.step(&grads)
//! }
//! # let _ = DType::F32;
//! # Ok(()) }
//! ```
//!
//! Every rank must list the same variables in the same order, with the same names, shapes and
//! dtypes ([`oxccl_ddp::Ddp::new`] checks it; [`CandleDdp::from_varmap`] sorts a `VarMap`'s by
//! name). Gradients may be `f32`, `f64`, `f16` or `bf16`.
//!
//! **Where the tensors live.** Host tensors (`Device::Cpu`) are copied out of the `GradStore`
//! into DDP's flat buckets ([`Ddp`]) and the averages put back as new tensors. With the `cuda`
//! feature, variables on a CUDA device go through `oxccl_ddp::DeviceDdp` instead:
//! they are broadcast in their own device storage, each gradient is copied device to device into
//! a bucket on candle's stream while full buckets are all-reduced on a communication stream, and
//! the averages come back as new device tensors; nothing goes through host memory and the host
//! does not wait for the GPU. Every variable must be on one device. (The CUDA path is built,
//! linted and run on CPU tensors; it has not run on a GPU yet.)
//!
//! **Unused variables.** A variable that got no gradient in a step is an error naming it, unless
//! [`DdpConfig::find_unused_parameters`](oxccl_ddp::DdpConfig) is set: then it is reduced as
//! zeros (another rank may have used it) and its average is put into the store.

#![forbid(unsafe_code)]

#[cfg(feature = "cuda")]
mod cuda;
mod host;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use oxccl_comm::Communicator;
use oxccl_ddp::{Ddp, DdpConfig, DdpError, FlatBuffer, Param, Step};

use host::to_flat;

/// Errors of the candle adapter.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// DDP (or the collective underneath) failed.
    #[error(transparent)]
    Ddp(#[from] DdpError),
    /// A candle call failed.
    #[error("rank {rank}: candle ddp {op}: {source}")]
    Candle {
        /// This rank.
        rank: usize,
        /// The adapter's call (`new`, `sync`, ...).
        op: &'static str,
        /// What candle said.
        source: candle_core::Error,
    },
    /// Arguments that cannot be right (a dtype DDP does not reduce, a tensor on a device, a
    /// variable without a gradient).
    #[error("rank {rank}: candle ddp {op}: {msg}")]
    InvalidArgument {
        /// This rank.
        rank: usize,
        /// The adapter's call.
        op: &'static str,
        /// What was wrong.
        msg: String,
    },
}

/// Results of the adapter.
pub type Result<T> = std::result::Result<T, Error>;

/// Data-parallel training of candle variables: the initial broadcast and each step's gradient
/// average (see the [crate docs](crate)).
pub struct CandleDdp {
    inner: Inner,
    vars: Vec<(String, Var)>,
    find_unused: bool,
}

/// The reducer: host buckets for CPU tensors, device buckets for CUDA tensors.
enum Inner {
    Host(Ddp),
    #[cfg(feature = "cuda")]
    Device {
        ddp: oxccl_ddp::DeviceDdp,
        dev: candle_core::CudaDevice,
    },
}

impl CandleDdp {
    /// Wraps `vars` (name and variable; the same list on every rank): sets every variable to
    /// rank 0's value and builds the [`Ddp`] that will average their gradients.
    ///
    /// # Errors
    /// `InvalidArgument` for a variable on a device other than the CPU or of a dtype DDP does not
    /// reduce; [`DdpError`] when the ranks' lists differ or a collective fails.
    pub fn new(comm: Communicator, vars: Vec<(String, Var)>, cfg: DdpConfig) -> Result<CandleDdp> {
        let find_unused = cfg.find_unused_parameters;
        #[cfg(feature = "cuda")]
        if let Some(dev) = cuda::device_of(comm.rank(), &vars)? {
            let ddp = cuda::new(comm, &vars, cfg, &dev)?;
            return Ok(CandleDdp {
                inner: Inner::Device { ddp, dev },
                vars,
                find_unused,
            });
        }
        let ddp = host_ddp(comm, &vars, cfg)?;
        Ok(CandleDdp {
            inner: Inner::Host(ddp),
            vars,
            find_unused,
        })
    }

    /// [`CandleDdp::new`] over every variable of a `candle_nn::VarMap`-like list of named
    /// variables, sorted by name so that every rank lists them in the same order.
    ///
    /// # Errors
    /// As [`CandleDdp::new`].
    pub fn from_named(
        comm: Communicator,
        vars: impl IntoIterator<Item = (String, Var)>,
        cfg: DdpConfig,
    ) -> Result<CandleDdp> {
        let mut vars: Vec<(String, Var)> = vars.into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        CandleDdp::new(comm, vars, cfg)
    }

    /// [`CandleDdp::from_named`] over a `candle_nn::VarMap`'s variables (`varmap.data()`).
    ///
    /// # Errors
    /// As [`CandleDdp::new`].
    pub fn from_varmap(
        comm: Communicator,
        data: &std::sync::Mutex<std::collections::HashMap<String, Var>>,
        cfg: DdpConfig,
    ) -> Result<CandleDdp> {
        let rank = comm.rank();
        let vars: Vec<(String, Var)> = match data.lock() {
            Ok(m) => m.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            Err(_) => {
                return Err(Error::InvalidArgument {
                    rank,
                    op: "from_varmap",
                    msg: "the VarMap's lock is poisoned".into(),
                })
            }
        };
        CandleDdp::from_named(comm, vars, cfg)
    }

    /// Averages this step's gradients across the ranks, in `grads` (each variable's entry is
    /// replaced by the average). With accumulation ([`Ddp::accumulate`]) a micro-batch before
    /// the last only adds into DDP's buckets and leaves `grads` as it was.
    ///
    /// # Errors
    /// `InvalidArgument` for a variable without a gradient (unless `find_unused_parameters`) or
    /// with a gradient of another shape or dtype; [`DdpError`] from the reduction.
    pub fn sync(&mut self, grads: &mut GradStore) -> Result<Step> {
        match &mut self.inner {
            Inner::Host(ddp) => host_sync(ddp, &self.vars, grads, self.find_unused),
            #[cfg(feature = "cuda")]
            Inner::Device { ddp, dev } => cuda::sync(ddp, dev, &self.vars, grads, self.find_unused),
        }
    }

    /// `loss.backward()` followed by [`CandleDdp::sync`]: the averaged gradients.
    ///
    /// # Errors
    /// A failed backward pass, or as [`CandleDdp::sync`].
    pub fn backward(&mut self, loss: &Tensor) -> Result<GradStore> {
        let rank = self.comm().rank();
        let mut grads = loss.backward().map_err(|source| Error::Candle {
            rank,
            op: "backward",
            source,
        })?;
        self.sync(&mut grads)?;
        Ok(grads)
    }

    /// The variables, in DDP's parameter order.
    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// The host reducer underneath (its configuration, comm hooks), for CPU tensors; `None` on
    /// the CUDA path (`CandleDdp::device_ddp`, feature `cuda`).
    pub fn ddp(&mut self) -> Option<&mut Ddp> {
        match &mut self.inner {
            Inner::Host(ddp) => Some(ddp),
            #[cfg(feature = "cuda")]
            Inner::Device { .. } => None,
        }
    }

    /// The device reducer underneath, for CUDA tensors; `None` on the CPU path.
    #[cfg(feature = "cuda")]
    pub fn device_ddp(&mut self) -> Option<&mut oxccl_ddp::DeviceDdp> {
        match &mut self.inner {
            Inner::Device { ddp, .. } => Some(ddp),
            Inner::Host(_) => None,
        }
    }

    /// Makes every step `k` micro-batches ([`Ddp::accumulate`]): `sync` of the first `k - 1`
    /// only adds into the buckets.
    ///
    /// # Errors
    /// `k == 0`, or a call in the middle of a step.
    pub fn accumulate(&mut self, k: usize) -> Result<()> {
        match &mut self.inner {
            Inner::Host(ddp) => ddp.accumulate(k)?,
            #[cfg(feature = "cuda")]
            Inner::Device { ddp, .. } => ddp.accumulate(k)?,
        }
        Ok(())
    }

    /// The communicator.
    pub fn comm(&self) -> &Communicator {
        match &self.inner {
            Inner::Host(ddp) => ddp.comm(),
            #[cfg(feature = "cuda")]
            Inner::Device { ddp, .. } => ddp.comm(),
        }
    }
}

/// The host reducer of `vars` (CPU tensors), after setting every variable to rank 0's value.
fn host_ddp(comm: Communicator, vars: &[(String, Var)], cfg: DdpConfig) -> Result<Ddp> {
    let rank = comm.rank();
    let mut values = Vec::with_capacity(vars.len());
    for (name, v) in vars {
        check_device(rank, "new", name, v.as_tensor())?;
        values.push(to_flat(v.as_tensor()).map_err(|e| e.at(rank, "new", name))?);
    }
    let mut params: Vec<Param<'_>> = vars
        .iter()
        .zip(values.iter_mut())
        .map(|((name, _), buf)| Param::untyped(name.clone(), buf.into()))
        .collect();
    let ddp = Ddp::new(comm, &mut params, cfg)?;
    drop(params);
    for ((name, v), buf) in vars.iter().zip(&values) {
        let t = host::from_flat(buf, v.as_tensor().shape(), &Device::Cpu)
            .map_err(|e| e.at(rank, "new", name))?;
        v.set(&t).map_err(|source| Error::Candle {
            rank,
            op: "new",
            source,
        })?;
    }
    Ok(ddp)
}

/// A step on the host: every gradient copied into a flat buffer, `Ddp::sync`, the averages put
/// back into `grads` as new tensors.
fn host_sync(
    ddp: &mut Ddp,
    vars: &[(String, Var)],
    grads: &mut GradStore,
    find_unused: bool,
) -> Result<Step> {
    let rank = ddp.comm().rank();
    let mut bufs = Vec::with_capacity(vars.len());
    for (name, v) in vars {
        let buf = match grads.get(v.as_tensor()) {
            Some(g) => {
                check_grad(rank, name, v.as_tensor(), g)?;
                to_flat(g).map_err(|e| e.at(rank, "sync", name))?
            }
            None if find_unused => {
                let dt =
                    host::dtype_of(v.as_tensor().dtype()).map_err(|e| e.at(rank, "sync", name))?;
                FlatBuffer::zeros(dt, v.as_tensor().elem_count())
            }
            None => return Err(no_gradient(rank, name)),
        };
        bufs.push(buf);
    }
    let step = ddp.sync(&mut bufs)?;
    if let Step::Synced { .. } = step {
        for ((name, v), buf) in vars.iter().zip(&bufs) {
            let t = v.as_tensor();
            let avg = host::from_flat(buf, t.shape(), &Device::Cpu)
                .map_err(|e| e.at(rank, "sync", name))?;
            grads.insert(t, avg);
        }
    }
    Ok(step)
}

/// A variable without a gradient (and `find_unused_parameters` not set).
fn no_gradient(rank: usize, name: &str) -> Error {
    Error::InvalidArgument {
        rank,
        op: "sync",
        msg: format!(
            "variable {name} received no gradient; every variable must get one each step, or \
             set find_unused_parameters to reduce missing ones as zeros"
        ),
    }
}

/// Refuses a tensor that is not in host memory on the host path (CUDA tensors need the `cuda`
/// feature; other devices are not averaged).
fn check_device(rank: usize, op: &'static str, name: &str, t: &Tensor) -> Result<()> {
    if t.device().is_cpu() {
        return Ok(());
    }
    let why = if t.device().is_cuda() {
        "CUDA tensors are averaged only when oxccl-candle is built with its `cuda` feature"
    } else {
        "only CPU and CUDA tensors are averaged"
    };
    Err(Error::InvalidArgument {
        rank,
        op,
        msg: format!("variable {name} is on {:?}: {why}", t.device().location()),
    })
}

/// A gradient must match its variable's shape, dtype and device.
fn check_grad(rank: usize, name: &str, var: &Tensor, g: &Tensor) -> Result<()> {
    if !g.device().same_device(var.device()) {
        return Err(Error::InvalidArgument {
            rank,
            op: "sync",
            msg: format!(
                "the gradient of {name} is on {:?}, its variable on {:?}",
                g.device().location(),
                var.device().location()
            ),
        });
    }
    if g.shape() != var.shape() || g.dtype() != var.dtype() {
        return Err(Error::InvalidArgument {
            rank,
            op: "sync",
            msg: format!(
                "the gradient of {name} is {:?} {:?}, its variable {:?} {:?}",
                g.dtype(),
                g.dims(),
                var.dtype(),
                var.dims()
            ),
        });
    }
    Ok(())
}
