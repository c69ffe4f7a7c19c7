//! The integration tests of oxccl-ddp, one module per area, in one test binary.

#[cfg(feature = "cuda")]
mod device;
mod elastic;
mod local_sgd;
mod powersgd;
mod reducer;
mod uneven;
