//! The operating-system calls oxccl makes through `libc`, each behind a safe function: CPU
//! affinity, clocks, `poll(2)`, futexes on shared memory, pidfds, `posix_fallocate`, `statvfs`
//! and `process_vm_readv`. Nothing else in the crate names `libc` (`crate::layers` checks it).
//! Memory maps go through `memmap2`, sockets through `socket2`.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Which readiness a wait in [`poll`] asks of a file descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollDir {
    /// Wake when readable.
    Read,
    /// Wake when writable.
    Write,
}

/// The CPUs the calling thread may run on (`sched_getaffinity`), in order; empty when unknown
/// (not Linux, or the call failed).
pub fn allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: cpu_set_t is plain data (an array of words); all-zero is a valid empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: pid 0 is this thread; the size matches the set passed.
        let rc =
            unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
        if rc != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            // SAFETY: `c` is below CPU_SETSIZE, the set's capacity.
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
            .collect()
    }
    #[cfg(not(target_os = "linux"))]
    {
        Vec::new()
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds; `coarse` reads `CLOCK_MONOTONIC_COARSE` instead, the same
/// clock as of the last tick (about 3 ns to read against 20). 0 if the clock cannot be read.
pub fn mono_ns(coarse: bool) -> u64 {
    let id = if coarse {
        libc::CLOCK_MONOTONIC_COARSE
    } else {
        libc::CLOCK_MONOTONIC
    };
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec that clock_gettime fills; nothing else is
    // touched.
    let rc = unsafe { libc::clock_gettime(id, &mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// The resolution of `CLOCK_MONOTONIC_COARSE` in nanoseconds (a tick: 1 to 10 ms); 10 ms if it
/// cannot be read.
pub fn coarse_resolution_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: as in `mono_ns`: a valid, writable timespec.
    let rc = unsafe { libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    if rc != 0 {
        return 10_000_000;
    }
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
        .max(1)
}

/// Sleeps in `poll(2)` until one of `fds` is ready as asked or `ms` milliseconds pass (200 us
/// when there is nothing to watch). Errors (`EINTR`) just end the sleep early.
pub fn poll(fds: &[(RawFd, PollDir)], ms: i32) {
    if fds.is_empty() {
        std::thread::sleep(Duration::from_micros(200));
        return;
    }
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|(fd, dir)| libc::pollfd {
            fd: *fd,
            events: match dir {
                PollDir::Read => libc::POLLIN,
                PollDir::Write => libc::POLLOUT,
            },
            revents: 0,
        })
        .collect();
    // SAFETY: `pfds` is a valid, initialised array of `pfds.len()` pollfd structs that outlives
    // the call; poll only writes their `revents` fields.
    unsafe {
        libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms);
    }
}

/// Whether `fd` is readable now (`poll(2)` with a zero timeout).
pub fn readable(fd: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & libc::POLLIN != 0
}

/// A pidfd of process `pid` (`pidfd_open`): readable once the process has exited. `None` when
/// the kernel refuses (no such process, or too old a kernel).
pub fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    // SAFETY: a non-negative return is a fresh fd that we now own.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Wakes every waiter on `word` (`FUTEX_WAKE`, not private: `word` may live in memory shared
/// between processes).
pub fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on the address of a live AtomicU32; no other memory is touched.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
        );
    }
}

/// Sleeps until `word` is woken or `timeout` passes, unless it no longer holds `seen`
/// (`FUTEX_WAIT`, not private). Interruptions and time-outs just end the wait.
pub fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on the address of a live AtomicU32 with a valid relative timeout; the
    // kernel returns at once if the value is no longer `seen`.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            seen,
            &ts as *const libc::timespec,
        );
    }
}

/// Reserves `bytes` bytes of the file `fd` (`posix_fallocate`), so that a full file system
/// fails here instead of with `SIGBUS` at a later write.
///
/// # Errors
/// The call's error (`ENOSPC` or `EFBIG` when there is no room: see [`no_room`]).
pub fn fallocate(fd: RawFd, bytes: usize) -> std::io::Result<()> {
    // SAFETY: posix_fallocate on a file descriptor the caller holds open; no memory is passed.
    let rc = unsafe { libc::posix_fallocate(fd, 0, bytes as libc::off_t) };
    match rc {
        0 => Ok(()),
        rc => Err(std::io::Error::from_raw_os_error(rc)),
    }
}

/// A new anonymous file in memory (`memfd_create`, close-on-exec) named `name` (a label for
/// `/proc/<pid>/fd`; no path).
///
/// # Errors
/// The call's error, or `InvalidInput` for a name with a NUL.
pub fn memfd(name: &str) -> std::io::Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    let name = std::ffi::CString::new(name)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "a NUL in the name"))?;
    // SAFETY: memfd_create reads the NUL-terminated name and returns a new descriptor (or -1).
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nothing else.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// Whether `e` says the file system has no room (`ENOSPC`, `EFBIG`).
pub fn no_room(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EFBIG))
}

/// Bytes free to unprivileged users in the file system of `dir` (`statvfs`); 0 if unknown.
pub fn free_bytes(dir: &str) -> u64 {
    let Ok(c) = std::ffi::CString::new(dir) else {
        return 0;
    };
    // SAFETY: statvfs writes into the zeroed struct we own; `c` is a valid C string.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut st) == 0 {
            st.f_bavail as u64 * st.f_frsize as u64
        } else {
            0
        }
    }
}

/// Copies `src` to address `addr` of process `pid` (`process_vm_writev`).
///
/// # Errors
/// The call's error (no permission, a bad address), or `UnexpectedEof` when the remote range
/// ends early.
pub fn write_remote(pid: u32, addr: usize, src: &[u8]) -> std::io::Result<()> {
    // The kernel only reads the local bytes of a write.
    remote_copy(pid, addr, src.as_ptr().cast_mut(), src.len(), true)
}

/// Copies `dst.len()` bytes at address `addr` of process `pid` into `dst`
/// (`process_vm_readv`).
///
/// # Errors
/// The call's error (no permission, a bad address), or `UnexpectedEof` when the remote range
/// ends early.
pub fn read_remote(pid: u32, addr: usize, dst: &mut [u8]) -> std::io::Result<()> {
    remote_copy(pid, addr, dst.as_mut_ptr(), dst.len(), false)
}

/// `len` bytes between `local` and address `addr` of process `pid`: read from there into
/// `local`, or (`write`) written there from `local`, until all are copied.
fn remote_copy(
    pid: u32,
    addr: usize,
    local: *mut u8,
    len: usize,
    write: bool,
) -> std::io::Result<()> {
    let mut done = 0;
    while done < len {
        let here = libc::iovec {
            iov_base: local.wrapping_add(done).cast(),
            iov_len: len - done,
        };
        let there = libc::iovec {
            iov_base: (addr + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        let pid = pid as libc::pid_t;
        // SAFETY: `here` describes `len - done` bytes of the caller's slice (writable for a
        // read, only read by the kernel for a write), alive for the call; the kernel checks
        // `there` against `pid`'s mappings.
        let n = unsafe {
            if write {
                libc::process_vm_writev(pid, &here, 1, &there, 1, 0)
            } else {
                libc::process_vm_readv(pid, &here, 1, &there, 1, 0)
            }
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the remote range ended early",
            ));
        }
        done += n as usize;
    }
    Ok(())
}
