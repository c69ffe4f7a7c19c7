//! The step: the micro-batch closed; at the last one, the ranks' calls compared, the shard's
//! gradient reduced across the replicas and averaged, clipped, the optimizer applied to the
//! shard, and the parameters all-gathered.

use oxccl_comm::ReduceOp;

use super::Zero;
use crate::agree::agree;
use crate::elem::ParamElement;
use crate::error::Result;

impl<T: ParamElement> Zero<T> {
    /// Ends a micro-batch (after its gradients were given with [`Zero::grad_ready`] or
    /// [`Zero::grads_ready`]). At the last micro-batch of a step (see [`Zero::accumulate`]) it
    /// steps: the gradients summed over micro-batches are averaged over every rank, clipped
    /// (with [`ZeroConfig::max_grad_norm`](super::ZeroConfig::max_grad_norm)), the optimizer
    /// updates this rank's shard, and every rank's `params` are set to the updated values.
    /// Returns whether it stepped. Collective.
    ///
    /// Before any collective of the step, the ranks compare their calls (the parameters'
    /// lengths, the micro-batches, what each refused since the last step): a rank called
    /// otherwise makes the step fail on every rank, the error naming each rank's call.
    ///
    /// # Errors
    /// `InvalidArgument` as above (the optimizer is then unusable); a collective's error.
    pub fn step(&mut self, params: &mut [&mut [T]]) -> Result<bool> {
        self.check_poisoned("step")?;
        let plens: Vec<usize> = params.iter().map(|p| p.len()).collect();
        if plens != self.layout.lens() {
            let msg = format!(
                "parameters of lengths {plens:?}; new had {:?}",
                self.layout.lens()
            );
            self.back.fault.get_or_insert(msg);
        }
        self.close_micro()?;
        if self.back.micro < self.back.accumulate {
            return Ok(false);
        }
        let call = format!(
            "step {} of parameters {:?} after {} micro-batches",
            self.t + 1,
            self.layout.lens(),
            self.back.micro
        );
        let fault = self.back.fault.take();
        if let Err(e) = agree(&self.check, self.rank, "step", &call, fault.as_deref()) {
            // Every rank launched the same buckets: let them finish before giving up.
            while !self.back.in_flight.is_empty() {
                let _ = self.complete_oldest();
            }
            let _ = self.finish_replicas();
            self.poisoned = Some(e.to_string());
            return Err(e);
        }
        self.back.micro = 0;
        while !self.back.in_flight.is_empty() {
            self.complete_oldest()?;
        }
        self.update(params)?;
        Ok(true)
    }

    /// [`Zero::grads_ready`] and [`Zero::step`] in one call.
    ///
    /// # Errors
    /// As `step` (a gradient list `grads_ready` refuses fails the step on every rank).
    pub fn step_with(&mut self, params: &mut [&mut [T]], grads: &[&[T]]) -> Result<bool> {
        // A refused list is a fault every rank hears of at the step, not an early return.
        let _ = self.grads_ready(grads);
        self.step(params)
    }

    /// The shard's gradient averaged over every rank, clipped; then bucket by bucket, the
    /// optimizer on the bucket's pieces and the bucket's all-gather into `params`.
    fn update(&mut self, params: &mut [&mut [T]]) -> Result<()> {
        let r = self.reduce_and_clip().and_then(|()| {
            self.t += 1;
            self.gather(params, true)
        });
        if let Err(e) = &r {
            self.poisoned = Some(format!("a step failed part-way: {e}"));
        }
        r
    }

    fn reduce_and_clip(&mut self) -> Result<()> {
        self.finish_replicas()?;
        if let Some(rep) = self.replica.as_ref().filter(|_| !self.back.overlap) {
            rep.all_reduce(&mut self.grad, ReduceOp::Sum)?;
        }
        let world = self.world as f32;
        self.grad.iter_mut().for_each(|g| *g /= world);
        if let Some(max) = self.max_grad_norm {
            self.clip(max)?;
        }
        Ok(())
    }

    /// Bucket by bucket: the optimizer on its pieces (with `step`), its chunk of the master
    /// weights rounded to `T` and all-gathered (asynchronously, at most `buckets_in_flight` at
    /// once, so the optimizer on the next bucket overlaps the all-gather of this one), each
    /// gathered bucket (the parameters laid end to end) copied into `params`.
    pub(super) fn gather(&mut self, params: &mut [&mut [T]], step: bool) -> Result<()> {
        let mut in_flight = std::collections::VecDeque::new();
        let (g, r) = (self.layout.group(), self.shard.rank());
        for b in 0..self.layout.buckets().len() {
            if step {
                self.step_bucket(b);
            }
            let bucket = &self.layout.buckets()[b];
            if let ([p], true) = (bucket.params.as_slice(), bucket.len == bucket.padded(g)) {
                // One parameter and no padding: gathered in place, in the parameter itself.
                let (p, chunk) = (*p, bucket.chunk);
                let src = &self.master[bucket.shard_offset..bucket.shard_offset + chunk];
                let dst = &mut params[p][r * chunk..(r + 1) * chunk];
                dst.iter_mut()
                    .zip(src)
                    .for_each(|(d, s)| *d = T::from_f32(*s));
                self.shard.all_gather(params[p])?;
                continue;
            }
            // The all-gather overwrites every chunk but this rank's, which is written here.
            let mut buf = self.gather_pool.pop().unwrap_or_default();
            buf.resize(bucket.padded(g), T::from_f32(0.0));
            let src = &self.master[bucket.shard_offset..bucket.shard_offset + bucket.chunk];
            let dst = &mut buf[r * bucket.chunk..(r + 1) * bucket.chunk];
            dst.iter_mut()
                .zip(src)
                .for_each(|(d, s)| *d = T::from_f32(*s));
            in_flight.push_back((b, self.shard.all_gather_async(buf)));
            if in_flight.len() >= self.buckets_in_flight {
                let (b, work) = in_flight.pop_front().expect("in flight");
                self.write_bucket(b, work.wait()?, params);
            }
        }
        while let Some((b, work)) = in_flight.pop_front() {
            self.write_bucket(b, work.wait()?, params);
        }
        Ok(())
    }

    /// The optimizer on bucket `b`'s pieces of this rank's shard, each with its parameter's
    /// hyper-parameters; a piece's state is `per` elements for each of its own, at `per * a`
    /// (the pieces are disjoint).
    fn step_bucket(&mut self, b: usize) {
        let per = self.opt.state_per_elem();
        for piece in &self.pieces[self.bucket_pieces[b].clone()] {
            let (a, z) = (piece.shard_offset, piece.shard_offset + piece.len);
            self.opt.step(
                self.t,
                self.hypers[piece.param],
                &mut self.master[a..z],
                &self.grad[a..z],
                &mut self.state[per * a..per * z],
            );
        }
    }

    /// A gathered bucket (its parameters end to end) into `params`; the buffer back to the pool.
    fn write_bucket(&mut self, b: usize, buf: Vec<T>, params: &mut [&mut [T]]) {
        let bucket = &self.layout.buckets()[b];
        for (&p, &start) in bucket.params.iter().zip(&bucket.starts) {
            let n = params[p].len();
            params[p].copy_from_slice(&buf[start..start + n]);
        }
        self.gather_pool.push(buf);
    }

    /// Scales the averaged shard so that the global norm is at most `max`.
    fn clip(&mut self, max: f32) -> Result<()> {
        let mut ss = [self
            .grad
            .iter()
            .map(|&g| f64::from(g) * f64::from(g))
            .sum::<f64>()];
        self.shard.all_reduce(&mut ss, ReduceOp::Sum)?;
        let norm = ss[0].sqrt();
        self.last_norm = Some(norm);
        let coef = f64::from(max) / (norm + 1e-6);
        if coef < 1.0 {
            let c = coef as f32;
            self.grad.iter_mut().for_each(|g| *g *= c);
        }
        Ok(())
    }
}
