//! The `oxccl` package's integration tests, in one test binary: one module per area (`launch`,
//! `perf`, `topo` and `trace` run the `oxccl` binary; `multiprocess` and `multinode` start ranks
//! as processes, the latter in network namespaces; `ddp_mlp`, `moe_example`, `survive_example`,
//! `replace_example` and `zero_mlp` check the examples' code as threads and as processes), and
//! `common`, the rank side of the scenarios and the helpers to start ranks.
//!
//! This binary is also the rank program of the tests that start ranks as processes: they run
//! `<this binary> rank_entry --exact --nocapture ...` ([`common::rank_cmd`]) with a variable
//! naming what the rank plays, and [`rank_entry`] plays it.

mod common;
mod ddp_mlp;
mod first_contact;
mod launch;
mod moe_example;
mod multinode;
mod multiprocess;
mod perf;
mod pipeline_mlp;
mod replace_example;
mod shm_footprint;
mod survive_example;
mod topo;
mod trace;
mod zero_mlp;

/// The rank program: does nothing in a normal test run; started as a rank, it plays what the
/// one variable set names: a scenario of `common` (`OXCCL_TEST_SCENARIO`, for `multiprocess`,
/// `multinode` and `trace`), a DDP rank (`OXCCL_TEST_DDP`), the MoE exchange
/// (`OXCCL_TEST_MOE`), the steps of example 04 (`OXCCL_TEST_SURVIVE`) or 05
/// (`OXCCL_TEST_REPLACE`), a ZeRO rank (`OXCCL_TEST_ZERO`), a pipeline stage
/// (`OXCCL_TEST_PIPELINE`), a trainer's first contact (`OXCCL_TEST_FIRST`) or a rank in a small
/// `/dev/shm` (`OXCCL_TEST_SHM`).
#[test]
fn rank_entry() {
    let programs: [(&str, fn()); 9] = [
        (common::SCENARIO, common::play_scenario),
        ("OXCCL_TEST_DDP", ddp_mlp::play_rank),
        ("OXCCL_TEST_MOE", moe_example::play_rank),
        ("OXCCL_TEST_SURVIVE", survive_example::play_rank),
        ("OXCCL_TEST_REPLACE", replace_example::play_rank),
        ("OXCCL_TEST_ZERO", zero_mlp::play_rank),
        ("OXCCL_TEST_PIPELINE", pipeline_mlp::play_rank),
        (first_contact::FIRST, first_contact::play_rank),
        (shm_footprint::SHM, shm_footprint::play_rank),
    ];
    let set: Vec<&(&str, fn())> = programs
        .iter()
        .filter(|(var, _)| std::env::var_os(var).is_some())
        .collect();
    match set.as_slice() {
        [] => {}
        [(var, play)] => {
            // As a trainer would: oxccl's lines at OXCCL_DEBUG's level (the tests of logging
            // itself, OXCCL_TEST_FIRST, set up their own).
            if *var != first_contact::FIRST {
                oxccl::logging::init();
            }
            play()
        }
        more => panic!(
            "more than one rank program asked for: {:?}",
            more.iter().map(|(var, _)| var).collect::<Vec<_>>()
        ),
    }
}
