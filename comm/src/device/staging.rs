//! Pinned host memory for staged device operations: the staging buffers (pooled per
//! communicator) and the flag word a stream waits on.
//!
//! A staging buffer is page-locked (`cuMemHostAlloc`, portable), so the copies between it and the
//! GPU are true asynchronous DMA, and every host collective runs on it like on any host slice.
//! Each buffer carries a `done` event, recorded on the stream after the last copy that reads or
//! writes it; a buffer goes back to the pool once its operation's host collectives have finished,
//! and is handed out again only once that event has completed.
//!
//! At most [`MAX_BUFFERS`] buffers exist per communicator: a call that finds none free waits (on
//! the caller's thread, bounded) for one, which bounds pinned memory and gives back-pressure.
//! Pinned memory is freed only on the caller's thread and only while none of the communicator's
//! host collectives is outstanding (`cuMemFreeHost` may wait for the device, whose streams may be
//! waiting for exactly those collectives), never on the progress thread.
//!
//! The flag is one pinned, device-mapped 32-bit word per communicator (the first of a cache line).
//! The progress thread stores the number of each finished part into it; the stream waits in a
//! one-thread kernel (`oxccl_wait_flag`, greater-or-equal, wrap-around safe, with a deadline)
//! before copying that part's result back. No host thread blocks on the GPU and the GPU polls
//! nothing but that line. (`cuStreamWaitValue32` did the same wait, with no deadline.)

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream, DriverError};
use oxccl_kernels::cuda::FlagWait;
use oxccl_kernels::KernelError;

/// Longest wait for the GPU before pinned memory is freed; past it the memory is leaked rather
/// than freed under a copy that may still use it.
const FREE_WAIT: Duration = Duration::from_secs(10);

/// Staging buffers per communicator, in use or free.
pub(crate) const MAX_BUFFERS: usize = 3;

/// Staging allocations are rounded up to this, so sizes that differ a little reuse a buffer.
const ROUND: usize = 1 << 20;

/// How long a poll of the GPU, the pool or a peer's host flag yields the core (checking again at
/// once) before it starts to sleep.
const YIELD_FOR: Duration = Duration::from_millis(1);

/// The longest sleep between two polls, once [`YIELD_FOR`] has passed.
const SLEEP_MAX: Duration = Duration::from_micros(200);

/// The pause between polls of the GPU, the pool or a peer's host flag: yields for
/// [`YIELD_FOR`], then sleeps, from 20 us doubling up to [`SLEEP_MAX`]. What these polls wait for
/// is usually microseconds away (a small copy behind the previous part's wait, a peer's host
/// flag) and on the critical path, where a sleep of 64 us (the first one, after 6 us of polling,
/// before) costs more than the wait itself, and a sleep may last longer than asked.
pub(crate) struct Backoff {
    start: Instant,
    sleep: Duration,
}

impl Backoff {
    pub(crate) fn new() -> Backoff {
        Backoff {
            start: Instant::now(),
            sleep: Duration::from_micros(20),
        }
    }

    pub(crate) fn pause(&mut self) {
        if self.start.elapsed() < YIELD_FOR {
            std::thread::yield_now();
        } else {
            std::thread::sleep(self.sleep);
            self.sleep = (self.sleep * 2).min(SLEEP_MAX);
        }
    }
}

/// Polls `event` until it completes or `deadline` passes (`Ok(false)`).
pub(crate) fn wait_event(event: &CudaEvent, deadline: Instant) -> Result<bool, DriverError> {
    let mut backoff = Backoff::new();
    loop {
        if event.try_is_complete()? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        backoff.pause();
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
        // SAFETY: cuMemHostAlloc with a valid size and flags. The bytes start uninitialised; Rust
        // reads a range only after a device-to-host copy or a host collective wrote it (a failed
        // operation may copy stale bytes back to the device, but that is DMA, not a Rust read).
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

impl Pinned {
    /// Frees the buffer once the GPU is done with it (bounded wait); `false` when it had to be
    /// leaked instead (the GPU still had a copy pending, or the context is gone).
    fn release(mut self) -> bool {
        let freed = self.free_now();
        self.ptr = std::ptr::null_mut();
        freed
    }

    fn free_now(&self) -> bool {
        if self.ptr.is_null() {
            return true;
        }
        // Made current directly: cudarc's `bind_to_thread` would also consume (and hide) an
        // error the application's own cudarc calls recorded on this context.
        // SAFETY: the context handle is live (held by `self.ctx`).
        let bound = unsafe { result::ctx::set_current(self.ctx.cu_ctx()) }.is_ok();
        if !bound || !wait_event(&self.done, Instant::now() + FREE_WAIT).unwrap_or(false) {
            tracing::warn!(
                bytes = self.len,
                "pinned staging buffer still in use by the GPU; leaking it instead of freeing it"
            );
            return false;
        }
        // SAFETY: allocated by cuMemHostAlloc in `alloc`; the GPU has finished every copy that
        // used it (the `done` event completed) and no slice of it outlives `self`.
        let _ = unsafe { result::free_host(self.ptr.cast()) };
        true
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        self.free_now();
    }
}

/// The staging buffers of one communicator.
#[derive(Default)]
pub(crate) struct Pool {
    free: Mutex<Vec<Pinned>>,
    /// Buffers allocated and not yet freed (free or lent).
    live: std::sync::atomic::AtomicUsize,
}

impl Pool {
    /// The smallest free buffer of at least `len` bytes whose last copies have completed, else a
    /// new one while fewer than [`MAX_BUFFERS`] exist, else (when `quiet()` says no host
    /// collective is outstanding) a free one that is too small is freed and replaced; otherwise
    /// waits for one of those, until `deadline` (`Ok(None)`).
    pub(crate) fn take(
        &self,
        rank: usize,
        ctx: &Arc<CudaContext>,
        len: usize,
        quiet: impl Fn() -> bool,
        deadline: Instant,
    ) -> Result<Option<Pinned>, DriverError> {
        let mut backoff = Backoff::new();
        loop {
            let mut small = None;
            {
                let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
                let best = free
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| p.len() >= len && p.idle())
                    .min_by_key(|(_, p)| p.len())
                    .map(|(i, _)| i);
                if let Some(i) = best {
                    return Ok(Some(free.swap_remove(i)));
                }
                if self.live.load(Ordering::Relaxed) >= MAX_BUFFERS && quiet() {
                    if let Some(i) = free.iter().position(|p| p.len() < len && p.idle()) {
                        small = Some(free.swap_remove(i));
                    }
                }
            }
            if let Some(p) = small {
                // Nothing outstanding: freeing cannot wait on a stream that waits on us. (A
                // buffer that has to be leaked instead leaves the pool all the same.)
                tracing::trace!(
                    rank,
                    bytes = p.len(),
                    "cuda: freeing a staging buffer (cuMemFreeHost)"
                );
                p.release();
                self.live.fetch_sub(1, Ordering::Relaxed);
                tracing::trace!(rank, "cuda: staging buffer freed");
            }
            if self.live.load(Ordering::Relaxed) < MAX_BUFFERS {
                tracing::trace!(
                    rank,
                    bytes = len,
                    "cuda: allocating a staging buffer (cuMemHostAlloc)"
                );
                let p = Pinned::alloc(ctx, len)?;
                self.live.fetch_add(1, Ordering::Relaxed);
                tracing::trace!(rank, "cuda: staging buffer allocated");
                return Ok(Some(p));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            backoff.pause();
        }
    }

    /// Gives a buffer back (any thread; never frees).
    pub(crate) fn give(&self, p: Pinned) {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).push(p);
    }

    /// Frees every free buffer (each waits for its copies first); `false` if any had to be
    /// leaked because the GPU still used it.
    pub(crate) fn clear(&self) -> bool {
        let all = std::mem::take(&mut *self.free.lock().unwrap_or_else(|p| p.into_inner()));
        let mut clean = true;
        for p in all {
            clean &= p.release();
            self.live.fetch_sub(1, Ordering::Relaxed);
        }
        clean
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

// SAFETY: the word is only accessed through atomic operations (`set`, `get`) on the host and by
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
        // SAFETY: `ptr` is a fresh, suitably aligned allocation of 64 bytes (16 words).
        unsafe { std::ptr::write_bytes(ptr, 0, 16) };
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

    /// The value last published.
    pub(crate) fn get(&self) -> u32 {
        self.atomic().load(Ordering::Acquire)
    }

    /// Word `i` (< 16) of the flag's cache line, as the GPU last wrote it.
    pub(crate) fn word(&self, i: usize) -> u32 {
        assert!(i < 16, "the flag has 16 words");
        // SAFETY: the allocation is 64 bytes, so word `i` is live and aligned; the host only
        // reads these words (with atomics), the GPU writes them.
        unsafe { AtomicU32::from_ptr(self.ptr.add(i)) }.load(Ordering::Acquire)
    }

    /// The device address of word 0.
    pub(crate) fn device_ptr(&self) -> sys::CUdeviceptr {
        self.dev
    }

    /// Makes `stream` wait, in `waiter`'s kernel, until the flag is at least `value` (cyclic
    /// comparison), for at most `timeout` once the wait has started on the GPU; a wait that
    /// gives up shows in [`Flag::wait_gave_up`].
    pub(crate) fn enqueue_wait(
        &self,
        waiter: &FlagWait,
        stream: &Arc<CudaStream>,
        value: u32,
        timeout: Duration,
    ) -> Result<(), KernelError> {
        let timeout_ns = u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX);
        // SAFETY: `dev` is the device address of word 0 of this live, mapped cache line, and
        // `dev + 4` of words 1 and 2, which only the wait kernel writes; the stream belongs to
        // the flag's context (checked by the caller), and the line outlives every wait: the
        // communicator frees it only after its staging buffers' `done` events, recorded after
        // those waits, have completed, and leaks it when one could not be waited for.
        unsafe { waiter.enqueue(stream, self.dev, value, timeout_ns, self.dev + 4) }
    }

    /// The part number a stream's wait gave up on at its deadline (the host collective never
    /// finished), if one did.
    pub(crate) fn wait_gave_up(&self) -> Option<u32> {
        (self.word(1) != 0).then(|| self.word(2))
    }
}

impl Drop for Flag {
    fn drop(&mut self) {
        // SAFETY: the context handle is live (held by `self.ctx`).
        let _ = unsafe { result::ctx::set_current(self.ctx.cu_ctx()) };
        // SAFETY: allocated by cuMemHostAlloc in `new`; see `enqueue_wait` for why no stream
        // still waits on it.
        let _ = unsafe { result::free_host(self.ptr.cast()) };
    }
}
