//! The model behind examples/08_pipeline_mlp.rs and the pipeline tests: a multi-layer
//! perceptron (tanh between layers, mean-squared-error loss) cut into stages, each stage a
//! contiguous run of layers, with its forward, its input-gradient backward (B) and its
//! weight-gradient backward (W) written out; and the one-process reference that runs every
//! layer, micro-batch by micro-batch, with the same arithmetic.

#![allow(dead_code)] // each includer uses its part

use std::collections::HashMap;
use std::ops::Range;

use oxccl_pipeline::{BoxError, Stage, Step, Tensor};

/// Each layer's weight and bias (or their gradients).
pub type Layers = Vec<(Vec<f32>, Vec<f32>)>;

/// Pre-activation gradients of a micro-batch's layers, waiting for the weight backward.
type Pending = Vec<(usize, Vec<f32>)>;

/// Sizes of the model and of a micro-batch.
#[derive(Clone, Debug)]
pub struct Shape {
    /// Input features.
    pub input: usize,
    /// Width of every hidden layer.
    pub width: usize,
    /// Outputs.
    pub output: usize,
    /// Linear layers.
    pub layers: usize,
    /// Samples per micro-batch.
    pub batch: usize,
    /// Micro-batches per step.
    pub micro: usize,
    /// SGD learning rate.
    pub lr: f32,
}

impl Shape {
    /// Widths: input, hidden..., output.
    pub fn dims(&self) -> Vec<usize> {
        let mut d = vec![self.input];
        d.extend(std::iter::repeat_n(self.width, self.layers - 1));
        d.push(self.output);
        d
    }
}

/// SplitMix64, for data and weights that are functions of an index.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn unit(h: u64) -> f32 {
    (h >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Inputs (count x input) and targets (count x output) of samples `first..first + count`.
pub fn samples(sh: &Shape, first: usize, count: usize) -> (Vec<f32>, Vec<f32>) {
    let x: Vec<f32> = (first * sh.input..(first + count) * sh.input)
        .map(|i| unit(mix(i as u64)))
        .collect();
    let t = (0..count * sh.output)
        .map(|k| {
            let (s, j) = (k / sh.output, k % sh.output);
            let row = &x[s * sh.input..(s + 1) * sh.input];
            let dot: f32 = row
                .iter()
                .enumerate()
                .map(|(i, v)| v * unit(mix(0xC0FFEE ^ (j * 1000 + i) as u64)))
                .sum();
            (dot / (sh.input as f32).sqrt()).sin()
        })
        .collect();
    (x, t)
}

/// Layer `l`'s weight (out x in, row-major) and bias, from `seed`.
pub fn init(sh: &Shape, seed: u64) -> Layers {
    let d = sh.dims();
    (0..sh.layers)
        .map(|l| {
            let scale = 1.0 / (d[l] as f32).sqrt();
            let w = (0..d[l] * d[l + 1])
                .map(|k| scale * unit(mix(seed << 48 ^ (l as u64) << 40 ^ k as u64)))
                .collect();
            (w, vec![0.0; d[l + 1]])
        })
        .collect()
}

/// The layers of stage `s` of `stages`: an even cut (a stage may hold none).
pub fn layers_of(sh: &Shape, stages: usize, s: usize) -> Range<usize> {
    s * sh.layers / stages..(s + 1) * sh.layers / stages
}

/// `y = act(W x + b)` for `batch` rows; tanh except on the last layer.
fn linear(sh: &Shape, l: usize, p: &(Vec<f32>, Vec<f32>), x: &[f32], batch: usize) -> Vec<f32> {
    let d = sh.dims();
    let (n_in, n_out) = (d[l], d[l + 1]);
    let mut y = vec![0.0f32; batch * n_out];
    for s in 0..batch {
        let xs = &x[s * n_in..(s + 1) * n_in];
        for o in 0..n_out {
            let row = &p.0[o * n_in..(o + 1) * n_in];
            let v = row.iter().zip(xs).map(|(a, b)| a * b).sum::<f32>() + p.1[o];
            y[s * n_out + o] = if l + 1 == sh.layers { v } else { v.tanh() };
        }
    }
    y
}

/// From the gradient of layer `l`'s output `g` (and its output `y`): the gradient of its
/// pre-activation.
fn pre_activation(sh: &Shape, l: usize, g: &[f32], y: &[f32]) -> Vec<f32> {
    if l + 1 == sh.layers {
        g.to_vec()
    } else {
        g.iter().zip(y).map(|(g, y)| g * (1.0 - y * y)).collect()
    }
}

/// `W^T dz`: the gradient of layer `l`'s input.
fn input_grad(sh: &Shape, l: usize, w: &[f32], dz: &[f32], batch: usize) -> Vec<f32> {
    let d = sh.dims();
    let (n_in, n_out) = (d[l], d[l + 1]);
    let mut dx = vec![0.0f32; batch * n_in];
    for s in 0..batch {
        for o in 0..n_out {
            let g = dz[s * n_out + o];
            for (x, w) in dx[s * n_in..(s + 1) * n_in]
                .iter_mut()
                .zip(&w[o * n_in..(o + 1) * n_in])
            {
                *x += g * w;
            }
        }
    }
    dx
}

/// Adds `dz^T x` to the weight gradient and the column sums of `dz` to the bias gradient.
fn weight_grad(
    sh: &Shape,
    l: usize,
    dz: &[f32],
    x: &[f32],
    batch: usize,
    acc: &mut (Vec<f32>, Vec<f32>),
) {
    let d = sh.dims();
    let (n_in, n_out) = (d[l], d[l + 1]);
    for s in 0..batch {
        for o in 0..n_out {
            let g = dz[s * n_out + o];
            for (a, x) in acc.0[o * n_in..(o + 1) * n_in]
                .iter_mut()
                .zip(&x[s * n_in..(s + 1) * n_in])
            {
                *a += g * x;
            }
            acc.1[o] += g;
        }
    }
}

/// The loss gradient `(y - t) / norm` and the loss `sum 0.5 (y - t)^2 / norm`.
fn loss_grad(y: &[f32], t: &[f32], norm: f32) -> (Vec<f32>, f32) {
    let mut loss = 0.0;
    let g = y
        .iter()
        .zip(t)
        .map(|(y, t)| {
            loss += 0.5 * (y - t) * (y - t);
            (y - t) / norm
        })
        .collect();
    (g, loss / norm)
}

/// Zero gradients shaped like the parameters.
pub fn zeros_like(p: &[(Vec<f32>, Vec<f32>)]) -> Layers {
    p.iter()
        .map(|(w, b)| (vec![0.0; w.len()], vec![0.0; b.len()]))
        .collect()
}

/// One step of the whole model in one process: every micro-batch's forward and backward in
/// order, gradients summed; returns them and the loss. `first` is the step's first sample;
/// `replicas` data-parallel replicas each take `micro` micro-batches in turn.
pub fn reference_grads(
    sh: &Shape,
    params: &[(Vec<f32>, Vec<f32>)],
    first: usize,
    replicas: usize,
) -> (Layers, f32) {
    let mut grads = zeros_like(params);
    let mut loss = 0.0;
    let norm = (sh.batch * sh.micro * replicas) as f32;
    for mb in 0..sh.micro * replicas {
        let (x, t) = samples(sh, first + mb * sh.batch, sh.batch);
        let mut acts = vec![x];
        for (l, p) in params.iter().enumerate() {
            let y = linear(sh, l, p, &acts[l], sh.batch);
            acts.push(y);
        }
        let (mut g, lo) = loss_grad(&acts[sh.layers], &t, norm);
        loss += lo;
        for l in (0..sh.layers).rev() {
            let dz = pre_activation(sh, l, &g, &acts[l + 1]);
            weight_grad(sh, l, &dz, &acts[l], sh.batch, &mut grads[l]);
            g = input_grad(sh, l, &params[l].0, &dz, sh.batch);
        }
    }
    (grads, loss)
}

/// The one-process run of `steps` steps with `replicas` replicas' micro-batches each step:
/// the gradients of every step, the final parameters and every step's loss.
pub fn reference(sh: &Shape, steps: usize, replicas: usize) -> (Vec<Layers>, Layers, Vec<f32>) {
    let mut params = init(sh, 7);
    let (mut grads, mut losses) = (Vec::new(), Vec::new());
    for step in 0..steps {
        let (g, loss) =
            reference_grads(sh, &params, step * sh.batch * sh.micro * replicas, replicas);
        sgd(&mut params, &g, sh.lr);
        grads.push(g);
        losses.push(loss);
    }
    (grads, params, losses)
}

/// `p -= lr g`.
pub fn sgd(p: &mut [(Vec<f32>, Vec<f32>)], g: &[(Vec<f32>, Vec<f32>)], lr: f32) {
    for ((w, b), (gw, gb)) in p.iter_mut().zip(g) {
        w.iter_mut().zip(gw).for_each(|(x, g)| *x -= lr * g);
        b.iter_mut().zip(gb).for_each(|(x, g)| *x -= lr * g);
    }
}

/// Largest relative difference between two parameter lists (relative to the largest value).
pub fn max_rel_diff(a: &[(Vec<f32>, Vec<f32>)], b: &[(Vec<f32>, Vec<f32>)]) -> f32 {
    let (mut diff, mut scale) = (0.0f32, 1e-12f32);
    for ((aw, ab), (bw, bb)) in a.iter().zip(b) {
        for (x, y) in aw.iter().chain(ab).zip(bw.iter().chain(bb)) {
            diff = diff.max((x - y).abs());
            scale = scale.max(x.abs()).max(y.abs());
        }
    }
    diff / scale
}

/// Called with each parameter's final gradient (layer l's weight is `2 l`, its bias `2 l + 1`)
/// during the last micro-batch's weight backward: where DDP's `grad_ready` goes.
pub type OnGrad<'a> = Box<dyn FnMut(usize, &[f32]) -> Result<(), BoxError> + 'a>;

/// How a stage sends its activations: one f32 tensor, or (to test several tensors of several
/// dtypes) the first half of the features as f32 and the rest as f64.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wire {
    /// One f32 tensor `[batch, width]`.
    One,
    /// f32 `[batch, k]` and f64 `[batch, width - k]`.
    Split,
}

/// This rank's stages (one per chunk) of the model.
pub struct MlpStage<'a> {
    pub sh: Shape,
    /// Ranks and chunks of the pipeline.
    pub p: usize,
    pub v: usize,
    pub rank: usize,
    /// Every layer's parameters (only this rank's are used and updated).
    pub params: Layers,
    /// This rank's layers' gradients, summed over the step's micro-batches.
    pub grads: Layers,
    /// The step's first sample (the replica's first micro-batch).
    pub first: usize,
    /// Samples the loss is averaged over (all replicas').
    pub norm: f32,
    /// The loss of the step on the last stage.
    pub loss: f32,
    pub wire: Wire,
    /// Fail the forward of this micro-batch (a crashed stage).
    pub fail_at: Option<usize>,
    pub on_grad: Option<OnGrad<'a>>,
    /// Saved activations per (mb, chunk): the chunk's input and each layer's output.
    saved: HashMap<(usize, usize), Vec<Vec<f32>>>,
    /// Pre-activation gradients waiting for their weight backward, per (mb, chunk), by layer.
    pending: HashMap<(usize, usize), Pending>,
}

impl<'a> MlpStage<'a> {
    /// Rank `rank` of `p` with `v` chunks, parameters from `seed`.
    pub fn new(sh: &Shape, p: usize, v: usize, rank: usize, seed: u64) -> MlpStage<'a> {
        let params = init(sh, seed);
        MlpStage {
            grads: zeros_like(&params),
            params,
            sh: sh.clone(),
            p,
            v,
            rank,
            first: 0,
            norm: (sh.batch * sh.micro) as f32,
            loss: 0.0,
            wire: Wire::One,
            fail_at: None,
            on_grad: None,
            saved: HashMap::new(),
            pending: HashMap::new(),
        }
    }

    fn stage(&self, chunk: usize) -> usize {
        chunk * self.p + self.rank
    }

    /// The layers this rank holds, over all its chunks.
    pub fn my_layers(&self) -> Vec<usize> {
        (0..self.v)
            .flat_map(|c| layers_of(&self.sh, self.p * self.v, self.stage(c)))
            .collect()
    }

    /// Zeroes the gradients for the next step, starting at sample `first`.
    pub fn begin_step(&mut self, first: usize) {
        self.grads = zeros_like(&self.params);
        self.first = first;
        self.loss = 0.0;
    }

    fn pack(&self, rows: usize, data: &[f32]) -> Vec<Tensor> {
        let width = data.len() / rows.max(1);
        match self.wire {
            Wire::One => vec![Tensor::new(&[rows, width], data).expect("sized")],
            Wire::Split => {
                let k = width / 2;
                let (mut a, mut b) = (Vec::new(), Vec::new());
                for r in 0..rows {
                    a.extend_from_slice(&data[r * width..r * width + k]);
                    b.extend(
                        data[r * width + k..(r + 1) * width]
                            .iter()
                            .map(|&x| f64::from(x)),
                    );
                }
                vec![
                    Tensor::new(&[rows, k], &a).expect("sized"),
                    Tensor::new(&[rows, width - k], &b).expect("sized"),
                ]
            }
        }
    }

    fn unpack(inputs: &[Tensor]) -> Result<Vec<f32>, BoxError> {
        match inputs {
            [t] => Ok(t
                .as_slice::<f32>()
                .ok_or("expected f32 activations")?
                .to_vec()),
            [a, b] => {
                let (rows, k, rest) = (a.shape()[0], a.shape()[1], b.shape()[1]);
                let (a, b) = (
                    a.as_slice::<f32>().ok_or("expected f32 first")?,
                    b.as_slice::<f64>().ok_or("expected f64 second")?,
                );
                let mut out = Vec::with_capacity(rows * (k + rest));
                for r in 0..rows {
                    out.extend_from_slice(&a[r * k..(r + 1) * k]);
                    out.extend(b[r * rest..(r + 1) * rest].iter().map(|&x| x as f32));
                }
                Ok(out)
            }
            _ => Err(format!("expected 1 or 2 tensors, got {}", inputs.len()).into()),
        }
    }
}

impl Stage for MlpStage<'_> {
    fn forward(&mut self, st: Step, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        if self.fail_at == Some(st.mb) {
            return Err(format!("this stage crashed at micro-batch {}", st.mb).into());
        }
        let s = self.stage(st.chunk);
        let x = if s == 0 {
            samples(&self.sh, self.first + st.mb * self.sh.batch, self.sh.batch).0
        } else {
            Self::unpack(&inputs)?
        };
        let mut acts = vec![x];
        for l in layers_of(&self.sh, self.p * self.v, s) {
            let y = linear(
                &self.sh,
                l,
                &self.params[l],
                acts.last().expect("input"),
                self.sh.batch,
            );
            acts.push(y);
        }
        let out = self.pack(self.sh.batch, acts.last().expect("output"));
        self.saved.insert((st.mb, st.chunk), acts);
        Ok(if s + 1 == self.p * self.v {
            Vec::new()
        } else {
            out
        })
    }

    fn backward(&mut self, st: Step, grads: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        let dx = self.backward_input(st, grads)?;
        self.backward_weight(st)?;
        Ok(dx)
    }

    fn backward_input(&mut self, st: Step, grads: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        let s = self.stage(st.chunk);
        let acts = self
            .saved
            .remove(&(st.mb, st.chunk))
            .ok_or("backward before forward")?;
        let mut g = if s + 1 == self.p * self.v {
            let (_, t) = samples(&self.sh, self.first + st.mb * self.sh.batch, self.sh.batch);
            let (g, loss) = loss_grad(acts.last().expect("output"), &t, self.norm);
            self.loss += loss;
            g
        } else {
            Self::unpack(&grads)?
        };
        let range = layers_of(&self.sh, self.p * self.v, s);
        let mut pending = Vec::new();
        for (i, l) in range.clone().enumerate().rev() {
            let dz = pre_activation(&self.sh, l, &g, &acts[i + 1]);
            if l > 0 {
                g = input_grad(&self.sh, l, &self.params[l].0, &dz, self.sh.batch);
            }
            pending.push((l, dz));
        }
        self.pending.insert((st.mb, st.chunk), pending);
        self.saved.insert((st.mb, st.chunk), acts);
        Ok(if s == 0 {
            Vec::new()
        } else {
            self.pack(self.sh.batch, &g)
        })
    }

    fn backward_weight(&mut self, st: Step) -> Result<(), BoxError> {
        let s = self.stage(st.chunk);
        let first = layers_of(&self.sh, self.p * self.v, s).start;
        let acts = self
            .saved
            .remove(&(st.mb, st.chunk))
            .ok_or("weight backward before forward")?;
        let pending = self
            .pending
            .remove(&(st.mb, st.chunk))
            .ok_or("weight backward before input backward")?;
        for (l, dz) in pending {
            weight_grad(
                &self.sh,
                l,
                &dz,
                &acts[l - first],
                self.sh.batch,
                &mut self.grads[l],
            );
            if st.mb + 1 == self.sh.micro {
                if let Some(f) = self.on_grad.as_mut() {
                    f(2 * l, &self.grads[l].0)?;
                    f(2 * l + 1, &self.grads[l].1)?;
                }
            }
        }
        Ok(())
    }
}
