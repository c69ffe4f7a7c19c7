//! A host executor of the device plan, for the tests: buckets in host memory, reduced by the
//! host hooks, and every access checked against the order the two streams would give it on a
//! GPU ([`StreamCheck`]: vector clocks over the trainer's and the communication stream, advanced
//! by the plan's events). A plan that let the communication stream read a bucket before the
//! trainer's copy into it was ordered before, or the trainer overwrite a bucket still being
//! reduced, fails here without a GPU.

use std::collections::HashMap;

use oxccl_comm::Communicator;

use super::plan::{Ending, Event, Op, Planner, Queue};
use crate::config::{DdpConfig, Step};
use crate::error::Result;
use crate::flat::FlatBuffer;
use crate::hooks::{AllReduceAvg, CommHook, CompressHook, DeviceHook, GradBucket};
use crate::layout::ParamSpec;
use crate::reducer::entries;

/// A buffer the plan touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Region {
    Bucket(usize),
    Grad(usize),
}

#[derive(Default, Debug)]
struct Access {
    write: Option<(usize, u64)>,
    reads: Vec<(usize, u64)>,
}

fn q(queue: Queue) -> usize {
    match queue {
        Queue::Trainer => 0,
        Queue::Comm => 1,
    }
}

/// Happens-before between two streams' operations, as CUDA orders them: in order on one
/// stream, across streams only through an event recorded on one and waited for on the other.
#[derive(Default, Debug)]
pub(crate) struct StreamCheck {
    clock: [[u64; 2]; 2],
    events: HashMap<Event, [u64; 2]>,
    last: HashMap<Region, Access>,
}

impl StreamCheck {
    fn tick(&mut self, s: usize) -> u64 {
        self.clock[s][s] += 1;
        self.clock[s][s]
    }

    fn before(&self, s: usize, (w, t): (usize, u64)) -> bool {
        w == s || self.clock[s][w] >= t
    }

    pub(crate) fn read(&mut self, on: Queue, r: Region) -> std::result::Result<(), String> {
        let s = q(on);
        let t = self.tick(s);
        let a = self.last.entry(r).or_default();
        if let Some(w) = a.write {
            if !(w.0 == s || self.clock[s][w.0] >= w.1) {
                return Err(format!(
                    "{on:?} reads {r:?} unordered after its write on stream {}",
                    w.0
                ));
            }
        }
        self.last.entry(r).or_default().reads.push((s, t));
        Ok(())
    }

    pub(crate) fn write(&mut self, on: Queue, r: Region) -> std::result::Result<(), String> {
        let s = q(on);
        let t = self.tick(s);
        let a = self.last.remove(&r).unwrap_or_default();
        let earlier = a.write.into_iter().chain(a.reads.iter().copied());
        for e in earlier {
            if !self.before(s, e) {
                return Err(format!(
                    "{on:?} writes {r:?} unordered after an access on stream {}",
                    e.0
                ));
            }
        }
        self.last.insert(
            r,
            Access {
                write: Some((s, t)),
                reads: Vec::new(),
            },
        );
        Ok(())
    }

    pub(crate) fn record(&mut self, on: Queue, e: Event) {
        let s = q(on);
        self.tick(s);
        self.events.insert(e, self.clock[s]);
    }

    pub(crate) fn wait(&mut self, on: Queue, e: Event) -> std::result::Result<(), String> {
        let s = q(on);
        let snap = self
            .events
            .get(&e)
            .ok_or_else(|| format!("{on:?} waits for {e:?}, never recorded"))?;
        for (c, v) in self.clock[s].iter_mut().zip(snap) {
            *c = (*c).max(*v);
        }
        Ok(())
    }
}

/// The device reducer run on the host (see the module docs).
pub(crate) struct SimDdp<'c> {
    comm: &'c Communicator,
    pub(crate) planner: Planner,
    buckets: Vec<FlatBuffer>,
    pub(crate) check: StreamCheck,
    /// Every op applied, in order.
    pub(crate) log: Vec<Op>,
}

impl<'c> SimDdp<'c> {
    pub(crate) fn new(comm: &'c Communicator, specs: Vec<ParamSpec>, cfg: DdpConfig) -> Self {
        let planner = Planner::new(comm.rank(), specs, cfg);
        let buckets = planner
            .buckets()
            .iter()
            .map(|b| FlatBuffer::zeros(b.dtype, b.len))
            .collect();
        SimDdp {
            comm,
            planner,
            buckets,
            check: StreamCheck::default(),
            log: Vec::new(),
        }
    }

    /// The trainer's backward wrote `grad` (on its stream), then handed it over.
    pub(crate) fn grad_ready(&mut self, p: usize, grad: &FlatBuffer) -> Result<()> {
        self.check.write(Queue::Trainer, Region::Grad(p)).unwrap();
        let ops = self.planner.grad_ready(p, grad.dtype(), grad.len())?;
        let mut grads = vec![None; self.planner.specs.len()];
        grads[p] = Some(grad.clone());
        self.apply(ops, &mut grads)
    }

    /// Backward computes `grad` into the slot (written or added, as the slot's flag says).
    pub(crate) fn grad_in_slot(&mut self, p: usize, grad: &FlatBuffer) -> Result<()> {
        let (ops, fresh) = self.planner.grad_slot(p, grad.dtype())?;
        self.apply(ops, &mut [])?;
        let (b, off, len) = self.planner.slot(p);
        self.check.write(Queue::Trainer, Region::Bucket(b)).unwrap();
        let sz = grad.dtype().size();
        let dst = &mut self.buckets[b].bytes_mut()[off * sz..(off + len) * sz];
        if fresh {
            dst.copy_from_slice(grad.bytes());
        } else {
            oxccl_kernels::reduce_bytes(grad.dtype(), oxccl_comm::ReduceOp::Sum, dst, grad.bytes())
                .unwrap();
        }
        let ops = self.planner.grad_ready_in_place(p)?;
        self.apply(ops, &mut [])
    }

    pub(crate) fn finish(&mut self) -> Result<Step> {
        let mut ops = Vec::new();
        let ending = self.planner.finish(&mut ops);
        self.apply(ops, &mut [])?;
        self.end(ending)
    }

    pub(crate) fn sync(&mut self, grads: &mut [FlatBuffer]) -> Result<Step> {
        let given: Vec<_> = grads.iter().map(|g| (g.dtype(), g.len())).collect();
        for p in 0..grads.len() {
            self.check.write(Queue::Trainer, Region::Grad(p)).unwrap();
        }
        let (ops, ending) = self.planner.sync(&given)?;
        let mut slots: Vec<Option<FlatBuffer>> = grads.iter().cloned().map(Some).collect();
        self.apply(ops, &mut slots)?;
        for (g, s) in grads.iter_mut().zip(slots) {
            *g = s.expect("kept");
        }
        self.end(ending)
    }

    fn end(&mut self, ending: Ending) -> Result<Step> {
        match ending {
            Ending::Accumulated(step) => Ok(step),
            Ending::Synced { unused } => self.planner.complete(self.comm, unused),
        }
    }

    /// Parameter `p`'s slot, read on the trainer's stream (after `finish`, its average).
    pub(crate) fn grad(&mut self, p: usize) -> FlatBuffer {
        self.planner.readable(p).unwrap();
        let (b, off, len) = self.planner.slot(p);
        self.check.read(Queue::Trainer, Region::Bucket(b)).unwrap();
        let dt = self.planner.specs[p].dtype;
        let sz = dt.size();
        let mut out = FlatBuffer::zeros(dt, len);
        out.bytes_mut()
            .copy_from_slice(&self.buckets[b].bytes()[off * sz..(off + len) * sz]);
        out
    }

    fn apply(&mut self, ops: Vec<Op>, grads: &mut [Option<FlatBuffer>]) -> Result<()> {
        for op in ops {
            self.log.push(op);
            self.apply_one(op, grads);
        }
        Ok(())
    }

    fn apply_one(&mut self, op: Op, grads: &mut [Option<FlatBuffer>]) {
        let check =
            |r: std::result::Result<(), String>| r.unwrap_or_else(|e| panic!("{op:?}: {e}"));
        match op {
            Op::Relayout => {
                self.buckets = self
                    .planner
                    .buckets()
                    .iter()
                    .map(|b| FlatBuffer::zeros(b.dtype, b.len))
                    .collect();
                for b in 0..self.buckets.len() {
                    check(self.check.write(Queue::Trainer, Region::Bucket(b)));
                }
            }
            Op::CopyIn { param, add } => {
                let (b, off, len) = self.planner.slot(param);
                check(self.check.read(Queue::Trainer, Region::Grad(param)));
                check(self.check.write(Queue::Trainer, Region::Bucket(b)));
                let g = grads[param].as_ref().expect("the call's gradient");
                let sz = g.dtype().size();
                let dst = &mut self.buckets[b].bytes_mut()[off * sz..(off + len) * sz];
                if add {
                    let sum = oxccl_comm::ReduceOp::Sum;
                    oxccl_kernels::reduce_bytes(g.dtype(), sum, dst, g.bytes()).unwrap();
                } else {
                    dst.copy_from_slice(g.bytes());
                }
            }
            Op::Zero { param } => {
                let (b, off, len) = self.planner.slot(param);
                check(self.check.write(Queue::Trainer, Region::Bucket(b)));
                let sz = self.planner.specs[param].dtype.size();
                self.buckets[b].bytes_mut()[off * sz..(off + len) * sz].fill(0);
            }
            Op::Record { on, event } => self.check.record(on, event),
            Op::Wait { on, event } => check(self.check.wait(on, event)),
            Op::Reduce { bucket, wire } => {
                check(self.check.read(Queue::Comm, Region::Bucket(bucket)));
                check(self.check.write(Queue::Comm, Region::Bucket(bucket)));
                let mut hook: Box<dyn CommHook> = match (wire, self.planner.hook()) {
                    (Some(oxccl_comm::DType::F16), _) => Box::new(CompressHook::fp16()),
                    (Some(_), _) => Box::new(CompressHook::bf16()),
                    (None, DeviceHook::Avg | DeviceHook::Compress(_)) => Box::new(AllReduceAvg),
                };
                let spec = &self.planner.buckets()[bucket];
                let buffer =
                    std::mem::replace(&mut self.buckets[bucket], FlatBuffer::zeros(spec.dtype, 0));
                let gb = GradBucket {
                    index: bucket,
                    buffer,
                    params: entries(spec),
                };
                self.buckets[bucket] = hook.start(self.comm, gb).wait(self.comm).expect("reduce");
            }
            Op::CopyOut { param } => {
                let (b, off, len) = self.planner.slot(param);
                check(self.check.read(Queue::Trainer, Region::Bucket(b)));
                check(self.check.write(Queue::Trainer, Region::Grad(param)));
                let g = grads[param].as_mut().expect("the call's gradient");
                let sz = g.dtype().size();
                g.bytes_mut()
                    .copy_from_slice(&self.buckets[b].bytes()[off * sz..(off + len) * sz]);
            }
        }
    }
}
