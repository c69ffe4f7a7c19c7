//! The communicator behind an `ncclComm_t`: a [`Handle`] shared through an `Arc` (the pointer
//! the caller holds is `Arc::into_raw`), so a watchdog thread can abort it while another thread
//! is inside a call. Creating one (`ncclCommInitRank`, `ncclCommSplit`, `ncclCommShrink`) is
//! collective and, inside `ncclGroupStart/End`, deferred to the group's end (`crate::group`);
//! outside a group with a non-blocking config (`blocking = 0`) it runs on a thread of its own and
//! the call returns `ncclInProgress` (`ncclCommGetAsyncError` says when it is done).

use std::ffi::c_int;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use oxccl_comm::bootstrap::{MemStore, Store, TcpStore};
use oxccl_comm::{Communicator, Config, ReduceOp};

use crate::abi::{self, NCCL_OPS_LIMIT, NUM_OPS};
use crate::group;
use crate::id::Root;
use crate::status::{bad_arg, bad_use, fail, in_progress, Failure, Outcome};

/// What an `ncclComm_t` points to.
pub struct Handle {
    /// The communicator, once created (at the call, or at the end of its group).
    comm: OnceLock<Communicator>,
    /// Why creating it failed, if it did.
    failed: Mutex<Option<(c_int, String)>>,
    /// Notified (under `failed`) when creating it ended.
    created: Condvar,
    /// Set when it is created on a thread of its own: how long a call on it waits for that.
    background: OnceLock<Duration>,
    /// Created blocking (`ncclConfig_t.blocking` not 0; a split or shrink of it inherits that
    /// unless its own config says).
    pub blocking: bool,
    /// The CUDA device it was created for (`ncclCommCuDevice`).
    pub device: c_int,
    /// Operations made by `ncclRedOpCreatePreMulSum`: op `NUM_OPS + i` is `ops[i]` (`None`
    /// once destroyed).
    ops: Mutex<Vec<Option<ReduceOp>>>,
}

/// The raw `ncclComm_t`.
pub type CommPtr = *const Handle;

impl Handle {
    fn new(device: c_int, blocking: bool) -> Arc<Handle> {
        Arc::new(Handle {
            comm: OnceLock::new(),
            failed: Mutex::new(None),
            created: Condvar::new(),
            background: OnceLock::new(),
            blocking,
            device,
            ops: Mutex::new(Vec::new()),
        })
    }

    /// The communicator, or why there is none; one still being created on a thread of its own
    /// is waited for (bounded: its creation has deadlines of its own).
    pub fn comm(&self) -> Result<&Communicator, Failure> {
        if let Some(c) = self.comm.get() {
            return Ok(c);
        }
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&budget) = self.background.get() {
            let deadline = Instant::now() + budget;
            while self.comm.get().is_none() && failed.is_none() {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(fail(
                        abi::TIMEOUT,
                        format!(
                            "this non-blocking communicator was still being created after {} s",
                            budget.as_secs()
                        ),
                    ));
                }
                failed = self
                    .created
                    .wait_timeout(failed, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            if let Some(c) = self.comm.get() {
                return Ok(c);
            }
        }
        Err(match failed.as_ref() {
            Some((code, msg)) => fail(*code, format!("creating this communicator failed: {msg}")),
            None => bad_use(
                "this communicator is not created yet: it was initialised inside \
                 ncclGroupStart/ncclGroupEnd and the group has not ended",
            ),
        })
    }

    /// The communicator if it is created (no wait).
    pub fn created(&self) -> Option<&Communicator> {
        self.comm.get()
    }

    /// Records the end of creating it, and wakes the calls waiting for it in `comm` (they
    /// check under the same lock: each sees the end or is notified).
    fn finish(&self, made: Result<Communicator, Failure>) -> Outcome {
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        let out = match made {
            Ok(c) => {
                let _ = self.comm.set(c);
                Ok(())
            }
            Err(f) => {
                *failed = Some((f.code, f.msg.clone()));
                Err(f)
            }
        };
        self.created.notify_all();
        out
    }

    /// `ncclCommGetAsyncError`: a creation that failed, else an error a device operation met
    /// after its call returned (feature `cuda`), else success.
    pub fn async_error(&self) -> c_int {
        if let Some((code, _)) = *self.failed.lock().unwrap_or_else(|p| p.into_inner()) {
            return code;
        }
        #[cfg(feature = "cuda")]
        if let Some(e) = self.comm.get().and_then(|c| c.device_async_error()) {
            return Failure::from(e).code;
        }
        if self.comm.get().is_none() {
            return abi::IN_PROGRESS;
        }
        abi::SUCCESS
    }

    /// A reduction operation: a built-in one, or one this communicator made.
    pub fn op(&self, op: c_int) -> Result<ReduceOp, Failure> {
        if let Some(o) = abi::builtin_op(op) {
            return Ok(o);
        }
        let ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        usize::try_from(op - NUM_OPS)
            .ok()
            .and_then(|i| ops.get(i).copied().flatten())
            .ok_or_else(|| bad_arg(format!("ncclRedOp_t {op} is not a valid operation here")))
    }

    /// `ncclRedOpCreatePreMulSum` with a host scalar `factor`: the new operation's number.
    pub fn add_premul(&self, factor: f64) -> Result<c_int, Failure> {
        let mut ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        if ops.len() >= NCCL_OPS_LIMIT {
            return Err(bad_use(format!(
                "{NCCL_OPS_LIMIT} operations exist on this communicator: destroy some first"
            )));
        }
        ops.push(Some(ReduceOp::premul_sum(factor)));
        Ok(NUM_OPS + ops.len() as c_int - 1)
    }

    /// `ncclRedOpDestroy`.
    pub fn remove_op(&self, op: c_int) -> Outcome {
        let mut ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        match usize::try_from(op - NUM_OPS)
            .ok()
            .and_then(|i| ops.get_mut(i))
        {
            Some(slot @ Some(_)) => {
                *slot = None;
                Ok(())
            }
            _ => Err(bad_arg(format!(
                "ncclRedOp_t {op} was not made by ncclRedOpCreatePreMulSum on this communicator"
            ))),
        }
    }
}

/// Borrows the handle behind `comm`.
///
/// # Safety
/// `comm` is null or a pointer this library returned and the caller has not destroyed.
pub unsafe fn handle<'a>(comm: CommPtr) -> Result<&'a Handle, Failure> {
    // SAFETY: per the contract, a non-null `comm` came from `Arc::into_raw` and is alive.
    unsafe { comm.as_ref() }.ok_or_else(|| bad_arg("the communicator is NULL"))
}

/// Hands a new handle to the caller (`*out`).
///
/// # Safety
/// `out` is valid for a write.
unsafe fn give(out: *mut CommPtr, h: &Arc<Handle>) {
    // SAFETY: per the contract; the caller owns one count of the Arc from now on.
    unsafe { out.write(Arc::into_raw(h.clone())) };
}

/// Ends the caller's handle (`ncclCommDestroy`, `ncclCommAbort`): the communicator closes once
/// no call is using it any more.
///
/// # Safety
/// `comm` is a pointer this library returned, not destroyed before.
pub unsafe fn release(comm: CommPtr) {
    if !comm.is_null() {
        // SAFETY: per the contract, this gives back the count `give` handed out.
        drop(unsafe { Arc::from_raw(comm) });
    }
}

/// The CUDA device current on this thread (0 without the `cuda` feature or a context).
fn current_device() -> c_int {
    #[cfg(feature = "cuda")]
    if crate::coll::driver_present() {
        use cudarc::driver::sys;
        let mut d: sys::CUdevice = 0;
        // SAFETY: writes the current context's device into `d`; fails (no context) harmlessly.
        if unsafe { sys::cuCtxGetDevice(&mut d) } == sys::CUresult::CUDA_SUCCESS {
            return d;
        }
    }
    0
}

/// Runs `job`, which creates `h`: now, at the group's end inside a group, or (non-blocking,
/// outside a group) on a thread of its own, returning `ncclInProgress`.
fn create(h: &Arc<Handle>, job: group::Job) -> Outcome {
    if h.blocking || group::active() {
        return group::connect(job);
    }
    // A call on it waits for the creation at most this long (the rendezvous and the
    // connections have `OXCCL_TIMEOUT` each), then reports a time-out.
    let timeout = Config::from_env()?.timeout;
    let _ = h
        .background
        .set(timeout.saturating_mul(3) + Duration::from_secs(30));
    let spawned = thread::Builder::new()
        .name("oxccl-nccl-create".into())
        .spawn(move || {
            let _ = job();
        });
    if let Err(e) = spawned {
        let f = fail(
            abi::SYSTEM_ERROR,
            format!("could not start a thread to create it: {e}"),
        );
        return h.finish(Err(f));
    }
    Err(in_progress())
}

/// `ncclCommInitRank` / `ncclCommInitRankConfig`: rank `rank` of `nranks`, meeting at `root`.
///
/// # Safety
/// `out` is valid for a write.
pub unsafe fn init_rank(
    out: *mut CommPtr,
    nranks: c_int,
    root: Root,
    rank: c_int,
    blocking: bool,
) -> Outcome {
    if out.is_null() {
        return Err(bad_arg("comm (the ncclComm_t* to fill) is NULL"));
    }
    if nranks < 1 || rank < 0 || rank >= nranks {
        return Err(bad_arg(format!(
            "rank {rank} of nranks {nranks}: need 0 <= rank < nranks"
        )));
    }
    let device = current_device();
    let h = Handle::new(device, blocking);
    // SAFETY: checked non-null; writable per the contract.
    unsafe { give(out, &h) };
    let (rank, size) = (rank as usize, nranks as usize);
    let made_for = Arc::clone(&h);
    let job = move || {
        let made = (|| {
            let cfg = Config::from_env()?;
            let host = root.addr.ip().to_string();
            let store = TcpStore::connect_with_token(
                &host,
                root.addr.port(),
                cfg.timeout,
                Some(&root.nonce),
            )?;
            let store: Arc<dyn Store> = Arc::new(store);
            let c = Communicator::init_with_config(rank, size, store, cfg)?;
            crate::coll::connect_device(&c, device);
            Ok(c)
        })();
        made_for.finish(made)
    };
    create(&h, Box::new(job))
}

/// `ncclCommInitAll`: `ndev` ranks of one communicator in this process, rank `i` on device
/// `devlist[i]` (or `i`).
///
/// # Safety
/// `out` is valid for `ndev` writes; `devlist` is null or valid for `ndev` reads.
pub unsafe fn init_all(out: *mut CommPtr, ndev: c_int, devlist: *const c_int) -> Outcome {
    if out.is_null() || ndev < 1 {
        return Err(bad_arg(format!("comms is NULL or ndev = {ndev} < 1")));
    }
    let n = ndev as usize;
    let devices: Vec<c_int> = (0..n)
        .map(|i| {
            if devlist.is_null() {
                i as c_int
            } else {
                // SAFETY: `devlist` is valid for `ndev` reads when not null, per the contract.
                unsafe { *devlist.add(i) }
            }
        })
        .collect();
    let cfg = Config::from_env()?;
    let store: Arc<dyn Store> = Arc::new(MemStore::new());
    let made: Vec<Result<Communicator, Failure>> = thread::scope(|s| {
        let ranks: Vec<_> = (0..n)
            .map(|r| {
                let (store, cfg, dev) = (store.clone(), cfg.clone(), devices[r]);
                s.spawn(move || {
                    let c = Communicator::init_with_config(r, n, store, cfg)?;
                    crate::coll::connect_device(&c, dev);
                    Ok(c)
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|t| {
                t.join()
                    .unwrap_or_else(|_| Err(bad_use("a rank's init panicked")))
            })
            .collect()
    });
    if let Some(e) = made.iter().find_map(|m| m.as_ref().err()) {
        return Err(fail(e.code, e.msg.clone()));
    }
    for (i, (c, dev)) in made.into_iter().zip(devices).enumerate() {
        let h = Handle::new(dev, true);
        h.finish(c)?;
        // SAFETY: `out` is valid for `ndev` writes, per the contract.
        unsafe { give(out.add(i), &h) };
    }
    Ok(())
}

/// `ncclCommSplit`: a new communicator of the ranks passing `color` (none for
/// `NCCL_SPLIT_NOCOLOR`: `*out` becomes NULL), ordered by `key`; non-blocking as `blocking`
/// says, else as the parent is.
///
/// # Safety
/// `parent` as for [`handle`]; `out` is valid for a write.
pub unsafe fn split(
    parent: CommPtr,
    color: c_int,
    key: c_int,
    out: *mut CommPtr,
    blocking: Option<bool>,
) -> Outcome {
    // SAFETY: per the contract.
    let parent = unsafe { handle(parent) }?;
    if out.is_null() {
        return Err(bad_arg("newcomm (the ncclComm_t* to fill) is NULL"));
    }
    if color < abi::SPLIT_NOCOLOR {
        return Err(bad_arg(format!(
            "color {color}: must be >= 0 or NCCL_SPLIT_NOCOLOR (-1)"
        )));
    }
    let member = color != abi::SPLIT_NOCOLOR;
    let h = Handle::new(parent.device, blocking.unwrap_or(parent.blocking));
    if member {
        // SAFETY: checked non-null; writable per the contract.
        unsafe { give(out, &h) };
    } else {
        // SAFETY: as above.
        unsafe { out.write(std::ptr::null()) };
    }
    // The parent must outlive the deferred split: hold a count of it until then.
    // SAFETY: `parent` is a live handle from `Arc::into_raw`: a new count of the same Arc.
    let parent: Arc<Handle> = unsafe {
        let p = parent as *const Handle;
        Arc::increment_strong_count(p);
        Arc::from_raw(p)
    };
    let made_for = Arc::clone(&h);
    let job = move || {
        let made = parent
            .comm()
            .and_then(|c| Ok(c.split(member.then_some(color as u32), i64::from(key))?));
        if let Ok(Some(c)) = &made {
            crate::coll::connect_device(c, parent.device);
        }
        match made {
            Ok(Some(c)) => made_for.finish(Ok(c)),
            Ok(None) => Ok(()),
            Err(f) => made_for.finish(Err(f)),
        }
    };
    create(&h, Box::new(job))
}

/// `ncclCommShrink`: a new communicator of the parent's ranks but `exclude` (which do not call
/// it: lost, or left out), through oxccl's `shrink`. With `NCCL_SHRINK_ABORT` (flag 1) the
/// parent is aborted first, ending any call still in progress on it.
///
/// Non-blocking as `blocking` says, else as the parent is.
///
/// # Safety
/// `parent` as for [`handle`]; `out` is valid for a write; `exclude` is null (with `count` 0)
/// or valid for `count` reads.
pub unsafe fn shrink(
    parent: CommPtr,
    exclude: *const c_int,
    count: c_int,
    out: *mut CommPtr,
    (flags, blocking): (c_int, Option<bool>),
) -> Outcome {
    // SAFETY: per the contract.
    let p = unsafe { handle(parent) }?;
    if out.is_null() || count < 0 || (exclude.is_null() && count > 0) {
        return Err(bad_arg(
            "newcomm is NULL, or the exclusion list is NULL with a count, or negative",
        ));
    }
    let list: Vec<usize> = (0..count as usize)
        // SAFETY: `exclude` is valid for `count` reads, per the contract.
        .map(|i| unsafe { *exclude.add(i) })
        .map(|r| usize::try_from(r).map_err(|_| bad_arg(format!("excluded rank {r} is negative"))))
        .collect::<Result<_, _>>()?;
    if flags & !1 != 0 {
        return Err(bad_arg(format!(
            "shrinkFlags {flags:#x}: only NCCL_SHRINK_ABORT (1) is known"
        )));
    }
    let h = Handle::new(p.device, blocking.unwrap_or(p.blocking));
    // SAFETY: checked non-null; writable per the contract.
    unsafe { give(out, &h) };
    // SAFETY: as in `split`: a count of our own on the live parent for the deferred job.
    let parent: Arc<Handle> = unsafe {
        Arc::increment_strong_count(parent);
        Arc::from_raw(parent)
    };
    let made_for = Arc::clone(&h);
    let job = move || {
        let made = parent.comm().and_then(|c| {
            if flags & 1 != 0 {
                c.abort();
            }
            Ok(c.shrink(&list)?)
        });
        if let Ok(c) = &made {
            crate::coll::connect_device(c, parent.device);
        }
        made_for.finish(made)
    };
    create(&h, Box::new(job))
}
