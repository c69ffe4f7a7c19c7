//! The generated CUDA C: the entry point of every kernel, one line each, named from [`table`]
//! as the Rust dispatch names them, appended to [`BASE_SOURCE`] whole ([`source`]) or in
//! [`PARTS`] parts ([`part_sources`]).

use super::{
    ADAMW_KERNEL, BARRIER_KERNEL, BASE_SOURCE, CAST_PAIRS, COPY_KERNEL, KERNEL_OPS,
    P2P_POST_KERNEL, P2P_WAIT_KERNEL, SGD_KERNEL,
};
use crate::{DType, ReduceOp};

/// Every `(dtype, op)` pair that has a reduce kernel: the one list the generated CUDA source and
/// the Rust dispatch are both built from.
pub fn table() -> impl Iterator<Item = (DType, ReduceOp)> {
    DType::ALL
        .into_iter()
        .flat_map(|d| KERNEL_OPS.into_iter().map(move |o| (d, o)))
}

/// The C type of `dt` in the CUDA source (the source typedefs the short names).
fn ctype(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "float",
        DType::F64 => "double",
        other => other.short_name(),
    }
}

/// The kernel an operation runs: `Avg` and `PreMulSum` combine as `Sum`.
fn kernel_op(op: ReduceOp) -> ReduceOp {
    match op {
        ReduceOp::Avg | ReduceOp::PreMulSum(_) => ReduceOp::Sum,
        op => op,
    }
}

fn op_struct(op: ReduceOp) -> &'static str {
    match kernel_op(op) {
        ReduceOp::Prod => "OpProd",
        ReduceOp::Min => "OpMin",
        ReduceOp::Max => "OpMax",
        _ => "OpSum",
    }
}

/// Name of the reduce kernel for `(dt, op)` (`Avg` and `PreMulSum` share the sum kernel).
pub fn reduce_kernel_name(dt: DType, op: ReduceOp) -> String {
    format!("oxccl_reduce_{}_{}", dt.short_name(), kernel_op(op).name())
}

/// Name of the divide kernel for `dt`.
pub fn div_kernel_name(dt: DType) -> String {
    format!("oxccl_div_{}", dt.short_name())
}

/// Name of the scale kernel for `dt` (a float factor for the float types, a whole one modulo
/// 2^64 for the integers).
pub fn scale_kernel_name(dt: DType) -> String {
    format!("oxccl_scale_{}", dt.short_name())
}

/// Name of the conversion kernel from `src` to `dst` (the pairs of [`CAST_PAIRS`]).
pub fn cast_kernel_name(src: DType, dst: DType) -> String {
    format!("oxccl_cast_{}_{}", src.short_name(), dst.short_name())
}

/// Every kernel name [`source`] defines.
pub fn kernel_names() -> Vec<String> {
    let mut names: Vec<String> = table().map(|(d, o)| reduce_kernel_name(d, o)).collect();
    names.extend(DType::ALL.into_iter().map(div_kernel_name));
    names.extend(DType::ALL.into_iter().map(scale_kernel_name));
    names.extend(CAST_PAIRS.iter().map(|&(s, d)| cast_kernel_name(s, d)));
    names.push(ADAMW_KERNEL.to_string());
    names.push(SGD_KERNEL.to_string());
    names.push(COPY_KERNEL.to_string());
    names.extend([BARRIER_KERNEL, P2P_WAIT_KERNEL, P2P_POST_KERNEL].map(String::from));
    names
}

/// Every generated entry point: its name and its one line of CUDA C (one per [`table`] entry,
/// the divide and scale kernels of every dtype, and the copy kernel). The barrier kernel is
/// written out in [`BASE_SOURCE`].
fn entries() -> Vec<(String, String)> {
    let mut e = Vec::new();
    for (dt, op) in table() {
        let name = reduce_kernel_name(dt, op);
        let line = format!(
            "extern \"C\" __global__ void {name}({t}* dst, Inputs in, int k, usize n) \
             {{ reduce_any<{t}, {o}>(dst, in, k, n); }}",
            t = ctype(dt),
            o = op_struct(op),
        );
        e.push((name, line));
    }
    for dt in DType::ALL {
        let name = div_kernel_name(dt);
        let line = format!(
            "extern \"C\" __global__ void {name}({t}* dst, const {t}* src, u64 d, usize n) \
             {{ div_elems<{t}>(dst, src, d, n); }}",
            t = ctype(dt),
        );
        e.push((name, line));
        let (arg, body) = if dt.is_float() {
            ("double f", "scale_elems")
        } else {
            ("u64 f", "scale_int_elems")
        };
        let line = format!(
            "extern \"C\" __global__ void {name}({t}* dst, const {t}* src, {arg}, usize n) \
             {{ {body}<{t}>(dst, src, f, n); }}",
            name = scale_kernel_name(dt),
            t = ctype(dt),
        );
        e.push((scale_kernel_name(dt), line));
    }
    for &(src, dst) in &CAST_PAIRS {
        let name = cast_kernel_name(src, dst);
        let line = format!(
            "extern \"C\" __global__ void {name}({d}* dst, const {s}* src, double f, usize n) \
             {{ cast_elems<{s}, {d}>(dst, src, f, n); }}",
            s = ctype(src),
            d = ctype(dst),
        );
        e.push((name, line));
    }
    e.push((
        ADAMW_KERNEL.to_string(),
        format!(
            "extern \"C\" __global__ void {ADAMW_KERNEL}(float* p, const float* g, float* m, \
             float* v, usize n, float lr, float decay, float b1, float omb1, float b2, \
             float omb2, float eps, float c1, float c2) \
             {{ adamw_elems(p, g, m, v, n, lr, decay, b1, omb1, b2, omb2, eps, c1, c2); }}"
        ),
    ));
    e.push((
        SGD_KERNEL.to_string(),
        format!(
            "extern \"C\" __global__ void {SGD_KERNEL}(float* p, const float* g, float* buf, \
             usize n, float lr, float wd, float momentum, float omd, int nesterov, int first) \
             {{ sgd_elems(p, g, buf, n, lr, wd, momentum, omd, nesterov, first); }}"
        ),
    ));
    e.push((
        COPY_KERNEL.to_string(),
        format!(
            "extern \"C\" __global__ void {COPY_KERNEL}(u8* dst, const u8* src, usize n) \
             {{ copy_bytes(dst, src, n); }}"
        ),
    ));
    e
}

/// The complete CUDA C source: [`BASE_SOURCE`] plus every generated entry point (for reading;
/// the kernels are compiled from [`part_sources`]).
pub fn source() -> String {
    let mut s = String::from(BASE_SOURCE);
    for (_, line) in entries() {
        s.push_str(&line);
        s.push('\n');
    }
    s
}

/// Into how many sources the entry points are split, compiled by NVRTC at the same time and
/// loaded as as many modules: compiling the whole table as one program keeps NVRTC busy on one
/// core for about 6 s, most of it in the reduce kernels, which the first device collective on a
/// machine with empty caches waited for; in parts it takes about that divided by the cores (up
/// to this many: 3 s on 2 cores). A fixed number, so a part's source, and so its cache key, is
/// the same everywhere.
pub const PARTS: usize = 8;

/// The [`PARTS`] sources: each is [`BASE_SOURCE`] (templates, and the barrier kernel, which part
/// 0 provides) plus every `PARTS`-th generated entry point, with the names it defines.
pub fn part_sources() -> Vec<(Vec<String>, String)> {
    let mut parts: Vec<(Vec<String>, String)> = (0..PARTS)
        .map(|_| (Vec::new(), String::from(BASE_SOURCE)))
        .collect();
    for (i, (name, line)) in entries().into_iter().enumerate() {
        let (names, src) = &mut parts[i % PARTS];
        names.push(name);
        src.push_str(&line);
        src.push('\n');
    }
    parts[0]
        .0
        .extend([BARRIER_KERNEL, P2P_WAIT_KERNEL, P2P_POST_KERNEL].map(String::from));
    parts
}
