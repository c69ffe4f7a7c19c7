//! The CUDA optimizer kernels' arithmetic (the `OXCCL_OPTIM` section of
//! kernels/cuda/oxccl_kernels.cu, what `oxccl_adamw_f32` and `oxccl_sgd_f32` run per element)
//! compiled for the host by a C++ compiler and run on the same values as the host optimizers:
//! equal bit for bit over several steps. That the device compiles the section without
//! contracting a multiply-add is checked on its PTX (kernels' `cuda_ptx` test). Needs a C++
//! compiler (`$CXX`, else `c++`); without one the test says so and passes, unless
//! `OXCCL_REQUIRE_CXX=1` (CI sets it).

use std::process::Command;

use oxccl_zero::{AdamW, Hyper, Sgd, ShardOptimizer};

/// The section, with the intrinsics it uses defined for the host (IEEE single operations, each
/// rounded on its own: compiled with `-ffp-contract=off`), and a driver: it reads `kind n steps`,
/// the parameters and state, then per step the scalars and the gradient, and writes the
/// parameters and state after every step.
fn section_as_cpp() -> String {
    let src = include_str!("../../../kernels/cuda/oxccl_kernels.cu");
    let begin = src
        .find("// OXCCL_OPTIM_BEGIN")
        .expect("OXCCL_OPTIM_BEGIN marker");
    let end = src
        .find("// OXCCL_OPTIM_END")
        .expect("OXCCL_OPTIM_END marker");
    let section = &src[begin..end];
    format!(
        r#"#include <cmath>
#include <cstdio>
#include <vector>
#define __device__
#define __forceinline__ inline
static inline float __fadd_rn(float a, float b) {{ return a + b; }}
static inline float __fsub_rn(float a, float b) {{ return a - b; }}
static inline float __fmul_rn(float a, float b) {{ return a * b; }}
static inline float __fdiv_rn(float a, float b) {{ return a / b; }}
static inline float __fsqrt_rn(float a) {{ return std::sqrt(a); }}
{section}
template <typename T> static bool get(FILE* f, T* v, size_t n) {{ return std::fread(v, sizeof(T), n, f) == n; }}
int main(int argc, char** argv) {{
    if (argc != 3) return 2;
    FILE* in = std::fopen(argv[1], "rb");
    FILE* out = std::fopen(argv[2], "wb");
    if (!in || !out) return 3;
    unsigned hdr[3];
    if (!get(in, hdr, 3)) return 4;
    unsigned kind = hdr[0], n = hdr[1], steps = hdr[2];
    std::vector<float> p(n), a(n), b(n), g(n);
    if (!get(in, p.data(), n) || !get(in, a.data(), n) || !get(in, b.data(), n)) return 5;
    for (unsigned t = 0; t < steps; t++) {{
        float s[9];
        int flags[2];
        if (!get(in, s, 9) || !get(in, flags, 2) || !get(in, g.data(), n)) return 6;
        for (unsigned i = 0; i < n; i++) {{
            if (kind == 0) adamw_elem(&p[i], g[i], &a[i], &b[i], s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8]);
            else sgd_elem(&p[i], g[i], &a[i], s[0], s[1], s[2], s[3], flags[0], flags[1]);
        }}
        std::fwrite(p.data(), 4, n, out);
        std::fwrite(a.data(), 4, n, out);
        std::fwrite(b.data(), 4, n, out);
    }}
    return std::fclose(out) == 0 ? 0 : 7;
}}
"#
    )
}

/// SplitMix64 values: signed, of magnitudes from 1e-6 to 10, and some exact zeros.
fn values(seed: u64, n: usize) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let mut z = (seed << 32 ^ i).wrapping_add(0x9e37_79b9_7f4a_7c15);
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            if z.is_multiple_of(17) {
                return 0.0;
            }
            let unit = (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            unit * 10f32.powi((z % 8) as i32 - 6)
        })
        .collect()
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// One optimizer over `STEPS` steps: the host's state after each, and the C++ driver's input.
struct Case {
    input: Vec<u8>,
    want: Vec<u8>,
}

const N: usize = 4096;
const STEPS: usize = 4;

fn case(
    kind: u32,
    opt: &mut dyn ShardOptimizer,
    scalars: impl Fn(u64, Hyper) -> ([f32; 9], [i32; 2]),
) -> Case {
    let h = Hyper {
        lr: 0.01,
        weight_decay: 0.1,
    };
    let mut p = values(1, N);
    let mut state = vec![0.0f32; 2 * N];
    let mut input: Vec<u8> = [kind, N as u32, STEPS as u32]
        .iter()
        .flat_map(|x| x.to_ne_bytes())
        .collect();
    input.extend(bytes(&p));
    input.extend(bytes(&state));
    let mut want = Vec::new();
    for t in 1..=STEPS as u64 {
        let g = values(10 + t, N);
        let (s, flags) = scalars(t, h);
        input.extend(bytes(&s));
        input.extend(flags.iter().flat_map(|x| x.to_ne_bytes()));
        input.extend(bytes(&g));
        let per = opt.state_per_elem();
        opt.step(t, h, &mut p, &g, &mut state[..per * N]);
        want.extend(bytes(&p));
        want.extend(bytes(&state));
    }
    Case { input, want }
}

#[test]
fn the_cuda_optimizer_arithmetic_equals_the_host_bit_for_bit() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let dir = std::env::temp_dir().join(format!("oxccl-optim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cpp, exe) = (dir.join("optim.cpp"), dir.join("optim"));
    std::fs::write(&cpp, section_as_cpp()).unwrap();
    let built = Command::new(&cxx)
        .args(["-O2", "-std=c++17", "-ffp-contract=off", "-o"])
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
        "{cxx} could not compile the optimizer section:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let adamw = AdamW::default();
    let sgd = Sgd {
        momentum: 0.9,
        dampening: 0.1,
        nesterov: true,
    };
    let cases = [
        case(0, &mut adamw.clone(), |t, h| {
            let s = adamw.scalars(t, h);
            let v = [
                s.lr, s.decay, s.beta1, s.omb1, s.beta2, s.omb2, s.eps, s.c1, s.c2,
            ];
            (v, [0, 0])
        }),
        case(1, &mut sgd.clone(), |t, h| {
            let s = sgd.scalars(t, h);
            let v = [
                s.lr,
                s.weight_decay,
                s.momentum,
                s.omd,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
            ];
            (v, [i32::from(s.nesterov), i32::from(s.first)])
        }),
    ];
    for (k, c) in cases.iter().enumerate() {
        let (inp, outp) = (dir.join("in"), dir.join("out"));
        std::fs::write(&inp, &c.input).unwrap();
        let ran = Command::new(&exe).arg(&inp).arg(&outp).status().unwrap();
        let got = std::fs::read(&outp).unwrap_or_default();
        assert!(ran.success(), "case {k}: the driver exited with {ran}");
        // SGD's state is one vector: the driver writes a second, unused one; compare per step
        // the parameters and the state the host has.
        let per_step = c.want.len() / STEPS;
        for t in 0..STEPS {
            let want = &c.want[t * per_step..(t + 1) * per_step];
            let got = &got[t * 3 * N * 4..][..per_step];
            let first = want.iter().zip(got).position(|(a, b)| a != b);
            assert!(
                first.is_none(),
                "case {k} step {}: differs at byte {first:?}",
                t + 1
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
