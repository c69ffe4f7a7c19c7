//! Integration tests for `oxccl-kernels`: every (dtype, op) against an independent scalar
//! reference, NaN propagation, unaligned byte slices, errors, parsing and a property test.

#[macro_use]
mod common;
mod bytes;
mod fp8;
mod parse;
mod prop;
mod reduce;
mod scale;
