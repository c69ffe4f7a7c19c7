//! `ncclGroupStart` / `ncclGroupEnd`, per thread as in NCCL. Inside a group, creating a
//! communicator (init, split) and every operation are deferred to the outermost end: the
//! creations then run at once, each on a thread of its own (nccl-tests creates all of a
//! process's ranks from one thread inside a group: one after the other they would wait for
//! each other for ever), then the operations in the order they were called, each
//! communicator's sends and receives together ([`crate::coll::run_group`]).

use std::cell::{Cell, RefCell};
use std::thread;

use crate::coll::{Call, Target};
use crate::status::{bad_use, Failure, Outcome};

/// Deferred work.
pub type Job = Box<dyn FnOnce() -> Outcome + Send>;

thread_local! {
    static DEPTH: Cell<usize> = const { Cell::new(0) };
    static CONNECTS: RefCell<Vec<Job>> = const { RefCell::new(Vec::new()) };
    static OPS: RefCell<Vec<(Target, Call)>> = const { RefCell::new(Vec::new()) };
}

/// Whether this thread is inside a group.
pub fn active() -> bool {
    DEPTH.with(Cell::get) > 0
}

/// `ncclGroupStart`.
pub fn start() {
    DEPTH.with(|d| d.set(d.get() + 1));
}

/// `ncclGroupEnd`: at the outermost end, runs what the group deferred; the first failure is
/// the result (every creation still runs to its end, each recording its own outcome).
pub fn end() -> Outcome {
    let depth = DEPTH.with(Cell::get);
    if depth == 0 {
        return Err(bad_use("ncclGroupEnd without a matching ncclGroupStart"));
    }
    DEPTH.with(|d| d.set(depth - 1));
    if depth > 1 {
        return Ok(());
    }
    let connects = CONNECTS.with(|c| std::mem::take(&mut *c.borrow_mut()));
    let ops = OPS.with(|o| std::mem::take(&mut *o.borrow_mut()));
    let made: Vec<Outcome> = thread::scope(|s| {
        let running: Vec<_> = connects.into_iter().map(|job| s.spawn(job)).collect();
        running
            .into_iter()
            .map(|t| {
                t.join()
                    .unwrap_or_else(|_| Err(bad_use("creating a communicator panicked")))
            })
            .collect()
    });
    let first: Option<Failure> = made.into_iter().find_map(Result::err);
    let ran = crate::coll::run_group(ops);
    match first {
        Some(f) => Err(f),
        None => ran,
    }
}

/// Creates a communicator now, or at the group's end inside a group.
pub fn connect(job: Job) -> Outcome {
    if active() {
        CONNECTS.with(|c| c.borrow_mut().push(job));
        Ok(())
    } else {
        job()
    }
}

/// Defers an operation to the group's end (see [`crate::coll::run_group`]).
pub fn op(t: Target, call: Call) {
    OPS.with(|o| o.borrow_mut().push((t, call)));
}
