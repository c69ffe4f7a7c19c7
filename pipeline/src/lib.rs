//! oxccl-pipeline: pipeline parallelism over the user's stage functions, correct at any depth.
//!
//! **Running a pipeline.** A rank's part of the model is a [`Stage`] (forward; backward, or
//! its input-gradient and weight-gradient halves for zero-bubble schedules); a [`Pipeline`]
//! over a communicator whose ranks are the stages runs every micro-batch of a step in the
//! order of its schedule, exchanging any number of host [`Tensor`]s of any dtype and shape
//! with the neighbouring stages (shapes sent once per link, again when they change):
//!
//! ```no_run
//! use oxccl_comm::Communicator;
//! use oxccl_pipeline::{BoxError, Pipeline, PipelineConfig, ScheduleKind, Stage, Step, Tensor};
//!
//! struct Layers; // this rank's layers, its saved activations and gradients
//! impl Stage for Layers {
//!     fn forward(&mut self, st: Step, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
//!         Ok(inputs) // the first stage gets none and reads micro-batch `st.mb` itself
//!     }
//!     fn backward(&mut self, st: Step, grads: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
//!         Ok(grads) // the last stage gets none and starts from its loss
//!     }
//! }
//!
//! let comm = Communicator::from_env()?; // under `oxccl launch -n 4`: 4 stages
//! let mut pipe = Pipeline::new(&comm, PipelineConfig::new(ScheduleKind::OneFOneB, 8))?;
//! let stats = pipe.step(&mut Layers)?;  // 8 micro-batches, forward and backward
//! println!("bubble on this rank: {:.3}", stats.bubble());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! **Schedules as data.** A schedule is one list of [`Action`]s per rank (a micro-batch's
//! forward, backward, or its halves, on one of the rank's model chunks; exchanges posted as
//! batches), made for GPipe, 1F1B, interleaved 1F1B and ZB-H1 ([`Schedule::new`]).
//! [`timeline`] says when each computation runs for given costs and what fraction of the time
//! is bubble; [`simulate`] runs the lists with the communicator's semantics and rendezvous
//! sends and says whether they finish, or where they deadlock.
//!
//! ```
//! use oxccl_pipeline::{simulate, timeline, Costs, Schedule, ScheduleKind};
//!
//! let s = Schedule::new(ScheduleKind::Interleaved, 4, 8, 2)?;
//! simulate(&s)?;                                    // no deadlock, nothing missing
//! let t = timeline(&s, Costs::default())?;
//! assert!((t.bubble() - 3.0 / 19.0).abs() < 1e-9); // (p - 1) / (v m + p - 1)
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! **Device tensors** (feature `cuda`): `Pipeline::new_on_device` takes stages whose tensors
//! are in device memory (`Tensor::device_zeros`, `Tensor::from_device`); their payloads move as
//! oxccl's device batches of sends and receives on a stream of the pipeline's own: device to
//! device over CUDA IPC where every stage shares a node, staged through pinned host memory
//! elsewhere. Checked on an H200 (`pipeline/tests/pipeline/device.rs`: stage threads on one
//! GPU; `08_pipeline_mlp --device --check`: processes under MPS).

#![forbid(unsafe_code)]

mod error;
mod runtime;
mod schedule;
mod sim;
mod tensor;
mod timing;

pub use error::{BoxError, PipelineError};
pub use runtime::{Check, Pipeline, PipelineConfig, Stage, StepStats};
pub use schedule::{Action, Costs, Dir, Op, Schedule, ScheduleError, ScheduleKind, Step};
pub use sim::{simulate, SimError};
pub use tensor::{Meta, Tensor};
pub use timing::{bubble, timeline, Timeline};
