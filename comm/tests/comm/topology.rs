//! `Topology::setup` over threaded ranks on simulated nodes: every group has the members the
//! placement rule gives, runs collectives among exactly them, and reaches its members over shared
//! memory inside a node and TCP across nodes; MoE groups; bad lists fail on every rank before
//! anything is sent.

use std::time::Duration;

use oxccl_comm::harness::spawn_world_on_nodes;
use oxccl_comm::topology::{plan_groups, MODEL, MOE_DP, MOE_EP};
use oxccl_comm::{Communicator, Config, ReduceOp, Result, Topology};

fn cfg() -> Config {
    Config {
        timeout: Duration::from_secs(60),
        ..Config::default()
    }
}

/// Checks every accessor of group `name` on this rank against the plan, and that an all-reduce
/// in the group sums exactly its members' global ranks.
fn check_group(world: &Communicator, topo: &Topology, name: &str, per_node: usize) -> Result<()> {
    let me = world.rank();
    let members = topo.ranks_in_group(name)?.to_vec();
    assert!(topo.all_groups(name)?.contains(&members), "{name}");
    let pos = members
        .iter()
        .position(|&r| r == me)
        .expect("member of own group");
    assert_eq!(topo.group_rank(name)?, pos, "{name} rank {me}");
    assert_eq!(topo.group_size(name)?, members.len());
    assert_eq!(topo.is_first(name)?, pos == 0);
    assert_eq!(topo.is_last(name)?, pos + 1 == members.len());
    let k = members.len();
    assert_eq!(topo.next_rank(name)?, members[(pos + 1) % k]);
    assert_eq!(topo.prev_rank(name)?, members[(pos + k - 1) % k]);
    let g = topo.group(name)?;
    assert_eq!((g.rank(), g.size()), (pos, k));
    for (i, &r) in members.iter().enumerate() {
        let want = if r == me {
            "self"
        } else if r / per_node == me / per_node {
            "shm"
        } else {
            "tcp"
        };
        assert_eq!(
            g.stats().transports.get(i).copied(),
            Some(want),
            "{name}: rank {me} to {r}"
        );
    }
    let mut v = [me as u64, 1];
    g.all_reduce(&mut v, ReduceOp::Sum)?;
    assert_eq!(
        v,
        [members.iter().map(|&r| r as u64).sum(), k as u64],
        "{name}"
    );
    Ok(())
}

#[test]
fn three_dimensions_on_two_nodes() {
    let dims = [("pipe", 2), ("tensor", 2), ("data", 2)];
    let results = spawn_world_on_nodes(8, 4, cfg(), |world| {
        let topo = Topology::setup(&world, &dims)?;
        assert_eq!(topo.names(), ["pipe", "tensor", "data", MODEL]);
        for name in topo.names() {
            check_group(&world, &topo, name, 4)?;
        }
        // data innermost: consecutive ranks, inside a node; pipe outermost: across the nodes.
        let me = world.rank();
        assert_eq!(topo.ranks_in_group("data")?, [me & !1, me | 1]);
        assert_eq!(topo.ranks_in_group("pipe")?, [me % 4, me % 4 + 4]);
        assert_eq!(
            topo.group("pipe")?
                .stats()
                .transports
                .get(1 - topo.group_rank("pipe")?)
                .copied(),
            Some("tcp")
        );
        let e = topo.group("expert").unwrap_err().to_string();
        assert!(
            e.contains(&format!("rank {me}")) && e.contains("\"expert\""),
            "{e}"
        );
        Ok(())
    });
    for r in results {
        r.unwrap();
    }
}

#[test]
fn moe_groups_split_from_data_groups() {
    let results = spawn_world_on_nodes(8, 8, cfg(), |world| {
        let mut topo = Topology::setup(&world, &[("pipe", 2), ("data", 4)])?;
        topo.setup_moe(&world, 2)?;
        assert_eq!(topo.names(), ["pipe", "data", MODEL, MOE_EP, MOE_DP]);
        let me = world.rank();
        // data groups [0..4) and [4..8); ep 2: runs of 2, dp: stride 2.
        assert_eq!(topo.ranks_in_group(MOE_EP)?, [me & !1, me | 1]);
        let base = me & !3;
        let odd = me & 1;
        assert_eq!(topo.ranks_in_group(MOE_DP)?, [base + odd, base + odd + 2]);
        for name in [MOE_EP, MOE_DP] {
            check_group(&world, &topo, name, 8)?;
        }
        assert!(topo.setup_moe(&world, 2).is_err());
        Ok(())
    });
    for r in results {
        r.unwrap();
    }
}

#[test]
fn bad_lists_fail_on_every_rank_before_anything_is_sent() {
    let results = spawn_world_on_nodes(4, 4, cfg(), |world| {
        let me = world.rank();
        for dims in [
            &[("tensor", 2), ("data", 4)][..],
            &[("tensor", 2), ("pipe", 2)][..],
            &[("data", 4), ("data", 1)][..],
        ] {
            let e = Topology::setup(&world, dims).unwrap_err().to_string();
            assert!(
                e.contains(&format!("rank {me}")) && e.contains("topology"),
                "{e}"
            );
        }
        let mut topo = Topology::setup(&world, &[("data", 4)])?;
        assert!(topo.setup_moe(&world, 3).is_err());
        // Nothing was sent by the failed calls: the communicator still works.
        let mut v = [1u32];
        world.all_reduce(&mut v, ReduceOp::Sum)?;
        assert_eq!(v[0], 4);
        assert_eq!(topo.group_size("data")?, 4);
        Ok(())
    });
    for r in results {
        r.unwrap();
    }
}

#[test]
fn the_plan_is_the_same_as_setup_uses() {
    let p = plan_groups(0, 16, &[("pipe", 2), ("tensor", 2), ("data", 4)]).unwrap();
    assert_eq!(p.len(), 4);
    assert_eq!(p[3].name, MODEL);
}
