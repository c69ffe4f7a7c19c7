//! oxccl-pipeline (work in progress): pipeline-parallel schedules as data. A schedule is one
//! list of [`Action`]s per rank (a micro-batch's forward, backward, or its input-gradient and
//! weight-gradient halves, on one of the rank's model chunks; exchanges of activations and
//! gradients with the neighbouring stages, posted as batches), made for GPipe, 1F1B,
//! interleaved 1F1B and ZB-H1 ([`Schedule::new`]). [`timeline`] says when each computation
//! runs for given costs and what fraction of the time is bubble; [`simulate`] runs the lists
//! with the communicator's semantics and rendezvous sends and says whether they finish, or
//! where they deadlock.
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
//! Not yet: the runtime over a communicator.

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
