//! Schedules: per-rank action lists.

/// Which way a tensor travels: activations forward (to the next stage), gradients backward
/// (to the previous one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dir {
    /// Activations of a micro-batch, stage s to s + 1.
    Act,
    /// Gradients of a micro-batch's activations, stage s + 1 to s.
    Grad,
}

/// One point-to-point operation: a send to or a receive from `peer` of micro-batch `mb`'s
/// tensor going `dir`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// Send to `peer`.
    Send {
        /// The rank it goes to.
        peer: usize,
        /// Activations or gradients.
        dir: Dir,
        /// The micro-batch.
        mb: usize,
    },
    /// Receive from `peer`.
    Recv {
        /// The rank it comes from.
        peer: usize,
        /// Activations or gradients.
        dir: Dir,
        /// The micro-batch.
        mb: usize,
    },
}

/// One step of a rank's list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// The stage's forward on micro-batch `mb`.
    Forward(usize),
    /// The stage's backward on micro-batch `mb`.
    Backward(usize),
    /// Point-to-point operations posted together (one group): the action ends when every one
    /// of them has met its peer's.
    Exchange(Vec<Op>),
}

/// A schedule: `p` stages (one per rank), `m` micro-batches, one action list per rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// Stages (ranks).
    pub p: usize,
    /// Micro-batches per step.
    pub m: usize,
    /// Each rank's actions, in order.
    pub ranks: Vec<Vec<Action>>,
}

/// The list of one rank being built: its stage and the helpers that add a micro-batch's
/// forward or backward with the exchanges around it.
struct Builder {
    r: usize,
    p: usize,
    out: Vec<Action>,
}

impl Builder {
    fn first(&self) -> bool {
        self.r == 0
    }

    fn last(&self) -> bool {
        self.r + 1 == self.p
    }

    fn recv_act(&self, mb: usize) -> Option<Op> {
        (!self.first()).then(|| Op::Recv {
            peer: self.r - 1,
            dir: Dir::Act,
            mb,
        })
    }

    fn send_act(&self, mb: usize) -> Option<Op> {
        (!self.last()).then(|| Op::Send {
            peer: self.r + 1,
            dir: Dir::Act,
            mb,
        })
    }

    fn recv_grad(&self, mb: usize) -> Option<Op> {
        (!self.last()).then(|| Op::Recv {
            peer: self.r + 1,
            dir: Dir::Grad,
            mb,
        })
    }

    fn send_grad(&self, mb: usize) -> Option<Op> {
        (!self.first()).then(|| Op::Send {
            peer: self.r - 1,
            dir: Dir::Grad,
            mb,
        })
    }

    /// One exchange of the operations given (none: nothing).
    fn exchange(&mut self, ops: impl IntoIterator<Item = Option<Op>>) {
        let ops: Vec<Op> = ops.into_iter().flatten().collect();
        if !ops.is_empty() {
            self.out.push(Action::Exchange(ops));
        }
    }
}

impl Schedule {
    /// GPipe: every micro-batch's forward, then every backward (in the same order); each
    /// computation between the receive of its input and the send of its output.
    pub fn gpipe(p: usize, m: usize) -> Schedule {
        let p = p.max(1);
        let ranks = (0..p)
            .map(|r| {
                let mut b = Builder {
                    r,
                    p,
                    out: Vec::new(),
                };
                for mb in 0..m {
                    b.exchange([b.recv_act(mb)]);
                    b.out.push(Action::Forward(mb));
                    b.exchange([b.send_act(mb)]);
                }
                for mb in 0..m {
                    b.exchange([b.recv_grad(mb)]);
                    b.out.push(Action::Backward(mb));
                    b.exchange([b.send_grad(mb)]);
                }
                b.out
            })
            .collect();
        Schedule { p, m, ranks }
    }

    /// 1F1B (PipeDream-flush, Megatron's default): stage r runs `min(p - r - 1, m)` warm-up
    /// forwards, then alternates one forward and one backward, then the remaining backwards.
    /// In the steady state a forward's send of activations is batched with the receive of the
    /// gradient the next backward needs, and a backward's send of gradients with the receive
    /// of the next forward's activations (Megatron's `send_forward_recv_backward` and
    /// `send_backward_recv_forward`), so that no order of stages can deadlock.
    pub fn one_f_one_b(p: usize, m: usize) -> Schedule {
        let p = p.max(1);
        let ranks = (0..p)
            .map(|r| {
                let mut b = Builder {
                    r,
                    p,
                    out: Vec::new(),
                };
                let warmup = (p - r - 1).min(m);
                let steady = m - warmup;
                for mb in 0..warmup {
                    b.exchange([b.recv_act(mb)]);
                    b.out.push(Action::Forward(mb));
                    b.exchange([b.send_act(mb)]);
                }
                if steady > 0 {
                    b.exchange([b.recv_act(warmup)]);
                }
                for i in 0..steady {
                    let (f, bw) = (warmup + i, i);
                    b.out.push(Action::Forward(f));
                    b.exchange([b.send_act(f), b.recv_grad(bw)]);
                    b.out.push(Action::Backward(bw));
                    let next = (i + 1 < steady).then(|| b.recv_act(f + 1)).flatten();
                    b.exchange([b.send_grad(bw), next]);
                }
                for bw in steady..m {
                    b.exchange([b.recv_grad(bw)]);
                    b.out.push(Action::Backward(bw));
                    b.exchange([b.send_grad(bw)]);
                }
                b.out
            })
            .collect();
        Schedule { p, m, ranks }
    }
}
