//! The runtime: runs one rank's action list over a communicator, calling the user's stage.
//!
//! The rank's thread computes; an exchange thread, started for each step, runs the exchanges
//! one after another in the order the list posts them ([`wire`]), as the communicator's line
//! would. A computation that needs received tensors waits for the exchange that brings them;
//! tensors to send are moved to the exchange thread. An error anywhere (the stage's, a lost
//! peer, a refused shape) aborts the communicator, so every other stage fails too instead of
//! waiting.

mod line;
mod place;
mod shapes;
#[cfg(test)]
mod tests;
mod wire;

use std::borrow::Borrow;
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[cfg(feature = "cuda-core")]
use std::sync::Arc;

#[cfg(feature = "cuda-core")]
use cudarc::driver::CudaStream;
use oxccl_comm::Communicator;

use line::Line;
use place::Place;
pub use wire::Check;
use wire::{Caches, Job, Key, Wire};

use crate::error::{BoxError, PipelineError};
use crate::schedule::{Action, Costs, Dir, Op, Schedule, ScheduleKind, Step};
use crate::tensor::{Meta, Tensor};

/// The user's code for this rank's stage (or, interleaved, its chunks: `step.chunk` says
/// which). Tensors in, tensors out: any number, any dtypes, any shapes, which may change from
/// one step to the next.
///
/// - The first stage's forward gets no inputs: it reads micro-batch `step.mb` itself.
/// - The last stage's forward output is dropped (keep the loss yourself); its backward gets no
///   gradients: it starts from its loss.
/// - The first stage's backward returns no gradients (or any: they are dropped).
/// - Micro-batch `m - 1`'s backward is each chunk's last of the step: where data-parallel
///   gradient reduction (DDP's last micro-batch) overlaps the cool-down.
pub trait Stage {
    /// The forward of `step.mb` on `step.chunk`: the previous stage's outputs in, this stage's
    /// out (to the next stage).
    ///
    /// # Errors
    /// Any: the step fails on every rank, this one naming it.
    fn forward(&mut self, step: Step, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError>;

    /// The whole backward: gradients of this stage's outputs in (in the order of the forward's
    /// outputs), gradients of its inputs out; the weight gradients accumulate in the stage.
    ///
    /// # Errors
    /// As [`Stage::forward`].
    fn backward(&mut self, step: Step, grads: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError>;

    /// The input-gradient half of the backward (B), for zero-bubble schedules: by default the
    /// whole backward.
    ///
    /// # Errors
    /// As [`Stage::forward`].
    fn backward_input(&mut self, step: Step, grads: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        self.backward(step, grads)
    }

    /// The weight-gradient half (W), after [`Stage::backward_input`] of the same step: by
    /// default nothing (the input half did it all).
    ///
    /// # Errors
    /// As [`Stage::forward`].
    fn backward_weight(&mut self, step: Step) -> Result<(), BoxError> {
        let _ = step;
        Ok(())
    }
}

/// A stage behind a mutable reference (a `&mut dyn Stage`, say) is a stage.
impl<S: Stage + ?Sized> Stage for &mut S {
    fn forward(&mut self, step: Step, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        (**self).forward(step, inputs)
    }
    fn backward(&mut self, step: Step, grads: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        (**self).backward(step, grads)
    }
    fn backward_input(&mut self, step: Step, grads: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        (**self).backward_input(step, grads)
    }
    fn backward_weight(&mut self, step: Step) -> Result<(), BoxError> {
        (**self).backward_weight(step)
    }
}

/// How to run the pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PipelineConfig {
    /// The schedule's rule.
    pub schedule: ScheduleKind,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Model chunks per rank (interleaved only; 1 otherwise).
    pub chunks: usize,
    /// The relative costs of forward, input and weight gradients the exchanges are placed for.
    pub costs: Costs,
}

impl PipelineConfig {
    /// `schedule` over `micro_batches`, one chunk per rank, equal costs.
    pub fn new(schedule: ScheduleKind, micro_batches: usize) -> PipelineConfig {
        PipelineConfig {
            schedule,
            micro_batches,
            chunks: 1,
            costs: Costs::default(),
        }
    }
}

/// What one step took on this rank.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepStats {
    /// From the call to the return.
    pub wall: Duration,
    /// In the stage's forward and backward calls.
    pub compute: Duration,
    /// Waiting for received tensors.
    pub waiting: Duration,
    /// Exchanges run.
    pub exchanges: usize,
    /// Payload bytes sent.
    pub bytes_sent: u64,
}

impl StepStats {
    /// The fraction of the step this rank did not compute: `1 - compute / wall`.
    pub fn bubble(&self) -> f64 {
        if self.wall.is_zero() {
            return 0.0;
        }
        1.0 - self.compute.as_secs_f64() / self.wall.as_secs_f64()
    }
}

/// A pipeline over a communicator whose ranks are its stages (rank r holds stage r, or stages
/// `c p + r` with `v` chunks), e.g. the `pipe` group of a [`oxccl_comm::Topology`].
pub struct Pipeline<C: Borrow<Communicator> = Communicator> {
    comm: C,
    schedule: Schedule,
    caches: Caches,
    check: Option<Check>,
    place: Place,
}

impl<C: Borrow<Communicator>> std::fmt::Debug for Pipeline<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("rank", &self.comm.borrow().rank())
            .field("schedule", &self.schedule.kind)
            .field("m", &self.schedule.m)
            .field("v", &self.schedule.v)
            .finish()
    }
}

impl<C: Borrow<Communicator> + Sync> Pipeline<C> {
    /// Makes the schedule for this communicator's size and checks that every rank asked for
    /// the same one. Collective over `comm`.
    ///
    /// # Errors
    /// [`PipelineError::Schedule`] for sizes no schedule takes; [`PipelineError::Invalid`]
    /// listing every rank's request when they differ; [`PipelineError::Comm`].
    pub fn new(comm: C, cfg: PipelineConfig) -> Result<Pipeline<C>, PipelineError> {
        Pipeline::make(comm, cfg, Place::Host)
    }

    /// A pipeline whose stages take and give device tensors ([`Tensor::device_zeros`],
    /// [`Tensor::from_device`]) computed on `stream` (or on streams cudarc orders with it):
    /// the payloads move as oxccl's device batches of sends and receives, enqueued on a
    /// stream of the pipeline's own in `stream`'s context, so that a receive that waits for its
    /// peer holds up only the computations that use what it brings. Headers and shapes still
    /// go through host memory. Every rank must make it this way. Collective over `comm`.
    ///
    /// The communicator's device path is set up here ([`oxccl_comm::cuda::StreamComm::connect`]):
    /// where every stage shares a node (2 to 8 of them), activations and gradients move from
    /// device to device over CUDA IPC; elsewhere they are staged through pinned host memory.
    /// `pipeline/tests/pipeline/device.rs` checks it on a GPU.
    ///
    /// # Errors
    /// As [`Pipeline::new`] (ranks that differ in host or device are named); `Device` when
    /// the exchange stream cannot be made.
    #[cfg(feature = "cuda-core")]
    pub fn new_on_device(
        comm: C,
        cfg: PipelineConfig,
        stream: &Arc<CudaStream>,
    ) -> Result<Pipeline<C>, PipelineError> {
        let rank = comm.borrow().rank();
        let xs = stream
            .context()
            .new_stream()
            .map_err(|e| PipelineError::Device {
                rank,
                what: format!("creating the exchange stream: {e}"),
            })?;
        let p = Pipeline::make(comm, cfg, Place::Device(Arc::clone(&xs)))?;
        p.comm()
            .on_stream(&xs)
            .connect()
            .map_err(|e| PipelineError::Comm {
                rank,
                what: "the device path set up".into(),
                source: e,
            })?;
        Ok(p)
    }

    fn make(comm: C, cfg: PipelineConfig, place: Place) -> Result<Pipeline<C>, PipelineError> {
        let c = comm.borrow();
        let schedule = Schedule::with_costs(
            cfg.schedule,
            c.size(),
            cfg.micro_batches,
            cfg.chunks,
            cfg.costs,
        );
        let code = |k: Option<ScheduleKind>| {
            k.and_then(|k| ScheduleKind::ALL.iter().position(|&x| x == k))
                .map_or(u64::MAX, |i| i as u64)
        };
        let mine = [
            code(schedule.as_ref().ok().map(|s| s.kind)),
            cfg.micro_batches as u64,
            cfg.chunks as u64,
            u64::from(place.is_device()),
        ];
        let mut all = vec![0u64; 4 * c.size()];
        c.all_gather_into(&mine, &mut all)
            .map_err(|e| PipelineError::Comm {
                rank: c.rank(),
                what: "the ranks' schedules compared".into(),
                source: e,
            })?;
        let schedule = schedule?;
        if all.chunks(4).any(|w| w != mine) {
            let show: Vec<String> = all
                .chunks(4)
                .enumerate()
                .map(|(r, w)| {
                    let kind = ScheduleKind::ALL
                        .get(w[0] as usize)
                        .map_or("none", |k| k.name());
                    let at = if w[3] == 1 { "device" } else { "host" };
                    format!("rank {r}: {kind} m {} v {} on {at}", w[1], w[2])
                })
                .collect();
            return Err(PipelineError::Invalid {
                rank: c.rank(),
                what: format!(
                    "the ranks asked for different schedules: {}",
                    show.join("; ")
                ),
            });
        }
        let caches = Caches::new(2 * schedule.m * schedule.v);
        Ok(Pipeline {
            comm,
            schedule,
            caches,
            check: None,
            place,
        })
    }

    /// Sets the check each new set of received shapes must pass (`(direction, this rank's
    /// chunk, shapes)`, `Err(why)` to refuse): a refusal fails the step on the receiver and on
    /// the sender, both naming the stages, the shapes and the reason.
    pub fn set_check(
        &mut self,
        check: impl Fn(Dir, usize, &[Meta]) -> Result<(), String> + Send + Sync + 'static,
    ) {
        self.check = Some(std::sync::Arc::new(check));
    }

    /// The schedule this rank runs.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The communicator.
    pub fn comm(&self) -> &Communicator {
        self.comm.borrow()
    }

    /// This rank's stage for `chunk`: `chunk p + rank`.
    pub fn stage(&self, chunk: usize) -> usize {
        chunk * self.schedule.p + self.comm().rank()
    }

    /// Times shapes were sent or accepted on this rank since it was made (each link's first
    /// exchange, then each change).
    pub fn shape_exchanges(&self) -> u64 {
        self.caches.meta_rounds
    }

    /// Runs one step (every micro-batch's forward and backward) of this rank's schedule,
    /// calling `stage`. Collective over the communicator.
    ///
    /// # Errors
    /// The stage's error ([`PipelineError::Stage`]), a refused shape
    /// ([`PipelineError::Refused`]), an exchange's ([`PipelineError::Comm`]): after any of them
    /// the communicator is aborted and every rank's step fails.
    pub fn step(&mut self, stage: &mut impl Stage) -> Result<StepStats, PipelineError> {
        let t0 = Instant::now();
        let comm = self.comm.borrow();
        let actions = &self.schedule.ranks[comm.rank()];
        let (p, stages) = (self.schedule.p, self.schedule.stages());
        let wire = Wire {
            comm,
            caches: &mut self.caches,
            check: self.check.clone(),
            place: self.place.clone(),
        };
        let place = self.place.name();
        let line = Line::new(wire);
        let mut stats = std::thread::scope(|sc| {
            let worker = sc.spawn(|| line.serve());
            let mut run = Run {
                rank: comm.rank(),
                place,
                p,
                stages,
                line: &line,
                posted: 0,
                finished: 0,
                deadline: comm.config().timeout + Duration::from_secs(5),
                mailbox: HashMap::new(),
                outbox: HashMap::new(),
                stats: StepStats::default(),
            };
            let mut result = run.actions(actions, stage);
            if result.is_ok() {
                result = run.drain();
            }
            if result.is_err() {
                comm.abort();
            }
            line.close();
            let _ = worker.join();
            result.map(|()| run.stats)
        })?;
        stats.wall = t0.elapsed();
        Ok(stats)
    }
}

/// One step in progress on the rank's thread.
struct Run<'l, 'w> {
    rank: usize,
    /// Where every tensor exchanged must be (`host` or `device`).
    place: &'static str,
    p: usize,
    stages: usize,
    line: &'l Line<'w>,
    posted: usize,
    finished: usize,
    /// How long to wait for the next exchange to finish.
    deadline: Duration,
    /// Received (or handed over on this rank) tensors, by consumer.
    mailbox: HashMap<Key, Vec<Tensor>>,
    /// Computed tensors waiting for their exchange, by producer: (direction, mb, chunk).
    outbox: HashMap<Key, Vec<Tensor>>,
    stats: StepStats,
}

impl Run<'_, '_> {
    fn actions(&mut self, actions: &[Action], stage: &mut impl Stage) -> Result<(), PipelineError> {
        // Exchanges posted so far: every one before `ahead`'s scan point that only receives
        // may already be in the line (posted early: the line keeps their order, so this only
        // lets them start sooner).
        let mut early = vec![false; actions.len()];
        self.look_ahead(actions, 0, &mut early)?;
        for (i, a) in actions.iter().enumerate() {
            match a {
                Action::Exchange(_) if early[i] => {}
                Action::Exchange(ops) => {
                    self.post(ops)?;
                    self.look_ahead(actions, i + 1, &mut early)?;
                }
                Action::Forward(st) => {
                    let s = st.chunk * self.p + self.rank;
                    let inputs = if s > 0 {
                        self.input((Dir::Act, st.mb, st.chunk))?
                    } else {
                        Vec::new()
                    };
                    let out = self.compute(s, "forward", *st, || stage.forward(*st, inputs))?;
                    if s + 1 < self.stages {
                        self.produced(Dir::Act, *st, s + 1, out);
                    }
                }
                Action::Backward(st) | Action::BackwardInput(st) => {
                    let s = st.chunk * self.p + self.rank;
                    let grads = if s + 1 < self.stages {
                        self.input((Dir::Grad, st.mb, st.chunk))?
                    } else {
                        Vec::new()
                    };
                    let out = if matches!(a, Action::Backward(_)) {
                        self.compute(s, "backward", *st, || stage.backward(*st, grads))?
                    } else {
                        self.compute(s, "input-gradient backward", *st, || {
                            stage.backward_input(*st, grads)
                        })?
                    };
                    if s > 0 {
                        self.produced(Dir::Grad, *st, s - 1, out);
                    }
                }
                Action::BackwardWeight(st) => {
                    let s = st.chunk * self.p + self.rank;
                    self.compute(s, "weight-gradient backward", *st, || {
                        stage.backward_weight(*st)
                    })?;
                }
            }
        }
        Ok(())
    }

    /// Posts, in order from `from`, the exchanges that only receive, up to the first one that
    /// sends (which needs a computation not done yet).
    fn look_ahead(
        &mut self,
        actions: &[Action],
        from: usize,
        early: &mut [bool],
    ) -> Result<(), PipelineError> {
        for (i, a) in actions.iter().enumerate().skip(from) {
            let Action::Exchange(ops) = a else { continue };
            if early[i] {
                continue;
            }
            if ops.iter().any(|o| matches!(o, Op::Send { .. })) {
                break;
            }
            self.post(ops)?;
            early[i] = true;
        }
        Ok(())
    }

    fn compute<R>(
        &mut self,
        stage: usize,
        what: &str,
        st: Step,
        f: impl FnOnce() -> Result<R, BoxError>,
    ) -> Result<R, PipelineError> {
        let t = Instant::now();
        let r = f();
        self.stats.compute += t.elapsed();
        r.map_err(|source| PipelineError::Stage {
            rank: self.rank,
            stage,
            action: format!("{what} of micro-batch {} (chunk {})", st.mb, st.chunk),
            source,
        })
    }

    /// Keeps a computation's output for the exchange that sends it, or hands it to this rank's
    /// own chunk that takes it.
    fn produced(&mut self, dir: Dir, st: Step, to: usize, out: Vec<Tensor>) {
        if to % self.p == self.rank {
            self.mailbox.insert((dir, st.mb, to / self.p), out);
        } else {
            self.outbox.insert((dir, st.mb, st.chunk), out);
        }
    }

    fn post(&mut self, ops: &[Op]) -> Result<(), PipelineError> {
        let mut sends = Vec::with_capacity(ops.len());
        for op in ops {
            match *op {
                Op::Send { dir, mb, chunk, .. } => {
                    let ts = self.outbox.remove(&(dir, mb, chunk)).ok_or_else(|| {
                        PipelineError::Protocol {
                            rank: self.rank,
                            what: format!("{op:?}: nothing computed to send"),
                        }
                    })?;
                    let device = self.place == "device";
                    if let Some(i) = ts.iter().position(|t| t.is_device() != device) {
                        let at = if device { "host" } else { "device" };
                        return Err(PipelineError::Invalid {
                            rank: self.rank,
                            what: format!(
                                "{op:?}: tensor {i} ({}) is in {at} memory, but this pipeline \
                                 moves {} tensors (Pipeline::{})",
                                ts[i].meta(),
                                self.place,
                                if device { "new_on_device" } else { "new" }
                            ),
                        });
                    }
                    self.stats.bytes_sent += ts.iter().map(|t| t.nbytes() as u64).sum::<u64>();
                    sends.push(ts);
                }
                Op::Recv { .. } => sends.push(Vec::new()),
            }
        }
        let job = Job {
            ops: ops.to_vec(),
            sends,
        };
        if !self.line.post(job) {
            // An exchange failed: its error is the line's last result.
            return self.next_done();
        }
        self.posted += 1;
        self.stats.exchanges += 1;
        Ok(())
    }

    /// Takes one finished exchange's result.
    fn next_done(&mut self) -> Result<(), PipelineError> {
        let t = Instant::now();
        // Each exchange waits at most the communicator's time-out: the one in progress ends
        // within it, with a result or an error.
        let r = self.line.next(self.deadline);
        self.stats.waiting += t.elapsed();
        match r {
            Some(Ok(got)) => {
                self.finished += 1;
                self.mailbox.extend(got);
                Ok(())
            }
            Some(Err(e)) => Err(e),
            None => Err(PipelineError::Protocol {
                rank: self.rank,
                what: format!(
                    "no exchange finished within {:?} (the communicator's time-out and a margin)",
                    self.deadline
                ),
            }),
        }
    }

    fn input(&mut self, key: Key) -> Result<Vec<Tensor>, PipelineError> {
        loop {
            if let Some(t) = self.mailbox.remove(&key) {
                return Ok(t);
            }
            if self.finished == self.posted {
                return Err(PipelineError::Protocol {
                    rank: self.rank,
                    what: format!("{key:?} is needed but no exchange posted brings it"),
                });
            }
            self.next_done()?;
        }
    }

    /// Waits for every exchange posted.
    fn drain(&mut self) -> Result<(), PipelineError> {
        while self.finished < self.posted {
            self.next_done()?;
        }
        Ok(())
    }
}
