//! DDP across a lost rank (threaded ranks): the survivors' step fails with `PeerLost` inside
//! `grad_ready` or `finish`; they drop the `Ddp`, shrink the lost rank away (and, in one case,
//! grow back with a joining replacement), build a new `Ddp` on the new communicator, whose
//! construction hands rank 0's parameters to every rank, the newcomer included, and redo the
//! step. Every rank ends with bit-identical parameters that match a serial recomputation over the
//! members of each step.

use oxccl_comm::harness::{spawn_world, spawn_world_and_joiners};
use oxccl_comm::{Communicator, Config, ReduceOp};
use oxccl_ddp::{Ddp, DdpConfig, DdpError, Param};

const STEPS: usize = 6;
const LENS: [usize; 2] = [3000, 700];
const LR: f32 = 0.25;

fn cfg() -> DdpConfig {
    DdpConfig {
        bucket_cap_bytes: 4096,
        first_bucket_bytes: 1024,
        // Buckets launched during backward: a lost rank's error then comes from the finish()
        // that waits for them, not from the all-reduce finish() starts itself.
        overlap: oxccl_ddp::Overlap::On,
        ..DdpConfig::default()
    }
}

/// Gradient of parameter `p` of member `m` (numbered as at the start; a replacement gets the
/// next number) at `step`.
fn grad(m: usize, step: usize, p: usize) -> Vec<f32> {
    (0..LENS[p])
        .map(|i| ((m * 7 + step * 3 + p * 5 + i) % 17) as f32 - 8.0)
        .collect()
}

/// The parameters every rank starts with (rank 0's win anyway).
fn initial(rank: usize) -> Vec<Vec<f32>> {
    LENS.iter().map(|&n| vec![rank as f32 + 0.5; n]).collect()
}

/// What rank 0 hands over after a loss: the step, the next member number, the members and the
/// members of every finished step.
#[derive(Debug, Default)]
struct Progress {
    step: usize,
    next_id: usize,
    members: Vec<usize>,
    history: Vec<Vec<usize>>,
}

impl Progress {
    /// Rank 0's progress, on every rank of `comm`.
    fn share(&self, comm: &Communicator) -> oxccl_comm::Result<Progress> {
        let mut v = vec![self.step as u64, self.next_id as u64];
        for list in std::iter::once(&self.members).chain(&self.history) {
            v.push(list.len() as u64);
            v.extend(list.iter().map(|&m| m as u64));
        }
        let mut len = [v.len() as u64];
        comm.broadcast(&mut len, 0)?;
        v.resize(len[0] as usize, 0);
        comm.broadcast(&mut v, 0)?;
        let mut it = v.iter().map(|&x| x as usize);
        let (step, next_id) = (it.next().unwrap(), it.next().unwrap());
        let mut lists = Vec::new();
        while let Some(n) = it.next() {
            lists.push((0..n).map(|_| it.next().unwrap()).collect::<Vec<_>>());
        }
        let members = lists.remove(0);
        Ok(Progress {
            step,
            next_id,
            members,
            history: lists,
        })
    }
}

/// A rank's parameters at the end, and the members of every step.
type Run = (Vec<Vec<f32>>, Vec<Vec<usize>>);

/// Runs the steps from `progress`; member `fail.0` leaves at step `fail.1` (returns `None`). On
/// a lost peer the others shrink it away, grow back to the old size when `replace` is set, and
/// go on from rank 0's progress with a new `Ddp`.
fn train(
    mut comm: Communicator,
    mut w: Vec<Vec<f32>>,
    mut progress: Progress,
    fail: Option<(usize, usize)>,
    replace: bool,
) -> Result<Option<Run>, DdpError> {
    while progress.step < STEPS {
        let mut ddp = {
            let (a, b) = w.split_at_mut(1);
            let mut params = [Param::new("w0", &mut a[0]), Param::new("w1", &mut b[0])];
            Ddp::new(&comm, &mut params, cfg())?
        };
        let lost = loop {
            if progress.step == STEPS {
                break None;
            }
            let (me, step) = (progress.members[comm.rank()], progress.step);
            if fail == Some((me, step)) {
                return Ok(None);
            }
            let r = (|| {
                for p in [1, 0] {
                    ddp.grad_ready(p, &grad(me, step, p))?;
                }
                ddp.finish()
            })();
            match r {
                Ok(_) => {
                    for (p, w) in w.iter_mut().enumerate() {
                        for (x, g) in w.iter_mut().zip(ddp.grad::<f32>(p)?) {
                            *x -= LR * g;
                        }
                    }
                    progress.history.push(progress.members.clone());
                    progress.step += 1;
                }
                Err(DdpError::Comm(e)) if e.lost_peer().is_some() => break e.lost_peer(),
                Err(e) => return Err(e),
            }
        };
        drop(ddp);
        let Some(lost) = lost else { break };
        let size = comm.size();
        comm = comm.shrink(&[lost])?;
        progress.members.remove(lost);
        if replace {
            comm = comm.grow(size)?;
            progress.members.push(progress.next_id);
            progress.next_id += 1;
        }
        progress = progress.share(&comm)?;
    }
    // Bit-identical on every rank.
    for (p, w) in w.iter().enumerate() {
        let mut mine = w.clone();
        comm.all_reduce(&mut mine, ReduceOp::Max)?;
        assert_eq!(
            &mine,
            w,
            "rank {}: parameter {p} differs between ranks",
            comm.rank()
        );
    }
    Ok(Some((w, progress.history)))
}

/// The parameters `history` gives from rank 0's initial values, in f64.
fn reference(history: &[Vec<usize>]) -> Vec<Vec<f64>> {
    let mut w: Vec<Vec<f64>> = initial(0)
        .into_iter()
        .map(|v| v.into_iter().map(f64::from).collect())
        .collect();
    for (step, members) in history.iter().enumerate() {
        for (p, w) in w.iter_mut().enumerate() {
            let mut sum = vec![0f64; LENS[p]];
            for &m in members {
                for (s, g) in sum.iter_mut().zip(grad(m, step, p)) {
                    *s += f64::from(g);
                }
            }
            for (x, s) in w.iter_mut().zip(sum) {
                *x -= f64::from(LR) * s / members.len() as f64;
            }
        }
    }
    w
}

fn check(out: &Run, lost: usize, after: &[usize]) {
    let (w, history) = out;
    assert_eq!(history.len(), STEPS);
    let cut = history.iter().position(|m| !m.contains(&lost));
    assert!(matches!(cut, Some(1 | 2)), "{history:?}");
    assert!(
        history[cut.unwrap()..].iter().all(|m| m == after),
        "{history:?}"
    );
    for (got, want) in w.iter().zip(reference(history)) {
        for (&g, &r) in got.iter().zip(&want) {
            assert!(
                (f64::from(g) - r).abs() <= 1e-5 * r.abs().max(1.0),
                "{g} vs {r}"
            );
        }
    }
}

fn start(comm: &Communicator) -> Progress {
    Progress {
        step: 0,
        next_id: comm.size(),
        members: (0..comm.size()).collect(),
        history: Vec::new(),
    }
}

#[test]
fn survivors_shrink_and_go_on_with_a_new_ddp() {
    let out: Vec<_> = spawn_world(3, Config::default(), |c| {
        let (w, p) = (initial(c.rank()), start(&c));
        Ok(train(c, w, p, Some((1, 2)), false).map_err(|e| e.to_string()))
    })
    .into_iter()
    .map(|r| r.unwrap().unwrap())
    .collect();
    assert!(out[1].is_none());
    for o in [&out[0], &out[2]] {
        let o = o.as_ref().expect("a survivor's result");
        check(o, 1, &[0, 2]);
        assert_eq!(o, out[0].as_ref().unwrap());
    }
}

#[test]
fn survivors_grow_back_and_the_new_ddp_syncs_the_replacement() {
    let out: Vec<_> = spawn_world_and_joiners(
        3,
        1,
        |_| Config::default(),
        |c| {
            let (w, p) = (initial(c.rank()), start(&c));
            Ok(train(c, w, p, Some((1, 2)), true).map_err(|e| e.to_string()))
        },
        |_, store, cfg| {
            let c = Communicator::join_with_config(store, cfg)?;
            // Zeros: the new Ddp must hand it rank 0's parameters.
            let w = LENS.iter().map(|&n| vec![0.0; n]).collect();
            let p = Progress::default().share(&c)?;
            Ok(train(c, w, p, None, true).map_err(|e| e.to_string()))
        },
    )
    .into_iter()
    .map(|r| r.unwrap().unwrap())
    .collect();
    assert!(out[1].is_none());
    for o in [&out[0], &out[2], &out[3]] {
        let o = o.as_ref().expect("a result");
        check(o, 1, &[0, 2, 3]);
        assert_eq!(o, out[0].as_ref().unwrap());
    }
}
