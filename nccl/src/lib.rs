//! `libnccl.so.2` from oxccl: NCCL's C API (2.30) over oxccl's communicators, so programs
//! built against NCCL (nccl-tests, PyTorch's ProcessGroupNCCL) run on oxccl unchanged.
//!
//! The library exports every public function of NCCL 2.30's `nccl.h`, each also under its
//! `pnccl` name (NCCL's profiling twins), without symbol versions, and with the SONAME
//! `libnccl.so.2`. What oxccl does not implement fails with `ncclInvalidUsage` and a
//! `ncclGetLastError` text naming the function. No panic crosses the C boundary. The header
//! `include/nccl.h` declares the same API for C callers and tests.
//!
//! - [`abi`]: NCCL's types and values; [`status`]: results and error texts;
//! - [`id`]: `ncclUniqueId` (an oxccl TCP store and a job nonce);
//! - [`comm`]: communicators (init, split, destroy, abort); [`group`]: group semantics;
//! - [`coll`]: collectives and point-to-point (feature `cuda`); [`exports`]: the C functions;
//!   [`device_api`]: the host side of NCCL's device API (not implemented, but exported).
//!
//! docs/NCCL.md says how to build it, run nccl-tests and PyTorch on it, and how it differs
//! from NCCL.

#[macro_use]
mod macros;

pub mod abi;
pub mod coll;
pub mod comm;
pub mod device_api;
pub mod exports;
pub mod group;
pub mod id;
pub mod status;
