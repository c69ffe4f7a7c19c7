//! Backward: gradients widened into their buckets as they arrive, and each bucket launched
//! (reduce-scattered inside the shard group, asynchronously) once it is full and every bucket
//! before it is launched, so that every rank issues the same collectives in the same order
//! whatever order its gradients arrive in.

use std::collections::VecDeque;

use oxccl_comm::ReduceOp;

use super::{InFlight, Stage, Zero};
use crate::elem::ParamElement;
use crate::error::Result;
use crate::shard::ShardLayout;

/// The buckets' state through a step's micro-batches.
pub(super) struct Backward {
    stage: Stage,
    /// Micro-batches per step.
    pub(super) accumulate: usize,
    /// Micro-batches closed in this step.
    pub(super) micro: usize,
    /// A gradient arrived since the last `step` call.
    open: bool,
    /// Parameters given in this micro-batch.
    given: Vec<bool>,
    /// Per bucket: members not given yet in this micro-batch.
    pending: Vec<usize>,
    /// Per bucket: its buffer (stage 1: always, but while in flight; stage 2: while filling).
    bufs: Vec<Option<Vec<f32>>>,
    /// Stage 2: free buffers, and how many were made (each of the largest bucket's length).
    pool: Vec<Vec<f32>>,
    made: usize,
    max_in_flight: usize,
    largest: usize,
    pub(super) in_flight: VecDeque<InFlight>,
    /// The next bucket to launch in this micro-batch.
    next: usize,
    /// What this rank refused since the last step (reported to every rank at the step).
    pub(super) fault: Option<String>,
}

impl Backward {
    pub(super) fn new(layout: &ShardLayout, stage: Stage, max_in_flight: usize) -> Backward {
        let g = layout.group();
        let buckets = layout.buckets();
        let bufs = buckets
            .iter()
            .map(|b| (stage == Stage::One).then(|| vec![0.0f32; b.padded(g)]))
            .collect();
        Backward {
            stage,
            accumulate: 1,
            micro: 0,
            open: false,
            given: vec![false; layout.lens().len()],
            pending: buckets.iter().map(|b| b.params.len()).collect(),
            bufs,
            pool: Vec::new(),
            made: 0,
            max_in_flight: max_in_flight.max(1),
            largest: buckets.iter().map(|b| b.padded(g)).max().unwrap_or(0),
            in_flight: VecDeque::new(),
            next: 0,
            fault: None,
        }
    }

    /// In the middle of a step.
    pub(super) fn busy(&self) -> bool {
        self.open || self.micro > 0 || !self.in_flight.is_empty()
    }

    /// f32 elements of the bucket buffers.
    pub(super) fn buffer_elems(&self) -> usize {
        match self.stage {
            Stage::One => {
                self.bufs.iter().flatten().map(Vec::len).sum::<usize>()
                    + self.in_flight.len() * self.largest
            } // an upper bound while in flight
            Stage::Two => self.made * self.largest,
        }
    }

    /// This micro-batch reduce-scatters its buckets.
    fn communicates(&self) -> bool {
        self.stage == Stage::Two || self.micro + 1 >= self.accumulate
    }

    fn fault(&mut self, msg: String) -> String {
        self.fault.get_or_insert(msg.clone());
        msg
    }
}

impl<T: ParamElement> Zero<T> {
    /// Parameter `param`'s gradient of this micro-batch (this rank's, not averaged), as soon as
    /// backward has it: widened into its bucket, whose reduce-scatter starts once it is full
    /// (see [`ZeroConfig::bucket_elems`](super::ZeroConfig::bucket_elems)). A parameter without
    /// a gradient in a micro-batch counts as zeros.
    ///
    /// # Errors
    /// `InvalidArgument` for a parameter index or length that is not `new`'s, or a gradient
    /// given twice in a micro-batch (the next [`Zero::step`] then fails on every rank, naming
    /// it); the error of a reduce-scatter waited for to free a buffer.
    pub fn grad_ready(&mut self, param: usize, grad: &[T]) -> Result<()> {
        self.check_poisoned("grad_ready")?;
        let lens = self.layout.lens();
        let msg = if param >= lens.len() {
            Some(format!(
                "gradient of parameter {param}; new had {} parameters",
                lens.len()
            ))
        } else if grad.len() != lens[param] {
            Some(format!(
                "gradient of parameter {param} has {} elements; the parameter has {}",
                grad.len(),
                lens[param]
            ))
        } else if self.back.given[param] {
            Some(format!(
                "gradient of parameter {param} given twice in one micro-batch"
            ))
        } else {
            None
        };
        if let Some(m) = msg {
            let m = self.back.fault(m);
            return Err(self.invalid("grad_ready", m));
        }
        self.back.open = true;
        let (b, start) = self.layout.place(param);
        self.ensure_buffer(b)?;
        let add = self.stage == Stage::One && self.back.micro > 0;
        let buf = self.back.bufs[b]
            .as_mut()
            .expect("a filling bucket has its buffer");
        let dst = &mut buf[start..start + grad.len()];
        if add {
            dst.iter_mut().zip(grad).for_each(|(d, g)| *d += g.to_f32());
        } else {
            dst.iter_mut().zip(grad).for_each(|(d, g)| *d = g.to_f32());
        }
        self.back.given[param] = true;
        self.back.pending[b] -= 1;
        if self.back.communicates() {
            self.launch_ready();
        }
        Ok(())
    }

    /// Every parameter's gradient of this micro-batch at once (frameworks that hand back all
    /// gradients after backward): [`Zero::grad_ready`] for each, last parameter first.
    ///
    /// # Errors
    /// `InvalidArgument` for a list of another length, or any gradient `grad_ready` refuses (the
    /// next [`Zero::step`] then fails on every rank, naming it).
    pub fn grads_ready(&mut self, grads: &[&[T]]) -> Result<()> {
        self.check_poisoned("grads_ready")?;
        let lens = self.layout.lens();
        let glens: Vec<usize> = grads.iter().map(|g| g.len()).collect();
        if glens != lens {
            let m = format!("gradients of lengths {glens:?}; new had {lens:?}");
            let m = self.back.fault(m);
            return Err(self.invalid("grads_ready", m));
        }
        for p in (0..grads.len()).rev() {
            self.grad_ready(p, grads[p])?;
        }
        Ok(())
    }

    /// Closes the micro-batch: the parameters without a gradient count as zeros, and, where
    /// the micro-batch communicates, every bucket not launched yet is.
    pub(super) fn close_micro(&mut self) -> Result<()> {
        // Buckets before `next` are launched: every member was given.
        for b in self.back.next..self.layout.buckets().len() {
            self.ensure_buffer(b)?;
            // Stage 1's buffers hold the last step's sums until the first micro-batch writes.
            if self.stage == Stage::One && self.back.micro == 0 {
                let bucket = &self.layout.buckets()[b];
                let buf = self.back.bufs[b].as_mut().expect("stage 1 buffers");
                for (&p, &start) in bucket.params.iter().zip(&bucket.starts) {
                    if !self.back.given[p] {
                        buf[start..start + self.layout.lens()[p]].fill(0.0);
                    }
                }
            }
            self.back.pending[b] = 0;
        }
        if self.back.communicates() {
            self.launch_ready();
        }
        let b = &mut self.back;
        b.given.fill(false);
        for (pending, bucket) in b.pending.iter_mut().zip(self.layout.buckets()) {
            *pending = bucket.params.len();
        }
        b.next = 0;
        b.open = false;
        b.micro += 1;
        Ok(())
    }

    /// Launches the full buckets, in order, up to the first that is not.
    fn launch_ready(&mut self) {
        let n_buckets = self.layout.buckets().len();
        while self.back.next < n_buckets && self.back.pending[self.back.next] == 0 {
            let b = self.back.next;
            let buf = self.back.bufs[b]
                .take()
                .expect("a full bucket has its buffer");
            let work = self.shard.reduce_scatter_async(buf, ReduceOp::Sum);
            let micro = self.back.micro;
            self.back.in_flight.push_back(InFlight {
                bucket: b,
                micro,
                work,
            });
            self.back.next += 1;
        }
    }

    /// Stage 2: gives bucket `b` a zeroed buffer for this micro-batch, if it has none: a free
    /// one, a new one while fewer than `buckets_in_flight` exist (or none is in flight), else
    /// the oldest in flight's once it is done.
    fn ensure_buffer(&mut self, b: usize) -> Result<()> {
        if self.back.bufs[b].is_some() {
            return Ok(());
        }
        if self.back.pool.is_empty() {
            let full = self.back.made >= self.back.max_in_flight;
            if full && !self.back.in_flight.is_empty() {
                self.complete_oldest()?;
            } else {
                self.back.made += 1;
                self.back.pool.push(Vec::with_capacity(self.back.largest));
            }
        }
        let mut buf = self.back.pool.pop().expect("a free buffer");
        buf.clear();
        buf.resize(self.layout.buckets()[b].padded(self.layout.group()), 0.0);
        self.back.bufs[b] = Some(buf);
        Ok(())
    }

    /// Waits for the oldest reduce-scatter and moves this rank's chunk into the shard's
    /// gradient (written by the step's first, added after).
    pub(super) fn complete_oldest(&mut self) -> Result<()> {
        let Some(f) = self.back.in_flight.pop_front() else {
            return Ok(());
        };
        let buf = match f.work.wait() {
            Ok(buf) => buf,
            Err(e) => {
                self.poisoned = Some(format!("a reduce-scatter failed: {e}"));
                return Err(e.into());
            }
        };
        let bucket = &self.layout.buckets()[f.bucket];
        let r = self.shard.rank();
        let src = &buf[r * bucket.chunk..(r + 1) * bucket.chunk];
        let dst = &mut self.grad[bucket.shard_offset..bucket.shard_offset + bucket.chunk];
        if self.stage == Stage::One || f.micro == 0 {
            dst.copy_from_slice(src);
        } else {
            dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
        }
        match self.stage {
            Stage::One => self.back.bufs[f.bucket] = Some(buf),
            Stage::Two => self.back.pool.push(buf),
        }
        Ok(())
    }
}
