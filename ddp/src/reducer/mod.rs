//! The reducer: [`Ddp`], whose buckets are filled by `grad_ready` / `sync`, launched in order,
//! averaged by a comm hook and waited on by `finish`. This file holds the `Ddp` type and its
//! construction (the settings compared between the ranks, the parameters broadcast), its
//! accessors (the averaged gradients, `grad`, among them), the argument checks, the accumulation
//! settings (`accumulate`, `no_sync` and its [`NoSync`] guard) and `broadcast_buffers`; the
//! step's parts are in the submodules:
//!
//! - `backward`: a micro-batch's gradients arriving (`grad_ready`, `grad_slot`) and the buckets
//!   launched as they fill;
//! - `step`: `finish`, the step's completion and its errors;
//! - `sync`: `sync`, every gradient at once;
//! - `join`: uneven inputs, the per-step flag and `join_step`;
//! - `rebuild`: the bucket order rebuilt from the observed gradient order;
//! - `hook`: the comm hook, set and compared between the ranks.

use std::borrow::Borrow;
use std::ops::{Deref, DerefMut};

use oxccl_comm::{Communicator, DType, Element, Work};

use crate::agree::{agree, fnv1a, Setting};
use crate::config::{DdpConfig, Overlap, Param, UnevenInputs};
use crate::error::{DdpError, Result};
use crate::flat::{FlatBuffer, GradBuf};
use crate::hooks::{AllReduceAvg, BucketEntry, CommHook, HookWork};
use crate::layout::{plan, BucketSpec, ParamSpec};

mod backward;
mod hook;
mod join;
mod rebuild;
#[cfg(any(test, feature = "cuda-core"))]
pub(crate) use rebuild::broadcast_order;
mod step;
mod sync;

use hook::HookCheck;
use join::Trainers;

/// Where each member of a bucket lies in its buffer, for the hook.
pub(crate) fn entries(spec: &BucketSpec) -> Vec<BucketEntry> {
    let end = spec.offsets.iter().skip(1).copied().chain([spec.len]);
    spec.params
        .iter()
        .zip(&spec.offsets)
        .zip(end)
        .map(|((&param, &offset), end)| BucketEntry {
            param,
            offset,
            len: end - offset,
        })
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Between `finish()` and the next gradient.
    Idle,
    /// Gradients of a micro-batch are arriving.
    Backward,
}

struct Bucket {
    spec: BucketSpec,
    /// `None` while the bucket's hook owns it.
    buf: Option<FlatBuffer>,
    work: Option<HookWork>,
    /// Members whose gradient has not arrived in this micro-batch.
    pending: usize,
}

impl Bucket {
    fn new(spec: BucketSpec) -> Bucket {
        Bucket {
            buf: Some(FlatBuffer::zeros(spec.dtype, spec.len)),
            pending: spec.params.len(),
            work: None,
            spec,
        }
    }
}

/// Data-parallel gradient reducer (see the crate docs for the flow). `C` is how the communicator
/// is held: owned (the default), `&Communicator` or `Arc<Communicator>`.
pub struct Ddp<C: Borrow<Communicator> = Communicator> {
    comm: C,
    cfg: DdpConfig,
    specs: Vec<ParamSpec>,
    buckets: Vec<Bucket>,
    /// Per parameter: (bucket, element offset).
    slot: Vec<(usize, usize)>,
    /// Gradient arrived in this micro-batch.
    ready: Vec<bool>,
    /// Gradient arrived in some micro-batch of this step (later ones add to it).
    seen: Vec<bool>,
    /// `grad_slot` handed out the parameter's slot in this micro-batch.
    slot_out: Vec<bool>,
    /// Arrival order in this micro-batch.
    order: Vec<usize>,
    next_launch: usize,
    phase: Phase,
    step: u64,
    micro: usize,
    accumulate: usize,
    no_sync: bool,
    /// Whether the current micro-batch reduces, decided when it begins.
    sync_now: bool,
    rebuilt: bool,
    pending_order: Option<Vec<usize>>,
    hook: Box<dyn CommHook>,
    /// The hook is the default all-reduce (so `sync` may reduce large gradients in place).
    default_hook: bool,
    /// `sync`'s layout for the current buckets, made on first use.
    sync_plan: Option<sync::SyncPlan>,
    /// The buckets hold the last step's averaged gradients (false after an in-place `sync`).
    reduced: bool,
    /// `cfg.overlap` resolved at `new`: `grad_ready` launches full buckets.
    overlap: bool,
    /// Uneven inputs: the flag all-reduce of this synchronising micro-batch, issued when it
    /// began.
    join_flag: Option<Work<Vec<u8>>>,
    /// The micro-batch began through `sync` (for the flag, and for error messages).
    via_sync: bool,
    /// Inside `join_step`: who trains in the step this rank stands in for with zero gradients.
    shadow: Option<Trainers>,
    /// The flag of this step, once read (`sync` reads it before choosing its path).
    flag_read: Option<Trainers>,
    /// Ranks that trained in the last synchronised step.
    active: usize,
    /// The lowest rank that trained in the last synchronised step (0 without uneven inputs):
    /// the root of the rebuilt order and of `broadcast_buffers`.
    lead: usize,
    /// `join_step`'s zero gradients for `sync`, kept between calls.
    shadow_grads: Vec<FlatBuffer>,
    /// With `find_unused_parameters`: the parameters no rank gave a gradient in the last
    /// synchronised step.
    unused_everywhere: Vec<usize>,
    /// The hook's settings compared between the ranks.
    hook_check: HookCheck,
}

/// The settings every rank must share for `new`: those that shape the sequence of collectives,
/// and the parameter count, lengths and dtypes.
pub(crate) fn settings(specs: &[ParamSpec], cfg: &DdpConfig) -> Vec<Setting> {
    let elems: usize = specs.iter().map(|s| s.len).sum();
    let list = fnv1a(
        specs
            .iter()
            .flat_map(|s| [s.len as u64, u64::from(s.dtype.to_u8())]),
    );
    vec![
        Setting::number("bucket_cap_bytes", cfg.bucket_cap_bytes as u64),
        Setting::number("first_bucket_bytes", cfg.first_bucket_bytes as u64),
        Setting::number("sync_in_place_bytes", cfg.sync_in_place_bytes as u64),
        Setting::described(
            "rebuild_buckets",
            u64::from(cfg.rebuild_buckets),
            cfg.rebuild_buckets.to_string(),
        ),
        Setting::described(
            "find_unused_parameters",
            u64::from(cfg.find_unused_parameters),
            cfg.find_unused_parameters.to_string(),
        ),
        Setting::described(
            "uneven_inputs",
            cfg.uneven_inputs as u64,
            format!("{:?}", cfg.uneven_inputs),
        ),
        Setting::number("the parameter count", specs.len() as u64),
        Setting::described(
            "the parameter list (lengths, dtypes)",
            list,
            format!("{} parameter(s), {elems} elements", specs.len()),
        ),
    ]
}

/// Broadcasts `items` from rank `from`, small ones packed together into buffers of up to `cap`
/// bytes.
pub(crate) fn broadcast_coalesced(
    comm: &Communicator,
    items: Vec<&mut [u8]>,
    cap: usize,
    from: usize,
) -> oxccl_comm::Result<()> {
    let root = comm.rank() == from;
    let mut staged: Vec<u8> = Vec::new();
    let mut group: Vec<&mut [u8]> = Vec::new();
    let flush = |staged: &mut Vec<u8>, group: &mut Vec<&mut [u8]>| -> oxccl_comm::Result<()> {
        if !staged.is_empty() {
            comm.broadcast(staged.as_mut_slice(), from)?;
            let mut off = 0;
            for g in group.iter_mut() {
                g.copy_from_slice(&staged[off..off + g.len()]);
                off += g.len();
            }
        }
        staged.clear();
        group.clear();
        Ok(())
    };
    for item in items {
        if item.len() >= cap {
            comm.broadcast(item, from)?;
            continue;
        }
        if staged.len() + item.len() > cap {
            flush(&mut staged, &mut group)?;
        }
        if root {
            staged.extend_from_slice(item);
        } else {
            staged.resize(staged.len() + item.len(), 0);
        }
        group.push(item);
    }
    flush(&mut staged, &mut group)
}

impl<C: Borrow<Communicator>> Ddp<C> {
    /// Wraps `params`: checks that every rank has the same parameter list (count, lengths,
    /// dtypes), broadcasts rank 0's values into every rank's `params`, and lays the gradients out
    /// in buckets in reverse parameter order. Collective: every rank calls it.
    ///
    /// # Errors
    /// `InvalidArgument` for a zero bucket cap or parameter lists that differ between ranks; the
    /// broadcast's errors.
    pub fn new(comm: C, params: &mut [Param<'_>], cfg: DdpConfig) -> Result<Ddp<C>> {
        let c = comm.borrow();
        let rank = c.rank();
        let invalid = |msg: String| DdpError::InvalidArgument {
            rank,
            op: "new",
            msg,
        };
        let specs: Vec<ParamSpec> = params
            .iter()
            .map(|p| ParamSpec {
                name: p.name.clone(),
                len: p.tensor.elems(),
                dtype: p.tensor.dtype(),
            })
            .collect();
        // Every rank checks the others' parameter list and settings before anything else moves;
        // a bad local setting is reported after the collective so no rank is left waiting. The
        // same all-reduce tells whether some rank's node lacks a CPU to spare (`Overlap::Auto`
        // decides the same on every rank).
        let stats = c.stats();
        let mut short_of_cpus = [u64::from(!stats.node_holds(2))];
        agree(c, "new", &settings(&specs, &cfg), &mut short_of_cpus)?;
        if cfg.bucket_cap_bytes == 0 || cfg.first_bucket_bytes == 0 {
            return Err(invalid(format!(
                "bucket caps must be positive (bucket_cap_bytes {}, first_bucket_bytes {})",
                cfg.bucket_cap_bytes, cfg.first_bucket_bytes
            )));
        }
        if cfg.uneven_inputs == UnevenInputs::DivideByActiveRanks {
            if let Some(s) = specs.iter().find(|s| !s.dtype.is_float()) {
                return Err(invalid(format!(
                    "uneven_inputs DivideByActiveRanks scales averages by world / active ranks, \
                     which parameter {} ({}) cannot take; use DivideByWorldSize",
                    s.name,
                    s.dtype.short_name()
                )));
            }
        }
        let items = params.iter_mut().map(|p| p.tensor.bytes_mut()).collect();
        broadcast_coalesced(c, items, cfg.bucket_cap_bytes, 0)?;
        let order: Vec<usize> = (0..specs.len()).rev().collect();
        let layout = plan(&specs, &order, cfg.first_bucket_bytes, cfg.bucket_cap_bytes);
        let n = specs.len();
        let overlap = match cfg.overlap {
            Overlap::Auto => short_of_cpus[0] == 0,
            Overlap::On => true,
            Overlap::Off => false,
        };
        let node = stats.node;
        let world = c.size();
        tracing::debug!(
            rank,
            params = n,
            buckets = layout.buckets.len(),
            overlap,
            node_cpus = ?node.cpus,
            node_ranks = node.ranks,
            "ddp: initial bucket layout"
        );
        Ok(Ddp {
            comm,
            cfg,
            specs,
            buckets: layout.buckets.into_iter().map(Bucket::new).collect(),
            slot: layout.slot,
            ready: vec![false; n],
            seen: vec![false; n],
            slot_out: vec![false; n],
            order: Vec::with_capacity(n),
            next_launch: 0,
            phase: Phase::Idle,
            step: 0,
            micro: 0,
            accumulate: 1,
            no_sync: false,
            sync_now: true,
            rebuilt: false,
            pending_order: None,
            hook: Box::new(AllReduceAvg),
            default_hook: true,
            sync_plan: None,
            reduced: false,
            overlap,
            join_flag: None,
            via_sync: false,
            shadow: None,
            flag_read: None,
            active: world,
            lead: 0,
            shadow_grads: Vec::new(),
            unused_everywhere: Vec::new(),
            hook_check: HookCheck::Agreed,
        })
    }

    /// The communicator.
    pub fn comm(&self) -> &Communicator {
        self.comm.borrow()
    }

    /// The configuration.
    pub fn config(&self) -> &DdpConfig {
        &self.cfg
    }

    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        self.specs.len()
    }

    /// Name of parameter `p`.
    pub fn param_name(&self, p: usize) -> Option<&str> {
        self.specs.get(p).map(|s| s.name.as_str())
    }

    /// Index of the parameter called `name`.
    pub fn param_index(&self, name: &str) -> Option<usize> {
        self.specs.iter().position(|s| s.name == name)
    }

    /// Parameter indices per bucket, in launch order: the layout of the current (or last) step.
    /// The layout rebuilt after step 0 takes effect when step 1's first gradient arrives.
    pub fn bucket_params(&self) -> Vec<Vec<usize>> {
        self.buckets.iter().map(|b| b.spec.params.clone()).collect()
    }

    /// Whether `grad_ready` starts full buckets' all-reduces during backward
    /// ([`DdpConfig::overlap`], `Auto` resolved at [`Ddp::new`], alike on every rank); when
    /// not, `finish()` runs them.
    pub fn overlaps(&self) -> bool {
        self.overlap
    }

    /// Number of synchronised steps so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The parameters that no rank gave a gradient in the last synchronised step (none through
    /// `sync`, which takes every gradient; a rank in [`Ddp::join_step`] gives none), in index
    /// order; empty unless [`DdpConfig::find_unused_parameters`] is set. Their averages read as
    /// zeros (with the default and compression hooks; PowerSGD's error feedback may add
    /// residuals of earlier steps), where PyTorch leaves such a parameter's `.grad` untouched:
    /// skip them in the optimizer's update to do as it does.
    pub fn unused_on_every_rank(&self) -> &[usize] {
        &self.unused_everywhere
    }

    /// Ranks that trained in the last synchronised step: the world size, unless
    /// [`DdpConfig::uneven_inputs`] is set and some had joined (after [`Ddp::join_step`], the
    /// ranks it stood in for, this one not counted; 0 after it returned `None`).
    pub fn active_ranks(&self) -> usize {
        self.active
    }

    /// Makes every step `k` micro-batches: gradients of the first `k - 1` are only accumulated
    /// (no communication); the buckets are averaged during the last one's backward. Gradients are
    /// summed over micro-batches: scale the loss by `1/k` for a mean.
    ///
    /// # Errors
    /// `InvalidArgument` for `k == 0` or in the middle of a step.
    pub fn accumulate(&mut self, k: usize) -> Result<()> {
        if k == 0 {
            return Err(self.invalid("accumulate", "k must be at least 1"));
        }
        if self.phase == Phase::Backward || self.micro != 0 {
            return Err(self.invalid("accumulate", "cannot change k in the middle of a step"));
        }
        self.accumulate = k;
        Ok(())
    }

    /// While the guard lives, micro-batches only accumulate gradients (PyTorch's `no_sync`); the
    /// first micro-batch after it synchronises. The guard derefs to the `Ddp`. Whether a
    /// micro-batch reduces is decided when its first gradient arrives: take the guard before the
    /// backward pass and keep it until its `finish()`.
    pub fn no_sync(&mut self) -> NoSync<'_, C> {
        let prev = self.no_sync;
        self.no_sync = true;
        NoSync { ddp: self, prev }
    }

    fn invalid(&self, op: &'static str, msg: impl Into<String>) -> DdpError {
        DdpError::InvalidArgument {
            rank: self.comm().rank(),
            op,
            msg: msg.into(),
        }
    }

    /// Parameter `p`'s spec, or an error naming `op` for an index out of range.
    fn spec(&self, p: usize, op: &'static str) -> Result<&ParamSpec> {
        self.specs.get(p).ok_or_else(|| {
            self.invalid(
                op,
                format!(
                    "parameter index {p} out of range ({} parameters)",
                    self.specs.len()
                ),
            )
        })
    }

    fn check_param(&self, p: usize, dtype: DType, bytes: usize, op: &'static str) -> Result<()> {
        let s = self.spec(p, op)?;
        if dtype != s.dtype {
            return Err(self.invalid(
                op,
                format!(
                    "parameter {p} ({}) is {}, the gradient given is {}",
                    s.name,
                    s.dtype.short_name(),
                    dtype.short_name()
                ),
            ));
        }
        if bytes != s.bytes() {
            return Err(self.invalid(
                op,
                format!(
                    "parameter {p} ({}) has {} elements, the gradient given has {}",
                    s.name,
                    s.len,
                    bytes / dtype.size()
                ),
            ));
        }
        Ok(())
    }

    /// Parameter `param`'s gradient in its bucket: after a synchronised `finish()` (or a `sync()`
    /// that went through the buckets, i.e. with a comm hook set) the average over ranks, until
    /// the next backward pass starts; in an accumulating step the local sum so far for the
    /// parameters seen in it (the others hold the previous step's average, or zeros in the step
    /// after the buckets were rebuilt). After an in-place `sync()` the averages are in the
    /// caller's slices and this returns an error.
    ///
    /// # Errors
    /// `InvalidArgument` for an index out of range, a `T` that is not the parameter's dtype, or a
    /// bucket whose all-reduce is in flight or whose step failed in `finish()`.
    pub fn grad<T: Element>(&self, param: usize) -> Result<&[T]> {
        let s = self.spec(param, "grad")?;
        if !self.reduced && self.phase == Phase::Idle && self.micro == 0 && self.step > 0 {
            return Err(self.invalid(
                "grad",
                "the last step was reduced by sync(): its averages are in the slices given to sync",
            ));
        }
        let (b, off) = self.slot[param];
        let buf = self.buckets[b].buf.as_ref().ok_or_else(|| {
            self.invalid(
                "grad",
                format!(
                    "parameter {param} ({}): its bucket holds no averages: its all-reduce is in \
                     flight (call finish() first), or the step's finish() failed",
                    s.name
                ),
            )
        })?;
        let all = buf.as_slice::<T>().ok_or_else(|| {
            self.invalid(
                "grad",
                format!(
                    "parameter {param} ({}) is {}, read as {}",
                    s.name,
                    s.dtype.short_name(),
                    T::DTYPE.short_name()
                ),
            )
        })?;
        Ok(&all[off..off + s.len])
    }

    /// Broadcasts `buffers` (e.g. batch-norm running statistics) from rank 0 into every rank's,
    /// small ones packed together. Collective; call it where every rank does (e.g. before each
    /// forward, as PyTorch's `broadcast_buffers`). With [`DdpConfig::uneven_inputs`] the root is
    /// the lowest rank that trained in the last synchronised step (rank 0 until rank 0
    /// joins; after the last `join_step`, one that trained to the end), so a joined rank's
    /// stale buffers are never broadcast; call it after each step's synchronising
    /// `finish()`/`sync()`, and
    /// on a joined rank after each `join_step` that returns `Some` (see there).
    ///
    /// # Errors
    /// The broadcast's errors.
    pub fn broadcast_buffers<G: GradBuf>(&self, buffers: &mut [G]) -> Result<()> {
        let items = buffers.iter_mut().map(|b| b.bytes_mut()).collect();
        broadcast_coalesced(self.comm(), items, self.cfg.bucket_cap_bytes, self.lead)?;
        Ok(())
    }
}

/// Guard returned by [`Ddp::no_sync`]: derefs to the `Ddp`; micro-batches under it only
/// accumulate.
pub struct NoSync<'a, C: Borrow<Communicator>> {
    ddp: &'a mut Ddp<C>,
    prev: bool,
}

impl<C: Borrow<Communicator>> Deref for NoSync<'_, C> {
    type Target = Ddp<C>;
    fn deref(&self) -> &Ddp<C> {
        self.ddp
    }
}

impl<C: Borrow<Communicator>> DerefMut for NoSync<'_, C> {
    fn deref_mut(&mut self) -> &mut Ddp<C> {
        self.ddp
    }
}

impl<C: Borrow<Communicator>> Drop for NoSync<'_, C> {
    fn drop(&mut self) {
        self.ddp.no_sync = self.prev;
    }
}
