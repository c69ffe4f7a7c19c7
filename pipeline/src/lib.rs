//! oxccl-pipeline (work in progress): pipeline-parallel schedules as data. A schedule is one
//! list of [`Action`]s per rank (compute a micro-batch's forward or backward, exchange its
//! activations or gradients with the next or previous stage, alone or batched), generated for
//! GPipe and 1F1B ([`Schedule::gpipe`], [`Schedule::one_f_one_b`]); [`simulate`] runs the lists
//! with rendezvous sends (a send completes only when its receive is posted, the worst case of
//! NCCL's and oxccl's point-to-point calls) and says whether they finish, or where they
//! deadlock or compute before their inputs arrived.
//!
//! Not yet: interleaved 1F1B and ZB-H1, the runtime over a communicator, the CLI timeline.

#![forbid(unsafe_code)]

mod schedule;
mod sim;

pub use schedule::{Action, Dir, Op, Schedule};
pub use sim::{simulate, SimError, Timeline};
