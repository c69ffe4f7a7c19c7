//! The device exchange protocol without a GPU: a pipeline whose payloads go in a batch of their
//! own after the headers' ([`Place::Split`], as on a device) receives exactly what the host
//! protocol does, through shapes and dtypes that change between steps, at every schedule.

use oxccl_comm::harness::spawn_world;
use oxccl_comm::{Config, DType};

use super::place::Place;
use super::{Pipeline, PipelineConfig, Stage};
use crate::error::BoxError;
use crate::schedule::{ScheduleKind, Step};
use crate::tensor::Tensor;

/// Every tensor a stage received: (what, micro-batch, chunk, its dtype and shape, its bytes).
type Seen = Vec<(&'static str, usize, usize, String, Vec<u8>)>;

/// Stages that relay numbered tensors: the first stage makes two (f32 `[rows, 3]` and a second
/// whose dtype and length depend on the step), every other adds its stage number to each
/// element; gradients come back the same way from the last stage.
struct Relay {
    p: usize,
    rank: usize,
    stages: usize,
    step: usize,
    seen: Seen,
}

impl Relay {
    fn stage(&self, st: Step) -> usize {
        st.chunk * self.p + self.rank
    }

    fn rows(&self) -> usize {
        [2, 3, 3, 1][self.step % 4]
    }

    fn make(&self, mb: usize, base: f32) -> Vec<Tensor> {
        let n = self.rows() * 3;
        let a: Vec<f32> = (0..n).map(|i| base + (mb * 100 + i) as f32).collect();
        let second = if self.step == 2 {
            Tensor::from_slice(&[base as f64 + mb as f64; 2])
        } else {
            Tensor::from_slice(&vec![base + mb as f32; self.step + 1])
        };
        vec![Tensor::new(&[self.rows(), 3], &a).unwrap(), second]
    }

    fn bump(&mut self, what: &'static str, st: Step, ts: Vec<Tensor>) -> Vec<Tensor> {
        let add = self.stage(st) as f64;
        ts.into_iter()
            .map(|mut t| {
                let bytes = t.bytes().unwrap().to_vec();
                self.seen
                    .push((what, st.mb, st.chunk, t.meta().to_string(), bytes));
                if let Some(v) = t.as_mut_slice::<f32>() {
                    v.iter_mut().for_each(|x| *x += add as f32);
                } else if let Some(v) = t.as_mut_slice::<f64>() {
                    v.iter_mut().for_each(|x| *x += add);
                }
                t
            })
            .collect()
    }
}

impl Stage for Relay {
    fn forward(&mut self, st: Step, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        if self.stage(st) == 0 {
            return Ok(self.make(st.mb, 0.5));
        }
        Ok(self.bump("activations", st, inputs))
    }

    fn backward(&mut self, st: Step, grads: Vec<Tensor>) -> Result<Vec<Tensor>, BoxError> {
        if self.stage(st) + 1 == self.stages {
            return Ok(self.make(st.mb, -7.0));
        }
        Ok(self.bump("gradients", st, grads))
    }
}

/// Four steps of `kind` on 3 ranks at `place`: what each rank received, and the shape rounds.
fn play(kind: ScheduleKind, v: usize, split: bool) -> Vec<(Seen, u64)> {
    let cfg = Config {
        timeout: std::time::Duration::from_secs(30),
        ..Config::default()
    };
    spawn_world(3, cfg, move |comm| {
        let place = if split { Place::Split } else { Place::Host };
        let pc = PipelineConfig {
            chunks: v,
            ..PipelineConfig::new(kind, 4)
        };
        let mut pipe = Pipeline::make(&comm, pc, place)
            .map_err(|e| oxccl_comm::Error::Config(e.to_string()))?;
        let mut relay = Relay {
            p: 3,
            rank: comm.rank(),
            stages: 3 * v,
            step: 0,
            seen: Vec::new(),
        };
        for step in 0..4 {
            relay.step = step;
            pipe.step(&mut relay)
                .map_err(|e| oxccl_comm::Error::Config(e.to_string()))?;
        }
        Ok((relay.seen, pipe.shape_exchanges()))
    })
    .into_iter()
    .collect::<oxccl_comm::Result<_>>()
    .unwrap()
}

#[test]
fn payloads_after_the_headers_receive_what_the_host_protocol_does() {
    for (kind, v) in [
        (ScheduleKind::GPipe, 1),
        (ScheduleKind::OneFOneB, 1),
        (ScheduleKind::Interleaved, 2),
        (ScheduleKind::ZeroBubbleH1, 1),
    ] {
        let host = play(kind, v, false);
        let split = play(kind, v, true);
        for (r, ((h, hs), (s, ss))) in host.iter().zip(&split).enumerate() {
            assert!(
                !h.is_empty() || r == 0 && v == 1,
                "{kind} rank {r} received nothing"
            );
            assert_eq!(
                h, s,
                "{kind} v {v} rank {r}: split payloads differ from the host's"
            );
            assert_eq!(hs, ss, "{kind} rank {r}: shape rounds");
        }
        // The last stage's first micro-batch of step 1: rows 3, f32 values 0.5 + i plus
        // every stage's number before it.
        let last = &split[2].0;
        let (_, _, _, meta, bytes) = last
            .iter()
            .filter(|e| e.0 == "activations" && e.1 == 0 && e.2 == v - 1)
            .nth(2)
            .expect("step 1's first activations on the last stage");
        assert_eq!(meta, &format!("{} [3, 3]", DType::F32.short_name()));
        let got: &[f32] = bytemuck::cast_slice(bytes);
        let before: usize = (1..3 * v - 1).sum();
        assert_eq!(got[4], 0.5 + 4.0 + before as f32, "{kind}");
    }
}
