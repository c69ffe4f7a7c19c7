//! The device reducer's plan: what each call of [`DeviceDdp`](super::DeviceDdp) enqueues, on
//! which stream, in which order, as a list of [`Op`]s. It holds the whole state machine of a
//! step (micro-batches, accumulation, buckets launched in order as they fill, unused parameters,
//! the rebuilt order) and no device memory, so every rule in it is tested without a GPU
//! (`device/tests.rs` runs it through a host executor that checks every buffer access against
//! the stream order, `device/sim.rs`); the CUDA executor (`device/cuda.rs`) maps each `Op` to
//! one or two driver calls.

use oxccl_comm::{Communicator, DType, ReduceOp};

use crate::config::{DdpConfig, Step};
use crate::error::{DdpError, Result};
use crate::hooks::DeviceHook;
use crate::layout::{plan, BucketSpec, ParamSpec};
use crate::reducer::broadcast_order;

/// The two streams of a device step: the trainer's (backward, the gradients' copies) and the
/// reducer's own communication stream (the buckets' all-reduces).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Queue {
    Trainer,
    Comm,
}

/// The events that order the two streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Event {
    /// Bucket `b`'s gradients are in it (recorded on the trainer's stream).
    Filled(usize),
    /// Every bucket launched in this step is reduced (recorded on the communication stream).
    Reduced,
}

/// One thing a call enqueues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// Reallocate the buckets for the rebuilt layout ([`Planner::buckets`]), zeroed, on the
    /// trainer's stream (after the last step's `Reduced` wait, so nothing still reads the old).
    Relayout,
    /// Trainer's stream: the call's gradient of `param` into its slot (`add`: added to the
    /// earlier micro-batches' sum).
    CopyIn {
        param: usize,
        add: bool,
    },
    /// Trainer's stream: `param`'s slot set to zeros (a parameter no micro-batch of the step
    /// gave a gradient).
    Zero {
        param: usize,
    },
    Record {
        on: Queue,
        event: Event,
    },
    Wait {
        on: Queue,
        event: Event,
    },
    /// Communication stream: bucket `bucket` averaged over the ranks, sent as `wire` when set
    /// (the compression hook: scaled by 1/world, converted, summed, converted back).
    Reduce {
        bucket: usize,
        wire: Option<DType>,
    },
    /// Trainer's stream: `param`'s averaged slot into the call's gradient (`sync`).
    CopyOut {
        param: usize,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Idle,
    Backward,
}

/// What `finish` (or `sync`) left to do on the host: the step's collectives on host memory (the
/// rebuilt order, the used-parameter map), given to [`Planner::complete`].
#[derive(Debug)]
pub(crate) enum Ending {
    /// An accumulating micro-batch: nothing to reduce.
    Accumulated(Step),
    /// A synchronising one: these parameters got no gradient in the step.
    Synced { unused: Vec<usize> },
}

/// The state machine of the device reducer (see the module docs).
#[derive(Debug)]
pub(crate) struct Planner {
    rank: usize,
    pub(crate) specs: Vec<ParamSpec>,
    pub(crate) cfg: DdpConfig,
    buckets: Vec<BucketSpec>,
    slot: Vec<(usize, usize)>,
    pending: Vec<usize>,
    ready: Vec<bool>,
    seen: Vec<bool>,
    slot_out: Vec<bool>,
    order: Vec<usize>,
    next_launch: usize,
    phase: Phase,
    step: u64,
    micro: usize,
    accumulate: usize,
    pub(crate) no_sync: bool,
    sync_now: bool,
    rebuilt: bool,
    pending_order: Option<Vec<usize>>,
    hook: DeviceHook,
    unused_everywhere: Vec<usize>,
}

impl Planner {
    /// The plan for `specs` on rank `rank`: buckets in reverse parameter order until the first
    /// step's order is known.
    pub(crate) fn new(rank: usize, specs: Vec<ParamSpec>, cfg: DdpConfig) -> Planner {
        let order: Vec<usize> = (0..specs.len()).rev().collect();
        let layout = plan(&specs, &order, cfg.first_bucket_bytes, cfg.bucket_cap_bytes);
        let n = specs.len();
        Planner {
            rank,
            pending: layout.buckets.iter().map(|b| b.params.len()).collect(),
            buckets: layout.buckets,
            slot: layout.slot,
            specs,
            cfg,
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
            hook: DeviceHook::Avg,
            unused_everywhere: Vec::new(),
        }
    }

    pub(crate) fn buckets(&self) -> &[BucketSpec] {
        &self.buckets
    }

    /// Parameter `p`'s bucket, element offset and length.
    pub(crate) fn slot(&self, p: usize) -> (usize, usize, usize) {
        let (b, off) = self.slot[p];
        (b, off, self.specs[p].len)
    }

    pub(crate) fn steps(&self) -> u64 {
        self.step
    }

    pub(crate) fn unused_on_every_rank(&self) -> &[usize] {
        &self.unused_everywhere
    }

    #[cfg(test)]
    pub(crate) fn hook(&self) -> DeviceHook {
        self.hook
    }

    pub(crate) fn invalid(&self, op: &'static str, msg: impl Into<String>) -> DdpError {
        DdpError::InvalidArgument {
            rank: self.rank,
            op,
            msg: msg.into(),
        }
    }

    /// Sets the hook, refused in the middle of a step or, for compression, on `f64` buckets
    /// (the device converts `f32` only).
    pub(crate) fn set_hook(&mut self, hook: DeviceHook) -> Result<()> {
        if self.phase == Phase::Backward || self.micro != 0 {
            return Err(self.invalid(
                "set_comm_hook",
                "cannot change the hook in the middle of a step",
            ));
        }
        if let DeviceHook::Compress(wire) = hook {
            if let Some(s) = self.specs.iter().find(|s| s.dtype == DType::F64) {
                return Err(self.invalid(
                    "set_comm_hook",
                    format!(
                        "{} compression on device buffers converts f32 gradients only; parameter \
                         {} is f64",
                        wire.short_name(),
                        s.name
                    ),
                ));
            }
        }
        self.hook = hook;
        Ok(())
    }

    pub(crate) fn accumulate(&mut self, k: usize) -> Result<()> {
        if k == 0 {
            return Err(self.invalid("accumulate", "k must be at least 1"));
        }
        if self.phase == Phase::Backward || self.micro != 0 {
            return Err(self.invalid("accumulate", "cannot change k in the middle of a step"));
        }
        self.accumulate = k;
        Ok(())
    }

    fn syncing(&self) -> bool {
        if self.phase == Phase::Backward {
            self.sync_now
        } else {
            !self.no_sync && self.micro + 1 >= self.accumulate
        }
    }

    /// Starts a micro-batch unless one is under way (and, at a step's first, lays the buckets out
    /// again from the agreed order).
    fn begin(&mut self, ops: &mut Vec<Op>) {
        if self.phase == Phase::Backward {
            return;
        }
        self.sync_now = self.syncing();
        self.phase = Phase::Backward;
        if self.micro == 0 {
            if let Some(order) = self.pending_order.take() {
                let layout = plan(
                    &self.specs,
                    &order,
                    self.cfg.first_bucket_bytes,
                    self.cfg.bucket_cap_bytes,
                );
                if layout.buckets != self.buckets {
                    self.buckets = layout.buckets;
                    self.slot = layout.slot;
                    ops.push(Op::Relayout);
                }
            }
            self.seen.fill(false);
        }
        self.pending = self.buckets.iter().map(|b| b.params.len()).collect();
        self.ready.fill(false);
        self.slot_out.fill(false);
        self.order.clear();
        self.next_launch = 0;
    }

    /// Checks parameter `p` for `op`: in range, and (when given) of this dtype and length.
    pub(crate) fn check(
        &self,
        p: usize,
        op: &'static str,
        dtype: DType,
        len: Option<usize>,
    ) -> Result<()> {
        let Some(s) = self.specs.get(p) else {
            let n = self.specs.len();
            return Err(self.invalid(
                op,
                format!("parameter index {p} out of range ({n} parameters)"),
            ));
        };
        if s.dtype != dtype {
            let msg = format!(
                "parameter {p} ({}) is {}, the gradient given is {}",
                s.name,
                s.dtype.short_name(),
                dtype.short_name()
            );
            return Err(self.invalid(op, msg));
        }
        match len {
            Some(len) if len != s.len => Err(self.invalid(
                op,
                format!(
                    "parameter {p} ({}) has {} elements, the gradient given has {len}",
                    s.name, s.len
                ),
            )),
            _ => Ok(()),
        }
    }

    fn check_not_ready(&self, p: usize, op: &'static str) -> Result<()> {
        if self.phase == Phase::Backward && self.ready[p] {
            let msg = format!(
                "parameter {p} ({}) already got its gradient in this backward pass",
                self.specs[p].name
            );
            return Err(self.invalid(op, msg));
        }
        Ok(())
    }

    /// `grad_ready`: the gradient copied (or added) into its slot, then what filled launched.
    pub(crate) fn grad_ready(&mut self, p: usize, dtype: DType, len: usize) -> Result<Vec<Op>> {
        self.check(p, "grad_ready", dtype, Some(len))?;
        self.check_not_ready(p, "grad_ready")?;
        let mut ops = Vec::new();
        self.begin(&mut ops);
        ops.push(Op::CopyIn {
            param: p,
            add: self.seen[p],
        });
        self.mark_ready(p, &mut ops);
        Ok(ops)
    }

    /// `grad_slot`: what to enqueue before the slot is handed out, and whether it holds stale
    /// values to overwrite (`true`) or the earlier micro-batches' sum to add to.
    pub(crate) fn grad_slot(&mut self, p: usize, dtype: DType) -> Result<(Vec<Op>, bool)> {
        self.check(p, "grad_slot", dtype, None)?;
        self.check_not_ready(p, "grad_slot")?;
        let mut ops = Vec::new();
        self.begin(&mut ops);
        self.slot_out[p] = true;
        Ok((ops, !self.seen[p]))
    }

    /// `grad_ready_in_place`: the slot handed out by `grad_slot` holds the gradient.
    pub(crate) fn grad_ready_in_place(&mut self, p: usize) -> Result<Vec<Op>> {
        if p >= self.specs.len() || self.phase != Phase::Backward || !self.slot_out[p] {
            return Err(self.invalid(
                "grad_ready_in_place",
                format!(
                    "parameter {p}: its slot was not taken with grad_slot in this backward pass"
                ),
            ));
        }
        self.check_not_ready(p, "grad_ready_in_place")?;
        let mut ops = Vec::new();
        self.mark_ready(p, &mut ops);
        Ok(ops)
    }

    fn mark_ready(&mut self, p: usize, ops: &mut Vec<Op>) {
        let b = self.slot[p].0;
        self.pending[b] -= 1;
        self.ready[p] = true;
        self.seen[p] = true;
        self.order.push(p);
        if self.pending[b] == 0 && self.sync_now {
            self.launch_ready(ops);
        }
    }

    /// Launches, in bucket order, every full bucket not yet launched: the trainer's stream
    /// records that its gradients are in, the communication stream waits for that and reduces.
    fn launch_ready(&mut self, ops: &mut Vec<Op>) {
        while self.next_launch < self.buckets.len() && self.pending[self.next_launch] == 0 {
            let b = self.next_launch;
            let wire = match self.hook {
                DeviceHook::Compress(w) if self.buckets[b].dtype == DType::F32 => Some(w),
                _ => None,
            };
            ops.push(Op::Record {
                on: Queue::Trainer,
                event: Event::Filled(b),
            });
            ops.push(Op::Wait {
                on: Queue::Comm,
                event: Event::Filled(b),
            });
            ops.push(Op::Reduce { bucket: b, wire });
            self.next_launch += 1;
        }
    }

    /// `finish`: in an accumulating micro-batch only counts it; otherwise zeros the slots of
    /// parameters without a gradient in the step, launches what is left, and makes the trainer's
    /// stream wait for the communication stream (no host synchronisation).
    pub(crate) fn finish(&mut self, ops: &mut Vec<Op>) -> Ending {
        self.begin(ops);
        if !self.sync_now {
            self.micro += 1;
            self.phase = Phase::Idle;
            return Ending::Accumulated(Step::Accumulated {
                micro_batch: self.micro - 1,
            });
        }
        let mut unused = Vec::new();
        for p in 0..self.specs.len() {
            if self.ready[p] {
                continue;
            }
            if !self.seen[p] {
                unused.push(p);
                ops.push(Op::Zero { param: p });
            }
            self.ready[p] = true;
            self.pending[self.slot[p].0] -= 1;
        }
        self.launch_ready(ops);
        ops.push(Op::Record {
            on: Queue::Comm,
            event: Event::Reduced,
        });
        ops.push(Op::Wait {
            on: Queue::Trainer,
            event: Event::Reduced,
        });
        self.phase = Phase::Idle;
        self.micro = 0;
        Ending::Synced { unused }
    }

    /// `sync`: every gradient copied in, bucket by bucket in launch order (each bucket launched
    /// once packed), then `finish`, then (synchronising) every average copied back.
    pub(crate) fn sync(&mut self, given: &[(DType, usize)]) -> Result<(Vec<Op>, Ending)> {
        if given.len() != self.specs.len() {
            let msg = format!(
                "{} gradients given for {} parameters",
                given.len(),
                self.specs.len()
            );
            return Err(self.invalid("sync", msg));
        }
        for (p, &(dtype, len)) in given.iter().enumerate() {
            self.check(p, "sync", dtype, Some(len))?;
        }
        if self.phase == Phase::Backward {
            return Err(self.invalid(
                "sync",
                "a backward pass fed through grad_ready is under way: finish it first",
            ));
        }
        let mut ops = Vec::new();
        self.begin(&mut ops);
        for b in 0..self.buckets.len() {
            for i in 0..self.buckets[b].params.len() {
                let p = self.buckets[b].params[i];
                ops.push(Op::CopyIn {
                    param: p,
                    add: self.seen[p],
                });
                self.mark_ready(p, &mut ops);
            }
        }
        let ending = self.finish(&mut ops);
        if matches!(ending, Ending::Synced { .. }) {
            ops.extend((0..self.specs.len()).map(|param| Op::CopyOut { param }));
        }
        Ok((ops, ending))
    }

    /// Parameter `p`'s slot may be read as an average (or an accumulating sum).
    pub(crate) fn readable(&self, p: usize) -> Result<()> {
        if self.phase == Phase::Backward && self.sync_now && self.next_launch > self.slot[p].0 {
            let msg = format!(
                "parameter {p} ({}): its bucket is being reduced; call finish() first",
                self.specs[p].name
            );
            return Err(self.invalid("grad", msg));
        }
        Ok(())
    }

    /// The end of a synchronising step, on the host: after the first step the order the
    /// gradients arrived in on rank 0 is broadcast (the buckets follow it from the next step);
    /// with `find_unused_parameters` the used-parameter map is all-reduced. Collective.
    ///
    /// # Errors
    /// The collectives'; `UnusedParameters` without `find_unused_parameters`.
    pub(crate) fn complete(&mut self, comm: &Communicator, unused: Vec<usize>) -> Result<Step> {
        if self.cfg.rebuild_buckets && !self.rebuilt {
            self.rebuilt = true;
            self.agree_order(comm)?;
        }
        if self.cfg.find_unused_parameters && !self.specs.is_empty() {
            let mut used = vec![1u8; self.specs.len()];
            for &p in &unused {
                used[p] = 0;
            }
            comm.all_reduce(&mut used, ReduceOp::Max)?;
            self.unused_everywhere = (0..used.len()).filter(|&p| used[p] == 0).collect();
        }
        let step = self.step;
        self.step += 1;
        if !unused.is_empty() && !self.cfg.find_unused_parameters {
            return Err(DdpError::UnusedParameters {
                rank: self.rank,
                step,
                names: unused.iter().map(|&p| self.specs[p].name.clone()).collect(),
            });
        }
        Ok(Step::Synced { step })
    }

    fn agree_order(&mut self, comm: &Communicator) -> Result<()> {
        let n = self.specs.len();
        match broadcast_order(comm, 0, &self.order, n)? {
            Some(order) => {
                self.pending_order = Some(order);
                Ok(())
            }
            None => Err(self.invalid(
                "rebuild_buckets",
                "the order received from rank 0 is not a permutation of the parameters",
            )),
        }
    }
}
