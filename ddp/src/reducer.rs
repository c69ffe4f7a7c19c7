//! The reducer: buckets filled by `grad_ready` / `sync`, launched in order, averaged by a comm
//! hook, waited on by `finish`.

use std::borrow::Borrow;
use std::ops::{Deref, DerefMut};

use oxccl_comm::{Communicator, DType, Element, ReduceOp, Work};

use crate::agree::{agree, differing, fnv1a, fnv1a_str, Setting};
use crate::config::{DdpConfig, Overlap, Param, Step, UnevenInputs};
use crate::error::{DdpError, Result};
use crate::flat::{FlatBuffer, GradBuf};
use crate::hooks::{AllReduceAvg, BucketEntry, CommHook, GradBucket, HookWork};
use crate::layout::{plan, BucketSpec, ParamSpec};

mod sync;

/// Where each member of a bucket lies in its buffer, for the hook.
fn entries(spec: &BucketSpec) -> Vec<BucketEntry> {
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

/// Whether the comm hook's settings were compared between the ranks ([`CommHook::settings`]).
#[derive(Clone, Debug, PartialEq, Eq)]
enum HookCheck {
    /// Alike on every rank (or the default hook, which has none).
    Agreed,
    /// Not yet: before the next bucket the hook would start.
    Pending,
    /// They differ, as the message says: no bucket goes through the hook.
    Refused(String),
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

/// Who trained in a step, read from the uneven-inputs flag (one byte per rank: 0 joined,
/// 1 through `grad_ready`/`finish`, 2 through `sync`).
#[derive(Clone, Copy, Debug)]
struct Trainers {
    active: usize,
    syncs: usize,
    lead: usize,
}

/// The settings every rank must share for `new`: those that shape the sequence of collectives,
/// and the parameter count, lengths and dtypes.
fn settings(specs: &[ParamSpec], cfg: &DdpConfig) -> Vec<Setting> {
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
        let mut short_of_cpus = [u64::from(!c.node_holds(2))];
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
        let node = c.node_share();
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

    /// Replaces the comm hook (default [`AllReduceAvg`]).
    ///
    /// # Errors
    /// `InvalidArgument` in the middle of a step, or for a hook that does not average over every
    /// rank ([`CommHook::averages_every_rank`]) with [`UnevenInputs::DivideByActiveRanks`].
    pub fn set_comm_hook(&mut self, hook: impl CommHook + 'static) -> Result<()> {
        if self.phase == Phase::Backward || self.micro != 0 {
            return Err(self.invalid(
                "set_comm_hook",
                "cannot change hooks in the middle of a step",
            ));
        }
        if !hook.averages_every_rank()
            && self.cfg.uneven_inputs == UnevenInputs::DivideByActiveRanks
        {
            return Err(self.invalid(
                "set_comm_hook",
                format!(
                    "hook {} averages over fewer ranks than the communicator's, which \
                     uneven_inputs DivideByActiveRanks cannot rescale; use DivideByWorldSize",
                    hook.name()
                ),
            ));
        }
        self.hook = Box::new(hook);
        self.default_hook = false;
        self.sync_plan = None;
        self.hook_check = HookCheck::Pending;
        Ok(())
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

    /// Whether this micro-batch reduces: decided once when it begins (so a `no_sync` guard taken
    /// in the middle of a backward pass does not change it).
    fn syncing(&self) -> bool {
        if self.phase == Phase::Backward {
            self.sync_now
        } else {
            !self.no_sync && self.micro + 1 >= self.accumulate
        }
    }

    /// Starts a micro-batch (and, at its first micro-batch, a step) unless one is under way;
    /// `via_sync` when `sync` starts it. With uneven inputs, a synchronising micro-batch issues
    /// the flag all-reduce first, before any bucket.
    fn begin(&mut self, via_sync: bool) {
        if self.phase == Phase::Backward {
            return;
        }
        // `join_step` stands in for the last micro-batch of the others' step: it always reduces.
        self.sync_now = self.shadow.is_some() || self.syncing();
        self.phase = Phase::Backward;
        self.via_sync = via_sync;
        if self.sync_now && self.shadow.is_none() && self.cfg.uneven_inputs != UnevenInputs::Off {
            let c = self.comm.borrow();
            let mut flag = vec![0u8; c.size()];
            flag[c.rank()] = 1 + u8::from(via_sync);
            self.join_flag = Some(c.all_reduce_async(flag, ReduceOp::Sum));
        }
        if self.micro == 0 {
            if let Some(order) = self.pending_order.take() {
                self.relayout(&order);
            }
            self.seen.fill(false);
        }
        for b in &mut self.buckets {
            b.pending = b.spec.params.len();
            if b.buf.is_none() {
                // Lost with a failed collective: start again from zeros.
                b.buf = Some(FlatBuffer::zeros(b.spec.dtype, b.spec.len));
            }
        }
        self.ready.fill(false);
        self.slot_out.fill(false);
        self.order.clear();
        self.next_launch = 0;
        self.reduced = false;
    }

    fn relayout(&mut self, order: &[usize]) {
        let layout = plan(
            &self.specs,
            order,
            self.cfg.first_bucket_bytes,
            self.cfg.bucket_cap_bytes,
        );
        let same = layout.buckets.len() == self.buckets.len()
            && layout
                .buckets
                .iter()
                .zip(&self.buckets)
                .all(|(a, b)| *a == b.spec);
        tracing::debug!(
            rank = self.comm().rank(),
            buckets = layout.buckets.len(),
            changed = !same,
            "ddp: buckets rebuilt from the observed gradient order"
        );
        if !same {
            self.buckets = layout.buckets.into_iter().map(Bucket::new).collect();
            self.slot = layout.slot;
            self.sync_plan = None;
        }
    }

    /// Declares parameter `param`'s gradient for this backward pass: copied (or, in later
    /// micro-batches of a step, added) into its bucket; when that fills a bucket, and every
    /// bucket before it has been launched, its all-reduce starts at once (unless overlap is off,
    /// [`DdpConfig::overlap`]: then `finish()` starts it).
    ///
    /// # Errors
    /// `InvalidArgument` for an index out of range, a dtype or length that is not the
    /// parameter's, or a second gradient for one parameter in one backward pass.
    pub fn grad_ready<T: Element>(&mut self, param: usize, grad: &[T]) -> Result<()> {
        let bytes: &[u8] = bytemuck::cast_slice(grad);
        self.check_param(param, T::DTYPE, bytes.len(), "grad_ready")?;
        self.ingest(param, bytes, "grad_ready", self.overlap)
    }

    /// Parameter `param`'s slot in its bucket, for a backward pass that computes the gradient
    /// there instead of handing a copy to [`Ddp::grad_ready`] (PyTorch's
    /// `gradient_as_bucket_view`): write it, then call [`Ddp::grad_ready_in_place`]. Saves
    /// `grad_ready`'s copy. The flag says what the slot holds: `true` (the parameter's first
    /// micro-batch of the step) stale values to overwrite, `false` (a later micro-batch of
    /// [`Ddp::accumulate`] or [`Ddp::no_sync`]) the sum of the earlier micro-batches'
    /// gradients, to add to. Starts the micro-batch like `grad_ready`. A slot handed out but
    /// never declared ready counts as unused at `finish()` (its contents are then zeros, or the
    /// earlier micro-batches' sum).
    ///
    /// # Errors
    /// `InvalidArgument` for an index out of range, a `T` that is not the parameter's dtype, or a
    /// parameter that already got its gradient in this backward pass.
    pub fn grad_slot<T: Element>(&mut self, param: usize) -> Result<(&mut [T], bool)> {
        let s = self.spec(param, "grad_slot")?;
        if T::DTYPE != s.dtype {
            let msg = format!(
                "parameter {param} ({}) is {}, its slot was asked for as {}",
                s.name,
                s.dtype.short_name(),
                T::DTYPE.short_name()
            );
            return Err(self.invalid("grad_slot", msg));
        }
        self.begin(false);
        self.check_not_ready(param, "grad_slot")?;
        self.slot_out[param] = true;
        let fresh = !self.seen[param];
        let (b, off) = self.slot[param];
        let len = self.specs[param].len;
        let rank = self.comm().rank();
        let bucket = &mut self.buckets[b];
        let buf = bucket
            .buf
            .get_or_insert_with(|| FlatBuffer::zeros(bucket.spec.dtype, bucket.spec.len));
        let all = buf
            .as_mut_slice::<T>()
            .ok_or_else(|| DdpError::InvalidArgument {
                rank,
                op: "grad_slot",
                msg: format!(
                    "parameter {param}'s bucket is not {}",
                    T::DTYPE.short_name()
                ),
            })?;
        Ok((&mut all[off..off + len], fresh))
    }

    /// Declares that parameter `param`'s gradient is in its slot ([`Ddp::grad_slot`]): from
    /// here on as [`Ddp::grad_ready`] after its copy (a full bucket's all-reduce starts).
    ///
    /// # Errors
    /// `InvalidArgument` for an index out of range, a parameter whose slot `grad_slot` did not
    /// hand out in this backward pass, or a second gradient for one parameter in one backward
    /// pass.
    pub fn grad_ready_in_place(&mut self, param: usize) -> Result<()> {
        self.spec(param, "grad_ready_in_place")?;
        // Checked before `begin`: a refused call starts no micro-batch (and sends no flag).
        if self.phase != Phase::Backward || !self.slot_out[param] {
            return Err(self.invalid(
                "grad_ready_in_place",
                format!(
                    "parameter {param} ({}): its slot was not taken with grad_slot in this \
                     backward pass",
                    self.specs[param].name
                ),
            ));
        }
        self.check_not_ready(param, "grad_ready_in_place")?;
        self.mark_ready(param, self.overlap);
        Ok(())
    }

    fn check_not_ready(&self, p: usize, op: &'static str) -> Result<()> {
        if self.ready[p] {
            return Err(self.invalid(
                op,
                format!(
                    "parameter {p} ({}) already got its gradient in this backward pass",
                    self.specs[p].name
                ),
            ));
        }
        Ok(())
    }

    /// Copies or adds a checked gradient into its slot and, with `launch`, launches what became
    /// ready.
    fn ingest(&mut self, p: usize, bytes: &[u8], op: &'static str, launch: bool) -> Result<()> {
        self.begin(false);
        self.check_not_ready(p, op)?;
        let dtype = self.specs[p].dtype;
        let (b, off) = self.slot[p];
        let sz = dtype.size();
        let seen = self.seen[p];
        let bucket = &mut self.buckets[b];
        let buf = bucket
            .buf
            .get_or_insert_with(|| FlatBuffer::zeros(bucket.spec.dtype, bucket.spec.len));
        let dst = &mut buf.bytes_mut()[off * sz..off * sz + bytes.len()];
        if seen {
            oxccl_kernels::reduce_bytes(dtype, ReduceOp::Sum, dst, bytes).map_err(|e| {
                DdpError::InvalidArgument {
                    rank: self.comm.borrow().rank(),
                    op,
                    msg: format!("accumulating parameter {p}: {e}"),
                }
            })?;
        } else {
            dst.copy_from_slice(bytes);
        }
        self.mark_ready(p, launch);
        Ok(())
    }

    /// Parameter `p`'s gradient is in its slot; with `launch`, launches what became ready.
    fn mark_ready(&mut self, p: usize, launch: bool) {
        let b = self.slot[p].0;
        self.buckets[b].pending -= 1;
        self.ready[p] = true;
        self.seen[p] = true;
        self.order.push(p);
        if launch && self.buckets[b].pending == 0 && self.syncing() {
            self.launch_ready();
        }
    }

    /// Launches, in bucket order, every bucket that is full and not yet launched, stopping at the
    /// first that is not full (so every rank launches in the same order).
    fn launch_ready(&mut self) {
        while self.next_launch < self.buckets.len() && self.buckets[self.next_launch].pending == 0 {
            self.launch_next();
        }
    }

    /// Compares the hook's name and settings between the ranks once after `set_comm_hook` (see
    /// [`CommHook::settings`]): one all-reduce of three settings (six words), and when only the
    /// settings' values differ, a second one that names them. Every rank calls it at the same
    /// point (before the first bucket it launches in the step) and gets the same answer; the
    /// error is reported under the call that reports the step's errors.
    fn check_hook(&mut self) -> Result<()> {
        let op = self.step_op();
        match &self.hook_check {
            HookCheck::Agreed => return Ok(()),
            HookCheck::Refused(msg) => return Err(self.invalid(op, msg.clone())),
            HookCheck::Pending => {}
        }
        let name = self.hook.name().to_string();
        let pairs = self.hook.settings();
        let settings: Vec<Setting> = pairs.iter().map(|&(n, v)| Setting::number(n, v)).collect();
        let all = fnv1a(pairs.iter().flat_map(|&(n, v)| [fnv1a_str(n), v]));
        let listed: Vec<String> = pairs.iter().map(|(n, v)| format!("{n} {v}")).collect();
        let summary = [
            Setting::described("the comm hook", fnv1a_str(&name), name.clone()),
            Setting::number("the hook's setting count", settings.len() as u64),
            Setting::described(
                "the hook's settings",
                all,
                format!("[{}]", listed.join(", ")),
            ),
        ];
        let c = self.comm.borrow();
        let mut d = differing(c, &summary, &mut [])?;
        if d.len() == 1 && d[0].0 == 2 {
            // The same hook with other values: say which (the summary's word if none by name).
            let named = differing(c, &settings, &mut [])?;
            if !named.is_empty() {
                d = named;
            }
        }
        if d.is_empty() {
            self.hook_check = HookCheck::Agreed;
            return Ok(());
        }
        let msg: Vec<String> = d.into_iter().map(|(_, m)| m).collect();
        let msg = format!(
            "hook {name} (given to set_comm_hook): {}; no bucket goes through it (every step \
             fails) until every rank calls set_comm_hook again with hooks alike",
            msg.join("; ")
        );
        self.hook_check = HookCheck::Refused(msg.clone());
        Err(self.invalid(op, msg))
    }

    /// Launches bucket `next_launch` through the hook.
    fn launch_next(&mut self) {
        let b = self.next_launch;
        if let Err(e) = self.check_hook() {
            // No average: grad() refuses the bucket until a step fills it again.
            self.buckets[b].buf = None;
            self.buckets[b].work = Some(HookWork::new(move || Err(e)));
            self.next_launch += 1;
            return;
        }
        let bucket = &mut self.buckets[b];
        let buffer = bucket
            .buf
            .take()
            .unwrap_or_else(|| FlatBuffer::zeros(bucket.spec.dtype, bucket.spec.len));
        let params = entries(&bucket.spec);
        let work = self.hook.start(
            self.comm.borrow(),
            GradBucket {
                index: b,
                buffer,
                params,
            },
        );
        self.buckets[b].work = Some(work);
        self.next_launch += 1;
    }

    /// Ends a backward pass. In an accumulating micro-batch it only records it. Otherwise it
    /// launches what is left, waits for every bucket (with overlap off, launching each only
    /// when the one before it is done), and leaves the averaged gradients readable
    /// through [`Ddp::grad`] until the next backward pass; after the first step it also agrees
    /// on the rebuilt bucket order. Collective.
    ///
    /// # Errors
    /// A collective's error (`PeerLost`, `Timeout`, ...); [`DdpError::UnusedParameters`] naming
    /// every parameter that got no gradient in the step, unless `find_unused_parameters` is set
    /// (they are reduced as zeros either way, so the other ranks are not left waiting).
    pub fn finish(&mut self) -> Result<Step> {
        self.finish_with(|_, _| {})
    }

    fn finish_with(&mut self, mut done: impl FnMut(&BucketSpec, &FlatBuffer)) -> Result<Step> {
        self.begin(false);
        if !self.syncing() {
            self.micro += 1;
            self.phase = Phase::Idle;
            return Ok(Step::Accumulated {
                micro_batch: self.micro - 1,
            });
        }
        let mut unused = Vec::new();
        for p in 0..self.specs.len() {
            if self.ready[p] {
                continue;
            }
            let (b, off) = self.slot[p];
            if !self.seen[p] {
                unused.push(p);
                let sz = self.specs[p].dtype.size();
                if let Some(buf) = self.buckets[b].buf.as_mut() {
                    buf.bytes_mut()[off * sz..(off + self.specs[p].len) * sz].fill(0);
                }
            }
            self.ready[p] = true;
            self.buckets[b].pending -= 1;
        }
        if self.overlap || self.hook.communicates_in_wait() {
            self.launch_ready();
        }
        let mut first_err: Option<DdpError> = None;
        // Uneven inputs: the flag went first, so it is done before any bucket is.
        let factor = self.wait_flag().unwrap_or_else(|e| {
            first_err = Some(e);
            1.0
        });
        for b in 0..self.buckets.len() {
            if self.next_launch == b {
                // Overlap off: one bucket at a time, so the waiter usually runs each all-reduce
                // on this thread (unless the progress thread takes it first).
                self.launch_next();
            }
            let Some(work) = self.buckets[b].work.take() else {
                continue;
            };
            match work.wait(self.comm.borrow()) {
                Ok(mut buf)
                    if buf.dtype() == self.buckets[b].spec.dtype
                        && buf.len() == self.buckets[b].spec.len =>
                {
                    let dtype = buf.dtype();
                    if let Err(e) = self.rescale(buf.bytes_mut(), dtype, factor) {
                        first_err.get_or_insert(e);
                    }
                    done(&self.buckets[b].spec, &buf);
                    self.buckets[b].buf = Some(buf);
                }
                Ok(buf) => {
                    let msg = format!(
                        "comm hook {} returned {} elements of {} for bucket {b} of {} elements \
                         of {}",
                        self.hook.name(),
                        buf.len(),
                        buf.dtype().short_name(),
                        self.buckets[b].spec.len,
                        self.buckets[b].spec.dtype.short_name()
                    );
                    first_err.get_or_insert(self.invalid("finish", msg));
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        self.reduced = true;
        self.complete_step(first_err, unused)
    }

    /// Ends a synchronising micro-batch: agrees on the rebuilt order after the first step and
    /// reports the first error, then unused parameters.
    fn complete_step(&mut self, first_err: Option<DdpError>, unused: Vec<usize>) -> Result<Step> {
        self.phase = Phase::Idle;
        self.micro = 0;
        if let Some(e @ DdpError::Comm(_)) = first_err {
            // The communicator is broken: issuing more collectives would only fail again.
            return Err(e);
        }
        // A local error (e.g. a user hook's) leaves the communicator working: keep issuing the
        // same collectives as the other ranks before reporting it.
        if self.cfg.rebuild_buckets && !self.rebuilt {
            self.rebuilt = true;
            self.agree_order()?;
        }
        if self.cfg.find_unused_parameters && !self.specs.is_empty() {
            // PyTorch's local_used_map: a byte per parameter, set where this rank gave a
            // gradient; every rank issues it in every synchronising step (the setting is the
            // same everywhere, `new` checks).
            let mut used = vec![u8::from(self.shadow.is_none()); self.specs.len()];
            if self.shadow.is_none() {
                for &p in &unused {
                    used[p] = 0;
                }
            }
            if let Err(e) = self.comm().all_reduce(&mut used, ReduceOp::Max) {
                if let Some(local) = &first_err {
                    // Only one error is returned: the communicator's; say what came before it.
                    tracing::warn!(error = %local, "ddp: step failed locally before the communicator failed");
                }
                return Err(e.into());
            }
            self.unused_everywhere = (0..used.len()).filter(|&p| used[p] == 0).collect();
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        let step = self.step;
        self.step += 1;
        if !unused.is_empty() && !self.cfg.find_unused_parameters && self.shadow.is_none() {
            return Err(DdpError::UnusedParameters {
                rank: self.comm().rank(),
                step,
                names: unused.iter().map(|&p| self.specs[p].name.clone()).collect(),
            });
        }
        Ok(Step::Synced { step })
    }

    /// The call a step's errors are reported under: `join_step`, `sync` or `finish`.
    fn step_op(&self) -> &'static str {
        if self.shadow.is_some() {
            "join_step"
        } else if self.via_sync {
            "sync"
        } else {
            "finish"
        }
    }

    /// Reads the uneven-inputs flag: one byte per rank.
    fn read_flag(&self, flag: &[u8], op: &'static str) -> Result<Trainers> {
        if let Some(r) = flag.iter().position(|&b| b > 2) {
            return Err(self.invalid(
                op,
                format!("the uneven-inputs flag says {} for rank {r}", flag[r]),
            ));
        }
        Ok(Trainers {
            active: flag.iter().filter(|&&b| b != 0).count(),
            syncs: flag.iter().filter(|&&b| b == 2).count(),
            lead: flag.iter().position(|&b| b != 0).unwrap_or(0),
        })
    }

    /// The error for a step that ranks feed in different ways.
    fn mixed_feeds(&self, t: Trainers, op: &'static str) -> DdpError {
        self.invalid(
            op,
            format!(
                "of the {} ranks training in step {}, {} feed it through sync() and the others \
                 through grad_ready()/finish(); every rank must feed a step the same way",
                t.active, self.step, t.syncs
            ),
        )
    }

    /// Uneven inputs: waits for this step's flag (or, in `join_step`, takes what it read),
    /// records who trained in the step, and returns the factor the averages are scaled by: 1
    /// unless [`UnevenInputs::DivideByActiveRanks`] and some ranks joined. Ranks that fed the
    /// step in different ways are an error here, after which the caller still issues the
    /// step's collectives (every rank sees the same flag).
    fn wait_flag(&mut self) -> Result<f64> {
        let world = self.comm().size();
        let op = self.step_op();
        let t = self.trainers()?;
        self.flag_read = None;
        self.active = t.active;
        self.lead = t.lead;
        if t.syncs != 0 && t.syncs != t.active {
            return Err(self.mixed_feeds(t, op));
        }
        Ok(match self.cfg.uneven_inputs {
            UnevenInputs::DivideByActiveRanks if t.active > 0 && t.active < world => {
                world as f64 / t.active as f64
            }
            _ => 1.0,
        })
    }

    /// Who trains in this synchronising step: what `join_step` read, or this step's flag
    /// (waited for once, kept until [`Ddp::wait_flag`]); every rank, without uneven inputs.
    fn trainers(&mut self) -> Result<Trainers> {
        if let Some(t) = self.shadow.or(self.flag_read) {
            return Ok(t);
        }
        let op = self.step_op();
        let t = if let Some(work) = self.join_flag.take() {
            let flag = work.wait()?;
            self.read_flag(&flag, op)?
        } else if self.cfg.uneven_inputs != UnevenInputs::Off {
            // Only after a call of this step failed half-way: the ranks are out of step.
            return Err(self.invalid(
                op,
                "this step's uneven-inputs flag was already read by a call that failed; the \
                 ranks are no longer in step",
            ));
        } else {
            Trainers {
                active: self.comm().size(),
                syncs: 0,
                lead: 0,
            }
        };
        self.flag_read = Some(t);
        Ok(t)
    }

    /// Multiplies averaged gradients by `factor` (from [`Ddp::wait_flag`]) unless it is 1.
    fn rescale(&self, bytes: &mut [u8], dtype: DType, factor: f64) -> Result<()> {
        if factor == 1.0 {
            return Ok(());
        }
        oxccl_kernels::scale_bytes(dtype, bytes, factor).map_err(|e| {
            self.invalid(
                self.step_op(),
                format!(
                    "dividing the sum by the {} ranks still training: {e}",
                    self.active
                ),
            )
        })
    }

    /// For a rank that has run out of data while others may still train, under
    /// [`DdpConfig::uneven_inputs`] (PyTorch's `Join` context): stands in for one step of the
    /// ranks still training, issuing the collectives their step issues with zero gradients of
    /// its own. Returns `Some` after such a step, with its averaged gradients readable through
    /// [`Ddp::grad`], the same values the training ranks get: apply them as they do and every
    /// replica (optimizer state included) stays identical. Returns `None` once every rank has
    /// joined: every rank's `join_step` returns `None` in the same call, and a next epoch can
    /// start with every rank training. Call it between steps, in a loop, until `None`:
    ///
    /// ```no_run
    /// # fn f(ddp: &mut oxccl_ddp::Ddp, params: &mut [f32]) -> oxccl_ddp::Result<()> {
    /// while ddp.join_step()?.is_some() {
    ///     for (x, g) in params.iter_mut().zip(ddp.grad::<f32>(0)?) {
    ///         *x -= 0.1 * g;
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// Collective with the training ranks' steps: it matches their `grad_ready`/`finish()` or
    /// `sync()`, whichever they use (the flag, one byte per rank, says), with this rank's comm
    /// hook (a hook with state of its own may still send some: with error feedback,
    /// [`PowerSgd`](crate::PowerSgd) sends this rank's residual, its last input less the
    /// averaged approximation). A joined rank learns of a step only from its flag, issued at
    /// the first gradient of the step's synchronising micro-batch: collectives the trainer
    /// issues itself once per step (a loss all-reduce, [`Ddp::broadcast_buffers`]) must come
    /// after the step's synchronising `finish()`/`sync()` (not after an accumulating one) on
    /// training ranks, and after each `Some` on a joined one, or the ranks' sequences part. A joined rank waits in
    /// the flag while the others compute: the communicator's time-out (`OXCCL_TIMEOUT`) must
    /// be longer than a step.
    ///
    /// # Errors
    /// `InvalidArgument` when `uneven_inputs` is `Off`, in the middle of a step (a micro-batch
    /// under way, or one of `accumulate(k)` done), or when the training ranks feed the step in
    /// different ways (reported once the step's collectives are done, as on the training
    /// ranks); a collective's error.
    pub fn join_step(&mut self) -> Result<Option<Step>> {
        if self.cfg.uneven_inputs == UnevenInputs::Off {
            return Err(self.invalid(
                "join_step",
                "DdpConfig::uneven_inputs is Off: set it, alike on every rank, to let ranks \
                 join early",
            ));
        }
        if self.phase == Phase::Backward || self.micro != 0 {
            let doing = if self.phase == Phase::Backward {
                "a micro-batch's gradients are arriving"
            } else {
                "micro-batches of accumulate(k) are done and the step's last is not"
            };
            return Err(self.invalid(
                "join_step",
                format!(
                    "called in the middle of step {} ({doing}); join between steps, when this \
                     rank has no more data",
                    self.step
                ),
            ));
        }
        let mut flag = vec![0u8; self.comm().size()];
        self.comm().all_reduce(&mut flag, ReduceOp::Sum)?;
        let t = self.read_flag(&flag, "join_step")?;
        if t.active == 0 {
            // Every rank has joined; `lead` stays the last step's, a rank that trained to the end.
            self.active = 0;
            return Ok(None);
        }
        // Ranks that feed the step in different ways are reported at the end of the step;
        // the bucket path is what `grad_ready` and a hooked `sync` issue.
        self.shadow = Some(t);
        let r = if t.syncs == t.active {
            self.shadow_sync()
        } else {
            self.finish()
        };
        self.shadow = None;
        r.map(Some)
    }

    /// `join_step` for ranks that use `sync`: zero gradients through the same path, then the
    /// averages copied into the buckets for [`Ddp::grad`].
    fn shadow_sync(&mut self) -> Result<Step> {
        let mut zeros = std::mem::take(&mut self.shadow_grads);
        if zeros.len() == self.specs.len() {
            for z in &mut zeros {
                z.bytes_mut().fill(0);
            }
        } else {
            zeros = self
                .specs
                .iter()
                .map(|s| FlatBuffer::zeros(s.dtype, s.len))
                .collect();
        }
        let r = self.sync(&mut zeros);
        if r.is_ok() && !self.reduced {
            for (p, z) in zeros.iter().enumerate() {
                let (b, off) = self.slot[p];
                let bucket = &mut self.buckets[b];
                let sz = bucket.spec.dtype.size();
                let buf = bucket
                    .buf
                    .get_or_insert_with(|| FlatBuffer::zeros(bucket.spec.dtype, bucket.spec.len));
                buf.bytes_mut()[off * sz..off * sz + z.bytes().len()].copy_from_slice(z.bytes());
            }
            self.reduced = true;
        }
        self.shadow_grads = zeros;
        r
    }

    /// Ranks that trained in the last synchronised step: the world size, unless
    /// [`DdpConfig::uneven_inputs`] is set and some had joined (after [`Ddp::join_step`], the
    /// ranks it stood in for, this one not counted; 0 after it returned `None`).
    pub fn active_ranks(&self) -> usize {
        self.active
    }

    /// Broadcasts the observed gradient order of rank 0 (with uneven inputs, of the lowest rank
    /// that trained in the step); every rank rebuilds its buckets from it at the start of the
    /// next step.
    fn agree_order(&mut self) -> Result<()> {
        let n = self.specs.len();
        let root = self.lead;
        let mut v: Vec<u64> = if self.comm().rank() == root {
            let mut listed = vec![false; n];
            let mut full: Vec<u64> = Vec::with_capacity(n);
            for &p in &self.order {
                listed[p] = true;
                full.push(p as u64);
            }
            full.extend((0..n).rev().filter(|&p| !listed[p]).map(|p| p as u64));
            full
        } else {
            vec![0; n]
        };
        self.comm().broadcast(&mut v, root)?;
        let mut listed = vec![false; n];
        for &p in &v {
            match listed.get_mut(p as usize) {
                Some(l) if !*l => *l = true,
                _ => {
                    return Err(self.invalid(
                        "rebuild_buckets",
                        format!(
                            "the order received from rank {root} is not a permutation of the \
                             parameters"
                        ),
                    ))
                }
            }
        }
        self.pending_order = Some(v.into_iter().map(|p| p as usize).collect());
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
