//! Enqueueing one device operation: the checks, the communicator's device state, the choice of
//! CUDA IPC, and the staged path through pinned host memory (input copies, host collectives on
//! the progress thread, copies back behind the flag).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaEvent, DriverError};
use oxccl_kernels::DType;

use super::state::{DeviceState, IpcMode};
use super::{lock, Dev, Kind, StreamComm};
use crate::base::error::{Error, Result};
use crate::device::plan::Plan;
use crate::device::staging::{Flag, Lent};
use crate::transport::cuda_ipc as ipc;

/// A part handed to the progress thread: its number (the flag reaches it when the part is
/// done), the channel its result comes back on, and the deadline for that result.
type Pending = (u32, crossbeam_channel::Receiver<Result<()>>, Instant);

impl StreamComm<'_> {
    /// Checks and enqueues one device operation (see the module documentation), over CUDA IPC
    /// where the communicator's collectives run so, else staged; its errors not yet noted with
    /// the communicator's world ranks.
    pub(super) fn launch_unnamed(
        &self,
        kind: Kind,
        dt: DType,
        input: Dev,
        output: Dev,
    ) -> Result<()> {
        let comm = self.comm;
        let op = kind.name();
        let plan = self.staging_plan(kind, dt, input, output)?;
        let stream = &self.stream;
        // One device operation at a time per communicator: tickets, part numbers and stream
        // work are taken in the same order.
        let mut guard = lock(&comm.cuda);
        tracing::trace!(rank = comm.rank, "cuda: {op} {dt}: enqueueing");
        let state = self.device_state(&mut guard, op)?;
        let ctx = Arc::clone(&state.ctx);
        ctx.bind_to_thread()
            .map_err(|e| self.cuda_err(op, "binding the context", e))?;
        if kind.collective().is_some() {
            if let Some(r) = self.over_ipc(state, kind, dt, input, output) {
                return r;
            }
        }
        let one = |send: bool, peer: usize, d: Dev| {
            d.map(|(ptr, count)| ipc::P2pMsg {
                send,
                peer,
                ptr,
                bytes: count * dt.size(),
            })
        };
        let msg = match kind {
            Kind::Send { peer } => one(true, peer, input),
            Kind::Recv { peer } => one(false, peer, output),
            _ => None,
        };
        if let Some(m) = msg {
            if let Some(r) = self.p2p_over_ipc(state, &[m]) {
                return r;
            }
        }
        load_waiter(state, &ctx, comm.rank);
        let lent = self.take_staging(state, &ctx, op, plan.stage_bytes)?;
        let record_done = |lent: &Lent| lent.pinned().done.record(stream);

        // 1. Device inputs to staging, all parts first, an event after each.
        let ready = self
            .stage_inputs(&ctx, &state.events, &plan, input, &lent)
            .map_err(|e| self.cuda_err(op, "copying the input to host staging", e))?;

        // 2. One host collective per part, on the progress thread, in issue order.
        let pending = self.submit_parts(state, kind, dt, &plan, ready, &lent);

        // 3. Results back to the device, each behind its part's flag value.
        let mut result = self.copy_back(state, op, &plan, pending, output, &lent);
        if let Err(e) = record_done(&lent) {
            result = result.and(Err(self.cuda_err(op, "recording the done event", e)));
        }
        tracing::trace!(
            rank = comm.rank,
            "cuda: {op} {dt}: enqueued, parts up to {}",
            state.next
        );
        result
    }

    /// The staging plan of a call, its arguments checked as its host counterpart's are.
    fn staging_plan(&self, kind: Kind, dt: DType, input: Dev, output: Dev) -> Result<Plan> {
        let comm = self.comm;
        let op = kind.name();
        let plan = crate::device::plan::plan(
            kind,
            comm.rank,
            comm.size,
            dt.size(),
            input.map(|i| i.1),
            output.map(|o| o.1),
            comm.cfg.cuda_stage_chunk,
        )
        .map_err(|msg| comm.invalid(op, msg))?;
        if let Some(f) = kind.op().factor() {
            oxccl_kernels::check_factor(dt, f)
                .map_err(|e| comm.invalid(op, format!("op={}: {e}", kind.op())))?;
        }
        Ok(plan)
    }

    /// The communicator's device state (`slot`, made at its first device operation), once the
    /// stream is checked to belong to its context and no earlier operation has failed.
    pub(super) fn device_state<'s>(
        &self,
        slot: &'s mut Option<DeviceState>,
        op: &str,
    ) -> Result<&'s mut DeviceState> {
        let comm = self.comm;
        let stream = &self.stream;
        if slot.is_none() {
            tracing::trace!(
                rank = comm.rank,
                "cuda: allocating the pinned flag (cuMemHostAlloc)"
            );
            let s = DeviceState::new(
                stream.context(),
                comm.rank,
                &comm.cfg,
                comm.shares_process(),
            )
            .map_err(|e| self.cuda_err(op, "setting up pinned memory", e))?;
            tracing::trace!(rank = comm.rank, "cuda: pinned flag allocated");
            *slot = Some(s);
        }
        let state = slot.as_mut().expect("set above");
        if *state.ctx != **stream.context() {
            return Err(comm.invalid(
                op,
                format!(
                    "the stream belongs to CUDA device {}'s context, but this communicator's \
                     device operations use device {}'s",
                    stream.context().ordinal(),
                    state.ctx.ordinal()
                ),
            ));
        }
        if let Some(e) = state.async_error() {
            return Err(e);
        }
        Ok(state)
    }

    /// Runs a collective over CUDA IPC where this communicator's collectives run so (decided at
    /// its first device collective): `Some` with the call's result, `None` where it stages.
    fn over_ipc(
        &self,
        state: &mut DeviceState,
        kind: Kind,
        dt: DType,
        input: Dev,
        output: Dev,
    ) -> Option<Result<()>> {
        let comm = self.comm;
        let op = kind.name();
        let stream = &self.stream;
        self.decide_ipc(state, op);
        match &mut state.ipc {
            IpcMode::Failed(e) => Some(Err(e.clone())),
            IpcMode::On(s) => {
                let len = |d: Dev| d.map_or(0, |x| x.1);
                let count = match kind {
                    Kind::AllGather | Kind::Reduce { .. } | Kind::Gather { .. } => len(input),
                    Kind::AllToAll => len(input) / comm.size,
                    _ => len(output),
                };
                let addr = |d: Dev| d.map_or(0, |x| x.0);
                let call = ipc::IpcCall {
                    kind,
                    dt,
                    count,
                    input: addr(input),
                    output: addr(output),
                };
                let r = s.run(stream, &call, &comm.shared.abort);
                tracing::trace!(rank = comm.rank, "cuda: {op} {dt}: enqueued over cuda_ipc");
                Some(r.inspect_err(|e| {
                    // The ranks now disagree on the barrier count (or a barrier failed): no
                    // further collective on device buffers can work.
                    lock(&state.error).get_or_insert_with(|| e.clone());
                }))
            }
            IpcMode::Untried | IpcMode::Off => None,
        }
    }

    /// Decides, once per communicator (every rank at the same call), whether its device
    /// operations run over CUDA IPC: the set-up on this stream's context.
    fn decide_ipc(&self, state: &mut DeviceState, op: &str) {
        if matches!(state.ipc, IpcMode::Untried) {
            state.ipc = match ipc::setup(&self.comm.group(), &self.stream, op) {
                Ok(Some(s)) => IpcMode::On(Box::new(s)),
                Ok(None) => IpcMode::Off,
                Err(e) => IpcMode::Failed(e),
            };
        }
    }

    /// Runs device sends and receives over CUDA IPC where this communicator's collectives run so
    /// (set up by a device collective or [`StreamComm::connect`]): `Some` with the call's result,
    /// `None` where they stage.
    pub(super) fn p2p_over_ipc(
        &self,
        state: &mut DeviceState,
        msgs: &[ipc::P2pMsg],
    ) -> Option<Result<()>> {
        let comm = self.comm;
        match &mut state.ipc {
            IpcMode::Failed(e) => Some(Err(e.clone())),
            IpcMode::On(s) => {
                let r = s.run_p2p(&self.stream, msgs, &comm.shared.abort);
                tracing::trace!(rank = comm.rank, "cuda: batch_p2p: enqueued over cuda_ipc");
                Some(r.inspect_err(|e| {
                    if !matches!(e, Error::InvalidArgument { .. }) {
                        // Part of the batch may be enqueued: the ranks' pair counters and
                        // inboxes no longer agree, so no later device operation can work.
                        lock(&state.error).get_or_insert_with(|| e.clone());
                    }
                }))
            }
            IpcMode::Untried | IpcMode::Off => None,
        }
    }

    /// Sets up this communicator's device path now, on this stream's context (every rank calls
    /// it, like a collective): CUDA IPC where the ranks can map each other's memory, else
    /// staging, as a first device collective would decide. Device sends and receives go over
    /// CUDA IPC only once it is set up, since a batch involves only some ranks and the set-up
    /// needs them all; call this first where the first device operations are sends and
    /// receives (pipeline stages). Returns `"cuda_ipc"` or `"staged"`.
    ///
    /// # Errors
    /// `InvalidArgument` for a stream of another context than earlier device operations';
    /// `Cuda` when `OXCCL_CUDA_IPC=1` and some rank cannot take part, or a CUDA call fails;
    /// `Timeout` when a rank does not reach the set-up in time.
    pub fn connect(&self) -> Result<&'static str> {
        let comm = self.comm;
        let op = "connect";
        let mut guard = lock(&comm.cuda);
        let state = self
            .device_state(&mut guard, op)
            .map_err(|e| comm.shared.named(e))?;
        state.ctx.bind_to_thread().map_err(|e| {
            comm.shared
                .named(self.cuda_err(op, "binding the context", e))
        })?;
        self.decide_ipc(state, op);
        match &state.ipc {
            IpcMode::On(_) => Ok("cuda_ipc"),
            IpcMode::Failed(e) => Err(comm.shared.named(e.clone())),
            IpcMode::Off | IpcMode::Untried => Ok("staged"),
        }
    }

    /// A pinned staging buffer of at least `bytes` for this call, lent from the pool; one still
    /// in use comes free once every part enqueued so far is done.
    pub(super) fn take_staging(
        &self,
        state: &DeviceState,
        ctx: &Arc<CudaContext>,
        op: &str,
        bytes: usize,
    ) -> Result<Arc<Lent>> {
        let comm = self.comm;
        let (flag, last) = (Arc::clone(&state.flag), state.next);
        let pinned = state
            .pool
            .take(
                comm.rank,
                ctx,
                bytes,
                || flag.get() == last,
                Instant::now() + comm.cfg.timeout,
            )
            .map_err(|e| self.cuda_err(op, "allocating pinned staging memory", e))?
            .ok_or_else(|| Error::Timeout {
                rank: comm.rank,
                op: op.into(),
                timeout: comm.cfg.timeout,
                detail: "no pinned staging buffer came free (earlier device operations did not \
                         finish)"
                    .into(),
            })?;
        Ok(Arc::new(Lent::new(pinned, &state.pool)))
    }

    /// Enqueues the copy of every part's device input into staging, an event after each (one
    /// of `events` reused where there is one): the events, `None` for parts with no input. On a
    /// failure the staging buffer's done event is recorded (nothing more is enqueued).
    fn stage_inputs(
        &self,
        ctx: &Arc<CudaContext>,
        events: &Mutex<Vec<CudaEvent>>,
        plan: &Plan,
        input: Dev,
        lent: &Lent,
    ) -> std::result::Result<Vec<Option<CudaEvent>>, DriverError> {
        let stream = &self.stream;
        let cu = stream.cu_stream();
        let mut ready = Vec::with_capacity(plan.parts.len());
        for part in &plan.parts {
            let copied = match (part.d2h, input) {
                (Some(c), Some((ptr, _))) if c.len > 0 => {
                    let dst = lent.pinned().addr(c.stage);
                    // SAFETY: `dst..dst + len` lies inside the staging buffer (the plan sized
                    // it) and nothing reads it before the event below completes; the source is
                    // the caller's live device buffer of at least `dev + len` bytes (lengths
                    // checked by the plan), ordered on `stream` by its guard.
                    unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), ptr + c.dev as u64, c.len, cu) }
                        .result()
                        .and_then(|()| {
                            let reused = lock(events).pop();
                            let ev = match reused {
                                Some(ev) => ev,
                                None => ctx.new_event(None)?,
                            };
                            ev.record(stream).map(|()| Some(ev))
                        })
                }
                _ => Ok(None),
            };
            match copied {
                Ok(ev) => ready.push(ev),
                Err(e) => {
                    let _ = lent.pinned().done.record(stream);
                    return Err(e);
                }
            }
        }
        Ok(ready)
    }

    /// Submits one host collective per part to the progress thread, in issue order: each waits
    /// for its input copy (`ready`), runs over its range of the staging buffer, then sets the
    /// flag to its number.
    fn submit_parts(
        &self,
        state: &mut DeviceState,
        kind: Kind,
        dt: DType,
        plan: &Plan,
        ready: Vec<Option<CudaEvent>>,
        lent: &Arc<Lent>,
    ) -> Vec<Pending> {
        let comm = self.comm;
        let op = kind.name();
        let mut pending = Vec::with_capacity(plan.parts.len());
        for (part, ready) in plan.parts.iter().zip(ready) {
            state.next = state.next.wrapping_add(1);
            let number = state.next;
            let (tx, rx) = crossbeam_channel::bounded(1);
            let shared = Arc::clone(&comm.shared);
            let (lent, errors, events, ctx) = (
                Arc::clone(lent),
                Arc::clone(&state.error),
                Arc::clone(&state.events),
                Arc::clone(&state.ctx),
            );
            let set = SetOnDrop(Arc::clone(&state.flag), number);
            let (range, count) = (part.stage.clone(), part.count);
            let job = move |ticket: u64, ahead: u64| {
                let r = shared.run_turn(ticket, ahead, |st| {
                    tracing::trace!(rank = shared.rank, "cuda: {op} part {number}: its turn");
                    if let Some(ev) = &ready {
                        wait_ready(&ctx, ev, shared.rank, op, shared.timeout)?;
                    }
                    tracing::trace!(rank = shared.rank, "cuda: {op} part {number}: input staged");
                    // SAFETY: parts use disjoint ranges of the staging buffer and run one at a
                    // time on this thread; the device-to-host copy into this range has completed
                    // (the event above) and the copy back is enqueued behind the flag set below.
                    let stage = unsafe { lent.pinned().slice_mut(range) };
                    crate::engine::exec::exec_staged(&shared, st, kind, dt, count, stage)
                });
                if let Err(e) = &r {
                    lock(&errors).get_or_insert_with(|| e.clone());
                }
                tracing::trace!(
                    rank = shared.rank,
                    "cuda: {op} part {number}: done ({})",
                    if r.is_ok() { "ok" } else { "failed" }
                );
                // Recording a still-pending event again is allowed: the next record replaces it.
                lock(&events).extend(ready);
                drop(set);
                drop(lent);
                let _ = tx.send(r);
            };
            let (_, ahead) = comm.shared.submit_ticketed(job);
            // The turn wait, the input copy and the collective each have a deadline.
            let deadline =
                Instant::now() + comm.shared.timeout * (ahead as u32 + 3) + Duration::from_secs(1);
            pending.push((number, rx, deadline));
        }
        pending
    }

    /// Enqueues the copy of every part's result back to the device, behind a stream wait for
    /// its flag value, or after this thread waited for its host collective (where streams do
    /// not wait on the flag, or that wait cannot be launched).
    ///
    /// # Errors
    /// The first failure of a host collective waited for here, or of a copy; nothing later is
    /// enqueued then.
    fn copy_back(
        &self,
        state: &mut DeviceState,
        op: &str,
        plan: &Plan,
        pending: Vec<Pending>,
        output: Dev,
        lent: &Lent,
    ) -> Result<()> {
        let comm = self.comm;
        let stream = &self.stream;
        let cu = stream.cu_stream();
        let waited = |rx: crossbeam_channel::Receiver<Result<()>>, deadline: Instant| {
            let left = deadline.saturating_duration_since(Instant::now());
            rx.recv_timeout(left).unwrap_or_else(|_| {
                Err(Error::Timeout {
                    rank: comm.rank,
                    op: op.into(),
                    timeout: left,
                    detail: "the staged host collective did not finish".into(),
                })
            })
        };
        for (part, (number, rx, deadline)) in plan.parts.iter().zip(pending) {
            let back = match (part.h2d, output) {
                (Some(c), Some((ptr, _))) if c.len > 0 => Some((c, ptr)),
                _ => None,
            };
            if let (Some(w), true) = (&state.waiter, back.is_some() && state.stream_wait) {
                let left = deadline.saturating_duration_since(Instant::now());
                if let Err(e) = state.flag.enqueue_wait(w, stream, number, left) {
                    tracing::warn!(
                        rank = comm.rank,
                        "launching the wait kernel failed ({e}); device operations now wait \
                         for their host collectives before they return"
                    );
                    state.stream_wait = false;
                }
            }
            if !state.stream_wait {
                waited(rx, deadline)?;
            }
            if let Some((c, ptr)) = back {
                let src = lent.pinned().addr(c.stage);
                // SAFETY: the source range lies inside the staging buffer and its host
                // collective has finished before the copy runs (the stream waits for the flag,
                // or this thread waited above); the destination is the caller's live device
                // buffer of at least `dev + len` bytes, ordered on `stream` by its guard.
                unsafe { sys::cuMemcpyHtoDAsync_v2(ptr + c.dev as u64, src.cast(), c.len, cu) }
                    .result()
                    .map_err(|e| self.cuda_err(op, "copying the result to the device", e))?;
            }
        }
        Ok(())
    }
}

/// Loads the kernel streams wait on the flag in, where they do and it is not loaded yet; where
/// it cannot be, calls wait for their host collectives instead. Called before this
/// communicator has any staged work in flight (loading a module may wait for the context to go
/// idle).
pub(super) fn load_waiter(state: &mut DeviceState, ctx: &Arc<CudaContext>, rank: usize) {
    if state.stream_wait && state.waiter.is_none() {
        match oxccl_kernels::cuda::FlagWait::shared(ctx) {
            Ok(w) => state.waiter = Some(w),
            Err(e) => {
                tracing::info!(
                    rank,
                    "no wait kernel ({e}); device operations wait for their host \
                     collectives before they return"
                );
                state.stream_wait = false;
            }
        }
    }
}

/// Publishes a part's number when dropped: after the part's job, even if it panicked, so no
/// stream waits forever.
pub(super) struct SetOnDrop(pub(super) Arc<Flag>, pub(super) u32);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.set(self.1);
    }
}

/// Waits (on the progress thread) for a part's input copy to complete, within `timeout`.
pub(super) fn wait_ready(
    ctx: &Arc<CudaContext>,
    ev: &cudarc::driver::CudaEvent,
    rank: usize,
    op: &str,
    timeout: Duration,
) -> Result<()> {
    let cuda = |e: DriverError| Error::Cuda {
        rank,
        op: op.into(),
        msg: format!("waiting for the input copy: {e:?}"),
    };
    // Made current directly: cudarc's `bind_to_thread` would also consume (and hide) an error
    // the application's own cudarc calls recorded on this context.
    // SAFETY: the context handle is live (held by `ctx`).
    unsafe { cudarc::driver::result::ctx::set_current(ctx.cu_ctx()) }.map_err(cuda)?;
    if crate::device::staging::wait_event(ev, Instant::now() + timeout).map_err(cuda)? {
        Ok(())
    } else {
        Err(Error::Timeout {
            rank,
            op: op.into(),
            timeout,
            detail: "the copy of the device input to host staging did not complete (is the \
                     stream blocked?)"
                .into(),
        })
    }
}
