//! The integration tests of oxccl-comm, one module per area, in one test binary (one link, one
//! process: every module's tests run side by side, so each keeps to its own names, ports and
//! files).

mod all_to_all_v;
mod async_p2p;
mod async_rooted;
mod batch_p2p;
mod channels;
mod collectives;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod cuda_p2p;
mod env_detect;
mod faults;
mod gather_v;
mod grow;
mod hierarchical_uneven;
mod loom_ring;
mod loom_trace_slot;
mod mapped;
mod premul;
mod random_cases;
mod rdma;
mod send_thread;
mod shrink;
mod stall_reports;
mod store;
mod topology;
mod trace;
mod world_ranks;
