//! oxccl-candle against one candle process: a small MLP trained on 4 ranks (threads, each with
//! its own communicator over shared memory) equals one process trained on the concatenated
//! batch; the initial broadcast; the errors.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, SGD};
use oxccl_candle::{CandleDdp, Error};
use oxccl_comm::{harness::spawn_world, Config};
use oxccl_ddp::{DdpConfig, Step};

const IN: usize = 16;
const HIDDEN: usize = 32;
const PER_RANK: usize = 8;
const STEPS: usize = 10;
const LR: f64 = 0.05;

/// Deterministic values in [-0.5, 0.5) from a seed (an LCG), so every run and rank agree.
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

/// The MLP's variables, drawn from `seed` (ranks draw different ones; DDP broadcasts rank 0's).
fn model(seed: u64) -> Vec<(String, Var)> {
    let var = |name: &str, s: u64, shape: &[usize]| {
        let n = shape.iter().product();
        let t = Tensor::from_vec(values(seed * 10 + s, n), shape, &Device::Cpu).unwrap();
        (name.to_string(), Var::from_tensor(&t).unwrap())
    };
    vec![
        var("l1.weight", 1, &[IN, HIDDEN]),
        var("l1.bias", 2, &[HIDDEN]),
        var("l2.weight", 3, &[HIDDEN, 1]),
        var("l2.bias", 4, &[1]),
    ]
}

/// Rows `from..to` of the global batch (inputs, targets).
fn batch(from: usize, to: usize) -> (Tensor, Tensor) {
    let all = values(99, 4 * PER_RANK * IN);
    let x = Tensor::from_vec(
        all[from * IN..to * IN].to_vec(),
        (to - from, IN),
        &Device::Cpu,
    );
    let x = x.unwrap();
    let y = x.sin().unwrap().sum_keepdim(1).unwrap();
    (x, y)
}

fn loss(vars: &[(String, Var)], x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    let t = |name: &str| vars.iter().find(|v| v.0 == name).unwrap().1.as_tensor();
    let h = x
        .matmul(t("l1.weight"))?
        .broadcast_add(t("l1.bias"))?
        .relu()?;
    let out = h.matmul(t("l2.weight"))?.broadcast_add(t("l2.bias"))?;
    (out - y)?.sqr()?.mean_all()
}

fn snapshot(vars: &[(String, Var)]) -> Vec<Vec<f32>> {
    vars.iter()
        .map(|(_, v)| {
            v.as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        })
        .collect()
}

/// One process, the whole batch of every rank, the same steps.
fn reference() -> Vec<Vec<f32>> {
    let vars = model(0);
    let mut opt = SGD::new(vars.iter().map(|v| v.1.clone()).collect(), LR).unwrap();
    let (x, y) = batch(0, 4 * PER_RANK);
    for _ in 0..STEPS {
        let grads = loss(&vars, &x, &y).unwrap().backward().unwrap();
        opt.step(&grads).unwrap();
    }
    snapshot(&vars)
}

#[test]
fn four_ranks_equal_one_process_on_the_concatenated_batch() {
    let results = spawn_world(4, Config::default(), |comm| {
        let rank = comm.rank();
        let vars = model(rank as u64); // different on every rank before the broadcast
        let mut ddp = CandleDdp::from_named(comm, vars, DdpConfig::default()).unwrap();
        let vars = ddp.vars().to_vec();
        let start = snapshot(&vars);
        let mut opt = SGD::new(vars.iter().map(|v| v.1.clone()).collect(), LR).unwrap();
        let (x, y) = batch(rank * PER_RANK, (rank + 1) * PER_RANK);
        for step in 0..STEPS {
            let mut grads = loss(&vars, &x, &y).unwrap().backward().unwrap();
            let done = ddp.sync(&mut grads).unwrap();
            assert_eq!(done, Step::Synced { step: step as u64 });
            opt.step(&grads).unwrap();
        }
        Ok((start, snapshot(&vars)))
    });
    let want = reference();
    let rank0_start = snapshot(&model(0));
    let mut first: Option<Vec<Vec<f32>>> = None;
    for (rank, r) in results.into_iter().enumerate() {
        let (start, got) = r.unwrap();
        // from_named sorts by name: l1.bias, l1.weight, l2.bias, l2.weight.
        let order = [1, 0, 3, 2];
        for (i, &k) in order.iter().enumerate() {
            assert_eq!(
                start[i], rank0_start[k],
                "rank {rank}: variable {k} not broadcast"
            );
            let (g, w) = (&got[i], &want[k]);
            let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                diff <= 1e-5 * scale,
                "rank {rank}: variable {k} differs from one process by {diff} (scale {scale})"
            );
        }
        match &first {
            None => first = Some(got),
            Some(f) => assert_eq!(&got, f, "rank {rank}'s replica differs from rank 0's"),
        }
    }
}

#[test]
fn a_variable_without_gradient_is_named_or_reduced_as_zeros() {
    for find_unused in [false, true] {
        let results = spawn_world(2, Config::default(), move |comm| {
            let rank = comm.rank();
            let used =
                Var::from_tensor(&Tensor::ones(4, DType::F32, &Device::Cpu).unwrap()).unwrap();
            let unused =
                Var::from_tensor(&Tensor::ones(3, DType::F32, &Device::Cpu).unwrap()).unwrap();
            let vars = vec![
                ("used".into(), used.clone()),
                ("unused".into(), unused.clone()),
            ];
            let cfg = DdpConfig {
                find_unused_parameters: find_unused,
                ..DdpConfig::default()
            };
            let mut ddp = CandleDdp::new(comm, vars, cfg).unwrap();
            let scale = (rank + 1) as f64;
            let l = (used.as_tensor().sum_all().unwrap() * scale).unwrap();
            let mut grads = l.backward().unwrap();
            let r = ddp.sync(&mut grads);
            Ok((
                r.map_err(|e| e.to_string()),
                grads.get(unused.as_tensor()).cloned(),
                {
                    grads
                        .get(used.as_tensor())
                        .map(|g| g.to_vec1::<f32>().unwrap())
                },
            ))
        });
        for (rank, r) in results.into_iter().enumerate() {
            let (res, unused_grad, used_grad) = r.unwrap();
            if find_unused {
                assert!(res.is_ok(), "rank {rank}: {res:?}");
                let z = unused_grad.expect("the average of the unused one is put in the store");
                assert_eq!(z.to_vec1::<f32>().unwrap(), vec![0.0; 3]);
                assert_eq!(used_grad.unwrap(), vec![1.5; 4]); // mean of 1 and 2
            } else {
                let msg = res.unwrap_err();
                assert!(msg.contains(&format!("rank {rank}")), "{msg}");
                assert!(
                    msg.contains("variable unused received no gradient"),
                    "{msg}"
                );
            }
        }
    }
}

#[test]
fn dtypes_ddp_does_not_reduce_are_refused_by_name() {
    let results = spawn_world(2, Config::default(), |comm| {
        let ids = Var::from_tensor(&Tensor::zeros(4, DType::U32, &Device::Cpu).unwrap()).unwrap();
        let r = CandleDdp::new(comm, vec![("ids".into(), ids)], DdpConfig::default());
        Ok(r.err()
            .map(|e| (matches!(e, Error::InvalidArgument { .. }), e.to_string())))
    });
    for (rank, r) in results.into_iter().enumerate() {
        let (invalid, msg) = r.unwrap().expect("a u32 variable is refused");
        assert!(invalid, "{msg}");
        assert!(
            msg.contains(&format!("rank {rank}: candle ddp new: variable ids is U32")),
            "{msg}"
        );
    }
}

#[test]
fn bf16_and_f64_variables_are_averaged() {
    let results = spawn_world(2, Config::default(), |comm| {
        let rank = comm.rank();
        let a = Var::from_tensor(&Tensor::ones(5, DType::BF16, &Device::Cpu).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::ones(3, DType::F64, &Device::Cpu).unwrap()).unwrap();
        let vars = vec![("a".into(), a.clone()), ("b".into(), b.clone())];
        let mut ddp = CandleDdp::new(comm, vars, DdpConfig::default()).unwrap();
        let k = (rank + 1) as f64; // gradients 1 and 2: averages 1.5
        let l = ((a
            .as_tensor()
            .to_dtype(DType::F64)
            .unwrap()
            .sum_all()
            .unwrap()
            + b.as_tensor().sum_all().unwrap())
        .unwrap()
            * k)
            .unwrap();
        let grads = ddp.backward(&l).unwrap();
        let ga = grads
            .get(a.as_tensor())
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let gb = grads.get(b.as_tensor()).unwrap().to_vec1::<f64>().unwrap();
        Ok((ga, gb))
    });
    for r in results {
        let (ga, gb) = r.unwrap();
        assert_eq!(ga, vec![1.5; 5]);
        assert_eq!(gb, vec![1.5; 3]);
    }
}
