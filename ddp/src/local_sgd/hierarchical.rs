//! [`HierarchicalAverager`]: the parameters averaged over nested groups of ranks, each at its own
//! period (PyTorch's `HierarchicalModelAverager`).

use std::borrow::Borrow;

use oxccl_comm::Communicator;

use super::in_comm;
use super::packer::{check_params, Packer};
use crate::agree::{agree, fnv1a, Setting};
use crate::error::{DdpError, Result};
use crate::flat::GradBuf;

/// Averages parameters over nested groups of ranks, each at its own period (PyTorch's
/// `HierarchicalModelAverager`): e.g. over the ranks of a node every 4 steps, cheaply over shared
/// memory, and over every rank every 16, across the slow links. Each call counts one step, as
/// [`ModelAverager::average`](crate::ModelAverager::average) does; at call `s` (from 0), from
/// `warmup_steps` on, the level with the largest period that divides `s` averages, and none when no
/// period divides it: PyTorch's rule, which counts periods from step 0 (where
/// [`ModelAverager`](crate::ModelAverager), like PyTorch's `PeriodicModelAverager`, counts them
/// from the warm-up).
///
/// Levels are added with increasing periods, usually over growing groups, each group inside the
/// next ([`HierarchicalAverager::by_group_sizes`] makes them so). `G` is how the groups are held:
/// owned (the default), `Arc<Communicator>` or `&Communicator`.
///
/// ```no_run
/// use oxccl_comm::Communicator;
/// use oxccl_ddp::HierarchicalAverager;
///
/// let comm = Communicator::from_env()?;
/// // Groups of 8 consecutive ranks every 4 steps, every rank every 16, from step 100.
/// let mut averager = HierarchicalAverager::by_group_sizes(&comm, &[(4, 8), (16, comm.size())], 100)?;
/// let mut w = vec![0.5f32; 4];
/// for _step in 0..1000 {
///     // ... backward, gradients averaged within the node (PostLocalSgd), update ...
///     averager.average(&mut [&mut w])?;
/// }
/// # Ok::<(), oxccl_ddp::DdpError>(())
/// ```
pub struct HierarchicalAverager<G: Borrow<Communicator> = Communicator> {
    levels: Vec<(u64, G)>,
    warmup_steps: u64,
    step: u64,
    packer: Packer,
    /// Made by [`HierarchicalAverager::by_group_sizes`]: each of its levels' groups as ranks of
    /// the communicator it was split from, and this rank there, so that errors name those ranks
    /// (the groups are the averager's own; the caller knows only that communicator). Levels
    /// added after them with [`HierarchicalAverager::then`] have none: their errors name their
    /// groups' ranks.
    members: Option<(Vec<Vec<usize>>, usize)>,
}

impl<G: Borrow<Communicator>> std::fmt::Debug for HierarchicalAverager<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let levels: Vec<(u64, usize)> = self
            .levels
            .iter()
            .map(|(p, g)| (*p, g.borrow().size()))
            .collect();
        f.debug_struct("HierarchicalAverager")
            .field("levels (period, group size)", &levels)
            .field("warmup_steps", &self.warmup_steps)
            .field("step", &self.step)
            .field("cap_bytes", &self.packer.cap_bytes)
            .field("buffer_bytes", &self.packer.kept_bytes())
            .finish()
    }
}

impl<G: Borrow<Communicator>> HierarchicalAverager<G> {
    /// An averager of one level: over `group` at calls `s >= warmup_steps` that `period` divides
    /// (where [`ModelAverager`](crate::ModelAverager) counts its period from `warmup_steps`: the
    /// same calls when `period` divides `warmup_steps`). Add levels with
    /// [`HierarchicalAverager::then`].
    pub fn new(period: u64, group: G, warmup_steps: u64) -> HierarchicalAverager<G> {
        HierarchicalAverager {
            levels: vec![(period, group)],
            warmup_steps,
            step: 0,
            packer: Packer::new(),
            members: None,
        }
    }

    /// Adds a level: over `group` every `period` calls. Periods must increase from level to
    /// level (checked by [`HierarchicalAverager::average`], which refuses them otherwise).
    #[must_use]
    pub fn then(mut self, period: u64, group: G) -> HierarchicalAverager<G> {
        self.levels.push((period, group));
        self
    }

    /// Packs parameters into all-reduces of at most `bytes` (25 MiB by default; a larger
    /// parameter goes alone).
    #[must_use]
    pub fn with_bucket_cap_bytes(mut self, bytes: usize) -> HierarchicalAverager<G> {
        self.packer.cap_bytes = bytes.max(1);
        self
    }

    /// Counts `steps` calls as already made (resuming from a checkpoint taken after them).
    #[must_use]
    pub fn with_steps(mut self, steps: u64) -> HierarchicalAverager<G> {
        self.step = steps;
        self
    }

    /// Calls made so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The levels, in order: each one's period and group.
    pub fn levels(&self) -> impl Iterator<Item = (u64, &Communicator)> + '_ {
        self.levels.iter().map(|(p, g)| (*p, g.borrow()))
    }

    /// The level the next call averages over (its index in [`HierarchicalAverager::levels`]),
    /// or `None`.
    pub fn due(&self) -> Option<usize> {
        if self.step < self.warmup_steps {
            return None;
        }
        self.levels
            .iter()
            .rposition(|&(p, _)| p > 0 && self.step.is_multiple_of(p))
    }

    /// Counts one step; when a level is due ([`HierarchicalAverager::due`]), replaces every
    /// parameter with its average over that level's group, as
    /// [`ModelAverager::average`](crate::ModelAverager::average) does. Returns the level that
    /// averaged, or `None`. Collective over the due level's group: its ranks call it alike, with
    /// the same parameter list.
    ///
    /// # Errors
    /// `InvalidArgument` (naming this rank in the last level's group) for a period of 0 or periods
    /// that do not increase, and when due for an integer parameter or `GradBuf` views that disagree
    /// in length: before any communication, and the call is not counted. The all-reduces' errors as
    /// for [`ModelAverager::average`](crate::ModelAverager::average) (the call counted); with
    /// levels made by [`HierarchicalAverager::by_group_sizes`] their rank and peer are ranks of the
    /// communicator given to it (`lost_peer()` is the rank to shrink away there), otherwise of the
    /// level's group.
    pub fn average<P: GradBuf>(&mut self, params: &mut [P]) -> Result<Option<usize>> {
        const OP: &str = "HierarchicalAverager::average";
        let last = self.levels.last().map(|(_, g)| g.borrow());
        let rank = last.map_or(0, Communicator::rank);
        let periods: Vec<u64> = self.levels.iter().map(|&(p, _)| p).collect();
        if periods.contains(&0) || periods.windows(2).any(|w| w[0] >= w[1]) {
            return Err(DdpError::InvalidArgument {
                rank,
                op: OP,
                msg: format!(
                    "periods {periods:?}: each must be at least 1 and larger than the one before"
                ),
            });
        }
        let Some(level) = self.due() else {
            self.step = self.step.saturating_add(1);
            return Ok(None);
        };
        check_params(rank, OP, params)?;
        let group = self.levels[level].1.borrow();
        self.step = self.step.saturating_add(1);
        let mapped = self
            .members
            .as_ref()
            .and_then(|(m, rank)| Some((m.get(level)?, *rank)));
        self.packer
            .average(group, params)
            .map_err(|e| match mapped {
                Some((members, rank)) => {
                    let who = "HierarchicalAverager: this error's rank and peer are those of the \
                               communicator given to by_group_sizes";
                    in_comm(e, members, rank, who)
                }
                None => e,
            })?;
        Ok(Some(level))
    }
}

impl HierarchicalAverager {
    /// An averager over groups of consecutive ranks of `comm`, one level per `(period, size)`
    /// (PyTorch's `period_group_size_dict`): level `i` averages over groups of `size` ranks
    /// (`comm`'s ranks `j * size ..`, like `torch.distributed.new_subgroups`) every `period`
    /// calls, from call `warmup_steps`. Collective over `comm`: every rank calls it alike (one
    /// small all-reduce compares the levels and `warmup_steps` between ranks first). A level
    /// over every rank is a communicator of its own (a split of `comm` into one group).
    ///
    /// # Errors
    /// `InvalidArgument`, on every rank alike and before any split, when the levels or
    /// `warmup_steps` differ between ranks, `levels` is empty,
    /// a period is 0 or not larger than the one before, a size is 0, does not divide
    /// `comm.size()`, or does not divide the next level's size (so that each group lies inside
    /// the next), or the last size is not `comm.size()` (as PyTorch asks: the last level
    /// averages every rank); the splits' errors.
    pub fn by_group_sizes(
        comm: &Communicator,
        levels: &[(u64, usize)],
        warmup_steps: u64,
    ) -> Result<HierarchicalAverager> {
        let invalid = |msg: String| DdpError::InvalidArgument {
            rank: comm.rank(),
            op: "HierarchicalAverager::by_group_sizes",
            msg,
        };
        // Every rank must give the same levels: a rank whose levels differ would average at
        // other calls, or fail the checks below alone and leave the others waiting in a split.
        let words = levels.iter().flat_map(|&(p, k)| [p, k as u64]);
        let h = fnv1a([levels.len() as u64].into_iter().chain(words));
        let settings = [
            Setting::described(
                "the list of levels (period, group size)",
                h,
                format!("{levels:?}"),
            ),
            Setting::number("warmup_steps", warmup_steps),
        ];
        agree(
            comm,
            "HierarchicalAverager::by_group_sizes",
            &settings,
            &mut [],
        )?;
        let Some(&(_, last)) = levels.last() else {
            return Err(invalid("no levels given".into()));
        };
        if last != comm.size() {
            return Err(invalid(format!(
                "the last level's group size {last} is not the communicator's {} ranks: the \
                 last level averages every rank",
                comm.size()
            )));
        }
        for (i, &(period, size)) in levels.iter().enumerate() {
            if period == 0 || (i > 0 && period <= levels[i - 1].0) {
                return Err(invalid(format!(
                    "level {i}: period {period} must be at least 1 and larger than the one before"
                )));
            }
            if size == 0 || !comm.size().is_multiple_of(size) {
                return Err(invalid(format!(
                    "level {i}: group size {size} does not divide the communicator's {} ranks",
                    comm.size()
                )));
            }
            if let Some(&(_, next)) = levels.get(i + 1) {
                if !next.is_multiple_of(size) {
                    return Err(invalid(format!(
                        "level {i}: group size {size} does not divide the next level's {next}, \
                         so its groups would not lie inside the next level's"
                    )));
                }
            }
        }
        let rank = comm.rank();
        let mut made = Vec::with_capacity(levels.len());
        let mut members = Vec::with_capacity(levels.len());
        for &(period, size) in levels {
            let color = u32::try_from(rank / size)
                .map_err(|_| invalid(format!("group index {} too large", rank / size)))?;
            let group = comm.split(Some(color), rank as i64)?;
            let group = group.ok_or_else(|| invalid("a split gave this rank no group".into()))?;
            made.push((period, group));
            // Split with this rank as the key: the group's rank j is comm's rank base + j.
            let base = rank / size * size;
            members.push((base..base + size).collect());
        }
        Ok(HierarchicalAverager {
            levels: made,
            warmup_steps,
            step: 0,
            packer: Packer::new(),
            members: Some((members, rank)),
        })
    }
}
