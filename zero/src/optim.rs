//! Optimizers that step one shard: f32 master weights, the shard's averaged gradient, and the
//! shard's own state. Every update is element-wise, so stepping each shard alone equals stepping
//! the whole vector (the tests check it element for element): a rank keeps state for its shard
//! only.
//!
//! The formulas are PyTorch's (`torch.optim.SGD`, `torch.optim.AdamW`), in f32.

/// Hyper-parameters of one parameter group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hyper {
    /// Learning rate.
    pub lr: f32,
    /// Weight decay (L2 for SGD, decoupled for AdamW).
    pub weight_decay: f32,
}

/// An optimizer over shards (implement it for your own).
pub trait ShardOptimizer: Send {
    /// A name, for errors and checkpoints.
    fn name(&self) -> &str;

    /// f32 state elements per parameter element (momentum: 1; AdamW: 2).
    fn state_per_elem(&self) -> usize;

    /// The state vectors' names, `state_per_elem()` of them, for checkpoints (default
    /// `state0`, `state1`, ...).
    fn state_names(&self) -> Vec<String> {
        (0..self.state_per_elem())
            .map(|k| format!("state{k}"))
            .collect()
    }

    /// One step, `t` counting from 1, on `master` with `grad` (same length) and `state`
    /// (`state_per_elem() * master.len()` elements, zeros before the first step).
    fn step(&mut self, t: u64, hyper: Hyper, master: &mut [f32], grad: &[f32], state: &mut [f32]);
}

/// Stochastic gradient descent with momentum, dampening, Nesterov momentum and (L2) weight
/// decay: `torch.optim.SGD`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sgd {
    /// Momentum factor (0: plain SGD, no state).
    pub momentum: f32,
    /// Dampening of the momentum's new gradient.
    pub dampening: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
}

impl ShardOptimizer for Sgd {
    fn name(&self) -> &str {
        "sgd"
    }

    fn state_per_elem(&self) -> usize {
        usize::from(self.momentum != 0.0)
    }

    fn state_names(&self) -> Vec<String> {
        let names: &[&str] = if self.momentum != 0.0 {
            &["momentum_buffer"]
        } else {
            &[]
        };
        names.iter().map(|s| s.to_string()).collect()
    }

    fn step(&mut self, t: u64, h: Hyper, master: &mut [f32], grad: &[f32], state: &mut [f32]) {
        let s = self.scalars(t, h);
        for (i, (p, &g0)) in master.iter_mut().zip(grad).enumerate() {
            let mut g = g0 + s.weight_decay * *p;
            if s.momentum != 0.0 {
                let b = &mut state[i];
                *b = if s.first {
                    g
                } else {
                    s.momentum * *b + s.omd * g
                };
                g = if s.nesterov { g + s.momentum * *b } else { *b };
            }
            *p -= s.lr * g;
        }
    }
}

/// The scalars of one SGD step, as the host loop and the device kernel
/// (`oxccl_kernels::cuda::SgdScalars`) take them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdStep {
    /// Learning rate.
    pub lr: f32,
    /// L2 weight decay.
    pub weight_decay: f32,
    /// Momentum factor.
    pub momentum: f32,
    /// `1 - dampening`.
    pub omd: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Step 1: the buffer takes the gradient as it is.
    pub first: bool,
}

impl Sgd {
    /// The scalars of step `t` (from 1) with `h`.
    pub fn scalars(&self, t: u64, h: Hyper) -> SgdStep {
        SgdStep {
            lr: h.lr,
            weight_decay: h.weight_decay,
            momentum: self.momentum,
            omd: 1.0 - self.dampening,
            nesterov: self.nesterov,
            first: t <= 1,
        }
    }
}

/// Adam with decoupled weight decay: `torch.optim.AdamW` (without amsgrad).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the root of the second moment.
    pub eps: f32,
}

impl Default for AdamW {
    fn default() -> AdamW {
        AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }
}

impl ShardOptimizer for AdamW {
    fn name(&self) -> &str {
        "adamw"
    }

    fn state_per_elem(&self) -> usize {
        2
    }

    fn state_names(&self) -> Vec<String> {
        vec!["exp_avg".into(), "exp_avg_sq".into()]
    }

    fn step(&mut self, t: u64, h: Hyper, master: &mut [f32], grad: &[f32], state: &mut [f32]) {
        let n = master.len();
        let (m, v) = state.split_at_mut(n);
        let s = self.scalars(t, h);
        // Iterators, not indices: no bounds checks, so the loop vectorises.
        let each = master
            .iter_mut()
            .zip(grad)
            .zip(m.iter_mut().zip(v.iter_mut()));
        for ((p, &g), (m, v)) in each {
            *p *= s.decay;
            *m = s.beta1 * *m + s.omb1 * g;
            *v = s.beta2 * *v + s.omb2 * g * g;
            let denom = (*v / s.c2).sqrt() + s.eps;
            *p -= s.lr * (*m / s.c1) / denom;
        }
    }
}

/// The scalars of one AdamW step, as the host loop and the device kernel
/// (`oxccl_kernels::cuda::AdamWScalars`) take them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate.
    pub lr: f32,
    /// `1 - lr * weight_decay`.
    pub decay: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// `1 - beta1`.
    pub omb1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// `1 - beta2`.
    pub omb2: f32,
    /// Added to the root of the second moment.
    pub eps: f32,
    /// `1 - beta1^t`.
    pub c1: f32,
    /// `1 - beta2^t`.
    pub c2: f32,
}

impl AdamW {
    /// The scalars of step `t` (from 1) with `h`.
    pub fn scalars(&self, t: u64, h: Hyper) -> AdamWStep {
        let t = t.max(1).min(i32::MAX as u64) as i32;
        AdamWStep {
            lr: h.lr,
            decay: 1.0 - h.lr * h.weight_decay,
            beta1: self.beta1,
            omb1: 1.0 - self.beta1,
            beta2: self.beta2,
            omb2: 1.0 - self.beta2,
            eps: self.eps,
            c1: 1.0 - self.beta1.powi(t),
            c2: 1.0 - self.beta2.powi(t),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const H: Hyper = Hyper {
        lr: 0.1,
        weight_decay: 0.01,
    };

    #[test]
    fn sgd_momentum_matches_the_formula() {
        let mut o = Sgd {
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
        };
        let (mut p, mut s) = (vec![1.0f32], vec![0.0f32]);
        o.step(1, H, &mut p, &[0.5], &mut s);
        // g = 0.5 + 0.01 * 1 = 0.51; buf = g; p = 1 - 0.1 * 0.51
        assert_eq!(s[0], 0.51);
        assert_eq!(p[0], 1.0 - 0.1 * 0.51);
        let p1 = p[0];
        o.step(2, H, &mut p, &[0.5], &mut s);
        let g = 0.5 + 0.01 * p1;
        assert_eq!(s[0], 0.9 * 0.51 + g);
        assert_eq!(p[0], p1 - 0.1 * s[0]);
    }

    #[test]
    fn adamw_first_step_moves_by_about_the_learning_rate() {
        let mut o = AdamW::default();
        let (mut p, mut s) = (vec![1.0f32, -2.0], vec![0.0f32; 4]);
        o.step(1, H, &mut p, &[0.3, -0.7], &mut s);
        // After bias correction m / sqrt(v) = sign(g): each moves by lr against its gradient,
        // after the decoupled decay.
        assert!(
            (p[0] - (1.0 * (1.0 - 0.001) - 0.1)).abs() < 1e-6,
            "{}",
            p[0]
        );
        assert!(
            (p[1] - (-2.0 * (1.0 - 0.001) + 0.1)).abs() < 1e-6,
            "{}",
            p[1]
        );
    }

    fn run(o: &mut dyn ShardOptimizer, master: &mut [f32], grads: &[Vec<f32>], cut: &[usize]) {
        let per = o.state_per_elem();
        // One state per shard, as each rank keeps it.
        let mut bounds = vec![0];
        bounds.extend(cut.iter().copied().filter(|&c| c > 0 && c < master.len()));
        bounds.push(master.len());
        bounds.sort_unstable();
        let mut states: Vec<Vec<f32>> = bounds
            .windows(2)
            .map(|w| vec![0.0; per * (w[1] - w[0])])
            .collect();
        for (t, g) in grads.iter().enumerate() {
            for (w, st) in bounds.windows(2).zip(states.iter_mut()) {
                let (a, b) = (w[0], w[1]);
                o.step(t as u64 + 1, H, &mut master[a..b], &g[a..b], st);
            }
        }
    }

    proptest! {
        /// Stepping shards alone, each with its own state, equals stepping the whole vector:
        /// bit for bit.
        #[test]
        fn shards_step_as_the_whole(
            init in proptest::collection::vec(-2.0f32..2.0, 1..40),
            seed in 0u32..1000,
            cut in proptest::collection::vec(0usize..40, 0..4),
            nesterov in any::<bool>(),
        ) {
            let n = init.len();
            let grads: Vec<Vec<f32>> = (0..4u32)
                .map(|t| {
                    (0..n)
                        .map(|i| ((i as u32 * 7 + t * 13 + seed) % 11) as f32 * 0.1 - 0.5)
                        .collect()
                })
                .collect();
            let mut opts: Vec<Box<dyn ShardOptimizer>> = vec![
                Box::new(Sgd { momentum: 0.9, dampening: 0.1, nesterov }),
                Box::new(Sgd::default()),
                Box::new(AdamW::default()),
            ];
            for o in &mut opts {
                let (mut whole, mut sharded) = (init.clone(), init.clone());
                run(o.as_mut(), &mut whole, &grads, &[]);
                run(o.as_mut(), &mut sharded, &grads, &cut);
                prop_assert_eq!(&whole, &sharded, "{}", o.name());
            }
        }
    }
}
