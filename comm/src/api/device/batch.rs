//! A batch of sends and receives on device buffers ([`crate::Buffers::batch_p2p`] with device
//! views). Over CUDA IPC where the communicator has set it up (`crate::transport::cuda_ipc`'s
//! `p2p_exec.rs`); otherwise staged through pinned host memory like the other staged device
//! operations: the buffers to send are copied to a staging buffer on the caller's stream, the
//! batch runs over the host transports on the progress thread (every operation progressing
//! together, as [`Communicator::batch_p2p`](crate::Communicator::batch_p2p) runs them), and the
//! received bytes are copied back to the device behind the stream's wait for the flag. The call
//! returns once this is enqueued; later work on the stream sees the received data. Where streams
//! do not wait on the flag (ranks that are threads of one process), the call waits for the host
//! batch before it enqueues the copies back.
//!
//! `comm/tests/comm/cuda.rs` checks both paths on a GPU (`send_recv`: a batch both ways round the
//! ring, every dtype, 2 to 8 ranks), and `cuda_p2p.rs` the IPC path alone.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use oxccl_kernels::DType;

use super::staged::{load_waiter, wait_ready, SetOnDrop};
use super::{lock, StreamComm};
use crate::api::p2p::{run_batch, sort_batch, Part};
use crate::base::buffer::Device;
use crate::base::error::{Error, Result};
use crate::transport::cuda_ipc as ipc;

/// The name errors give a device batch.
const OP: &str = "batch_p2p";

/// One operation of a device batch: a send (`send`) or a receive, its peer, its device bytes
/// (on the stream the batch is enqueued on).
pub(crate) struct DevOp<'a> {
    pub send: bool,
    pub peer: usize,
    pub buf: Device<'a>,
}

impl StreamComm<'_> {
    /// Checks and enqueues a batch of device sends and receives (see the module documentation).
    ///
    /// # Errors
    /// `InvalidArgument` for a peer outside the communicator (before anything is enqueued);
    /// `Cuda` when enqueueing fails; the host batch's errors (`Mismatch`, `PeerLost`,
    /// `Timeout`, ...) directly where the call waits for it, else later through
    /// [`crate::Communicator::device_async_error`] and every later device operation.
    pub(crate) fn launch_batch(&self, ops: Vec<DevOp<'_>>) -> Result<()> {
        let comm = self.comm;
        for (i, o) in ops.iter().enumerate() {
            if o.peer >= comm.size {
                let msg = format!(
                    "operation {i}: peer {} is not a rank of this communicator (size {})",
                    o.peer, comm.size
                );
                return Err(comm.invalid(OP, msg));
            }
        }
        // Sends to this rank itself pair up with receives from it, in order, with equal
        // lengths (checked again on the host; an error there would only come after the call).
        let (mine_out, mine_in): (Vec<_>, Vec<_>) = ops
            .iter()
            .enumerate()
            .filter(|(_, o)| o.peer == comm.rank)
            .partition(|(_, o)| o.send);
        let unpaired = mine_out.len() != mine_in.len()
            || mine_out
                .iter()
                .zip(&mine_in)
                .any(|((_, s), (_, r))| s.buf.bytes != r.buf.bytes);
        if unpaired {
            let msg = format!(
                "{} sends to this rank itself do not pair up in order and length with {} \
                 receives from it",
                mine_out.len(),
                mine_in.len()
            );
            return Err(comm.invalid(OP, msg));
        }
        if ops.is_empty() {
            return Ok(());
        }
        let stream = &self.stream;
        let cu = stream.cu_stream();
        let mut guard = lock(&comm.cuda);
        let state = self.device_state(&mut guard, OP)?;
        let ctx = Arc::clone(&state.ctx);
        ctx.bind_to_thread()
            .map_err(|e| self.cuda_err(OP, "binding the context", e))?;
        let msgs: Vec<ipc::P2pMsg> = ops
            .iter()
            .map(|o| ipc::P2pMsg {
                send: o.send,
                peer: o.peer,
                ptr: o.buf.ptr,
                bytes: o.buf.bytes,
            })
            .collect();
        if let Some(r) = self.p2p_over_ipc(state, &msgs) {
            return r;
        }
        // Staged: each operation's bytes in the staging buffer, 64-byte aligned.
        let mut ranges: Vec<Range<usize>> = Vec::with_capacity(ops.len());
        let mut total = 0;
        for o in &ops {
            let start = usize::next_multiple_of(total, 64);
            total = start + o.buf.bytes;
            ranges.push(start..total);
        }
        load_waiter(state, &ctx, comm.rank);
        let lent = self.take_staging(state, &ctx, OP, total.max(1))?;
        let fail = |what: &str, e: sys::cudaError_enum| {
            let _ = lent.pinned().done.record(stream);
            self.cuda_err(OP, what, e)
        };

        // 1. The bytes to send, to staging; an event after them.
        for (o, r) in ops.iter().zip(&ranges) {
            if o.send && o.buf.bytes > 0 {
                let dst = lent.pinned().addr(r.start);
                // SAFETY: the destination lies inside the staging buffer (the layout above),
                // which nothing else uses until this batch is done; the source is the caller's
                // live device buffer of `bytes` bytes, ordered on `stream` by its view's guard.
                unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), o.buf.ptr, o.buf.bytes, cu) }
                    .result()
                    .map_err(|e| fail("copying a buffer to send to host staging", e.0))?;
            }
        }
        // The event the host batch waits for: only where there are bytes to send (a batch that
        // only receives starts at once, as a staged receive does).
        let ready = if ops.iter().any(|o| o.send && o.buf.bytes > 0) {
            let reused = lock(&state.events).pop();
            let ev = match reused {
                Some(ev) => ev,
                None => ctx
                    .new_event(None)
                    .map_err(|e| fail("creating an event", e.0))?,
            };
            ev.record(stream)
                .map_err(|e| fail("recording the staged event", e.0))?;
            Some(ev)
        } else {
            None
        };

        // 2. The batch over the host transports, on the progress thread, in this
        //    communicator's line.
        state.next = state.next.wrapping_add(1);
        let number = state.next;
        let (tx, rx) = crossbeam_channel::bounded(1);
        let shared = Arc::clone(&comm.shared);
        let (staged, errors, events) = (
            Arc::clone(&lent),
            Arc::clone(&state.error),
            Arc::clone(&state.events),
        );
        let set = SetOnDrop(Arc::clone(&state.flag), number);
        let layout: Vec<(bool, usize, Range<usize>)> = ops
            .iter()
            .zip(&ranges)
            .map(|(o, r)| (o.send, o.peer, r.clone()))
            .collect();
        let job_ctx = Arc::clone(&ctx);
        let job = move |ticket: u64, ahead: u64| {
            let r = shared.run_turn(ticket, ahead, |st| {
                if let Some(ev) = &ready {
                    wait_ready(&job_ctx, ev, shared.rank, OP, shared.timeout)?;
                }
                let parts = layout.iter().map(|(send, peer, r)| {
                    // SAFETY: the ranges are disjoint and inside the staging buffer, which only
                    // this job touches now: the copies into it have completed (the event
                    // above), and the copies back wait for the flag set after this job (on the
                    // GPU, or, where streams do not wait, the call waits for this job before it
                    // enqueues them).
                    let bytes = unsafe { staged.pinned().slice_mut(r.clone()) };
                    if *send {
                        Part::Send(*peer, &*bytes)
                    } else {
                        Part::Recv(*peer, bytes)
                    }
                });
                let batch = sort_batch((shared.rank, shared.size), 1, parts)?;
                run_batch(&shared, st, batch, DType::U8)
            });
            if let Err(e) = &r {
                lock(&errors).get_or_insert_with(|| e.clone());
            }
            lock(&events).extend(ready);
            drop(set);
            drop(staged);
            let _ = tx.send(r);
        };
        let (_, ahead) = comm.shared.submit_ticketed(job);
        let deadline =
            Instant::now() + comm.shared.timeout * (ahead as u32 + 3) + Duration::from_secs(1);

        // 3. The received bytes back to the device, behind the flag.
        let receives = ops.iter().any(|o| !o.send && o.buf.bytes > 0);
        if let (Some(w), true) = (&state.waiter, receives && state.stream_wait) {
            let left = deadline.saturating_duration_since(Instant::now());
            if let Err(e) = state.flag.enqueue_wait(w, stream, number, left) {
                tracing::warn!(
                    rank = comm.rank,
                    "launching the wait kernel failed ({e}); device operations now wait for \
                     their host collectives before they return"
                );
                state.stream_wait = false;
            }
        }
        if !state.stream_wait {
            let left = deadline.saturating_duration_since(Instant::now());
            let r = rx.recv_timeout(left).unwrap_or_else(|_| {
                Err(Error::Timeout {
                    rank: comm.rank,
                    op: OP.into(),
                    timeout: left,
                    detail: "the staged batch of sends and receives did not finish".into(),
                })
            });
            if let Err(e) = r {
                let _ = lent.pinned().done.record(stream);
                return Err(e);
            }
        }
        for (o, r) in ops.iter().zip(&ranges) {
            if !o.send && o.buf.bytes > 0 {
                let src = lent.pinned().addr(r.start);
                // SAFETY: the source lies inside the staging buffer and the batch has filled it
                // before the copy runs (the stream waits for the flag, or this thread waited
                // above); the destination is the caller's live device buffer of `bytes` bytes,
                // ordered on `stream` by its view's guard.
                unsafe { sys::cuMemcpyHtoDAsync_v2(o.buf.ptr, src.cast(), o.buf.bytes, cu) }
                    .result()
                    .map_err(|e| fail("copying received bytes to the device", e.0))?;
            }
        }
        lent.pinned()
            .done
            .record(stream)
            .map_err(|e| self.cuda_err(OP, "recording the done event", e))?;
        tracing::trace!(rank = comm.rank, "cuda: {OP}: enqueued, part {number}");
        Ok(())
    }
}
