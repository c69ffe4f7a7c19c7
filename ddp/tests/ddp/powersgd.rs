//! The PowerSGD comm hook on threaded ranks: exact where the averaged gradient has the
//! approximation's rank, error feedback that makes the updates' mean converge on the mean
//! gradient, warm start that iterates towards the best approximation, full averages before
//! `start_step` and for what is not compressed, identical replicas (also with uneven inputs and
//! with ranks of different `Overlap`), and errors for bad shapes and settings.

use oxccl_comm::harness::spawn_world;
use oxccl_comm::{Communicator, Config, DType};
use oxccl_ddp::{
    BucketEntry, Ddp, DdpConfig, DdpError, Overlap, Param, PowerSgd, PowerSgdConfig, Step,
    UnevenInputs,
};

/// A number in [-1, 1) that depends on every key.
fn rnd(keys: &[u64]) -> f64 {
    let mut z = 0x243f_6a88_85a3_08d3u64;
    for &k in keys {
        z = (z ^ k).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        z ^= z >> 29;
    }
    z = z.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^= z >> 32;
    (z >> 11) as f64 / (1u64 << 52) as f64 - 1.0
}

/// The test model: shapes and dtypes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    F32,
    F64,
    I32,
}

const MODEL: [(&str, Kind, &[usize]); 6] = [
    ("w0", Kind::F32, &[24, 40]), // compressed (960 elements against 2 x 64)
    ("b0", Kind::F32, &[24]),     // a vector: in full
    ("w1", Kind::F32, &[3, 4]),   // too small to pay: in full
    ("w2", Kind::F32, &[8, 4, 5]), // viewed as 8 x 20: compressed
    ("w3", Kind::F64, &[16, 10]), // f64: compressed
    ("n", Kind::I32, &[5]),       // an integer dtype: the plain average
];

fn len(p: usize) -> usize {
    MODEL[p].2.iter().product()
}

fn shapes() -> Vec<Vec<usize>> {
    MODEL.iter().map(|m| m.2.to_vec()).collect()
}

/// Gradients of one rank in one step, as f64: for matrices `u a^T + v b^T`, with `a` and `b`
/// the same on every rank (so the average over ranks has rank 2), for the rest anything.
fn low_rank_grad(rank: usize, step: usize, p: usize) -> Vec<f64> {
    let dims = MODEL[p].2;
    if MODEL[p].1 == Kind::I32 {
        return (0..len(p))
            .map(|i| (3 * (i + step + rank)) as f64)
            .collect();
    }
    if dims.len() < 2 {
        return (0..len(p))
            .map(|i| rnd(&[1, rank as u64, step as u64, p as u64, i as u64]))
            .collect();
    }
    let (n, m) = (dims[0], len(p) / dims[0]);
    let (r, s, pk) = (rank as u64, step as u64, p as u64);
    (0..n * m)
        .map(|x| {
            let (i, j) = ((x / m) as u64, (x % m) as u64);
            rnd(&[2, r, s, pk, i]) * rnd(&[3, s, pk, j])
                + rnd(&[4, r, s, pk, i]) * rnd(&[5, s, pk, j])
        })
        .collect()
}

/// One rank's replica of the model: its storage, by dtype.
struct Model {
    f32s: Vec<Vec<f32>>,
    f64s: Vec<Vec<f64>>,
    i32s: Vec<Vec<i32>>,
}

impl Model {
    fn new() -> Model {
        let of = |k: Kind| -> Vec<usize> {
            (0..MODEL.len())
                .filter(|&p| MODEL[p].1 == k)
                .map(len)
                .collect()
        };
        Model {
            f32s: of(Kind::F32).into_iter().map(|n| vec![0.0; n]).collect(),
            f64s: of(Kind::F64).into_iter().map(|n| vec![0.0; n]).collect(),
            i32s: of(Kind::I32).into_iter().map(|n| vec![0; n]).collect(),
        }
    }

    fn ddp(&mut self, comm: Communicator, cfg: DdpConfig) -> Ddp {
        let (mut f, mut d, mut i) = (
            self.f32s.iter_mut(),
            self.f64s.iter_mut(),
            self.i32s.iter_mut(),
        );
        let mut params: Vec<Param> = MODEL
            .iter()
            .map(|&(name, k, _)| match k {
                Kind::F32 => Param::new(name, f.next().unwrap().as_mut_slice()),
                Kind::F64 => Param::new(name, d.next().unwrap().as_mut_slice()),
                Kind::I32 => Param::new(name, i.next().unwrap().as_mut_slice()),
            })
            .collect();
        Ddp::new(comm, &mut params, cfg).unwrap()
    }
}

/// Hands over parameter `p`'s gradient `g` (in its dtype) through `grad_ready`.
fn give(ddp: &mut Ddp, p: usize, g: &[f64]) {
    match MODEL[p].1 {
        Kind::F32 => ddp.grad_ready(p, &g.iter().map(|&x| x as f32).collect::<Vec<_>>()),
        Kind::F64 => ddp.grad_ready(p, g),
        Kind::I32 => ddp.grad_ready(p, &g.iter().map(|&x| x as i32).collect::<Vec<_>>()),
    }
    .unwrap();
}

/// One step of `low_rank_grad`s through `grad_ready`, last parameter first, then `finish()`.
fn low_rank_step(ddp: &mut Ddp, rank: usize, step: usize) -> oxccl_ddp::Result<Step> {
    for p in (0..MODEL.len()).rev() {
        give(ddp, p, &low_rank_grad(rank, step, p));
    }
    ddp.finish()
}

/// Parameter `p`'s averaged gradient, as f64.
fn read(ddp: &Ddp, p: usize) -> Vec<f64> {
    match MODEL[p].1 {
        Kind::F32 => ddp
            .grad::<f32>(p)
            .unwrap()
            .iter()
            .map(|&x| f64::from(x))
            .collect(),
        Kind::F64 => ddp.grad::<f64>(p).unwrap().to_vec(),
        Kind::I32 => ddp
            .grad::<i32>(p)
            .unwrap()
            .iter()
            .map(|&x| f64::from(x))
            .collect(),
    }
}

fn small_buckets(overlap: Overlap) -> DdpConfig {
    DdpConfig {
        bucket_cap_bytes: 2048,
        first_bucket_bytes: 512,
        overlap,
        ..DdpConfig::default()
    }
}

fn psgd(rank: usize, start_step: u64) -> PowerSgd {
    PowerSgd::new(
        PowerSgdConfig {
            rank,
            start_step,
            ..PowerSgdConfig::default()
        },
        shapes(),
    )
}

/// Largest |got - want| over the largest |want|.
fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |a, w| a.max(w.abs())).max(1e-30);
    got.iter()
        .zip(want)
        .fold(0.0f64, |a, (g, w)| a.max((g - w).abs()))
        / scale
}

/// Steps of the exactness test: zeros first, then low-rank averages, then full rank.
const EXACT_STEPS: usize = 6;

/// The gradients of that test: in step 0 zeros (the averaged matrices have rank 0 < r: `Q` must
/// not get stuck at zero), in the last step full-rank matrices (which PowerSGD must approximate),
/// in between `low_rank_grad`.
fn exact_test_grad(rank: usize, step: usize, p: usize) -> Vec<f64> {
    match step {
        0 => vec![0.0; len(p)],
        s if s == EXACT_STEPS - 1 && MODEL[p].2.len() >= 2 && MODEL[p].1 != Kind::I32 => {
            (0..len(p))
                .map(|i| rnd(&[6, rank as u64, p as u64, i as u64]))
                .collect()
        }
        _ => low_rank_grad(rank, step, p),
    }
}

#[test]
fn an_average_of_the_approximations_rank_comes_back_exactly_on_every_rank() {
    const N: usize = 3;
    // Overlap on for rank 0 and off for the others: the second rounds still line up.
    let out = spawn_world(N, Config::default(), |comm| {
        let rank = comm.rank();
        let overlap = if rank == 0 { Overlap::On } else { Overlap::Off };
        let mut model = Model::new();
        let mut ddp = model.ddp(comm, small_buckets(overlap));
        // Without error feedback, which would add what the last step missed: with an unrelated
        // random row space in every step (unlike training), the warm-started power iteration
        // misses a part that grows about tenfold a step (1.6e-4 of the result by step 4).
        let cfg = PowerSgdConfig {
            rank: 2,
            start_step: 0,
            error_feedback: false,
            ..PowerSgdConfig::default()
        };
        ddp.set_comm_hook(PowerSgd::new(cfg, shapes())).unwrap();
        let mut seen = Vec::new();
        for step in 0..EXACT_STEPS {
            for p in (0..MODEL.len()).rev() {
                give(&mut ddp, p, &exact_test_grad(rank, step, p));
            }
            assert_eq!(ddp.finish().unwrap(), Step::Synced { step: step as u64 });
            seen.push((0..MODEL.len()).map(|p| read(&ddp, p)).collect::<Vec<_>>());
        }
        assert!(ddp.bucket_params().len() >= 4, "{:?}", ddp.bucket_params());
        Ok(seen)
    });
    let out: Vec<_> = out.into_iter().map(Result::unwrap).collect();
    for step in 0..EXACT_STEPS {
        for p in 0..MODEL.len() {
            let mut want = vec![0.0; len(p)];
            for r in 0..N {
                for (w, g) in want.iter_mut().zip(exact_test_grad(r, step, p)) {
                    *w += g / N as f64;
                }
            }
            let got = &out[0][step][p];
            let name = MODEL[p].0;
            let compressed = MODEL[p].2.len() >= 2 && name != "w1";
            if step == 0 {
                assert!(got.iter().all(|&x| x == 0.0), "step 0 {name}: {got:?}");
            } else if step == EXACT_STEPS - 1 && compressed {
                // Full rank: what a rank-2 approximation misses is most of it.
                let e = rel_err(got, &want);
                assert!(
                    e > 0.3,
                    "step {step} {name}: relative error only {e}: not compressed?"
                );
            } else {
                let tol = match (MODEL[p].1, MODEL[p].2.len()) {
                    (Kind::I32, _) => 0.0,
                    (Kind::F64, _) => 1e-10,
                    _ => 1e-5,
                };
                let e = rel_err(got, &want);
                assert!(e <= tol, "step {step} {name}: relative error {e}");
            }
            for (r, o) in out.iter().enumerate().skip(1) {
                assert_eq!(&o[step][p], got, "rank {r} differs, step {step} {name}");
            }
        }
    }
}

/// The single 32 x 48 matrix of the one-parameter tests.
const ROWS: usize = 32;
const COLS: usize = 48;

/// A `Ddp` over one 32 x 48 f32 parameter, its gradients through PowerSGD set as `cfg` says.
fn one_matrix(comm: Communicator, cfg: PowerSgdConfig) -> Ddp {
    let mut w = vec![0.0f32; ROWS * COLS];
    let mut ddp = Ddp::new(comm, &mut [Param::new("w", &mut w)], DdpConfig::default()).unwrap();
    ddp.set_comm_hook(PowerSgd::new(cfg, vec![vec![ROWS, COLS]]))
        .unwrap();
    ddp
}

/// Every rank's gradient of one `n x m` matrix is the same full-rank random matrix per rank in
/// every step; returns, per rank, the mean of the averaged gradients over `steps`, the first
/// step's and the last step's.
fn constant_gradients(
    n_ranks: usize,
    steps: usize,
    cfg: PowerSgdConfig,
    grad: impl Fn(usize, usize) -> f32 + Sync,
) -> Vec<(Vec<f64>, Vec<f64>, Vec<f64>)> {
    let out = spawn_world(n_ranks, Config::default(), |comm| {
        let rank = comm.rank();
        let mut ddp = one_matrix(comm, cfg.clone());
        let g: Vec<f32> = (0..ROWS * COLS).map(|i| grad(rank, i)).collect();
        let mut sum = vec![0.0f64; g.len()];
        let mut first = Vec::new();
        let mut last = Vec::new();
        for _ in 0..steps {
            let mut grads = [g.clone()];
            ddp.sync(&mut grads).unwrap();
            if first.is_empty() {
                first = grads[0].iter().map(|&x| f64::from(x)).collect();
            }
            for (s, &x) in sum.iter_mut().zip(&grads[0]) {
                *s += f64::from(x);
            }
            last = grads[0].iter().map(|&x| f64::from(x)).collect();
        }
        Ok((sum.iter().map(|s| s / steps as f64).collect(), first, last))
    });
    out.into_iter().map(Result::unwrap).collect()
}

/// A full-rank random gradient, different on each rank.
fn random_grad(rank: usize, i: usize) -> f32 {
    rnd(&[9, rank as u64, i as u64]) as f32
}

/// The mean over `n` ranks of `grad`, in f64.
fn mean_of(n: usize, grad: impl Fn(usize, usize) -> f32) -> Vec<f64> {
    (0..ROWS * COLS)
        .map(|i| (0..n).map(|r| f64::from(grad(r, i))).sum::<f64>() / n as f64)
        .collect()
}

#[test]
fn error_feedback_makes_the_mean_update_converge_on_the_mean_gradient() {
    const N: usize = 2;
    const STEPS: usize = 120;
    let want = mean_of(N, random_grad);
    let cfg = PowerSgdConfig {
        rank: 2,
        start_step: 0,
        ..PowerSgdConfig::default()
    };
    let with = constant_gradients(N, STEPS, cfg.clone(), random_grad);
    let without = constant_gradients(
        N,
        STEPS,
        PowerSgdConfig {
            error_feedback: false,
            ..cfg
        },
        random_grad,
    );
    // One step's rank-2 approximation of a random 32 x 48 matrix misses most of it ...
    let first = rel_err(&with[0].1, &want);
    assert!(first > 0.5, "first step's relative error {first}");
    // ... and so does the mean without error feedback, while with it the misses are made up
    // (measured 0.12 at 120 steps; the mean's error falls as 1 / steps).
    let e_with = rel_err(&with[0].0, &want);
    let e_without = rel_err(&without[0].0, &want);
    assert!(
        e_with < 0.2,
        "mean over {STEPS} steps with error feedback: {e_with}"
    );
    assert!(e_without > 0.5, "without error feedback: {e_without}");
    assert_eq!(with[0], with[1], "ranks differ");
}

/// A gradient whose mean has a decaying spectrum: `sum_k 2^-k a_k b_k^T`, each term scaled by
/// a factor of each rank's.
fn decaying_grad(rank: usize, i: usize) -> f32 {
    let (row, col) = (i / COLS, i % COLS);
    (0..6u64)
        .map(|k| {
            let a = rnd(&[10, k, row as u64]);
            let b = rnd(&[11, k, col as u64]);
            0.5f64.powi(k as i32) * a * b * (1.0 + 0.5 * rnd(&[12, k, rank as u64]))
        })
        .sum::<f64>() as f32
}

#[test]
fn warm_start_iterates_towards_the_best_approximation() {
    const N: usize = 2;
    let want = mean_of(N, decaying_grad);
    let fro = |got: &[f64]| {
        let d: f64 = got.iter().zip(&want).map(|(g, w)| (g - w).powi(2)).sum();
        (d / want.iter().map(|w| w * w).sum::<f64>()).sqrt()
    };
    let cfg = PowerSgdConfig {
        rank: 1,
        start_step: 0,
        error_feedback: false,
        ..PowerSgdConfig::default()
    };
    let warm = constant_gradients(N, 20, cfg.clone(), decaying_grad);
    let cold = constant_gradients(
        N,
        20,
        PowerSgdConfig {
            warm_start: false,
            ..cfg
        },
        decaying_grad,
    );
    let (e_warm, e_cold, e_first) = (fro(&warm[0].2), fro(&cold[0].2), fro(&warm[0].1));
    // Measured: 0.44 after 20 warm steps (0.77 after the first), 0.93 with a fresh Q each step.
    assert!(
        e_warm < 0.75 * e_cold.min(e_first),
        "last step: warm start {e_warm}, fresh Q {e_cold}, first step {e_first}"
    );
}

#[test]
fn steps_before_start_step_are_averaged_in_full() {
    const N: usize = 4;
    let out = spawn_world(N, Config::default(), |comm| {
        let rank = comm.rank();
        let cfg = PowerSgdConfig {
            start_step: 2,
            ..PowerSgdConfig::default()
        };
        let mut ddp = one_matrix(comm, cfg);
        let mut got = Vec::new();
        for step in 0..3u64 {
            // Integers: their average over 4 ranks is exact in f32.
            let mut grads = [(0..ROWS * COLS)
                .map(|i| ((rank as u64 * 7 + step * 3 + i as u64 * 5) % 17) as f32)
                .collect::<Vec<_>>()];
            ddp.sync(&mut grads).unwrap();
            got.push(grads[0].clone());
        }
        Ok(got)
    });
    let out: Vec<_> = out.into_iter().map(Result::unwrap).collect();
    for step in 0..3u64 {
        let want: Vec<f32> = (0..(ROWS * COLS) as u64)
            .map(|i| {
                (0..N as u64)
                    .map(|r| ((r * 7 + step * 3 + i * 5) % 17) as f32)
                    .sum::<f32>()
                    / N as f32
            })
            .collect();
        if step < 2 {
            assert_eq!(out[0][step as usize], want, "step {step}");
        } else {
            assert_ne!(
                out[0][step as usize], want,
                "step {step} was not compressed"
            );
        }
        for o in &out[1..] {
            assert_eq!(o[step as usize], out[0][step as usize], "step {step}");
        }
    }
}

#[test]
fn joined_ranks_stand_in_through_the_hook_and_replicas_stay_identical() {
    const N: usize = 3;
    let batches = [2usize, 5, 4];
    let out = spawn_world(N, Config::default(), |comm| {
        let rank = comm.rank();
        let mut model = Model::new();
        let mut ddp = model.ddp(
            comm,
            DdpConfig {
                uneven_inputs: UnevenInputs::DivideByWorldSize,
                ..small_buckets(Overlap::On)
            },
        );
        ddp.set_comm_hook(psgd(1, 1)).unwrap();
        let mut seen = Vec::new();
        for step in 0..batches[rank] {
            for p in (0..MODEL.len()).rev() {
                give(&mut ddp, p, &low_rank_grad(rank, step, p));
            }
            ddp.finish().unwrap();
            seen.push((0..MODEL.len()).map(|p| read(&ddp, p)).collect::<Vec<_>>());
        }
        while ddp.join_step().unwrap().is_some() {
            seen.push((0..MODEL.len()).map(|p| read(&ddp, p)).collect::<Vec<_>>());
        }
        Ok(seen)
    });
    let out: Vec<_> = out.into_iter().map(Result::unwrap).collect();
    assert_eq!(out[0].len(), 5);
    for (r, o) in out.iter().enumerate().skip(1) {
        assert_eq!(o, &out[0], "rank {r} differs from rank 0");
    }
}

/// The hooks of the error test, each with what its error must say.
fn bad_hook(k: usize) -> (PowerSgd, &'static [&'static str]) {
    let cfg = PowerSgdConfig {
        start_step: 0,
        ..PowerSgdConfig::default()
    };
    match k {
        0 => {
            let mut s = shapes();
            s[3] = vec![8, 21];
            (
                PowerSgd::new(cfg, s),
                &["parameter 3 has shape [8, 21] but 160 elements"],
            )
        }
        1 => (
            PowerSgd::new(cfg, shapes()[..2].to_vec()),
            &["no shape for parameter", "shapes given for 2"],
        ),
        _ => (psgd(0, 0), &["at least 1"]),
    }
}

#[test]
fn bad_shapes_and_settings_are_named_on_every_rank_and_the_next_step_goes_on() {
    for k in 0..3 {
        let out = spawn_world(2, Config::default(), |comm| {
            let rank = comm.rank();
            let mut model = Model::new();
            let mut ddp = model.ddp(comm, small_buckets(Overlap::On));
            ddp.set_comm_hook(bad_hook(k).0).unwrap();
            let e = low_rank_step(&mut ddp, rank, 0).unwrap_err();
            // A good hook, and the next step goes through.
            ddp.set_comm_hook(psgd(1, 0)).unwrap();
            low_rank_step(&mut ddp, rank, 1).unwrap();
            Ok((rank, e))
        });
        for r in out {
            let (rank, e) = r.unwrap();
            assert!(matches!(e, DdpError::InvalidArgument { .. }), "{e:?}");
            let msg = e.to_string();
            let rank_s = format!("rank {rank}");
            for n in [rank_s.as_str(), "powersgd hook"]
                .iter()
                .chain(bad_hook(k).1)
            {
                assert!(msg.contains(n), "case {k}: {msg:?} lacks {n:?}");
            }
        }
    }
}

#[test]
fn wire_elements_count_what_compression_sends() {
    let h = psgd(2, 0);
    let e = |param, offset| BucketEntry {
        param,
        offset,
        len: len(param),
    };
    // w0: (24 + 40) x 2 = 128 of 960; b0 in full; w1 too small, in full.
    let (sent, full) = h
        .wire_elements(0, DType::F32, &[e(0, 0), e(1, 960), e(2, 984)])
        .unwrap();
    assert_eq!((sent, full), (128 + 24 + 12, 960 + 24 + 12));
    // Other dtypes, and buckets with nothing to compress, go in full.
    let all = h
        .wire_elements(0, DType::BF16, &[e(0, 0), e(1, 960)])
        .unwrap();
    assert_eq!(all, (984, 984));
    let flat = h
        .wire_elements(0, DType::F32, &[e(1, 0), e(2, 24)])
        .unwrap();
    assert_eq!(flat, (36, 36));
    // A member outside the bucket is an error, not a panic.
    let outside = h.wire_elements(3, DType::F32, &[e(0, 0), e(1, 2000)]);
    let msg = outside.unwrap_err().to_string();
    assert!(
        msg.contains("rank 3") && msg.contains("parameter 1 at elements 2000..+24 lies outside"),
        "{msg}"
    );
}

#[test]
fn a_step_of_zero_gradients_does_not_stop_later_ones_with_error_feedback() {
    // Step 0 is all zeros (P, Q and the residual come out zero); step 1 the same rank-1
    // gradient on both ranks, which a rank-1 approximation must give back.
    let out = spawn_world(2, Config::default(), |comm| {
        let cfg = PowerSgdConfig {
            start_step: 0,
            ..PowerSgdConfig::default()
        };
        let mut ddp = one_matrix(comm, cfg);
        let mut zeros = [vec![0.0f32; ROWS * COLS]];
        ddp.sync(&mut zeros).unwrap();
        let g: Vec<f32> = (0..ROWS * COLS)
            .map(|i| (rnd(&[7, (i / COLS) as u64]) * rnd(&[8, (i % COLS) as u64])) as f32)
            .collect();
        let mut grads = [g.clone()];
        ddp.sync(&mut grads).unwrap();
        Ok((zeros, grads, g))
    });
    for r in out {
        let (zeros, grads, g) = r.unwrap();
        assert!(zeros[0].iter().all(|&x| x == 0.0));
        let want: Vec<f64> = g.iter().map(|&x| f64::from(x)).collect();
        let got: Vec<f64> = grads[0].iter().map(|&x| f64::from(x)).collect();
        let e = rel_err(&got, &want);
        assert!(e < 1e-5, "relative error {e} after a zero step");
    }
}

#[test]
fn settings_that_differ_between_ranks_are_named_before_anything_is_compressed() {
    // Each case sets one rank apart; without the check a seed or warm start that differs
    // averages each rank's approximation against other random matrices, with no error.
    let apart = |rank: usize, k: usize| {
        let mut cfg = PowerSgdConfig {
            start_step: 0,
            ..PowerSgdConfig::default()
        };
        let one = rank == 1;
        let what = match k {
            0 => {
                cfg.seed = u64::from(one) * 7;
                format!(
                    "seed differs between ranks: {} here, from 0 to 7",
                    u64::from(one) * 7
                )
            }
            1 => {
                cfg.warm_start = !one;
                format!(
                    "warm_start differs between ranks: {} here, from 0 to 1",
                    u64::from(!one)
                )
            }
            2 => {
                cfg.rank = 1 + usize::from(one);
                format!(
                    "rank (of each matrix's approximation) differs between ranks: {} here, from 1 to 2",
                    1 + usize::from(one)
                )
            }
            _ => {
                cfg.start_step = u64::from(one);
                format!(
                    "start_step differs between ranks: {} here, from 0 to 1",
                    u64::from(one)
                )
            }
        };
        (PowerSgd::new(cfg, shapes()), what)
    };
    for k in 0..4 {
        let out = spawn_world(2, Config::default(), |comm| {
            let rank = comm.rank();
            let mut model = Model::new();
            let mut ddp = model.ddp(comm, small_buckets(Overlap::On));
            let (hook, what) = apart(rank, k);
            ddp.set_comm_hook(hook).unwrap();
            let e = low_rank_step(&mut ddp, rank, 0).unwrap_err();
            // The same settings everywhere, and the next step goes through.
            ddp.set_comm_hook(psgd(1, 0)).unwrap();
            assert_eq!(
                low_rank_step(&mut ddp, rank, 1).unwrap(),
                Step::Synced { step: 0 }
            );
            Ok((rank, e, what))
        });
        for r in out {
            let (rank, e, what) = r.unwrap();
            let msg = e.to_string();
            let head = format!("rank {rank}: ddp finish: hook powersgd (given to set_comm_hook): ");
            assert!(matches!(e, DdpError::InvalidArgument { .. }), "{e:?}");
            for n in [head.as_str(), what.as_str()] {
                assert!(msg.contains(n), "case {k}: {msg:?} lacks {n:?}");
            }
        }
    }
}
