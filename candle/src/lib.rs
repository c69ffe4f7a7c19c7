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
//! into DDP's flat buckets and the averages put back as new tensors. Tensors on a CUDA device are
//! refused with a clear error in this version: DDP over device buffers is not there yet.
//!
//! **Unused variables.** A variable that got no gradient in a step is an error naming it, unless
//! [`DdpConfig::find_unused_parameters`](oxccl_ddp::DdpConfig) is set: then it is reduced as
//! zeros (another rank may have used it) and its average is put into the store.

#![forbid(unsafe_code)]

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
    ddp: Ddp,
    vars: Vec<(String, Var)>,
    find_unused: bool,
}

impl CandleDdp {
    /// Wraps `vars` (name and variable; the same list on every rank): sets every variable to
    /// rank 0's value and builds the [`Ddp`] that will average their gradients.
    ///
    /// # Errors
    /// `InvalidArgument` for a variable on a device other than the CPU or of a dtype DDP does not
    /// reduce; [`DdpError`] when the ranks' lists differ or a collective fails.
    pub fn new(comm: Communicator, vars: Vec<(String, Var)>, cfg: DdpConfig) -> Result<CandleDdp> {
        let rank = comm.rank();
        let find_unused = cfg.find_unused_parameters;
        let mut values = Vec::with_capacity(vars.len());
        for (name, v) in &vars {
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
        Ok(CandleDdp {
            ddp,
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
        let rank = self.ddp.comm().rank();
        let mut bufs = Vec::with_capacity(self.vars.len());
        for (name, v) in &self.vars {
            let buf = match grads.get(v.as_tensor()) {
                Some(g) => {
                    check_grad(rank, name, v.as_tensor(), g)?;
                    to_flat(g).map_err(|e| e.at(rank, "sync", name))?
                }
                None if self.find_unused => {
                    let dt = host::dtype_of(v.as_tensor().dtype())
                        .map_err(|e| e.at(rank, "sync", name))?;
                    FlatBuffer::zeros(dt, v.as_tensor().elem_count())
                }
                None => {
                    return Err(Error::InvalidArgument {
                        rank,
                        op: "sync",
                        msg: format!(
                            "variable {name} received no gradient; every variable must get one \
                             each step, or set find_unused_parameters to reduce missing ones as \
                             zeros"
                        ),
                    })
                }
            };
            bufs.push(buf);
        }
        let step = self.ddp.sync(&mut bufs)?;
        if let Step::Synced { .. } = step {
            for ((name, v), buf) in self.vars.iter().zip(&bufs) {
                let t = v.as_tensor();
                let avg = host::from_flat(buf, t.shape(), &Device::Cpu)
                    .map_err(|e| e.at(rank, "sync", name))?;
                grads.insert(t, avg);
            }
        }
        Ok(step)
    }

    /// `loss.backward()` followed by [`CandleDdp::sync`]: the averaged gradients.
    ///
    /// # Errors
    /// A failed backward pass, or as [`CandleDdp::sync`].
    pub fn backward(&mut self, loss: &Tensor) -> Result<GradStore> {
        let rank = self.ddp.comm().rank();
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

    /// The DDP reducer underneath (its configuration, accumulation, comm hooks).
    pub fn ddp(&mut self) -> &mut Ddp {
        &mut self.ddp
    }

    /// The communicator.
    pub fn comm(&self) -> &Communicator {
        self.ddp.comm()
    }
}

/// Refuses a tensor that is not in host memory (device DDP is not there yet).
fn check_device(rank: usize, op: &'static str, name: &str, t: &Tensor) -> Result<()> {
    if t.device().is_cpu() {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        rank,
        op,
        msg: format!(
            "variable {name} is on {:?}: only CPU tensors are averaged in this version (DDP \
             over device buffers is not there yet)",
            t.device().location()
        ),
    })
}

/// A gradient must match its variable's shape and dtype, and live on the host.
fn check_grad(rank: usize, name: &str, var: &Tensor, g: &Tensor) -> Result<()> {
    check_device(rank, "sync", name, g)?;
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
