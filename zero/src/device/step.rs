//! [`DeviceZero`]'s calls: gradients widened into their buckets, buckets reduce-scattered in
//! order (and, at the last micro-batch, each chunk all-reduced across the replicas), the step
//! (agreement, average, optimizer kernels, all-gathers), and checkpoints.

use std::path::Path;

use oxccl_comm::cuda::cudarc::driver::{CudaView, CudaViewMut};
use oxccl_comm::ReduceOp;
use oxccl_kernels::cuda::{AdamWScalars, SgdScalars};

use super::{device_err, DeviceOptimizer, DeviceParam, DeviceZero};
use crate::agree::agree;
use crate::checkpoint::{consolidate, shard_file, write_manifest, write_shard, Manifest};
use crate::error::{Result, ZeroError};
use crate::shard::grad_fault;
use crate::zero::Stage;

impl<T: DeviceParam> DeviceZero<T> {
    fn invalid(&self, op: &'static str, msg: String) -> ZeroError {
        ZeroError::InvalidArgument {
            rank: self.rank,
            op,
            msg,
        }
    }

    fn usable(&self, op: &'static str) -> Result<()> {
        match &self.poisoned {
            None => Ok(()),
            Some(why) => Err(self.invalid(op, format!("unusable after an earlier error: {why}"))),
        }
    }

    /// A failure of a device call: the optimizer is unusable after it.
    fn failed(&mut self, op: &'static str, what: &str, e: impl std::fmt::Debug) -> ZeroError {
        let e = device_err(self.rank, op, what, e);
        self.poisoned = Some(e.to_string());
        e
    }

    /// Makes every step `k` micro-batches (see [`Zero::accumulate`](crate::Zero::accumulate)).
    /// Collective, between steps.
    ///
    /// # Errors
    /// As `Zero::accumulate`.
    pub fn accumulate(&mut self, k: usize) -> Result<()> {
        self.usable("accumulate")?;
        let busy = self.micro > 0 || self.given.iter().any(|&g| g);
        let fault =
            (k == 0 || busy).then(|| format!("accumulate({k}) in the middle of a step, or 0"));
        agree(
            &self.check,
            self.rank,
            "accumulate",
            &format!("accumulate({k})"),
            fault.as_deref(),
        )?;
        self.accumulate = k;
        Ok(())
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.t
    }

    /// Optimizer-state bytes this rank holds on the device (padding included).
    pub fn state_bytes(&self) -> usize {
        self.state.len() * self.layout.shard_len() * 4
    }

    fn communicates(&self) -> bool {
        self.stage == Stage::Two || self.micro + 1 >= self.accumulate
    }

    /// Parameter `param`'s gradient of this micro-batch, computed on the stream given to
    /// `new`: widened into its bucket there; a full bucket (once every earlier one is) is
    /// reduce-scattered on the same stream.
    ///
    /// # Errors
    /// As [`Zero::grad_ready`](crate::Zero::grad_ready); a device call's failure.
    pub fn grad_ready(&mut self, param: usize, grad: &CudaView<'_, T>) -> Result<()> {
        self.usable("grad_ready")?;
        let given = self.given.get(param).copied().unwrap_or(false);
        let msg = grad_fault(self.layout.lens(), param, grad.len(), given);
        if let Some(m) = msg {
            self.fault.get_or_insert(m.clone());
            return Err(self.invalid("grad_ready", m));
        }
        let (b, start) = self.layout.place(param);
        let n = grad.len();
        let add = self.stage == Stage::One && self.micro > 0;
        let r = if add {
            let mut w = self.widen_tmp.slice_mut(0..n);
            T::widen(&self.kernels, &self.stream, &mut w, grad).and_then(|()| {
                let mut dst = self.buckets[b].slice_mut(start..start + n);
                let w = self.widen_tmp.slice(0..n);
                self.kernels
                    .add_into(&self.stream, &mut dst, &w)
                    .map_err(|e| e.to_string())
            })
        } else {
            let mut dst = self.buckets[b].slice_mut(start..start + n);
            T::widen(&self.kernels, &self.stream, &mut dst, grad)
        };
        if let Err(e) = r {
            return Err(self.failed("grad_ready", "copying the gradient into its bucket", e));
        }
        self.given[param] = true;
        self.pending[b] -= 1;
        if self.communicates() {
            self.launch_ready()?;
        }
        Ok(())
    }

    /// Reduce-scatters the full buckets, in order, up to the first that is not.
    fn launch_ready(&mut self) -> Result<()> {
        while self.next < self.pending.len() && self.pending[self.next] == 0 {
            let b = self.next;
            self.next += 1;
            if let Err(e) = self.reduce_bucket(b) {
                // Part of the bucket's work may be enqueued: never launch it again.
                self.poisoned.get_or_insert(e.to_string());
                return Err(e);
            }
        }
        Ok(())
    }

    /// Bucket `b`'s reduce-scatter into the shard's gradient (written by the step's first,
    /// added after), and at the last micro-batch the chunk's all-reduce across the replicas.
    fn reduce_bucket(&mut self, b: usize) -> Result<()> {
        let bucket = &self.layout.buckets()[b];
        let (chunk, off) = (bucket.chunk, bucket.shard_offset);
        if chunk == 0 {
            return Ok(());
        }
        let sc = self.shard.on_stream(&self.stream);
        let input = self.buckets[b].slice(0..chunk * self.layout.group());
        let first = self.stage == Stage::One || self.micro == 0;
        if first {
            sc.reduce_scatter_into(
                &input,
                &mut self.grad.slice_mut(off..off + chunk),
                ReduceOp::Sum,
            )?;
        } else {
            sc.reduce_scatter_into(
                &input,
                &mut self.chunk_tmp.slice_mut(0..chunk),
                ReduceOp::Sum,
            )?;
            let mut dst = self.grad.slice_mut(off..off + chunk);
            let src = self.chunk_tmp.slice(0..chunk);
            if let Err(e) = self.kernels.add_into(&self.stream, &mut dst, &src) {
                return Err(self.failed("grad_ready", "adding a chunk", e));
            }
        }
        let last = self.micro + 1 >= self.accumulate;
        if let Some(rep) = self.replica.as_ref().filter(|_| last) {
            let mut g = self.grad.slice_mut(off..off + chunk);
            rep.on_stream(&self.stream)
                .all_reduce(&mut g, ReduceOp::Sum)?;
        }
        Ok(())
    }

    /// Closes the micro-batch: parameters without a gradient count as zeros.
    fn close_micro(&mut self) -> Result<()> {
        for b in self.next..self.pending.len() {
            if self.stage == Stage::Two || self.micro == 0 {
                let bucket = &self.layout.buckets()[b];
                let missing: Vec<(usize, usize)> = bucket
                    .params
                    .iter()
                    .zip(&bucket.starts)
                    .filter(|(&p, _)| !self.given[p])
                    .map(|(&p, &start)| (start, self.layout.lens()[p]))
                    .collect();
                for (start, n) in missing {
                    let mut v = self.buckets[b].slice_mut(start..start + n);
                    if let Err(e) = self.stream.memset_zeros(&mut v) {
                        return Err(self.failed("step", "zeroing a missing gradient", e));
                    }
                }
            }
            self.pending[b] = 0;
        }
        if self.communicates() {
            self.launch_ready()?;
        }
        self.given.fill(false);
        for (p, b) in self.pending.iter_mut().zip(self.layout.buckets()) {
            *p = b.params.len();
        }
        self.next = 0;
        self.micro += 1;
        Ok(())
    }

    /// As [`Zero::step`](crate::Zero::step), everything enqueued on the stream: the average
    /// (divided by the world size), the optimizer kernels on this rank's shard, and the
    /// all-gather of each bucket into `params`.
    ///
    /// # Errors
    /// As `Zero::step`; a device call's failure.
    pub fn step(&mut self, params: &mut [CudaViewMut<'_, T>]) -> Result<bool> {
        self.usable("step")?;
        let plens: Vec<usize> = params.iter().map(|p| p.len()).collect();
        if plens != self.layout.lens() {
            let msg = format!(
                "parameters of lengths {plens:?}; new had {:?}",
                self.layout.lens()
            );
            self.fault.get_or_insert(msg);
        }
        self.close_micro()?;
        if self.micro < self.accumulate {
            return Ok(false);
        }
        let call = format!(
            "step {} of device parameters {:?} after {} micro-batches",
            self.t + 1,
            self.layout.lens(),
            self.micro
        );
        // A device collective that failed after its call returned (as far as this rank knows
        // now: the stream is not waited for) fails the step on every rank.
        let comms = [Some(&self.shard), self.replica.as_ref()];
        let late = comms
            .into_iter()
            .flatten()
            .find_map(|c| c.device_async_error());
        let fault = self.fault.take().or(late.map(|e| e.to_string()));
        if let Err(e) = agree(&self.check, self.rank, "step", &call, fault.as_deref()) {
            self.poisoned = Some(e.to_string());
            return Err(e);
        }
        self.micro = 0;
        if let Err(e) = self
            .kernels
            .div_f32(&self.stream, &mut self.grad, self.world)
        {
            return Err(self.failed("step", "averaging", e));
        }
        self.t += 1;
        self.optimize()?;
        self.gather(params)?;
        Ok(true)
    }

    /// The optimizer kernels on each piece of the shard, with its parameter's hyper-parameters.
    fn optimize(&mut self) -> Result<()> {
        for i in 0..self.pieces.len() {
            let pc = self.pieces[i];
            let h = self.hypers[pc.param];
            let r = pc.shard_offset..pc.shard_offset + pc.len;
            let mut p = self.master.slice_mut(r.clone());
            let g = self.grad.slice(r.clone());
            let res = match self.opt {
                DeviceOptimizer::AdamW(o) => {
                    let s = o.scalars(self.t, h);
                    let sc = AdamWScalars {
                        lr: s.lr,
                        decay: s.decay,
                        beta1: s.beta1,
                        omb1: s.omb1,
                        beta2: s.beta2,
                        omb2: s.omb2,
                        eps: s.eps,
                        c1: s.c1,
                        c2: s.c2,
                    };
                    let (m, v) = self.state.split_at_mut(1);
                    let (mut m, mut v) = (m[0].slice_mut(r.clone()), v[0].slice_mut(r.clone()));
                    self.kernels
                        .adamw_f32(&self.stream, &mut p, &g, (&mut m, &mut v), sc)
                }
                DeviceOptimizer::Sgd(o) => {
                    let s = o.scalars(self.t, h);
                    let sc = SgdScalars {
                        lr: s.lr,
                        weight_decay: s.weight_decay,
                        momentum: s.momentum,
                        omd: s.omd,
                        nesterov: s.nesterov,
                        first: s.first,
                    };
                    let mut buf = self.state.first_mut().map(|b| b.slice_mut(r.clone()));
                    self.kernels
                        .sgd_f32(&self.stream, &mut p, &g, buf.as_mut(), sc)
                }
            };
            if let Err(e) = res {
                return Err(self.failed("step", "the optimizer kernel", e));
            }
        }
        Ok(())
    }

    /// Bucket by bucket: this rank's chunk of the master weights rounded to `T`, all-gathered,
    /// and each parameter copied out of the gathered bucket.
    fn gather(&mut self, params: &mut [CudaViewMut<'_, T>]) -> Result<()> {
        let g = self.layout.group();
        for b in 0..self.layout.buckets().len() {
            let bucket = self.layout.buckets()[b].clone();
            let chunk = bucket.chunk;
            if chunk == 0 {
                continue;
            }
            let src = self
                .master
                .slice(bucket.shard_offset..bucket.shard_offset + chunk);
            if let Err(e) = T::narrow(
                &self.kernels,
                &self.stream,
                &mut self.mine.slice_mut(0..chunk),
                &src,
            ) {
                return Err(self.failed("step", "rounding the master weights", e));
            }
            let sc = self.shard.on_stream(&self.stream);
            sc.all_gather_into(
                &self.mine.slice(0..chunk),
                &mut self.gather.slice_mut(0..chunk * g),
            )?;
            for (&p, &start) in bucket.params.iter().zip(&bucket.starts) {
                let n = params[p].len();
                let from = self.gather.slice(start..start + n);
                if let Err(e) = self.stream.memcpy_dtod(&from, &mut params[p]) {
                    return Err(self.failed("step", "copying a parameter out", e));
                }
            }
        }
        Ok(())
    }

    /// Writes a checkpoint (see [`Zero::save`](crate::Zero::save); the same files): the shard is
    /// copied to the host first (a synchronisation of the stream). Collective.
    ///
    /// # Errors
    /// As `Zero::save`; a device copy's failure.
    pub fn save(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        self.usable("save")?;
        let dir = dir.as_ref();
        let names = self.opt.names();
        let group = self.layout.group();
        let busy = self.micro > 0 || self.given.iter().any(|&g| g);
        let mut fault = busy.then(|| "save in the middle of a step".to_string());
        if fault.is_none() && self.writer {
            fault = self.write_shard_file(dir, &names).err();
        }
        if fault.is_none() && self.rank == 0 {
            let m = Manifest::new(self.opt.name(), names, self.t, self.layout.lens(), group);
            fault = write_manifest(dir, &m).err().map(|e| e.to_string());
        }
        agree(&self.check, self.rank, "save", "save", fault.as_deref())
    }

    fn write_shard_file(&self, dir: &Path, names: &[String]) -> std::result::Result<(), String> {
        let host = |v: &oxccl_comm::cuda::cudarc::driver::CudaSlice<f32>| {
            self.stream
                .clone_dtoh(v)
                .map_err(|e| format!("copying to the host: {e:?}"))
        };
        let master = host(&self.master)?;
        let states = self
            .state
            .iter()
            .map(host)
            .collect::<std::result::Result<Vec<_>, _>>()?;
        // The host layout: `per` vectors of each piece's length at `per * shard_offset`.
        let per = states.len();
        let mut state = vec![0.0f32; per * master.len()];
        for pc in &self.pieces {
            let (a, n) = (pc.shard_offset, pc.len);
            for (k, s) in states.iter().enumerate() {
                state[per * a + k * n..per * a + (k + 1) * n].copy_from_slice(&s[a..a + n]);
            }
        }
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = dir.join(shard_file(self.shard.rank(), self.layout.group()));
        write_shard(&path, &self.pieces, names, &master, &state).map_err(|e| e.to_string())
    }

    /// Loads a checkpoint directory (see [`Zero::load`](crate::Zero::load)) and sets every
    /// rank's `params` to its master weights. Collective.
    ///
    /// # Errors
    /// As `Zero::load`; a device copy's failure.
    pub fn load(&mut self, dir: impl AsRef<Path>, params: &mut [CudaViewMut<'_, T>]) -> Result<()> {
        self.usable("load")?;
        let names = self.opt.names();
        let full = consolidate(dir);
        let plens: Vec<usize> = params.iter().map(|p| p.len()).collect();
        let busy = self.micro > 0 || self.given.iter().any(|&g| g);
        let fault = match &full {
            _ if busy => Some("load in the middle of a step".to_string()),
            _ if plens != self.layout.lens() => Some(format!(
                "parameters of lengths {plens:?}; new had {:?}",
                self.layout.lens()
            )),
            Err(e) => Some(e.to_string()),
            Ok(f) if f.optimizer != self.opt.name() || f.state_names != names => Some(format!(
                "a state of {} {:?} for {} {names:?}",
                f.optimizer,
                f.state_names,
                self.opt.name()
            )),
            Ok(f)
                if f.params.iter().map(|p| p.master.len()).ne(self
                    .layout
                    .lens()
                    .iter()
                    .copied()) =>
            {
                Some("a state of other parameters".to_string())
            }
            Ok(_) => None,
        };
        agree(&self.check, self.rank, "load", "load", fault.as_deref())?;
        let full = full?;
        let n = self.layout.shard_len();
        let mut master = vec![0.0f32; n];
        let mut states = vec![vec![0.0f32; n]; self.state.len()];
        for pc in &self.pieces {
            let (a, len, off) = (pc.shard_offset, pc.len, pc.param_offset);
            let src = &full.params[pc.param];
            master[a..a + len].copy_from_slice(&src.master[off..off + len]);
            for (k, s) in src.state.iter().enumerate() {
                states[k][a..a + len].copy_from_slice(&s[off..off + len]);
            }
        }
        let r = self.stream.memcpy_htod(&master, &mut self.master);
        let r = states
            .iter()
            .zip(self.state.iter_mut())
            .try_fold((), |(), (h, d)| self.stream.memcpy_htod(h, d))
            .and(r);
        if let Err(e) = r {
            return Err(self.failed("load", "copying the state to the device", e));
        }
        self.t = full.step;
        self.gather(params)
    }
}
