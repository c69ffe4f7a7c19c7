//! The CUDA kernels compile to PTX with NVRTC, for every architecture oxccl targets, and every
//! kernel the Rust dispatch names is in the PTX. Needs only libnvrtc (no GPU, no driver): CI
//! installs the `nvidia-cuda-nvrtc` wheel, puts its lib directory on LD_LIBRARY_PATH and sets
//! OXCCL_REQUIRE_NVRTC=1, which turns a missing NVRTC into a failure instead of a visible skip.
#![cfg(feature = "cuda")]

use oxccl_kernels::cuda::{compile_ptx, kernel_names, nvrtc_available};

fn nvrtc_or_skip() -> bool {
    if nvrtc_available() {
        return true;
    }
    assert!(
        std::env::var("OXCCL_REQUIRE_NVRTC").as_deref() != Ok("1"),
        "OXCCL_REQUIRE_NVRTC=1 but libnvrtc.so.13 cannot be loaded (LD_LIBRARY_PATH?)"
    );
    eprintln!("SKIPPED: libnvrtc not found; set LD_LIBRARY_PATH to a CUDA 13 NVRTC lib dir");
    false
}

#[test]
fn every_kernel_compiles_to_ptx_for_every_target() {
    if !nvrtc_or_skip() {
        return;
    }
    // Ampere, Ada, Hopper, Blackwell: virtual architectures, so the driver JIT-compiles for the
    // actual device.
    for arch in ["compute_80", "compute_89", "compute_90", "compute_100"] {
        let ptx = compile_ptx(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert!(
            ptx.contains(&format!(".target sm_{}", &arch[8..])),
            "{arch}"
        );
        for name in kernel_names() {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "{arch}: kernel {name} missing from the PTX"
            );
        }
    }
}

#[test]
fn compiled_ptx_is_cached_per_architecture() {
    if !nvrtc_or_skip() {
        return;
    }
    let a = compile_ptx("compute_90").expect("compiles");
    let t = std::time::Instant::now();
    let b = compile_ptx("compute_90").expect("compiles");
    assert_eq!(a, b);
    // A cache hit is a map lookup: far below any NVRTC compile of this source.
    eprintln!("second compile_ptx: {:?}", t.elapsed());
}

#[test]
fn ipc_barrier_uses_system_scope_release_acquire_and_a_timer() {
    if !nvrtc_or_skip() {
        return;
    }
    let ptx = compile_ptx("compute_90").expect("compiles");
    let start = ptx
        .find(".entry oxccl_ipc_barrier(")
        .expect("the barrier kernel is in the PTX");
    // The body runs to the next entry (or the end).
    let body = &ptx[start..];
    let body = &body[..body[1..].find(".entry").map_or(body.len(), |e| e + 1)];
    for needle in [
        "st.release.sys",
        "ld.acquire.sys",
        "%globaltimer",
        "membar.sys",
    ] {
        assert!(body.contains(needle), "barrier PTX lacks {needle}");
    }
}
