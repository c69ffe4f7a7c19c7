//! Integration tests for `oxccl-kernels`: every (dtype, op) against an independent scalar
//! reference, NaN propagation, unaligned byte slices, errors, parsing, a property test, and with
//! the `cuda` feature the kernels compiled to PTX (`cuda_ptx`) and run on a GPU (`cuda_gpu`).

#[macro_use]
mod common;
mod bytes;
#[cfg(feature = "cuda")]
mod cuda_gpu;
#[cfg(feature = "cuda")]
mod cuda_ptx;
mod fp8;
mod parse;
mod prop;
mod reduce;
mod scale;
