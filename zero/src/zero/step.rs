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
            self.poisoned = Some(e.to_string());
            return Err(e);
        }
        self.back.micro = 0;
        while !self.back.in_flight.is_empty() {
            self.complete_oldest()?;
        }
        self.update()?;
        self.write_params(params);
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

    /// The shard's gradient averaged over every rank, clipped, and the optimizer on the shard;
    /// the updated shard all-gathered.
    fn update(&mut self) -> Result<()> {
        let r = self.reduce_and_update();
        if let Err(e) = &r {
            self.poisoned = Some(format!("a step failed part-way: {e}"));
        }
        r
    }

    fn reduce_and_update(&mut self) -> Result<()> {
        if let Some(rep) = &self.replica {
            rep.all_reduce(&mut self.grad, ReduceOp::Sum)?;
        }
        let world = self.world as f32;
        self.grad.iter_mut().for_each(|g| *g /= world);
        if let Some(max) = self.max_grad_norm {
            self.clip(max)?;
        }
        self.t += 1;
        let per = self.opt.state_per_elem();
        for piece in &self.pieces {
            let (a, b) = (piece.shard_offset, piece.shard_offset + piece.len);
            // Each piece steps alone with its parameter's hyper-parameters; its state is `per`
            // elements for each of its own, at `per * a` (the pieces are disjoint).
            self.opt.step(
                self.t,
                self.hypers[piece.param],
                &mut self.master[a..b],
                &self.grad[a..b],
                &mut self.state[per * a..per * b],
            );
        }
        for (m, w) in self.mine.iter_mut().zip(&self.master) {
            *m = T::from_f32(*w);
        }
        self.shard.all_gather_into(&self.mine, &mut self.gathered)?;
        Ok(())
    }

    /// Every rank's pieces, from the gathered shards, into `params`.
    pub(super) fn write_params(&self, params: &mut [&mut [T]]) {
        let n = self.layout.shard_len();
        for (r, pieces) in self.all_pieces.iter().enumerate() {
            for pc in pieces {
                let src = &self.gathered[r * n + pc.shard_offset..][..pc.len];
                params[pc.param][pc.param_offset..pc.param_offset + pc.len].copy_from_slice(src);
            }
        }
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
