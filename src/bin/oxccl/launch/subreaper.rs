//! The launcher as a child subreaper (Linux): orphaned grandchildren of the ranks are
//! re-parented to it and reaped.

use std::io;
use std::sync::Mutex;

/// Makes the launcher a child subreaper (Linux) while at least one job runs in this process,
/// restoring the previous setting afterwards.
pub(super) struct Subreaper(());

/// (active jobs, setting before the first one)
static SUBREAPER: Mutex<(usize, bool)> = Mutex::new((0, false));

impl Subreaper {
    pub(super) fn acquire() -> Self {
        let mut s = SUBREAPER.lock().unwrap_or_else(|p| p.into_inner());
        if s.0 == 0 {
            s.1 = get_subreaper();
            set_subreaper(true);
        }
        s.0 += 1;
        Subreaper(())
    }
}

impl Drop for Subreaper {
    fn drop(&mut self) {
        let mut s = SUBREAPER.lock().unwrap_or_else(|p| p.into_inner());
        s.0 -= 1;
        if s.0 == 0 {
            set_subreaper(s.1);
        }
    }
}

#[cfg(target_os = "linux")]
fn get_subreaper() -> bool {
    let mut v: libc::c_int = 0;
    // SAFETY: PR_GET_CHILD_SUBREAPER writes one int through the given valid pointer.
    let r = unsafe {
        libc::prctl(
            libc::PR_GET_CHILD_SUBREAPER,
            &mut v as *mut libc::c_int,
            0,
            0,
            0,
        )
    };
    r == 0 && v != 0
}

#[cfg(target_os = "linux")]
fn set_subreaper(on: bool) {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) with integer arguments only.
    let r = unsafe {
        libc::prctl(
            libc::PR_SET_CHILD_SUBREAPER,
            libc::c_ulong::from(on),
            0,
            0,
            0,
        )
    };
    if r != 0 {
        tracing::debug!(
            "oxccl launch: PR_SET_CHILD_SUBREAPER: {}",
            io::Error::last_os_error()
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn get_subreaper() -> bool {
    false
}

#[cfg(not(target_os = "linux"))]
fn set_subreaper(_on: bool) {}
