//! The reducer's settings, the parameter list it is built from, and what a step did.

use oxccl_comm::Element;

use crate::flat::TensorMut;

/// How [`Ddp`](crate::Ddp) buckets and checks gradients. `Default` gives PyTorch's defaults.
#[derive(Clone, Debug)]
pub struct DdpConfig {
    /// Bytes of gradients per bucket (default 25 MiB). A parameter larger than this gets a bucket
    /// of its own.
    pub bucket_cap_bytes: usize,
    /// Cap of the first bucket of each dtype (default 1 MiB): small, so that the first
    /// all-reduce starts early in backward.
    pub first_bucket_bytes: usize,
    /// When set, parameters that got no gradient in a step are reduced as zeros, and each
    /// synchronising step also all-reduces a byte per parameter (PyTorch's `local_used_map`) to
    /// tell which no rank used ([`Ddp::unused_on_every_rank`](crate::Ddp::unused_on_every_rank));
    /// when not (the default), `finish()` names them in
    /// [`DdpError::UnusedParameters`](crate::DdpError::UnusedParameters). The same on every rank
    /// ([`Ddp::new`](crate::Ddp::new) checks). PyTorch leaves the `.grad` of a parameter unused
    /// on every rank as it was (`None` when it never had one); here its average reads as zeros
    /// (PowerSGD's error feedback may add residuals), and an optimizer with weight decay or
    /// momentum would still move it: skip the parameters of `unused_on_every_rank` to do as
    /// PyTorch does. PyTorch also does not rebuild the
    /// buckets when this is set (without `static_graph`); here [`DdpConfig::rebuild_buckets`]
    /// decides alone.
    pub find_unused_parameters: bool,
    /// Rebuild the buckets after the first step from the order in which gradients arrived
    /// (rank 0's order, or with uneven inputs that of the lowest rank that trained in the first
    /// step, broadcast so every rank agrees). Default on.
    pub rebuild_buckets: bool,
    /// In [`Ddp::sync`](crate::Ddp::sync) with the default hook, gradients of at least this many bytes are
    /// all-reduced in place in the caller's memory instead of being copied through a bucket
    /// (default 1 MiB; `usize::MAX` packs everything).
    pub sync_in_place_bytes: usize,
    /// When a full bucket's all-reduce starts in the `grad_ready` flow (default
    /// [`Overlap::Auto`], decided alike on every rank). `On` and `Off` may differ between ranks:
    /// DDP issues the same collectives in the same order either way, as long as the trainer
    /// keeps the crate's rule of no collective of its own between a step's first gradient and
    /// its `finish()`. Not used by `sync()`, which launches each bucket as soon as it is packed.
    pub overlap: Overlap,
    /// Whether ranks may run out of data at different steps (PyTorch's `Join` context for
    /// uneven inputs; default [`UnevenInputs::Off`]). When not `Off`, every synchronising step
    /// also all-reduces a flag of one byte per rank (who trains, and through `sync` or
    /// `grad_ready`), issued at the first gradient of the step's synchronising micro-batch,
    /// before any bucket, and a rank with no more data calls
    /// [`Ddp::join_step`](crate::Ddp::join_step) until it returns `None`: each call stands in
    /// for one step of the ranks still training, with zero gradients. The same
    /// on every rank ([`Ddp::new`](crate::Ddp::new) checks). Ranks that train in a step must
    /// feed it the same way (all `sync`, or all `grad_ready`/`grad_slot`): the flag tells, and
    /// a step fed both ways ends in an error on every rank (its collectives still matched:
    /// `sync` then takes the bucket path the others take).
    pub uneven_inputs: UnevenInputs,
}

/// Uneven inputs ([`DdpConfig::uneven_inputs`]): whether ranks may join (run out of data) early,
/// and what a step's gradients are divided by once some have.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UnevenInputs {
    /// Every rank takes every step; [`Ddp::join_step`](crate::Ddp::join_step) is refused. No
    /// flag is all-reduced.
    #[default]
    Off,
    /// Joined ranks count as ranks with zero gradients: the sum over the ranks still training
    /// is divided by the world size (PyTorch's `divide_by_initial_world_size=True`, its
    /// default). Steps after some ranks joined are smaller, as if their batches were empty.
    DivideByWorldSize,
    /// The sum is divided by the number of ranks still training: the mean over the samples of
    /// the step with equal local batches. Costs one pass over the gradients in each step with
    /// joined ranks: they are averaged over the world size, then scaled by world / active (so
    /// a comm hook must return the average over the world size, as the built-in ones do).
    /// Floating-point parameters only ([`Ddp::new`](crate::Ddp::new) refuses integer ones).
    DivideByActiveRanks,
}

/// When [`Ddp::grad_ready`](crate::Ddp::grad_ready) starts a full bucket's all-reduce.
///
/// Overlapping needs a CPU to run the communication while the rank's own thread computes the
/// next layers' gradients: the all-reduce of host memory is CPU work (the communicator's
/// progress thread copies and reduces). Where every CPU already runs a rank's backward pass, the
/// two take turns on the same CPUs, and the step ends up slower than backward followed by the
/// all-reduce (docs/PERF.md, "Overlap on a node without a CPU to spare").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Overlap {
    /// [`Overlap::On`] where every rank's node has 2 CPUs or more for each of its ranks (the
    /// node's CPUs and ranks as the communicator counted them,
    /// `comm.stats().node_holds(2)`, the rule of `OXCCL_SOCKET_SEND_THREAD=auto`; agreed in
    /// the all-reduce `Ddp::new` makes anyway), and [`Overlap::Off`] otherwise: ranks bound a
    /// core each (`oxccl launch --bind core`) or more ranks than half the CPUs on some node.
    /// It counts one busy CPU per rank: where the trainer's backward pass uses more (threads of
    /// its own) or fewer (it runs on a GPU and the CPU thread waits: docs/PERF.md, "Where the
    /// step goes"), set `Off` or `On`.
    #[default]
    Auto,
    /// A bucket's all-reduce starts as soon as its last gradient arrives, during backward
    /// (PyTorch's behaviour).
    On,
    /// The buckets are all-reduced in `finish()`, one after another, each waited for before the
    /// next starts (so the caller's thread usually runs it: `Work::wait` runs an operation the
    /// progress thread has not taken yet): backward, then the all-reduces.
    Off,
}

impl Default for DdpConfig {
    fn default() -> DdpConfig {
        DdpConfig {
            bucket_cap_bytes: 25 << 20,
            first_bucket_bytes: 1 << 20,
            find_unused_parameters: false,
            rebuild_buckets: true,
            sync_in_place_bytes: 1 << 20,
            overlap: Overlap::Auto,
            uneven_inputs: UnevenInputs::Off,
        }
    }
}

/// A named parameter: its storage, for the broadcast from rank 0 at [`Ddp::new`](crate::Ddp::new).
#[derive(Debug)]
pub struct Param<'a> {
    pub(crate) name: String,
    pub(crate) tensor: TensorMut<'a>,
}

impl<'a> Param<'a> {
    /// A parameter called `name` stored in `data`.
    pub fn new<T: Element>(name: impl Into<String>, data: &'a mut [T]) -> Param<'a> {
        Param {
            name: name.into(),
            tensor: TensorMut::new(data),
        }
    }

    /// A parameter called `name` stored in an untyped tensor (a [`crate::FlatBuffer`] or a
    /// typed slice, through `TensorMut::from`).
    pub fn untyped(name: impl Into<String>, tensor: TensorMut<'a>) -> Param<'a> {
        Param {
            name: name.into(),
            tensor,
        }
    }
}

/// What a `finish()` or `sync()` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// A micro-batch whose gradients were only accumulated locally (`no_sync` or
    /// `accumulate(k)`); `micro_batch` counts from 0 within the step.
    Accumulated {
        /// Index of this micro-batch within the step.
        micro_batch: usize,
    },
    /// The gradients were averaged across ranks; `step` counts synchronised steps from 0.
    Synced {
        /// Index of this step.
        step: u64,
    },
}
