//! Device execution (feature `cuda`): pinned staging buffers, flags, and the staging plans of
//! device operations.

pub(crate) mod plan;
pub(crate) mod staging;
