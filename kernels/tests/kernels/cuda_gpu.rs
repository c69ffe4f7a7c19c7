//! The CUDA kernels against the host kernels on a real GPU: every (dtype, op), input counts 1 to
//! 8, sizes from 0 to past 1 Mi elements, aligned and unaligned offsets. Results must be
//! bit-identical (the device runs the same IEEE operations in the same order), except NaN
//! payloads: inputs are NaN-free, but products of 8 inputs overflow and infinity times zero is
//! NaN, which the f16 conversion on the device makes canonical.
//! Without a driver or device the tests print SKIPPED; OXCCL_REQUIRE_GPU=1 makes that a failure.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use oxccl_kernels::cuda::{gpu_or_skip, CudaKernels, MAX_INPUTS};
use oxccl_kernels::{
    finish_avg_bytes, reduce_bytes, scale_bytes, DType, KernelError, ReduceOp, F8E4M3, F8E5M2,
};

fn gpu() -> Option<(Arc<CudaStream>, CudaKernels)> {
    if !gpu_or_skip() {
        return None;
    }
    let ctx = CudaContext::new(0).expect("context");
    let k = CudaKernels::new(&ctx).expect("kernels load");
    Some((ctx.default_stream(), k))
}

/// Deterministic pseudo-random bytes that are valid, NaN-free values of `dt` with small
/// magnitudes (so sums and products stay finite).
fn values(dt: DType, n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(n * dt.size());
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let v = (x % 2001) as f64 / 100.0 - 10.0; // -10.00 ..= 10.00
        let i = (x % 251) as i64 - 125;
        match dt {
            DType::F32 => out.extend_from_slice(&(v as f32).to_ne_bytes()),
            DType::F64 => out.extend_from_slice(&v.to_ne_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f64(v).to_ne_bytes()),
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f64(v).to_ne_bytes()),
            DType::I8 => out.push(i as i8 as u8),
            DType::U8 => out.push(x as u8),
            DType::I32 => out.extend_from_slice(&((x as i32) >> 3).to_ne_bytes()),
            DType::U32 => out.extend_from_slice(&(x as u32).to_ne_bytes()),
            DType::I64 => out.extend_from_slice(&((x as i64) >> 5).to_ne_bytes()),
            DType::U64 => out.extend_from_slice(&x.to_ne_bytes()),
            DType::F8E4M3 => out.push(F8E4M3::from_f64(v).to_bits()),
            DType::F8E5M2 => out.push(F8E5M2::from_f64(v).to_bits()),
        }
    }
    out
}

/// The first element where `got` and `want` differ, NaN payloads aside: products of many inputs
/// overflow to infinity and infinity times zero is NaN, which the device rounds to the canonical
/// NaN (`cvt.rn.f16.f32` gives 0x7fff) where the host keeps the sign (0xfe00). Everything else
/// must be bit-identical.
fn first_difference<'a>(
    dt: DType,
    got: &'a [u8],
    want: &'a [u8],
) -> Option<(usize, &'a [u8], &'a [u8])> {
    assert_eq!(got.len(), want.len());
    let es = dt.size();
    let nan = |b: &[u8]| match dt {
        DType::F32 => f32::from_ne_bytes(b.try_into().unwrap()).is_nan(),
        DType::F64 => f64::from_ne_bytes(b.try_into().unwrap()).is_nan(),
        DType::F16 => half::f16::from_ne_bytes(b.try_into().unwrap()).is_nan(),
        DType::BF16 => half::bf16::from_ne_bytes(b.try_into().unwrap()).is_nan(),
        DType::F8E4M3 => F8E4M3::from_bits(b[0]).is_nan(),
        DType::F8E5M2 => F8E5M2::from_bits(b[0]).is_nan(),
        _ => false,
    };
    got.chunks(es)
        .zip(want.chunks(es))
        .enumerate()
        .find(|(_, (g, w))| g != w && !(nan(g) && nan(w)))
        .map(|(i, (g, w))| (i, g, w))
}

fn host_reduce(dt: DType, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
    let mut acc = inputs[0].clone();
    for i in &inputs[1..] {
        reduce_bytes(dt, op, &mut acc, i).expect("host reduce");
    }
    acc
}

#[test]
fn reduce_matches_the_host_for_every_dtype_op_count_size_and_offset() {
    let Some((stream, k)) = gpu() else { return };
    let sizes = [0usize, 1, 3, 17, 255, 4096 + 5, (1 << 20) + 3];
    for dt in DType::ALL {
        for op in ReduceOp::ALL {
            for &n in &sizes {
                for &inputs in &[1usize, 2, 3, 8] {
                    // Element offsets: all aligned, all equally misaligned, mixed.
                    for offs in [[0usize; 2], [1, 1], [0, 1]] {
                        let es = dt.size();
                        let host: Vec<Vec<u8>> = (0..inputs)
                            .map(|j| values(dt, n, (n * 31 + j) as u64 + 1))
                            .collect();
                        let want = host_reduce(dt, op, &host);
                        let pad = 16;
                        let dev: Vec<_> = host
                            .iter()
                            .map(|h| {
                                let mut b = vec![0u8; h.len() + pad];
                                b[offs[0] * es..offs[0] * es + h.len()].copy_from_slice(h);
                                stream.clone_htod(&b).expect("htod")
                            })
                            .collect();
                        let mut out = stream.alloc_zeros::<u8>(n * es + pad).expect("alloc");
                        {
                            let views: Vec<_> = dev
                                .iter()
                                .map(|d| d.slice(offs[0] * es..offs[0] * es + n * es))
                                .collect();
                            let refs: Vec<_> = views.iter().collect();
                            let mut o = out.slice_mut(offs[1] * es..offs[1] * es + n * es);
                            k.reduce_bytes(&stream, dt, op, &mut o, &refs)
                                .expect("reduce");
                        }
                        let got = stream.clone_dtoh(&out).expect("dtoh");
                        let got = &got[offs[1] * es..offs[1] * es + n * es];
                        if let Some((i, g, w)) = first_difference(dt, got, &want) {
                            panic!(
                                "{dt} {op} n={n} inputs={inputs} offsets={offs:?}: element {i} \
                                 is {g:02x?} on the device, {w:02x?} on the host"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn avg_scale_and_copy_match_the_host() {
    let Some((stream, k)) = gpu() else { return };
    for dt in DType::ALL {
        let n = 100_003;
        let h = values(dt, n, 7);
        let mut want = h.clone();
        finish_avg_bytes(dt, &mut want, 3).expect("host avg");
        let mut d = stream.clone_htod(&h).expect("htod");
        k.finish_avg_bytes(&stream, dt, &mut d.as_view_mut(), 3)
            .expect("avg");
        assert_eq!(stream.clone_dtoh(&d).expect("dtoh"), want, "{dt} avg");
        let mut c = stream.alloc_zeros::<u8>(h.len() + 1).expect("alloc");
        let src = stream.clone_htod(&h).expect("htod");
        k.copy_bytes(&stream, &mut c.slice_mut(1..), &src.as_view())
            .expect("copy");
        assert_eq!(
            &stream.clone_dtoh(&c).expect("dtoh")[1..],
            &h[..],
            "{dt} copy"
        );
        let r = k.scale_bytes(&stream, dt, &mut d.as_view_mut(), 0.5);
        assert_eq!(
            dt.is_float(),
            r.is_ok(),
            "{dt} scale by 0.5 (integers: a bad factor)"
        );
        // Floats by 0.5, integers by -3 (wrapping), out of place as the pre-multiplied sum over
        // CUDA IPC scales an input; the source stays as it was.
        let f = if dt.is_float() { 0.5 } else { -3.0 };
        let mut want = h.clone();
        scale_bytes(dt, &mut want, f).expect("host scale");
        let src = stream.clone_htod(&h).expect("htod");
        let mut dst = stream.alloc_zeros::<u8>(h.len()).expect("alloc");
        {
            let (s, _sg) = src.device_ptr(&stream);
            let (o, _og) = dst.device_ptr_mut(&stream);
            // SAFETY: `s` and `o` are live allocations of `h.len()` bytes each, on this stream.
            unsafe { k.scale_raw(&stream, dt, o, s, h.len(), f) }.expect("scale_raw");
        }
        if let Some((i, g, w)) =
            first_difference(dt, &stream.clone_dtoh(&dst).expect("dtoh"), &want)
        {
            panic!(
                "{dt} scale by {f}: element {i} is {g:02x?} on the device, {w:02x?} on the host"
            );
        }
        assert_eq!(
            stream.clone_dtoh(&src).expect("dtoh"),
            h,
            "{dt} scale source"
        );
    }
}

#[test]
fn bad_arguments_are_errors() {
    let Some((stream, k)) = gpu() else { return };
    let a = stream.alloc_zeros::<u8>(64).expect("alloc");
    let b = stream.alloc_zeros::<u8>(60).expect("alloc");
    let mut o = stream.alloc_zeros::<u8>(64).expect("alloc");
    let (va, vb) = (a.as_view(), b.as_view());
    let r = k.reduce_bytes(
        &stream,
        DType::F32,
        ReduceOp::Sum,
        &mut o.as_view_mut(),
        &[&va, &vb],
    );
    assert!(matches!(r, Err(KernelError::LengthMismatch { .. })));
    let many = vec![&va; MAX_INPUTS + 1];
    let r = k.reduce_bytes(
        &stream,
        DType::F32,
        ReduceOp::Sum,
        &mut o.as_view_mut(),
        &many,
    );
    assert!(matches!(r, Err(KernelError::Inputs(9))));
}

/// Every pair of fp8 patterns (65536 elements: NaNs, infinities, the largest values, subnormals,
/// zeros of both signs) under every op, and every pattern divided and scaled: the device's
/// conversions (hardware `cvt.rn.satfinite` from sm_89) round and saturate as the host's do.
#[test]
fn fp8_every_pair_of_patterns_matches_the_host() {
    let Some((stream, k)) = gpu() else { return };
    let a: Vec<u8> = (0..65536u32).map(|i| (i >> 8) as u8).collect();
    let b: Vec<u8> = (0..65536u32).map(|i| i as u8).collect();
    let patterns: Vec<u8> = (0..=255u8).collect();
    for dt in [DType::F8E4M3, DType::F8E5M2] {
        let (da, db) = (
            stream.clone_htod(&a).expect("htod"),
            stream.clone_htod(&b).expect("htod"),
        );
        for op in ReduceOp::ALL {
            let want = host_reduce(dt, op, &[a.clone(), b.clone()]);
            let mut out = stream.alloc_zeros::<u8>(a.len()).expect("alloc");
            let (va, vb) = (da.as_view(), db.as_view());
            k.reduce_bytes(&stream, dt, op, &mut out.as_view_mut(), &[&va, &vb])
                .expect("reduce");
            let got = stream.clone_dtoh(&out).expect("dtoh");
            if let Some((i, g, w)) = first_difference(dt, &got, &want) {
                panic!(
                    "{dt} {op}: {:#04x} {op} {:#04x} is {g:02x?} on the device, {w:02x?} on \
                     the host",
                    a[i], b[i]
                );
            }
        }
        let mut want = patterns.clone();
        finish_avg_bytes(dt, &mut want, 3).expect("host avg");
        let mut d = stream.clone_htod(&patterns).expect("htod");
        k.finish_avg_bytes(&stream, dt, &mut d.as_view_mut(), 3)
            .expect("avg");
        let got = stream.clone_dtoh(&d).expect("dtoh");
        if let Some((i, g, w)) = first_difference(dt, &got, &want) {
            panic!("{dt} avg of {i:#04x}: {g:02x?} on the device, {w:02x?} on the host");
        }
        let mut d = stream.clone_htod(&patterns).expect("htod");
        k.scale_bytes(&stream, dt, &mut d.as_view_mut(), 3.0)
            .expect("scale");
        let got = stream.clone_dtoh(&d).expect("dtoh");
        let want: Vec<u8> = patterns
            .iter()
            .map(|&p| match dt {
                DType::F8E4M3 => F8E4M3::from_f32(F8E4M3::from_bits(p).to_f32() * 3.0).to_bits(),
                _ => F8E5M2::from_f32(F8E5M2::from_bits(p).to_f32() * 3.0).to_bits(),
            })
            .collect();
        if let Some((i, g, w)) = first_difference(dt, &got, &want) {
            panic!("{dt} scale of {i:#04x} by 3: {g:02x?} on the device, {w:02x?} on the host");
        }
    }
}
