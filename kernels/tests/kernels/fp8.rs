//! The fp8 types against the `float8` crate (a port of CUDA's `cuda_fp8.hpp` conversions, used
//! here as the independent reference): every pattern decoded, a million `f32` and `f64` values
//! encoded, and the saturating behaviour of reductions; and the CUDA source's own software
//! conversions (what devices before sm_89 run), compiled for the host by a C++ compiler and run
//! on the same values.

use oxccl_kernels::{reduce, reduce_bytes, DType, ReduceOp, F8E4M3, F8E5M2};

use crate::common::Rng;

/// Same bits, or both NaN (the NaN patterns differ: oxccl makes `0x7f`, `float8` `0x7e` for
/// E5M2; both are NaN).
fn agree(ours: u8, theirs: u8, nan: impl Fn(u8) -> bool) -> bool {
    ours == theirs || (nan(ours) && nan(theirs))
}

fn e4m3_nan(b: u8) -> bool {
    b & 0x7f == 0x7f
}

fn e5m2_nan(b: u8) -> bool {
    b & 0x7f > 0x7c
}

#[test]
fn every_pattern_decodes_as_the_reference() {
    for b in 0..=255u8 {
        let (ours, theirs) = (
            F8E4M3::from_bits(b).to_f32(),
            float8::F8E4M3::from_bits(b).to_f32(),
        );
        assert!(
            ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
            "e4m3 {b:#04x}: {ours} vs {theirs}"
        );
        assert_eq!(ours.is_nan(), e4m3_nan(b), "e4m3 {b:#04x}");
        let (ours, theirs) = (
            F8E5M2::from_bits(b).to_f32(),
            float8::F8E5M2::from_bits(b).to_f32(),
        );
        assert!(
            ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
            "e5m2 {b:#04x}: {ours} vs {theirs}"
        );
        assert_eq!(ours.is_nan(), e5m2_nan(b), "e5m2 {b:#04x}");
        let (wide, narrow) = (F8E5M2::from_bits(b).to_f64(), F8E5M2::from_bits(b).to_f32());
        assert!(wide == f64::from(narrow) || wide.is_nan() && narrow.is_nan());
    }
}

/// `f32` inputs that cover every sign and exponent with the fraction bits that decide rounding
/// (just below, at and above each tie of both formats), plus random patterns.
fn f32_samples() -> Vec<f32> {
    let mut v = Vec::new();
    let lows: [u32; 9] = [
        0, 1, 0x7_fff, 0x8_000, 0x8_001, 0xf_fff, 0x10_000, 0x10_001, 0x1f_ffff,
    ];
    for sign_exp in 0..512u32 {
        for top in 0..8u32 {
            for low in lows {
                v.push(f32::from_bits(
                    sign_exp << 23 | top << 20 | (low & 0xf_ffff),
                ));
                v.push(f32::from_bits(
                    sign_exp << 23 | top << 21 | (low & 0x1f_ffff),
                ));
            }
        }
    }
    let mut rng = Rng::new(0xf8);
    v.extend((0..1 << 19).map(|_| f32::from_bits(rng.next_u64() as u32)));
    v
}

#[test]
fn f32_encodes_as_the_reference() {
    for x in f32_samples() {
        let (ours, theirs) = (
            F8E4M3::from_f32(x).to_bits(),
            float8::F8E4M3::from_f32(x).to_bits(),
        );
        assert!(
            agree(ours, theirs, e4m3_nan),
            "e4m3 of {x:e} ({:#010x}): {ours:#04x} vs {theirs:#04x}",
            x.to_bits()
        );
        let (ours, theirs) = (
            F8E5M2::from_f32(x).to_bits(),
            float8::F8E5M2::from_f32(x).to_bits(),
        );
        assert!(
            agree(ours, theirs, e5m2_nan),
            "e5m2 of {x:e} ({:#010x}): {ours:#04x} vs {theirs:#04x}",
            x.to_bits()
        );
        // The general (branching) algorithm of the f64 path agrees with the fast f32 one on the
        // same values, ties included (f32 -> f64 is exact).
        let wide = f64::from(x);
        assert_eq!(
            F8E4M3::from_f64(wide).to_bits(),
            F8E4M3::from_f32(x).to_bits(),
            "{x:e}"
        );
        assert_eq!(
            F8E5M2::from_f64(wide).to_bits(),
            F8E5M2::from_f32(x).to_bits(),
            "{x:e}"
        );
    }
}

#[test]
fn f64_encodes_as_the_reference() {
    let mut rng = Rng::new(0xf64);
    for i in 0..(1 << 19) {
        // Half the values near the formats' range, half anywhere.
        let x = if i % 2 == 0 {
            rng.sym(1e5) * 2f64.powi((rng.next_u64() % 40) as i32 - 30)
        } else {
            f64::from_bits(rng.next_u64())
        };
        let (ours, theirs) = (
            F8E4M3::from_f64(x).to_bits(),
            float8::F8E4M3::from_f64(x).to_bits(),
        );
        assert!(
            agree(ours, theirs, e4m3_nan),
            "e4m3 of {x:e}: {ours:#04x} vs {theirs:#04x}"
        );
        let (ours, theirs) = (
            F8E5M2::from_f64(x).to_bits(),
            float8::F8E5M2::from_f64(x).to_bits(),
        );
        assert!(
            agree(ours, theirs, e5m2_nan),
            "e5m2 of {x:e}: {ours:#04x} vs {theirs:#04x}"
        );
    }
}

#[test]
fn reductions_saturate_and_propagate_nan() {
    let e4 = F8E4M3::from_f32;
    let mut d = [e4(448.0), e4(-448.0), e4(3.0), e4(f32::NAN), e4(1.0)];
    reduce(
        &mut d,
        &[e4(448.0), e4(-100.0), e4(0.25), e4(1.0), e4(f32::NAN)],
        ReduceOp::Sum,
    )
    .unwrap();
    assert_eq!(d[0].to_f32(), 448.0, "saturates instead of becoming NaN");
    assert_eq!(d[1].to_f32(), -448.0);
    assert_eq!(d[2].to_f32(), 3.25);
    assert!(d[3].is_nan() && d[4].is_nan());

    let e5 = F8E5M2::from_f32;
    let mut d = [e5(57344.0), F8E5M2::from_bits(0x7c), e5(2.0)];
    reduce(&mut d, &[e5(57344.0), e5(1.0), e5(f32::NAN)], ReduceOp::Max).unwrap();
    assert_eq!(d[0].to_f32(), 57344.0);
    assert_eq!(
        d[1].to_f32(),
        57344.0,
        "an infinity saturates when rounded back"
    );
    assert!(d[2].is_nan(), "max propagates NaN");

    // Byte form; products round after the step: 1.25^2 = 1.5625 is a tie, to even (1.5).
    let mut b = [e4(1.25).to_bits(), e4(3.0).to_bits()];
    let src = [e4(1.25).to_bits(), e4(5.0).to_bits()];
    reduce_bytes(DType::F8E4M3, ReduceOp::Prod, &mut b, &src).unwrap();
    assert_eq!(F8E4M3::from_bits(b[0]).to_f32(), 1.5);
    assert_eq!(F8E4M3::from_bits(b[1]).to_f32(), 15.0);
}

/// The section of the CUDA source between `OXCCL_FP8_BEGIN` and `OXCCL_FP8_END`, with the CUDA
/// intrinsics it uses defined for the host (bit casts, and `__float2int_rn` as `nearbyint` in
/// the default round-to-nearest-even mode).
fn device_section_as_cpp() -> String {
    let src = include_str!("../../cuda/oxccl_kernels.cu");
    let begin = src.find("OXCCL_FP8_BEGIN").expect("OXCCL_FP8_BEGIN marker");
    let end = src.find("// OXCCL_FP8_END").expect("OXCCL_FP8_END marker");
    let section = &src[src[..begin].rfind('\n').unwrap_or(0)..end];
    format!(
        r#"#include <cmath>
#include <cstdio>
#include <cstring>
typedef unsigned char u8;
typedef unsigned int u32;
#define __device__
#define __forceinline__ inline
static inline u32 __float_as_uint(float f) {{ u32 u; std::memcpy(&u, &f, 4); return u; }}
static inline float __uint_as_float(u32 u) {{ float f; std::memcpy(&f, &u, 4); return f; }}
static inline int __float2int_rn(float f) {{ return (int)std::nearbyint(f); }}
{section}
int main(int argc, char** argv) {{
    if (argc != 3) return 2;
    FILE* in = std::fopen(argv[1], "rb");
    FILE* out = std::fopen(argv[2], "wb");
    if (!in || !out) return 3;
    for (u32 b = 0; b < 256; b++) {{
        u32 bits = __float_as_uint(e4m3_to_f32_soft(b));
        std::fwrite(&bits, 4, 1, out);
    }}
    u32 x;
    while (std::fread(&x, 4, 1, in) == 1) {{
        float f = __uint_as_float(x);
        u8 r[2] = {{(u8)f32_to_e4m3_soft(f), (u8)f32_to_e5m2_soft(f)}};
        std::fwrite(r, 1, 2, out);
    }}
    return std::fclose(out) == 0 ? 0 : 4;
}}
"#
    )
}

/// The CUDA source's software fp8 conversions agree with the host's on every decode and on the
/// million `f32` samples. Needs a C++ compiler (`$CXX`, else `c++`); without one the test says
/// so and passes, unless `OXCCL_REQUIRE_CXX=1` (CI sets it).
#[test]
fn cuda_software_conversions_match_the_host() {
    use std::process::Command;
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let dir = std::env::temp_dir().join(format!("oxccl-fp8-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cpp = dir.join("fp8.cpp");
    let exe = dir.join("fp8");
    std::fs::write(&cpp, device_section_as_cpp()).unwrap();
    let built = Command::new(&cxx)
        .args(["-O1", "-std=c++17", "-o"])
        .arg(&exe)
        .arg(&cpp)
        .output();
    let built = match built {
        Ok(o) => o,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            assert!(
                std::env::var_os("OXCCL_REQUIRE_CXX").is_none_or(|v| v != "1"),
                "OXCCL_REQUIRE_CXX=1 but {cxx} cannot run: {e}"
            );
            eprintln!("skipped: no C++ compiler ({cxx}: {e})");
            return;
        }
    };
    assert!(
        built.status.success(),
        "{cxx} could not compile the CUDA source's fp8 section:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let samples = f32_samples();
    let input: Vec<u8> = samples
        .iter()
        .flat_map(|x| x.to_bits().to_ne_bytes())
        .collect();
    let (inp, outp) = (dir.join("in"), dir.join("out"));
    std::fs::write(&inp, &input).unwrap();
    let ran = Command::new(&exe).arg(&inp).arg(&outp).status().unwrap();
    let out = std::fs::read(&outp).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(ran.success(), "the compiled fp8 section exited with {ran}");
    assert_eq!(out.len(), 256 * 4 + samples.len() * 2);
    let (decoded, encoded) = out.split_at(256 * 4);
    for (b, w) in decoded.chunks_exact(4).enumerate() {
        let dev = f32::from_bits(u32::from_ne_bytes(w.try_into().unwrap()));
        let host = F8E4M3::from_bits(b as u8).to_f32();
        assert!(
            dev.to_bits() == host.to_bits() || dev.is_nan() && host.is_nan(),
            "e4m3_to_f32_soft({b:#04x}): device {dev} vs host {host}"
        );
    }
    for (x, r) in samples.iter().zip(encoded.chunks_exact(2)) {
        let (e4, e5) = (
            F8E4M3::from_f32(*x).to_bits(),
            F8E5M2::from_f32(*x).to_bits(),
        );
        assert_eq!(r[0], e4, "f32_to_e4m3_soft({x:e} = {:#010x})", x.to_bits());
        assert_eq!(r[1], e5, "f32_to_e5m2_soft({x:e} = {:#010x})", x.to_bits());
    }
}
