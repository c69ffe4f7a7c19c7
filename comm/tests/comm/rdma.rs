//! The RDMA transport's protocol under every collective: ranks as threads on simulated nodes,
//! connected across nodes by in-process queue pairs with RC semantics
//! (`OXCCL_IB_PROVIDER=sim`, `OXCCL_TRANSPORT=rdma`), shared memory inside a node. No verbs
//! device is needed. With the feature `rdma`: what a host without a verbs port does (a clear
//! error when RDMA is insisted on, TCP under `auto`), and every collective over the verbs
//! provider where a device exists (skipped with a message otherwise).

use oxccl_comm::config::{IbProvider, TransportChoice};
use oxccl_comm::harness::spawn_world_on_nodes;
use oxccl_comm::{Communicator, Config, ReduceOp, Registered, Result};

use crate::collectives::{all_collectives, config, every_dtype, BIG, COUNTS};

fn rdma(algo: &str) -> Config {
    Config {
        ib_provider: IbProvider::Sim,
        ..config(algo, TransportChoice::Rdma)
    }
}

/// `body` on `nodes` x `per_node` ranks over the in-process provider (see [`world_with`]).
fn world(nodes: usize, per_node: usize, algo: &str, body: fn(&Communicator) -> Result<()>) {
    world_with(rdma(algo), nodes, per_node, body);
}

/// Every collective in f32 and u8, every op, small counts and one large one (every dtype is
/// [`every_dtype`]'s, on fewer ranks).
fn f32_and_u8(c: &Communicator) -> Result<()> {
    all_collectives::<f32>(c, &COUNTS[..5], &ReduceOp::ALL, false)?;
    all_collectives::<f32>(c, &[BIG], &[ReduceOp::Sum], false)?;
    all_collectives::<u8>(c, &COUNTS[..5], &ReduceOp::ALL, false)
}

/// `body` on `nodes` x `per_node` ranks with `cfg`, after checking that every pair on two nodes
/// goes over RDMA.
fn world_with(cfg: Config, nodes: usize, per_node: usize, body: fn(&Communicator) -> Result<()>) {
    let n = nodes * per_node;
    for r in spawn_world_on_nodes(n, per_node, cfg, |c| {
        for p in 0..n {
            let want = match (p == c.rank(), p / per_node == c.rank() / per_node) {
                (true, _) => "self",
                (false, true) => "shm",
                (false, false) => "rdma",
            };
            assert_eq!(
                c.stats().transports.get(p).copied(),
                Some(want),
                "rank {} to {p}",
                c.rank()
            );
        }
        body(&c)
    }) {
        r.unwrap();
    }
}

#[test]
fn every_collective_over_rdma_on_2_and_3_nodes() {
    world(2, 1, "all-reduce=ring,broadcast=chain,reduce=chain", |c| {
        every_dtype(c, false)
    });
    world(3, 1, "tree", f32_and_u8);
}

#[test]
fn every_collective_over_rdma_on_8_ranks_of_4_nodes() {
    world(
        4,
        2,
        "all-reduce=ring,broadcast=chain,reduce=chain",
        f32_and_u8,
    );
}

#[test]
fn registered_buffers_go_out_over_rdma_straight_from_their_memory() {
    let n = 3;
    let count = (1 << 20) + 5;
    let cfg = rdma("all-reduce=ring,broadcast=chain,reduce=chain");
    for r in spawn_world_on_nodes(n, 1, cfg, |c| {
        let me = c.rank();
        assert_eq!(c.stats().registered_bytes, 0);
        // In-place ring all-reduce from a registered buffer.
        let mut reg = Registered::new((0..count).map(|i| (i % 97 + me) as f32).collect())?;
        c.all_reduce(&mut reg, ReduceOp::Sum)?;
        for (i, &x) in reg.iter().enumerate() {
            assert_eq!(x, (3 * (i % 97) + 3) as f32, "rank {me} element {i}");
        }
        let after_all_reduce = c.stats().registered_bytes;
        assert!(
            after_all_reduce > 0,
            "rank {me}: nothing went out from the registered buffer"
        );
        // Chain broadcast from a registered buffer on the root (and registered on the others).
        let mut b = Registered::new(if me == 1 {
            (0..count as u32).collect()
        } else {
            vec![0u32; count]
        })?;
        c.broadcast(&mut b, 1)?;
        assert!(
            b.iter().enumerate().all(|(i, &x)| x == i as u32),
            "rank {me}"
        );
        // Out-of-place all-gather from a registered input; an async all-reduce that owns one.
        let input = Registered::new(vec![me as i32; count])?;
        let mut out = vec![0i32; count * n];
        c.all_gather_into(&input, &mut out)?;
        for (r, part) in out.chunks(count).enumerate() {
            assert!(part.iter().all(|&x| x == r as i32), "rank {me}: part {r}");
        }
        let back = c
            .all_reduce_async(Registered::new(vec![1.0f64; count])?, ReduceOp::Sum)
            .wait()?;
        assert!(back.iter().all(|&x| x == 3.0), "rank {me}");
        let total = c.stats().registered_bytes;
        assert!(total > after_all_reduce, "rank {me}: {total}");
        Ok(total)
    }) {
        r.unwrap();
    }
}

#[test]
fn registered_outputs_take_their_messages_straight_from_the_wire() {
    let n = 3;
    let count = (1 << 18) + 3;
    let cfg = rdma("broadcast=chain,all-gather=ring");
    for r in spawn_world_on_nodes(n, 1, cfg, |c| {
        let me = c.rank();
        let landed = || c.stats().registered_recv_bytes;
        assert_eq!(landed(), 0);
        // Chain broadcast from plain memory on the root into registered buffers: rank 1 takes
        // it from the root straight into its buffer (the root writes it there from its slots),
        // and rank 2 from rank 1, which forwards each piece into it as it lands.
        let mut b = if me == 0 {
            Buf::Plain((0..count as u32).collect())
        } else {
            Buf::Reg(Registered::new(vec![0u32; count])?)
        };
        c.broadcast(b.as_mut(), 0)?;
        assert!(
            b.as_mut().iter().enumerate().all(|(i, &x)| x == i as u32),
            "rank {me}"
        );
        let after_broadcast = landed();
        if me != 0 {
            assert!(
                after_broadcast > 0,
                "rank {me}: nothing landed in its buffer"
            );
        }
        // Ring all-gather from plain input into a registered output: every rank takes its
        // left neighbour's parts straight into the output (written from the neighbour's own
        // registered output).
        let input = vec![me as f32 + 0.5; count];
        let mut out = Registered::new(vec![0f32; count * n])?;
        c.all_gather_into(&input, &mut out)?;
        for (r, part) in out.chunks(count).enumerate() {
            assert!(
                part.iter().all(|&x| x == r as f32 + 0.5),
                "rank {me}: part {r}"
            );
        }
        let after_all_gather = landed();
        assert!(
            after_all_gather > after_broadcast,
            "rank {me}: {after_all_gather}"
        );
        // Send/recv: plain memory on rank 0 into a registered buffer on rank 2.
        match me {
            0 => c.send(&vec![7u64; count], 2)?,
            2 => {
                let mut got = Registered::new(vec![0u64; count])?;
                c.recv(&mut got, 0)?;
                assert!(got.iter().all(|&x| x == 7));
                assert!(landed() > after_all_gather, "rank 2: nothing landed");
            }
            _ => {}
        }
        Ok(())
    }) {
        r.unwrap();
    }
}

/// A rank's buffer: registered, or plain (the broadcast root's).
enum Buf {
    Reg(Registered<u32>),
    Plain(Vec<u32>),
}

impl Buf {
    fn as_mut(&mut self) -> &mut [u32] {
        match self {
            Buf::Reg(r) => r,
            Buf::Plain(v) => v,
        }
    }
}

#[test]
#[cfg(not(feature = "rdma"))]
fn rdma_that_cannot_connect_is_a_clear_error() {
    // The verbs provider is not built: OXCCL_TRANSPORT=rdma across nodes names why.
    let cfg = Config {
        transport: TransportChoice::Rdma,
        ..Config::default()
    };
    let out = spawn_world_on_nodes(2, 1, cfg, |_| Ok(()));
    let e = out[0].as_ref().unwrap_err().to_string();
    assert!(
        e.contains("OXCCL_TRANSPORT=rdma") && e.contains("rdma: needs feature `rdma`"),
        "{e}"
    );
}

#[test]
fn a_rank_that_leaves_is_a_lost_peer_over_rdma() {
    let out = spawn_world_on_nodes(3, 1, rdma("all-reduce=ring"), |c| {
        if c.rank() == 2 {
            return Ok(String::new()); // leaves: its connections say goodbye
        }
        let mut v = vec![1.0f32; 4096];
        Ok(c.all_reduce(&mut v, ReduceOp::Sum)
            .map_or_else(|e| e.to_string(), |_| "finished".into()))
    });
    for (r, e) in out.iter().take(2).enumerate() {
        let e = e.as_ref().unwrap();
        assert!(e.contains("peer rank 2 lost"), "rank {r}: {e}");
    }
}

/// With the verbs provider built: this host's port, or why it has none.
#[cfg(feature = "rdma")]
fn verbs_port() -> std::result::Result<String, String> {
    oxccl_comm::internal::rdma::verbs_port(&Config::default())
}

#[test]
#[cfg(feature = "rdma")]
fn without_a_verbs_port_rdma_is_a_clear_error_and_auto_takes_tcp() {
    if let Ok(port) = verbs_port() {
        eprintln!("skipped: this host has a verbs port ({port}); the test needs one without");
        return;
    }
    let cfg = Config {
        transport: TransportChoice::Rdma,
        ..Config::default()
    };
    let out = spawn_world_on_nodes(2, 1, cfg, |_| Ok(()));
    let e = out[0].as_ref().unwrap_err().to_string();
    eprintln!("{e}");
    assert!(
        e.contains("OXCCL_TRANSPORT=rdma") && e.contains("has no verbs port"),
        "{e}"
    );
    for r in spawn_world_on_nodes(2, 1, Config::default(), |c| {
        assert_eq!(c.stats().transports.get(1 - c.rank()).copied(), Some("tcp"));
        let mut v = vec![1.0f32; 1000];
        c.all_reduce(&mut v, ReduceOp::Sum)?;
        assert!(v.iter().all(|&x| x == 2.0));
        Ok(())
    }) {
        r.unwrap();
    }
}

#[test]
#[cfg(feature = "rdma")]
fn every_collective_over_a_verbs_device() {
    let port = match verbs_port() {
        Ok(port) => port,
        Err(why) => {
            eprintln!("skipped: needs a verbs device with an active port ({why})");
            return;
        }
    };
    eprintln!("verbs port: {port}");
    let verbs = |algo| Config {
        ib_provider: IbProvider::Verbs,
        ..config(algo, TransportChoice::Rdma)
    };
    world_with(
        verbs("all-reduce=ring,broadcast=chain,reduce=chain"),
        2,
        1,
        |c| every_dtype(c, false),
    );
    world_with(verbs("tree"), 4, 1, f32_and_u8);
}

#[test]
fn an_all_gather_into_a_registered_output_lands_all_but_the_slots_of_each_message() {
    // 2 ranks, 16 MiB each: ring blocks of 4 MiB, frames of the tests' 64 KiB slots. A block's
    // sender fills at most its 4 slots (256 KiB) before it has to wait for a credit, and the
    // receiver offers before it takes a frame, on the queue pair that brings the credit: at
    // least 15 MiB land whatever the timing (14 asserted, which 2 MiB blocks would also meet).
    // Usually more: after the first block the sender holds each block's second frame for a
    // moment waiting for the offer.
    let count = 4 << 20;
    for r in spawn_world_on_nodes(2, 1, rdma("all-gather=ring"), |c| {
        let mut out = Registered::new(vec![c.rank() as f32; 2 * count])?;
        c.all_gather(&mut out)?;
        for (r, part) in out.chunks(count).enumerate() {
            assert!(
                part.iter().all(|&x| x == r as f32),
                "rank {}: part {r}",
                c.rank()
            );
        }
        Ok(c.stats().registered_recv_bytes)
    }) {
        let landed = r.unwrap();
        eprintln!("{landed} of {} received bytes landed", 16 << 20);
        assert!(landed >= 14 << 20, "{landed} of {} bytes landed", 16 << 20);
    }
}
