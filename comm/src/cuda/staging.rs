//! Pinned host memory for staged device operations: the staging buffers (pooled per
//! communicator) and the flag word a stream waits on.
//!
//! A staging buffer is page-locked (`cuMemHostAlloc`, portable), so the copies between it and the
//! GPU are true asynchronous DMA, and every host collective runs on it like on any host slice.
//! Each buffer carries a `done` event, recorded on the stream after the last copy that reads or
//! writes it; a buffer goes back to the pool once its operation's host collectives have finished,
//! and is handed out again only once that event has completed.
//!
//! The flag is one pinned, device-mapped 32-bit word per communicator. The progress thread stores
//! the number of each finished part into it; the stream waits with `cuStreamWaitValue32`
//! (greater-or-equal, wrap-around safe) before copying that part's result back. No host thread
//! blocks on the GPU and the GPU never polls anything but that word.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream, DriverError};

/// Longest wait for the GPU before pinned memory is freed; past it the memory is leaked rather
/// than freed under a copy that may still use it.
const FREE_WAIT: Duration = Duration::from_secs(10);

/// Staging buffers kept for reuse per communicator.
const POOL_KEEP: usize = 4;

/// Staging allocations are rounded up to this, so sizes that differ a little reuse a buffer.
const ROUND: usize = 1 << 20;

/// Polls `event` until it completes or `deadline` passes (`Ok(false)`).
pub(crate) fn wait_event(event: &CudaEvent, deadline: Instant) -> Result<bool, DriverError> {
    let mut pause = Duration::from_micros(1);
    loop {
        if event.try_is_complete()? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        if pause < Duration::from_micros(50) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(pause);
        }
        pause = (pause * 2).min(Duration::from_micros(200));
    }
}

/// One page-locked host buffer and the event that says the GPU is done with it.
pub(crate) struct Pinned {
    ptr: *mut u8,
    len: usize,
    /// Recorded after the last stream copy that touches the buffer.
    pub done: CudaEvent,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is plain host memory owned by this value; the raw pointer is only turned
// into slices by `slice_mut`, whose callers guarantee exclusive use of the range (one part per
// host collective, run one at a time), and by the stream copies ordered by events and the flag.
unsafe impl Send for Pinned {}
// SAFETY: as above; shared references only read the pointer value and the length.
unsafe impl Sync for Pinned {}

impl Pinned {
    /// Allocates at least `len` bytes (rounded up to 1 MiB).
    pub(crate) fn alloc(ctx: &Arc<CudaContext>, len: usize) -> Result<Pinned, DriverError> {
        let len = len.max(1).div_ceil(ROUND) * ROUND;
        ctx.bind_to_thread()?;
        let done = ctx.new_event(None)?;
        // SAFETY: cuMemHostAlloc with a valid size and flags; the memory is only read after it
        // has been written (by a device-to-host copy or by a host collective).
        let ptr = unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }? as *mut u8;
        Ok(Pinned {
            ptr,
            len,
            done,
            ctx: Arc::clone(ctx),
        })
    }

    /// Bytes allocated.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Address of byte `off` (for the stream copies).
    pub(crate) fn addr(&self, off: usize) -> *mut u8 {
        debug_assert!(off <= self.len);
        self.ptr.wrapping_add(off)
    }

    /// The bytes `range` as a slice.
    ///
    /// # Safety
    /// The range must lie inside the buffer, and nothing else (no other slice, no pending stream
    /// copy) may use it while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut(&self, range: std::ops::Range<usize>) -> &mut [u8] {
        assert!(range.start <= range.end && range.end <= self.len);
        // SAFETY: inside the allocation (checked above); exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }

    /// Whether the GPU has finished the copies recorded in `done`.
    fn idle(&self) -> bool {
        self.done.try_is_complete().unwrap_or(false)
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err()
            || !wait_event(&self.done, Instant::now() + FREE_WAIT).unwrap_or(false)
        {
            tracing::warn!(
                bytes = self.len,
                "pinned staging buffer still in use by the GPU; leaking it instead of freeing it"
            );
            return;
        }
        // SAFETY: allocated by cuMemHostAlloc in `alloc`; the GPU has finished every copy that
        // used it (the `done` event completed) and no slice of it outlives `self`.
        let _ = unsafe { result::free_host(self.ptr.cast()) };
    }
}

/// The free staging buffers of one communicator.
#[derive(Default)]
pub(crate) struct Pool {
    free: Mutex<Vec<Pinned>>,
}

impl Pool {
    /// The smallest free buffer of at least `len` bytes whose last copies have completed, or a new
    /// one.
    pub(crate) fn take(&self, ctx: &Arc<CudaContext>, len: usize) -> Result<Pinned, DriverError> {
        {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, p)| p.len() >= len && p.idle())
                .min_by_key(|(_, p)| p.len())
                .map(|(i, _)| i);
            if let Some(i) = best {
                return Ok(free.swap_remove(i));
            }
        }
        Pinned::alloc(ctx, len)
    }

    /// Gives a buffer back; the pool keeps the largest few.
    pub(crate) fn give(&self, p: Pinned) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        free.push(p);
        if free.len() > POOL_KEEP {
            free.sort_by_key(|p| std::cmp::Reverse(p.len()));
            let extra = free.split_off(POOL_KEEP);
            drop(free);
            drop(extra);
        }
    }

    /// Frees every pooled buffer (each waits for its copies first).
    pub(crate) fn clear(&self) {
        let all = std::mem::take(&mut *self.free.lock().unwrap_or_else(|p| p.into_inner()));
        drop(all);
    }
}

/// A staging buffer lent to one device operation: its parts' jobs share it, and the last one to
/// finish gives it back to the pool.
pub(crate) struct Lent {
    pinned: Option<Pinned>,
    pool: Weak<Pool>,
}

impl Lent {
    pub(crate) fn new(pinned: Pinned, pool: &Arc<Pool>) -> Lent {
        Lent {
            pinned: Some(pinned),
            pool: Arc::downgrade(pool),
        }
    }

    pub(crate) fn pinned(&self) -> &Pinned {
        self.pinned.as_ref().expect("present until dropped")
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let Some(p) = self.pinned.take() {
            match self.pool.upgrade() {
                Some(pool) => pool.give(p),
                None => drop(p),
            }
        }
    }
}

/// The pinned, device-mapped word a stream waits on.
pub(crate) struct Flag {
    ptr: *mut u32,
    dev: sys::CUdeviceptr,
    ctx: Arc<CudaContext>,
}

// SAFETY: the word is only accessed through the atomic store of `set` on the host and by
// the GPU's stream waits; the pointer itself is never handed out.
unsafe impl Send for Flag {}
// SAFETY: as above.
unsafe impl Sync for Flag {}

impl Flag {
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<Flag, DriverError> {
        ctx.bind_to_thread()?;
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: a 64-byte (one cache line) page-locked allocation; it is initialised to zero
        // right below before anything reads it.
        let ptr = unsafe { result::malloc_host(64, flags) }? as *mut u32;
        // SAFETY: `ptr` is a fresh, suitably aligned allocation of 64 bytes.
        unsafe { ptr.write_volatile(0) };
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` was allocated with DEVICEMAP in this context; the driver writes the
        // device address into `dev`.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, ptr.cast(), 0) }.result();
        if let Err(e) = r {
            // SAFETY: allocated above, never shared.
            let _ = unsafe { result::free_host(ptr.cast()) };
            return Err(e);
        }
        Ok(Flag {
            ptr,
            dev,
            ctx: Arc::clone(ctx),
        })
    }

    fn atomic(&self) -> &AtomicU32 {
        // SAFETY: `ptr` is a live, 4-byte aligned u32 for as long as `self`; every host access
        // goes through this atomic.
        unsafe { AtomicU32::from_ptr(self.ptr) }
    }

    /// Publishes `value` to the GPU (and to host readers).
    pub(crate) fn set(&self, value: u32) {
        self.atomic().store(value, Ordering::Release);
    }

    /// Makes `stream` wait until the flag is at least `value` (cyclic comparison).
    pub(crate) fn enqueue_wait(&self, stream: &CudaStream, value: u32) -> Result<(), DriverError> {
        self.ctx.bind_to_thread()?;
        let geq = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        // SAFETY: `dev` is the device address of this live, mapped word; the stream belongs to
        // the flag's context (checked by the caller), and the word outlives every stream wait:
        // the communicator frees it only after its staging buffers' `done` events, recorded
        // after those waits, have completed.
        unsafe { sys::cuStreamWaitValue32_v2(stream.cu_stream(), self.dev, value, geq) }.result()
    }
}

impl Drop for Flag {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by cuMemHostAlloc in `new`; see `enqueue_wait` for why no stream
        // still waits on it.
        let _ = unsafe { result::free_host(self.ptr.cast()) };
    }
}
