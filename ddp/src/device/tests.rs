//! The device plan without a GPU: its op sequence and stream order, and, run on host buffers by
//! `sim`, its results against the host `Ddp` on threaded ranks (bit for bit: the same hooks and
//! collectives, integer-valued gradients whose averages over 4 ranks are exact).

use oxccl_comm::harness::spawn_world;
use oxccl_comm::{Communicator, Config, DType};
use oxccl_kernels::bf16;

use super::plan::{Event, Op, Planner, Queue};
use super::sim::{Region, SimDdp, StreamCheck};
use crate::config::{DdpConfig, Step};
use crate::error::DdpError;
use crate::flat::FlatBuffer;
use crate::hooks::{CompressHook, DeviceHook};
use crate::layout::ParamSpec;
use crate::{Ddp, Param, PowerSgd, PowerSgdConfig};

/// Parameter lengths (one empty); parameter 4 is bf16, the others f32.
const LENS: [usize; 6] = [300, 7, 1000, 0, 64, 129];
const RANKS: usize = 4;

fn dtype(p: usize) -> DType {
    if p == 4 {
        DType::BF16
    } else {
        DType::F32
    }
}

fn specs() -> Vec<ParamSpec> {
    LENS.iter()
        .enumerate()
        .map(|(p, &len)| ParamSpec {
            name: format!("p{p}"),
            len,
            dtype: dtype(p),
        })
        .collect()
}

fn cfg() -> DdpConfig {
    DdpConfig {
        bucket_cap_bytes: 2048,
        first_bucket_bytes: 512,
        ..DdpConfig::default()
    }
}

/// Integer-valued gradient of `p` on `rank` at micro-batch `m`.
fn grad(rank: usize, m: usize, p: usize) -> FlatBuffer {
    let v: Vec<f32> = (0..LENS[p])
        .map(|i| ((rank * 7 + m * 3 + p * 5 + i) % 17) as f32)
        .collect();
    if dtype(p) == DType::BF16 {
        let h: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
        FlatBuffer::from_slice(&h)
    } else {
        FlatBuffer::from_slice(&v)
    }
}

/// How a micro-batch hands its gradients over.
#[derive(Clone, Copy, Debug)]
enum Feed {
    Ready,
    Slot,
    Sync,
}

/// This rank's gradient order: reversed, rotated by the rank (so ranks differ).
fn order(rank: usize) -> Vec<usize> {
    let mut o: Vec<usize> = (0..LENS.len()).rev().collect();
    o.rotate_left(rank % LENS.len());
    o
}

fn host_slot_write(host: &mut Ddp<&Communicator>, p: usize, g: &FlatBuffer) {
    macro_rules! write {
        ($t:ty) => {{
            let (slot, fresh) = host.grad_slot::<$t>(p).unwrap();
            let src = g.as_slice::<$t>().unwrap();
            for (d, s) in slot.iter_mut().zip(src) {
                *d = if fresh { *s } else { *d + *s };
            }
        }};
    }
    match g.dtype() {
        DType::BF16 => write!(bf16),
        _ => write!(f32),
    }
    host.grad_ready_in_place(p).unwrap();
}

fn host_grad(host: &Ddp<&Communicator>, p: usize) -> Vec<u8> {
    match dtype(p) {
        DType::BF16 => bytemuck::cast_slice(host.grad::<bf16>(p).unwrap()).to_vec(),
        _ => bytemuck::cast_slice(host.grad::<f32>(p).unwrap()).to_vec(),
    }
}

/// One micro-batch `m` fed to both reducers; `skip` leaves a parameter out.
fn micro(
    host: &mut Ddp<&Communicator>,
    sim: &mut SimDdp<'_>,
    feed: Feed,
    m: usize,
    skip: &dyn Fn(usize, usize) -> bool,
) -> (crate::Result<Step>, crate::Result<Step>) {
    let rank = host.comm().rank();
    match feed {
        Feed::Sync => {
            let mut hg: Vec<FlatBuffer> = (0..LENS.len()).map(|p| grad(rank, m, p)).collect();
            let mut sg = hg.clone();
            let a = host.sync(&mut hg);
            let b = sim.sync(&mut sg);
            if matches!(b, Ok(Step::Synced { .. })) {
                assert_eq!(hg, sg, "rank {rank}: sync wrote back the same averages");
            }
            (a, b)
        }
        Feed::Ready | Feed::Slot => {
            // One reducer's whole micro-batch, then the other's: the simulated reduces wait at
            // once (no streams), so interleaving the two could hold a rank in one while its
            // peers wait for it in the other.
            let ps: Vec<usize> = order(rank)
                .into_iter()
                .filter(|&p| !skip(rank, p))
                .collect();
            for &p in &ps {
                let g = grad(rank, m, p);
                match feed {
                    Feed::Slot => host_slot_write(host, p, &g),
                    _ => host_ready(host, p, &g),
                }
            }
            let a = host.finish();
            for &p in &ps {
                let g = grad(rank, m, p);
                match feed {
                    Feed::Slot => sim.grad_in_slot(p, &g).unwrap(),
                    _ => sim.grad_ready(p, &g).unwrap(),
                }
            }
            (a, sim.finish())
        }
    }
}

fn host_ready(host: &mut Ddp<&Communicator>, p: usize, g: &FlatBuffer) {
    match g.dtype() {
        DType::BF16 => host.grad_ready(p, g.as_slice::<bf16>().unwrap()),
        _ => host.grad_ready(p, g.as_slice::<f32>().unwrap()),
    }
    .unwrap();
}

/// Runs `steps` (each a list of micro-batches) on both reducers on every rank and compares
/// every step's outcome and averages.
fn compare(
    cfg: DdpConfig,
    hook: Option<CompressHook>,
    accumulate: usize,
    steps: &[Feed],
    skip: &(dyn Fn(usize, usize) -> bool + Sync),
) -> Vec<(Vec<usize>, Vec<usize>)> {
    let quick = Config {
        timeout: std::time::Duration::from_secs(60),
        ..Config::default()
    };
    let out = spawn_world(RANKS, quick, |comm| {
        let mut vals: Vec<Vec<f32>> = LENS.iter().map(|&l| vec![0.0; l]).collect();
        let mut bvals: Vec<bf16> = vec![bf16::ZERO; LENS[4]];
        let mut params: Vec<Param<'_>> = Vec::new();
        let mut bvals = Some(&mut bvals);
        for (p, v) in vals.iter_mut().enumerate() {
            match bvals.take() {
                Some(b) if p == 4 => params.push(Param::new("p4", b.as_mut_slice())),
                b => {
                    bvals = b;
                    params.push(Param::new(format!("p{p}"), v.as_mut_slice()));
                }
            }
        }
        let mut host = Ddp::new(&comm, &mut params, cfg.clone()).unwrap();
        // Its own communicator: the two reducers launch their buckets at different points.
        let dev_comm = comm.split(Some(0), comm.rank() as i64)?.expect("a member");
        let mut sim = SimDdp::new(&dev_comm, specs(), cfg.clone());
        if let Some(h) = hook {
            host.set_comm_hook(h).unwrap();
            sim.planner
                .set_hook(DeviceHook::Compress(h.wire()))
                .unwrap();
        }
        host.accumulate(accumulate).unwrap();
        sim.planner.accumulate(accumulate).unwrap();
        let mut m = 0;
        for (s, &feed) in steps.iter().enumerate() {
            // Parameters this rank gave a gradient in the step so far: in an accumulating
            // micro-batch only their slots are defined (the others hold whatever the last step
            // left, which differs where the host `sync` reduced in the caller's slices).
            let mut seen = vec![false; LENS.len()];
            for _ in 0..accumulate {
                let (a, b) = micro(&mut host, &mut sim, feed, m, skip);
                m += 1;
                for (p, seen) in seen.iter_mut().enumerate() {
                    *seen |= matches!(feed, Feed::Sync) || !skip(comm.rank(), p);
                }
                match (&a, &b) {
                    (Ok(x), Ok(y)) => assert_eq!(x, y, "step {s}"),
                    (
                        Err(DdpError::UnusedParameters { names: x, .. }),
                        Err(DdpError::UnusedParameters { names: y, .. }),
                    ) => assert_eq!(x, y),
                    _ => panic!(
                        "rank {}: step {s}: host {a:?}, device plan {b:?}",
                        comm.rank()
                    ),
                }
                if matches!(feed, Feed::Sync) {
                    continue;
                }
                let synced = matches!(a, Ok(Step::Synced { .. }));
                for p in (0..LENS.len()).filter(|&p| synced || seen[p]) {
                    let (h, d) = (host_grad(&host, p), sim.grad(p));
                    assert_eq!(h, d.bytes(), "rank {} step {s} param {p}", comm.rank());
                }
            }
        }
        assert_eq!(host.steps(), sim.planner.steps());
        let host_unused = host.unused_on_every_rank().to_vec();
        Ok((host_unused, sim.planner.unused_on_every_rank().to_vec()))
    });
    out.into_iter().map(|r| r.unwrap()).collect()
}

fn no_skip(_: usize, _: usize) -> bool {
    false
}

#[test]
fn plan_equals_host_ddp_through_grad_ready_slots_and_sync_with_a_rebuilt_order() {
    use Feed::*;
    compare(
        cfg(),
        None,
        1,
        &[Ready, Ready, Slot, Sync, Ready, Slot],
        &no_skip,
    );
}

#[test]
fn plan_equals_host_ddp_with_accumulation_and_compression() {
    use Feed::*;
    compare(cfg(), None, 3, &[Ready, Slot, Sync], &no_skip);
    compare(
        cfg(),
        Some(CompressHook::fp16()),
        1,
        &[Ready, Sync, Slot],
        &no_skip,
    );
    compare(
        cfg(),
        Some(CompressHook::bf16()),
        2,
        &[Slot, Ready],
        &no_skip,
    );
}

#[test]
fn plan_equals_host_ddp_with_unused_parameters() {
    use Feed::*;
    let found = DdpConfig {
        find_unused_parameters: true,
        ..cfg()
    };
    // Parameter 2 unused on rank 1 only, parameter 5 on every rank.
    let skip = |rank: usize, p: usize| p == 5 || (p == 2 && rank == 1);
    for (host, dev) in compare(found, None, 1, &[Ready, Slot, Ready], &skip) {
        assert_eq!(host, dev);
        assert_eq!(dev, vec![5]);
    }
    // Without the setting both report the same names (and the steps still complete).
    compare(cfg(), None, 1, &[Ready, Ready], &skip);
}

#[test]
fn ops_follow_the_stream_order_of_a_step() {
    let specs = vec![
        ParamSpec {
            name: "a".into(),
            len: 4,
            dtype: DType::F32,
        },
        ParamSpec {
            name: "b".into(),
            len: 4,
            dtype: DType::F32,
        },
    ];
    let cfg = DdpConfig {
        bucket_cap_bytes: 16,
        first_bucket_bytes: 16,
        rebuild_buckets: false,
        ..DdpConfig::default()
    };
    let mut pl = Planner::new(0, specs, cfg);
    // Reverse order: bucket 0 holds "b", bucket 1 "a".
    assert_eq!(pl.slot(1), (0, 0, 4));
    // "a" first: its bucket is full but waits for bucket 0 (launch order).
    assert_eq!(
        pl.grad_ready(0, DType::F32, 4).unwrap(),
        vec![Op::CopyIn {
            param: 0,
            add: false
        }]
    );
    let launch = |b| {
        [
            Op::Record {
                on: Queue::Trainer,
                event: Event::Filled(b),
            },
            Op::Wait {
                on: Queue::Comm,
                event: Event::Filled(b),
            },
            Op::Reduce {
                bucket: b,
                wire: None,
            },
        ]
    };
    let mut want = vec![Op::CopyIn {
        param: 1,
        add: false,
    }];
    want.extend(launch(0));
    want.extend(launch(1));
    assert_eq!(pl.grad_ready(1, DType::F32, 4).unwrap(), want);
    let mut ops = Vec::new();
    pl.finish(&mut ops);
    assert_eq!(
        ops,
        vec![
            Op::Record {
                on: Queue::Comm,
                event: Event::Reduced
            },
            Op::Wait {
                on: Queue::Trainer,
                event: Event::Reduced
            },
        ]
    );
    // An accumulating micro-batch copies (then adds) and launches nothing.
    pl.accumulate(2).unwrap();
    assert_eq!(
        pl.grad_ready(1, DType::F32, 4).unwrap(),
        vec![Op::CopyIn {
            param: 1,
            add: false
        }]
    );
    let mut ops = Vec::new();
    pl.finish(&mut ops);
    assert_eq!(
        ops,
        vec![Op::Zero { param: 0 }]
            .into_iter()
            .filter(|_| false)
            .collect::<Vec<_>>()
    );
    let (ops, fresh) = pl.grad_slot(1, DType::F32).unwrap();
    assert!(
        ops.is_empty() && !fresh,
        "the second micro-batch adds to the slot"
    );
    // Compression picks the wire for f32 buckets.
    let mut pl = Planner::new(
        0,
        vec![ParamSpec {
            name: "c".into(),
            len: 4,
            dtype: DType::F32,
        }],
        DdpConfig::default(),
    );
    pl.set_hook(DeviceHook::Compress(DType::BF16)).unwrap();
    let ops = pl.grad_ready(0, DType::F32, 4).unwrap();
    assert_eq!(
        ops[3],
        Op::Reduce {
            bucket: 0,
            wire: Some(DType::BF16)
        }
    );
}

#[test]
fn the_stream_check_catches_unordered_accesses() {
    let b = Region::Bucket(0);
    let mut c = StreamCheck::default();
    c.write(Queue::Trainer, b).unwrap();
    assert!(
        c.read(Queue::Comm, b).is_err(),
        "a reduce before the copy's event"
    );
    let mut c = StreamCheck::default();
    c.write(Queue::Trainer, b).unwrap();
    c.record(Queue::Trainer, Event::Filled(0));
    c.wait(Queue::Comm, Event::Filled(0)).unwrap();
    c.read(Queue::Comm, b).unwrap();
    c.write(Queue::Comm, b).unwrap();
    assert!(
        c.write(Queue::Trainer, b).is_err(),
        "the next copy before the reduce is waited for"
    );
    c.record(Queue::Comm, Event::Reduced);
    c.wait(Queue::Trainer, Event::Reduced).unwrap();
    c.write(Queue::Trainer, b).unwrap();
    assert!(
        c.wait(Queue::Comm, Event::Filled(3)).is_err(),
        "an event never recorded"
    );
}

#[test]
fn host_only_hooks_and_bad_gradients_are_refused_by_name() {
    let power = PowerSgd::new(PowerSgdConfig::default(), vec![vec![4, 4]]);
    let e = super::device_hook(&power, 2).unwrap_err().to_string();
    assert!(
        e.contains("rank 2") && e.contains("host buffers only"),
        "{e}"
    );
    assert_eq!(
        super::device_hook(&CompressHook::fp16(), 0).unwrap(),
        DeviceHook::Compress(DType::F16)
    );
    let f64s = vec![ParamSpec {
        name: "w".into(),
        len: 4,
        dtype: DType::F64,
    }];
    let mut pl = Planner::new(1, f64s, DdpConfig::default());
    let e = pl
        .set_hook(DeviceHook::Compress(DType::F16))
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 1") && e.contains("f64"), "{e}");
    let e = pl.grad_ready(0, DType::F32, 4).unwrap_err().to_string();
    assert!(e.contains("is f64, the gradient given is f32"), "{e}");
    let e = pl.grad_ready(0, DType::F64, 3).unwrap_err().to_string();
    assert!(
        e.contains("has 4 elements, the gradient given has 3"),
        "{e}"
    );
    pl.grad_ready(0, DType::F64, 4).unwrap();
    let e = pl.grad_ready(0, DType::F64, 4).unwrap_err().to_string();
    assert!(e.contains("already got its gradient"), "{e}");
    let e = pl
        .sync(&[(DType::F64, 4), (DType::F64, 4)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("2 gradients given for 1 parameters"), "{e}");
}

mod random {
    use proptest::prelude::*;

    use super::*;

    fn feed() -> impl Strategy<Value = Feed> {
        prop_oneof![Just(Feed::Ready), Just(Feed::Slot), Just(Feed::Sync)]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        /// Any mix of feeds, micro-batches per step, compression, bucket caps and parameters
        /// left out on some ranks: the plan gives what the host `Ddp` gives, bit for bit, with
        /// every access in stream order.
        #[test]
        fn plan_equals_host_ddp_on_random_steps(
            steps in proptest::collection::vec(feed(), 1..4),
            accumulate in 1usize..3,
            wire in 0u8..3,
            cap in prop_oneof![Just(512usize), Just(2048), Just(1 << 20)],
            skipped in proptest::collection::vec((0usize..RANKS, 0usize..LENS.len()), 0..3),
            find_unused in any::<bool>(),
        ) {
            let cfg = DdpConfig {
                bucket_cap_bytes: cap,
                first_bucket_bytes: cap.min(512),
                find_unused_parameters: find_unused,
                ..DdpConfig::default()
            };
            let hook = match wire {
                1 => Some(CompressHook::fp16()),
                2 => Some(CompressHook::bf16()),
                _ => None,
            };
            let skip = move |rank: usize, p: usize| skipped.contains(&(rank, p));
            for (host, dev) in compare(cfg, hook, accumulate, &steps, &skip) {
                prop_assert_eq!(host, dev);
            }
        }
    }
}
