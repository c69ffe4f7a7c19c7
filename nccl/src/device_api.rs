//! The host functions of NCCL 2.30's device API (`nccl_device.h`: device communicators,
//! windows, teams). oxccl has no device API: the functions that return a result fail with
//! `ncclInvalidUsage`, naming themselves; the team functions answer from the communicator
//! (the world team exactly; the node's team and the rail only where every node holds the same
//! number of consecutive ranks, else the team of this rank alone).
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::{c_int, c_void};

use crate::comm::{handle, CommPtr};
use crate::status::{not_implemented, run};

/// An opaque pointer of the device API.
type Opaque = *mut c_void;

/// `ncclTeam_t`: `nRanks` ranks, this one at `rank`, `stride` apart in the world.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Team {
    /// Ranks in the team.
    pub n_ranks: c_int,
    /// This rank's place in it.
    pub rank: c_int,
    /// World-rank distance between neighbours of the team.
    pub stride: c_int,
}

not_implemented!(ncclCommQueryProperties pncclCommQueryProperties(comm: CommPtr, props: Opaque));
not_implemented!(ncclDevCommCreate pncclDevCommCreate(comm: CommPtr, reqs: Opaque, out: Opaque));
not_implemented!(ncclDevCommDestroy pncclDevCommDestroy(comm: CommPtr, dev_comm: Opaque));
not_implemented!(ncclGetLsaMultimemDevicePointer pncclGetLsaMultimemDevicePointer(window: Opaque, offset: usize, out: Opaque));
not_implemented!(ncclGetMultimemDevicePointer pncclGetMultimemDevicePointer(window: Opaque, offset: usize, multimem: Opaque, out: Opaque));
not_implemented!(ncclGetLsaDevicePointer pncclGetLsaDevicePointer(window: Opaque, offset: usize, lsa_rank: c_int, out: Opaque));
not_implemented!(ncclGetPeerDevicePointer pncclGetPeerDevicePointer(window: Opaque, offset: usize, peer: c_int, out: Opaque));
not_implemented!(ncclGinBarrierCreateRequirement pncclGinBarrierCreateRequirement(comm: CommPtr, team: Team, n: c_int, out: Opaque, req: Opaque));
not_implemented!(ncclGinOutboxCreateRequirement pncclGinOutboxCreateRequirement(n_blocks: c_int, size_log2: c_int, out: Opaque, req: Opaque));
not_implemented!(ncclGinInboxA2ACreateRequirement pncclGinInboxA2ACreateRequirement(peers: Team, n_blocks: c_int, size_log2: c_int, out: Opaque, req: Opaque));
not_implemented!(ncclLLA2ACreateRequirement pncclLLA2ACreateRequirement(n_blocks: c_int, n_slots: c_int, out: Opaque, req: Opaque));
not_implemented!(ncclLsaBarrierCreateRequirement pncclLsaBarrierCreateRequirement(team: Team, n: c_int, out: Opaque, req: Opaque));

nccl_fn!("`ncclLLA2ACalcSlots`: not implemented by oxccl: 0 slots, and the last error says so."
ncclLLA2ACalcSlots pncclLLA2ACalcSlots(max_elts: c_int, max_elt_size: c_int) -> c_int {
    let _ = (max_elts, max_elt_size);
    let _ = run("ncclLLA2ACalcSlots", || Err(not_implemented("ncclLLA2ACalcSlots")));
    0
});

/// The teams of `comm`: world, node (LSA) and rail; the team of this rank alone where the
/// communicator is missing or its nodes are not blocks of consecutive ranks of one size.
fn teams(comm: CommPtr) -> (Team, Team, Team) {
    let alone = Team {
        n_ranks: 1,
        rank: 0,
        stride: 1,
    };
    // SAFETY: NCCL's contract: a live communicator (or null, refused by `handle`).
    let Ok(c) = unsafe { handle(comm) }.and_then(|h| h.comm()) else {
        return (alone, alone, alone);
    };
    let (n, me) = (c.size() as c_int, c.rank() as c_int);
    let world = Team {
        n_ranks: n,
        rank: me,
        stride: 1,
    };
    let local = c.local_size() as c_int;
    let nodes = c.node_ids();
    let blocks = local > 0
        && n % local == 0
        && (0..nodes.len()).all(|r| nodes[r] == nodes[r - r % local as usize]);
    if !blocks {
        return (world, alone, alone);
    }
    let lsa = Team {
        n_ranks: local,
        rank: me % local,
        stride: 1,
    };
    let rail = Team {
        n_ranks: n / local,
        rank: me / local,
        stride: local,
    };
    (world, lsa, rail)
}

nccl_fn!("`ncclTeamWorld`: every rank of the communicator."
ncclTeamWorld pncclTeamWorld(comm: CommPtr) -> Team { teams(comm).0 });

nccl_fn!("`ncclTeamLsa`: the ranks of this node (see the module docs)."
ncclTeamLsa pncclTeamLsa(comm: CommPtr) -> Team { teams(comm).1 });

nccl_fn!("`ncclTeamRail`: the ranks with this rank's place on every node (see the module docs)."
ncclTeamRail pncclTeamRail(comm: CommPtr) -> Team { teams(comm).2 });

nccl_fn!("`ncclTeamRankToWorld`: the world rank of rank `rank` of `team` (this rank's team)."
ncclTeamRankToWorld pncclTeamRankToWorld(comm: CommPtr, team: Team, rank: c_int) -> c_int {
    teams(comm).0.rank + (rank - team.rank) * team.stride
});

nccl_fn!("`ncclTeamRankToLsa`: the node-team rank of rank `rank` of `team` (this rank's team)."
ncclTeamRankToLsa pncclTeamRankToLsa(comm: CommPtr, team: Team, rank: c_int) -> c_int {
    let (world, lsa, _) = teams(comm);
    let w = world.rank + (rank - team.rank) * team.stride;
    w - (world.rank - lsa.rank)
});
