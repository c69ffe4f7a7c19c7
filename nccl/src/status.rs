//! Results and error texts: every exported function runs its body through [`run`], which turns
//! an error into its `ncclResult_t` and the text `ncclGetLastError` returns, and a panic into
//! `ncclInternalError` (no panic crosses the C boundary).

use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use oxccl_comm::Error;

use crate::abi::{self, NcclResult};

/// A failed call: its result code and what to tell the caller.
#[derive(Debug)]
pub struct Failure {
    /// The `ncclResult_t`.
    pub code: NcclResult,
    /// The text for `ncclGetLastError`.
    pub msg: String,
}

/// A body's result.
pub type Outcome = Result<(), Failure>;

/// A failure with `code` and `msg`.
pub fn fail(code: NcclResult, msg: impl Into<String>) -> Failure {
    Failure {
        code,
        msg: msg.into(),
    }
}

/// `ncclInvalidArgument` saying `msg`.
pub fn bad_arg(msg: impl Into<String>) -> Failure {
    fail(abi::INVALID_ARGUMENT, msg)
}

/// `ncclInvalidUsage` saying `msg`.
pub fn bad_use(msg: impl Into<String>) -> Failure {
    fail(abi::INVALID_USAGE, msg)
}

/// `ncclInProgress`: not a failure (a non-blocking communicator is being created); [`run`]
/// returns the code and leaves the last error alone.
pub fn in_progress() -> Failure {
    fail(abi::IN_PROGRESS, "")
}

impl From<Error> for Failure {
    /// oxccl's error as NCCL's closest result, its text unchanged.
    fn from(e: Error) -> Failure {
        let code = match &e {
            Error::InvalidArgument { .. } => abi::INVALID_ARGUMENT,
            Error::Mismatch { .. } | Error::Config(_) => abi::INVALID_USAGE,
            Error::PeerLost { .. } | Error::Aborted { .. } => abi::REMOTE_ERROR,
            Error::Timeout { .. } => abi::TIMEOUT,
            Error::Cuda { .. } => abi::UNHANDLED_CUDA_ERROR,
            _ => abi::SYSTEM_ERROR,
        };
        fail(code, e.to_string())
    }
}

/// The last failure's text, kept until the next one (callers read it after the call returned).
static LAST: Mutex<Option<CString>> = Mutex::new(None);

fn set_last(msg: String) {
    let text = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    *LAST.lock().unwrap_or_else(|p| p.into_inner()) = Some(text);
}

/// The text of the last failure in this process ("" before any).
pub fn last_error() -> *const c_char {
    let guard = LAST.lock().unwrap_or_else(|p| p.into_inner());
    // The CString lives in the static until the next failure replaces it: the pointer stays
    // valid until then, as NCCL's does.
    guard.as_ref().map_or(c"".as_ptr(), |s| s.as_ptr())
}

/// Runs the body of the exported function `name`: its failure (or panic) becomes the result
/// code and the last error, prefixed with `oxccl <name>:`.
pub fn run(name: &str, body: impl FnOnce() -> Outcome) -> NcclResult {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => abi::SUCCESS,
        Ok(Err(f)) if f.code == abi::IN_PROGRESS => f.code,
        Ok(Err(f)) => {
            set_last(format!("oxccl {name}: {}", f.msg));
            f.code
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            set_last(format!("oxccl {name}: internal error: {what}"));
            abi::INTERNAL_ERROR
        }
    }
}

/// `ncclGetErrorString`: a static text for every result code.
pub fn error_string(code: NcclResult) -> &'static CStr {
    match code {
        abi::SUCCESS => c"no error",
        abi::UNHANDLED_CUDA_ERROR => c"a CUDA call failed (ncclGetLastError says which)",
        abi::SYSTEM_ERROR => c"a system call or the network failed (ncclGetLastError says how)",
        abi::INTERNAL_ERROR => c"internal error in oxccl (ncclGetLastError has the details)",
        abi::INVALID_ARGUMENT => c"an argument is invalid (ncclGetLastError names it)",
        abi::INVALID_USAGE => c"the call is not allowed here (ncclGetLastError says why)",
        abi::REMOTE_ERROR => c"another rank failed or left (ncclGetLastError names it)",
        abi::IN_PROGRESS => c"the operation is still in progress",
        abi::TIMEOUT => c"the operation timed out (OXCCL_TIMEOUT)",
        _ => c"unknown result code",
    }
}

/// The name every function not implemented by oxccl reports, as its failure.
pub fn not_implemented(name: &str) -> Failure {
    bad_use(format!(
        "{name} is not implemented by oxccl's libnccl.so.2 (docs/NCCL.md lists what is)"
    ))
}
