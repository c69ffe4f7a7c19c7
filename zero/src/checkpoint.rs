//! Checkpoints of the sharded optimizer, in safetensors files.
//!
//! [`Zero::save`](crate::Zero::save) writes a directory: one file per shard of the shard group
//! (`shard-00001-of-00004.safetensors`), written by the ranks of the first replica, whose
//! tensors are the shard's pieces of each parameter (`"{param}.{offset}.master"` and
//! `"{param}.{offset}.{state}"`, f32, one dimension), and a manifest, `zero.json` (the optimizer,
//! its state names, the step, the parameters' lengths, the files).
//!
//! [`consolidate`] reads such a directory into one [`FullState`]: every parameter's master
//! weights and optimizer state, whole. It needs no communicator, so it also runs offline;
//! [`FullState::save`] writes it as one safetensors file (`"{param}.master"`,
//! `"{param}.{state}"`). [`Zero::load`](crate::Zero::load) and
//! [`Zero::load_state`](crate::Zero::load_state) take each rank's pieces out of the whole state,
//! which is what lets a checkpoint saved by a shard group of 4 resume on 2, or on 1.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};

use crate::error::{Result, ZeroError};
use crate::shard::Piece;

/// The manifest's name in a checkpoint directory.
pub const MANIFEST: &str = "zero.json";
const FORMAT: &str = "oxccl-zero/1";

/// One parameter's master weights and optimizer state, whole.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamState {
    /// f32 master weights.
    pub master: Vec<f32>,
    /// One vector per state name (e.g. AdamW's `exp_avg`, `exp_avg_sq`), as long as `master`.
    pub state: Vec<Vec<f32>>,
}

/// The whole optimizer state: every parameter's, consolidated from the shards.
#[derive(Clone, Debug, PartialEq)]
pub struct FullState {
    /// The optimizer's name ([`ShardOptimizer::name`](crate::ShardOptimizer::name)).
    pub optimizer: String,
    /// Its state vectors' names.
    pub state_names: Vec<String>,
    /// Steps taken.
    pub step: u64,
    /// Per parameter.
    pub params: Vec<ParamState>,
}

/// The manifest of a sharded checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Manifest {
    pub format: String,
    pub optimizer: String,
    pub state_names: Vec<String>,
    pub step: u64,
    pub lens: Vec<usize>,
    pub files: Vec<String>,
}

fn bad(path: &Path, msg: impl std::fmt::Display) -> ZeroError {
    ZeroError::Checkpoint {
        path: path.to_path_buf(),
        msg: msg.to_string(),
    }
}

/// The file of shard `r` of `group`.
pub(crate) fn shard_file(r: usize, group: usize) -> String {
    format!("shard-{r:05}-of-{group:05}.safetensors")
}

fn to_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn to_f32s(path: &Path, name: &str, t: &TensorView<'_>) -> Result<Vec<f32>> {
    if t.dtype() != Dtype::F32 || t.shape().len() != 1 {
        let msg = format!(
            "{name}: {:?} of shape {:?}, not f32 of one dimension",
            t.dtype(),
            t.shape()
        );
        return Err(bad(path, msg));
    }
    let data = t.data();
    Ok(data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Writes `tensors` (name, f32 data) to `path` with `meta`.
fn write(
    path: &Path,
    tensors: Vec<(String, Vec<u8>)>,
    meta: HashMap<String, String>,
) -> Result<()> {
    let mut views = Vec::with_capacity(tensors.len());
    for (name, bytes) in &tensors {
        let view =
            TensorView::new(Dtype::F32, vec![bytes.len() / 4], bytes).map_err(|e| bad(path, e))?;
        views.push((name.clone(), view));
    }
    safetensors::serialize_to_file(views, Some(meta), path).map_err(|e| bad(path, e))
}

/// One shard's file: its pieces' master weights and state (`state` laid out piece by piece:
/// `per` vectors of each piece's length at `per * shard_offset`).
pub(crate) fn write_shard(
    path: &Path,
    pieces: &[Piece],
    names: &[String],
    master: &[f32],
    state: &[f32],
) -> Result<()> {
    let per = names.len();
    let mut tensors = Vec::with_capacity(pieces.len() * (1 + per));
    for pc in pieces {
        let (a, n) = (pc.shard_offset, pc.len);
        let key = format!("{}.{}", pc.param, pc.param_offset);
        tensors.push((format!("{key}.master"), to_bytes(&master[a..a + n])));
        for (k, name) in names.iter().enumerate() {
            let s = &state[per * a + k * n..per * a + (k + 1) * n];
            tensors.push((format!("{key}.{name}"), to_bytes(s)));
        }
    }
    let meta = HashMap::from([("format".to_string(), FORMAT.to_string())]);
    write(path, tensors, meta)
}

impl Manifest {
    /// The manifest of a checkpoint of `optimizer` (its state vectors `state_names`) after
    /// `step` steps, of parameters of `lens`, in shard files for a group of `group`.
    pub(crate) fn new(
        optimizer: &str,
        state_names: Vec<String>,
        step: u64,
        lens: &[usize],
        group: usize,
    ) -> Manifest {
        Manifest {
            format: FORMAT.to_string(),
            optimizer: optimizer.to_string(),
            state_names,
            step,
            lens: lens.to_vec(),
            files: (0..group).map(|r| shard_file(r, group)).collect(),
        }
    }
}

pub(crate) fn write_manifest(dir: &Path, m: &Manifest) -> Result<()> {
    let path = dir.join(MANIFEST);
    let text = serde_json::to_string_pretty(m).map_err(|e| bad(&path, e))?;
    std::fs::write(&path, text).map_err(|e| bad(&path, e))
}

/// Reads a checkpoint directory written by [`Zero::save`](crate::Zero::save) into the whole
/// state, checking that the shards cover every element exactly once.
///
/// # Errors
/// [`ZeroError::Checkpoint`] naming the file and what is wrong in it (missing, unreadable, a
/// tensor of another type or outside its parameter, elements missing or written twice).
pub fn consolidate(dir: impl AsRef<Path>) -> Result<FullState> {
    let dir = dir.as_ref();
    let mpath = dir.join(MANIFEST);
    let text = std::fs::read_to_string(&mpath).map_err(|e| bad(&mpath, e))?;
    let m: Manifest = serde_json::from_str(&text).map_err(|e| bad(&mpath, e))?;
    if m.format != FORMAT {
        return Err(bad(
            &mpath,
            format!("format {:?}, not {FORMAT:?}", m.format),
        ));
    }
    let per = m.state_names.len();
    let mut params: Vec<ParamState> = m
        .lens
        .iter()
        .map(|&n| ParamState {
            master: vec![0.0; n],
            state: vec![vec![0.0; n]; per],
        })
        .collect();
    let mut seen: Vec<Vec<bool>> = m.lens.iter().map(|&n| vec![false; n]).collect();
    for f in &m.files {
        let path = dir.join(f);
        let bytes = std::fs::read(&path).map_err(|e| bad(&path, e))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(&path, e))?;
        for (name, t) in st.tensors() {
            let (p, off, kind) = parse_name(&name)
                .ok_or_else(|| bad(&path, format!("tensor {name:?}: not param.offset.kind")))?;
            let data = to_f32s(&path, &name, &t)?;
            let Some(ps) = params.get_mut(p) else {
                return Err(bad(&path, format!("tensor {name}: no parameter {p}")));
            };
            if off + data.len() > ps.master.len() {
                let msg = format!(
                    "tensor {name}: {} elements past parameter {p}'s {}",
                    data.len(),
                    ps.master.len()
                );
                return Err(bad(&path, msg));
            }
            let dst = if kind == "master" {
                for s in &mut seen[p][off..off + data.len()] {
                    if *s {
                        return Err(bad(&path, format!("tensor {name}: elements given twice")));
                    }
                    *s = true;
                }
                &mut ps.master
            } else {
                let k = m
                    .state_names
                    .iter()
                    .position(|n| n == kind)
                    .ok_or_else(|| {
                        bad(
                            &path,
                            format!("tensor {name}: no state {kind:?} in {:?}", m.state_names),
                        )
                    })?;
                &mut ps.state[k]
            };
            dst[off..off + data.len()].copy_from_slice(&data);
        }
    }
    if let Some(p) = seen.iter().position(|s| s.iter().any(|&x| !x)) {
        return Err(bad(
            dir,
            format!("parameter {p}: elements in no shard file"),
        ));
    }
    Ok(FullState {
        optimizer: m.optimizer,
        state_names: m.state_names,
        step: m.step,
        params,
    })
}

/// `"{param}.{offset}.{kind}"`.
fn parse_name(name: &str) -> Option<(usize, usize, &str)> {
    let mut it = name.splitn(3, '.');
    let p = it.next()?.parse().ok()?;
    let off = it.next()?.parse().ok()?;
    Some((p, off, it.next()?))
}

impl FullState {
    /// Writes the whole state as one safetensors file (`"{param}.master"`, `"{param}.{state}"`;
    /// the optimizer, step and state names in the header's metadata).
    ///
    /// # Errors
    /// [`ZeroError::Checkpoint`] when the file cannot be written.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let mut tensors = Vec::new();
        for (p, ps) in self.params.iter().enumerate() {
            tensors.push((format!("{p}.master"), to_bytes(&ps.master)));
            for (name, s) in self.state_names.iter().zip(&ps.state) {
                tensors.push((format!("{p}.{name}"), to_bytes(s)));
            }
        }
        let names = serde_json::to_string(&self.state_names).map_err(|e| bad(path, e))?;
        let meta = HashMap::from([
            ("format".to_string(), format!("{FORMAT}-full")),
            ("optimizer".to_string(), self.optimizer.clone()),
            ("step".to_string(), self.step.to_string()),
            ("state_names".to_string(), names),
            ("params".to_string(), self.params.len().to_string()),
        ]);
        write(path, tensors, meta)
    }

    /// Reads a file written by [`FullState::save`].
    ///
    /// # Errors
    /// [`ZeroError::Checkpoint`] naming what is missing or wrong.
    pub fn load(path: impl AsRef<Path>) -> Result<FullState> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| bad(path, e))?;
        let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(path, e))?;
        let meta = header.metadata().clone().unwrap_or_default();
        let get = |k: &str| {
            meta.get(k)
                .cloned()
                .ok_or_else(|| bad(path, format!("no {k:?} in the metadata")))
        };
        let state_names: Vec<String> =
            serde_json::from_str(&get("state_names")?).map_err(|e| bad(path, e))?;
        let step = get("step")?.parse().map_err(|e| bad(path, e))?;
        let n: usize = get("params")?.parse().map_err(|e| bad(path, e))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(path, e))?;
        let tensor = |name: String| -> Result<Vec<f32>> {
            let t = st.tensor(&name).map_err(|e| bad(path, e))?;
            to_f32s(path, &name, &t)
        };
        let mut params = Vec::with_capacity(n);
        for p in 0..n {
            let master = tensor(format!("{p}.master"))?;
            let state = state_names
                .iter()
                .map(|s| tensor(format!("{p}.{s}")))
                .collect::<Result<Vec<_>>>()?;
            if state.iter().any(|s| s.len() != master.len()) {
                return Err(bad(
                    path,
                    format!("parameter {p}: state of another length than its master weights"),
                ));
            }
            params.push(ParamState { master, state });
        }
        Ok(FullState {
            optimizer: get("optimizer")?,
            state_names,
            step,
            params,
        })
    }
}
