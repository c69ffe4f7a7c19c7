//! `--check` for 02_ddp_mlp: the reference models every step of training is compared with, and
//! the comparisons.

use oxccl::comm::{Communicator, ReduceOp};

use crate::mlp::{self, Shape};
use crate::{CompressArg, Setup};

/// What `--check` compares every step with.
pub(crate) struct References {
    /// Without `--local-sgd`: one process on the concatenated batches, per step.
    exact: Vec<mlp::Mlp>,
    /// With `--local-sgd`: per step, one model per group of consecutive ranks.
    local: Vec<Vec<mlp::Mlp>>,
    /// A communicator per level of `--local-sgd-levels` below every rank's (`rank / K`, as the
    /// averager's): its replicas must be identical after the level's averages.
    level_groups: Vec<Communicator>,
}

impl References {
    /// The references of the flags (empty without `--check`).
    pub(crate) fn new(
        setup: &Setup<'_>,
        shape: &Shape,
    ) -> Result<References, Box<dyn std::error::Error>> {
        let (args, comm) = (setup.args, setup.comm);
        let exact = if args.check && setup.group.is_none() {
            let steps: Vec<usize> = (0..comm.size()).map(|r| setup.own_steps(r)).collect();
            mlp::train_reference(shape, &steps)
        } else {
            Vec::new()
        };
        let level_groups = if args.check {
            let rank = comm.rank();
            let mut made = Vec::new();
            let below = setup.levels.iter().filter(|&&(_, k)| k < comm.size());
            for &(_, k) in below {
                let color = u32::try_from(rank / k)
                    .map_err(|_| format!("rank {rank}: level group {} out of range", rank / k))?;
                let g = comm.split(Some(color), rank as i64)?;
                made.push(g.ok_or_else(|| format!("rank {rank}: the split gave no level group"))?);
            }
            made
        } else {
            Vec::new()
        };
        let local = match &setup.group {
            Some(g) if args.check => local_reference(setup, shape, g)?,
            _ => Vec::new(),
        };
        Ok(References {
            exact,
            local,
            level_groups,
        })
    }

    /// With `--local-sgd`: checks step `step`'s `model` (within 1e-5 of its group's reference
    /// model; identical within the group, and across groups before local SGD and after every
    /// average over every rank) and adds what it found to `line`. Returns the difference.
    pub(crate) fn check_local_step(
        &self,
        setup: &Setup<'_>,
        group: &Communicator,
        step: usize,
        model: &mlp::Mlp,
        r: &mlp::StepReport,
        line: &mut String,
    ) -> Result<f32, Box<dyn std::error::Error>> {
        let (args, comm) = (setup.args, setup.comm);
        let (rank, world) = (comm.rank(), comm.size());
        let diff = mlp::max_rel_diff(model, &self.local[step][rank / group.size()]);
        let same = mlp::replicas_identical(group, model)?;
        if r.averaged != setup.averaged_over(step).is_some() {
            return Err(format!(
                "rank {rank}: step {step}: averaged: {}, expected {}",
                r.averaged,
                setup.averaged_over(step).is_some()
            )
            .into());
        }
        let global =
            (step as u64) < args.local_sgd_start || setup.averaged_over(step) == Some(world);
        let all_same = mlp::replicas_identical(comm, model)?;
        // After a level's average, its group's replicas too.
        let mut level_same = true;
        for lg in &self.level_groups {
            let same_here = mlp::replicas_identical(lg, model)?;
            level_same &= same_here || setup.averaged_over(step) != Some(lg.size());
        }
        *line += &format!(
            "  max rel diff vs 1 process {diff:.2e}  identical in the group: {same}, \
             everywhere: {all_same}{}",
            if r.averaged { "  (averaged)" } else { "" }
        );
        if diff > 1e-5 || !same || (global && !all_same) || !level_same {
            return Err(format!("rank {rank}: step {step}: {line}").into());
        }
        Ok(diff)
    }

    /// Without `--local-sgd`: checks step `step`'s `model` (within 1e-5 of one process where
    /// training is exact, replicas identical) and adds what it found to `line`. Returns the
    /// difference.
    pub(crate) fn check_step(
        &self,
        setup: &Setup<'_>,
        step: usize,
        model: &mlp::Mlp,
        line: &mut String,
    ) -> Result<f32, Box<dyn std::error::Error>> {
        let (args, comm) = (setup.args, setup.comm);
        let diff = mlp::max_rel_diff(model, &self.exact[step]);
        let same = mlp::replicas_identical(comm, model)?;
        *line += &format!("  max rel diff vs 1 process {diff:.2e}  replicas identical: {same}");
        // PowerSGD leaves the exact model once it compresses, 16-bit floats at once.
        let exact = args.compress == CompressArg::None
            && (args.powersgd == 0 || (step as u64) < args.powersgd_start);
        if (exact && diff > 1e-5) || !same {
            return Err(format!("rank {}: step {step}: {line}", comm.rank()).into());
        }
        Ok(diff)
    }
}

/// Post-local SGD's reference for `--check`: one model per group of consecutive ranks, per
/// step. Every rank learns whether every group qualifies (consecutive ranks, all of one size),
/// so that all stop or none.
fn local_reference(
    setup: &Setup<'_>,
    shape: &Shape,
    g: &Communicator,
) -> Result<Vec<Vec<mlp::Mlp>>, Box<dyn std::error::Error>> {
    let (args, comm) = (setup.args, setup.comm);
    let (rank, world) = (comm.rank(), comm.size());
    let size = g.size();
    let fits = u64::from(world % size == 0 && g.rank() == rank % size);
    let mut all = [fits, size as u64, u64::MAX - size as u64];
    comm.all_reduce(&mut all, ReduceOp::Min)?;
    if all[0] == 0 || all[1] != u64::MAX - all[2] {
        return Err(format!(
            "rank {rank}: --check with --local-sgd needs groups of consecutive ranks, \
             all of one size: some group is not (this rank is rank {} of a group of \
             {size})",
            g.rank()
        )
        .into());
    }
    if let Some(&(_, k)) = setup.levels.iter().find(|&&(_, k)| !k.is_multiple_of(size)) {
        return Err(format!(
            "rank {rank}: --check with --local-sgd-levels needs levels of whole groups: \
             {k} ranks are not groups of {size}"
        )
        .into());
    }
    let (start, period) = (args.local_sgd_start as usize, args.local_sgd as usize);
    Ok(if setup.levels.is_empty() {
        mlp::train_reference_local(shape, world, size, args.steps, start, period)
    } else {
        let averaged_over = |s: usize| setup.averaged_over(s);
        mlp::train_reference_groups(shape, world, size, args.steps, start, averaged_over)
    })
}
