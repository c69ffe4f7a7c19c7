//! The bucket order rebuilt after the first step: the gradient order observed on one rank,
//! broadcast so every rank agrees, and the buckets laid out again from it.

use std::borrow::Borrow;

use oxccl_comm::Communicator;

use super::{Bucket, Ddp};
use crate::error::Result;
use crate::layout::plan;

impl<C: Borrow<Communicator>> Ddp<C> {
    /// Broadcasts the observed gradient order of rank 0 (with uneven inputs, of the lowest rank
    /// that trained in the step); every rank rebuilds its buckets from it at the start of the
    /// next step.
    pub(super) fn agree_order(&mut self) -> Result<()> {
        let root = self.lead;
        match broadcast_order(self.comm(), root, &self.order, self.specs.len())? {
            Some(order) => {
                self.pending_order = Some(order);
                Ok(())
            }
            None => Err(self.invalid(
                "rebuild_buckets",
                format!(
                    "the order received from rank {root} is not a permutation of the parameters"
                ),
            )),
        }
    }

    pub(super) fn relayout(&mut self, order: &[usize]) {
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
}

/// Rank `root`'s observed gradient order (`observed`, then the parameters it does not list, in
/// reverse), broadcast to every rank; `None` where what arrived is not a permutation of the `n`
/// parameters. Collective.
pub(crate) fn broadcast_order(
    comm: &Communicator,
    root: usize,
    observed: &[usize],
    n: usize,
) -> oxccl_comm::Result<Option<Vec<usize>>> {
    let mut v: Vec<u64> = vec![0; n];
    if comm.rank() == root {
        let mut listed = vec![false; n];
        v.clear();
        for &p in observed {
            listed[p] = true;
            v.push(p as u64);
        }
        v.extend((0..n).rev().filter(|&p| !listed[p]).map(|p| p as u64));
    }
    comm.broadcast(&mut v, root)?;
    let mut listed = vec![false; n];
    for &p in &v {
        match listed.get_mut(p as usize) {
            Some(l) if !*l => *l = true,
            _ => return Ok(None),
        }
    }
    Ok(Some(v.into_iter().map(|p| p as usize).collect()))
}
