//! Saving and loading the sharded state (the file format is in `checkpoint`).

use std::path::Path;

use super::Zero;
use crate::agree::agree;
use crate::checkpoint::{
    consolidate, shard_file, write_manifest, write_shard, FullState, Manifest,
};
use crate::elem::ParamElement;
use crate::error::Result;

impl<T: ParamElement> Zero<T> {
    /// Writes this optimizer's state to the directory `dir` (created if need be): each rank of
    /// the first replica its shard's file, rank 0 the manifest (see the crate docs,
    /// "Checkpoints"). Call it between steps, on every rank with the same directory (on a file
    /// system every rank of the first replica can write). Collective.
    ///
    /// # Errors
    /// `InvalidArgument` on every rank when a rank is in the middle of a step or could not
    /// write its file (the error names it and why).
    pub fn save(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        self.check_poisoned("save")?;
        let dir = dir.as_ref();
        let names = self.opt.state_names();
        let group = self.layout.group();
        let mut fault = self
            .back
            .busy()
            .then(|| "save in the middle of a step (between micro-batches)".to_string());
        if fault.is_none() && self.writer {
            let r = std::fs::create_dir_all(dir)
                .map_err(|e| format!("{}: {e}", dir.display()))
                .and_then(|()| {
                    let path = dir.join(shard_file(self.shard.rank(), group));
                    write_shard(&path, &self.pieces, &names, &self.master, &self.state)
                        .map_err(|e| e.to_string())
                });
            fault = r.err();
        }
        if fault.is_none() && self.rank == 0 {
            let m = Manifest::new(self.opt.name(), names, self.t, self.layout.lens(), group);
            fault = write_manifest(dir, &m).err().map(|e| e.to_string());
        }
        agree(&self.check, self.rank, "save", "save", fault.as_deref())
    }

    /// Loads a checkpoint directory written by [`Zero::save`], with any shard group size (every
    /// rank reads every shard file: the directory must be readable on every node), and sets
    /// every rank's `params` to its master weights (rounded to `T`). Collective.
    ///
    /// # Errors
    /// As [`Zero::load_state`]; a checkpoint a rank cannot read fails the load on every rank,
    /// naming the file.
    pub fn load(&mut self, dir: impl AsRef<Path>, params: &mut [&mut [T]]) -> Result<()> {
        match consolidate(dir) {
            Ok(full) => self.load_state(&full, params),
            Err(e) => {
                let fault = e.to_string();
                agree(&self.check, self.rank, "load", "load", Some(&fault))
            }
        }
    }

    /// Loads a whole state (from [`consolidate`](crate::consolidate) or [`FullState::load`])
    /// into this rank's shard, and sets every rank's `params` to the master weights (rounded to
    /// `T`). Collective.
    ///
    /// # Errors
    /// `InvalidArgument` on every rank when a rank's state is for another optimizer or other
    /// parameters, or a rank is in the middle of a step; the all-gather's errors.
    pub fn load_state(&mut self, full: &FullState, params: &mut [&mut [T]]) -> Result<()> {
        self.check_poisoned("load")?;
        let lens: Vec<usize> = full.params.iter().map(|p| p.master.len()).collect();
        let plens: Vec<usize> = params.iter().map(|p| p.len()).collect();
        let names = self.opt.state_names();
        let fault = if self.back.busy() {
            Some("load in the middle of a step (between micro-batches)".to_string())
        } else if full.optimizer != self.opt.name() || full.state_names != names {
            Some(format!(
                "a state of {} {:?} for {} {names:?}",
                full.optimizer,
                full.state_names,
                self.opt.name()
            ))
        } else if lens != self.layout.lens() || plens != lens {
            Some(format!(
                "a state of parameters {lens:?} for parameters {:?} (given {plens:?})",
                self.layout.lens()
            ))
        } else {
            None
        };
        agree(&self.check, self.rank, "load", "load", fault.as_deref())?;
        let per = names.len();
        for pc in &self.pieces {
            let (a, n, off) = (pc.shard_offset, pc.len, pc.param_offset);
            let src = &full.params[pc.param];
            self.master[a..a + n].copy_from_slice(&src.master[off..off + n]);
            for (k, s) in src.state.iter().enumerate() {
                let dst = &mut self.state[per * a + k * n..per * a + (k + 1) * n];
                dst.copy_from_slice(&s[off..off + n]);
            }
        }
        self.t = full.step;
        self.grad.fill(0.0);
        if let Err(e) = self.gather(params, false) {
            self.poisoned = Some(format!("a load failed part-way: {e}"));
            return Err(e);
        }
        Ok(())
    }
}
