//! Backward: gradients widened into their buckets as they arrive, and each bucket launched
//! (reduce-scattered inside the shard group, asynchronously) once it is full and every bucket
//! before it is launched, so that every rank issues the same collectives in the same order
//! whatever order its gradients arrive in.

use std::collections::VecDeque;

use oxccl_comm::{ReduceOp, Work};

use super::{InFlight, Stage, Zero};
use crate::elem::ParamElement;
use crate::error::Result;
use crate::shard::{grad_fault, ShardLayout};

/// The buckets' state through a step's micro-batches.
pub(super) struct Backward {
    stage: Stage,
    /// Collectives run while backward goes on (else on the caller's thread as buckets fill).
    pub(super) overlap: bool,
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
    /// Replica all-reduces in flight (last micro-batch): the bucket and the work on its chunk.
    pub(super) reducing: VecDeque<(usize, Work<Vec<f32>>)>,
    /// Free buffers of the replica all-reduces.
    ar_pool: Vec<Vec<f32>>,
    /// A chunk's reduce-scatter result, to add (`reduce_direct` after the first micro-batch).
    scratch: Vec<f32>,
    /// The next bucket to launch in this micro-batch.
    next: usize,
    /// What this rank refused since the last step (reported to every rank at the step).
    pub(super) fault: Option<String>,
}

impl Backward {
    pub(super) fn new(
        layout: &ShardLayout,
        stage: Stage,
        max_in_flight: usize,
        overlap: bool,
    ) -> Backward {
        let g = layout.group();
        let buckets = layout.buckets();
        let bufs = buckets
            .iter()
            .map(|b| (stage == Stage::One).then(|| vec![0.0f32; b.padded(g)]))
            .collect();
        Backward {
            stage,
            overlap,
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
            reducing: VecDeque::new(),
            ar_pool: Vec::new(),
            scratch: Vec::new(),
            next: 0,
            fault: None,
        }
    }

    /// In the middle of a step.
    pub(super) fn busy(&self) -> bool {
        self.open || self.micro > 0 || !self.in_flight.is_empty() || !self.reducing.is_empty()
    }

    /// f32 elements of the bucket buffers and of the replica all-reduces' buffers.
    pub(super) fn buffer_elems(&self) -> usize {
        let buckets = match self.stage {
            // An upper bound while buckets are in flight.
            Stage::One => {
                let held: usize = self.bufs.iter().flatten().map(Vec::len).sum();
                held + self.in_flight.len() * self.largest
            }
            Stage::Two => self.made * self.largest,
        };
        buckets + self.ar_pool.iter().map(Vec::capacity).sum::<usize>()
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
        let given = self.back.given.get(param).copied().unwrap_or(false);
        let msg = grad_fault(self.layout.lens(), param, grad.len(), given);
        if let Some(m) = msg {
            let m = self.back.fault(m);
            return Err(self.invalid("grad_ready", m));
        }
        self.back.open = true;
        let (b, start) = self.layout.place(param);
        if self.reduce_direct(param, b, grad)? {
            return Ok(());
        }
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
        if self.back.overlap {
            // Reduce-scatters done by now hand their chunks on (to the replicas, in the last
            // micro-batch) while backward goes on.
            while self
                .back
                .in_flight
                .front()
                .is_some_and(|f| f.work.is_done())
            {
                self.complete_oldest()?;
            }
        } else {
            // Waited for at once: the caller's thread runs them (see `Work::wait`). The replicas'
            // all-reduce waits for the step: a replica may not have launched its buckets yet
            // (it launches the last ones in `step`, after the ranks agree).
            while !self.back.in_flight.is_empty() {
                self.complete_oldest()?;
            }
        }
        Ok(())
    }

    /// Without overlap, in stage 2, a gradient of f32 that is a bucket of its own without
    /// padding and the next to launch is reduce-scattered straight from the caller's slice into
    /// the shard's gradient (no copy into a bucket). Returns whether it was.
    fn reduce_direct(&mut self, param: usize, b: usize, grad: &[T]) -> Result<bool> {
        let bucket = &self.layout.buckets()[b];
        let g32: Option<&[f32]> = bytemuck::try_cast_slice(grad).ok();
        let alone = bucket.params.len() == 1 && bucket.len == bucket.padded(self.layout.group());
        let ready = b == self.back.next && self.back.in_flight.is_empty();
        let (Some(g32), true, true, true, false) = (
            g32.filter(|_| T::DTYPE == oxccl_comm::DType::F32),
            alone && ready,
            self.stage == Stage::Two,
            self.back.bufs[b].is_none(),
            self.back.overlap,
        ) else {
            return Ok(false);
        };
        let range = bucket.shard_offset..bucket.shard_offset + bucket.chunk;
        let r = if self.back.micro == 0 {
            self.shard
                .reduce_scatter_into(g32, &mut self.grad[range], ReduceOp::Sum)
        } else {
            let mut tmp = std::mem::take(&mut self.back.scratch);
            tmp.resize(bucket.chunk, 0.0);
            let r = self.shard.reduce_scatter_into(g32, &mut tmp, ReduceOp::Sum);
            self.grad[range]
                .iter_mut()
                .zip(&tmp)
                .for_each(|(d, s)| *d += s);
            self.back.scratch = tmp;
            r
        };
        if let Err(e) = r {
            self.poisoned = Some(format!("a reduce-scatter failed: {e}"));
            return Err(e.into());
        }
        self.back.given[param] = true;
        self.back.pending[b] = 0;
        self.back.next += 1;
        self.launch_ready();
        while !self.back.in_flight.is_empty() {
            self.complete_oldest()?;
        }
        Ok(true)
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
            // Stage 1's buffers hold the last step's sums until the first micro-batch writes,
            // stage 2's what their last bucket left.
            if self.stage == Stage::Two || self.back.micro == 0 {
                let bucket = &self.layout.buckets()[b];
                let buf = self.back.bufs[b]
                    .as_mut()
                    .expect("a bucket not launched has a buffer");
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

    /// Stage 2: gives bucket `b` a buffer for this micro-batch, if it has none: a free
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
        // Gradients are copied in; the parameters without one are zeroed when the micro-batch
        // closes, the padding here.
        let mut buf = self.back.pool.pop().expect("a free buffer");
        let bucket = &self.layout.buckets()[b];
        buf.resize(bucket.padded(self.layout.group()), 0.0);
        buf[bucket.len..].fill(0.0);
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
        // The step's sum of this chunk is complete: all-reduce it across the replicas (with
        // overlap; without, the step all-reduces the whole shard at once).
        let last = f.micro + 1 == self.back.accumulate;
        if let Some(rep) = self.replica.as_ref().filter(|_| last && self.back.overlap) {
            let range = bucket.shard_offset..bucket.shard_offset + bucket.chunk;
            let mut v = self.back.ar_pool.pop().unwrap_or_default();
            v.clear();
            v.extend_from_slice(&self.grad[range]);
            let work = rep.all_reduce_async(v, ReduceOp::Sum);
            self.back.reducing.push_back((f.bucket, work));
        }
        Ok(())
    }

    /// Waits for the replica all-reduces, in order, and moves each chunk's sum into the
    /// shard's gradient.
    pub(super) fn finish_replicas(&mut self) -> Result<()> {
        while let Some((b, work)) = self.back.reducing.pop_front() {
            let v = match work.wait() {
                Ok(v) => v,
                Err(e) => {
                    self.poisoned = Some(format!("a replica all-reduce failed: {e}"));
                    return Err(e.into());
                }
            };
            let bucket = &self.layout.buckets()[b];
            self.grad[bucket.shard_offset..bucket.shard_offset + bucket.chunk].copy_from_slice(&v);
            self.back.ar_pool.push(v);
        }
        Ok(())
    }
}
