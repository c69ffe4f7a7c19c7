//! The CUDA kernels compile to PTX with NVRTC, for every architecture oxccl targets, and every
//! kernel the Rust dispatch names is in the PTX. Needs only libnvrtc (no GPU, no driver): CI
//! installs the `nvidia-cuda-nvrtc` wheel, puts its lib directory on LD_LIBRARY_PATH and sets
//! OXCCL_REQUIRE_NVRTC=1, which turns a missing NVRTC into a failure instead of a visible skip.

use oxccl_kernels::cuda::{
    compile_ptx, compile_ptx_parts, compile_wait_ptx, kernel_names, nvrtc_available, part_sources,
    source, ADAMW_KERNEL, BASE_SOURCE, PARTS, SGD_KERNEL, WAIT_KERNEL,
};

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
        // The optimizer kernels round every operation on its own (the host's arithmetic): no
        // multiply-add contracted into an FMA.
        for name in [ADAMW_KERNEL, SGD_KERNEL] {
            let start = ptx.find(&format!(".entry {name}(")).expect("entry");
            let body = &ptx[start..];
            let end = body[1..].find(".entry ").map_or(body.len(), |e| e + 1);
            assert!(!body[..end].contains("fma."), "{arch}: {name} has an FMA");
            assert!(
                body[..end].contains("sqrt.rn.f32") || name == SGD_KERNEL,
                "{arch}"
            );
        }
    }
}

/// The parts split the entry points without losing or repeating one: every kernel the dispatch
/// names is defined by exactly one part (the barrier kernel, written out in the base source
/// every part starts with, is taken from part 0), and together they are the whole source.
#[test]
fn the_parts_define_every_kernel_exactly_once() {
    let parts = part_sources();
    assert_eq!(parts.len(), PARTS);
    let mut names: Vec<String> = parts.iter().flat_map(|(n, _)| n.clone()).collect();
    names.sort();
    let mut want = kernel_names();
    want.sort();
    assert_eq!(names, want);
    let whole = source();
    let mut lines = 0;
    for (n, src) in &parts {
        assert!(!n.is_empty(), "a part without kernels");
        let own = src
            .strip_prefix(BASE_SOURCE)
            .expect("every part starts with the base");
        for line in own.lines() {
            assert!(whole.contains(line), "{line}");
            lines += 1;
        }
    }
    assert_eq!(lines, whole.lines().count() - BASE_SOURCE.lines().count());
}

/// Each part's module defines the kernels it is loaded for.
#[test]
fn every_part_compiles_with_its_kernels() {
    if !nvrtc_or_skip() {
        return;
    }
    let ptx = compile_ptx_parts("compute_90").expect("compiles");
    assert_eq!(ptx.len(), PARTS);
    for ((names, _), text) in part_sources().iter().zip(ptx.iter()) {
        assert!(text.contains(".target sm_90"));
        for name in names {
            assert!(text.contains(&format!(".entry {name}(")), "{name}");
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

/// The p2p flag kernels of CUDA IPC keep the barrier's memory order: the wait polls with
/// system-scope acquire loads and a deadline, the post fences then stores with release.
#[test]
fn ipc_p2p_kernels_use_system_scope_release_acquire_and_a_timer() {
    if !nvrtc_or_skip() {
        return;
    }
    let ptx = compile_ptx("compute_90").expect("compiles");
    let body = |name: &str| {
        let start = ptx
            .find(&format!(".entry {name}("))
            .unwrap_or_else(|| panic!("{name} is in the PTX"));
        let b = &ptx[start..];
        b[..b[1..].find(".entry").map_or(b.len(), |e| e + 1)].to_string()
    };
    let wait = body("oxccl_ipc_p2p_wait");
    for needle in ["ld.acquire.sys", "%globaltimer", "membar.sys"] {
        assert!(wait.contains(needle), "p2p wait PTX lacks {needle}");
    }
    assert!(!wait.contains("st.release.sys"), "the wait stores no flag");
    let post = body("oxccl_ipc_p2p_post");
    for needle in ["st.release.sys", "membar.sys"] {
        assert!(post.contains(needle), "p2p post PTX lacks {needle}");
    }
}

/// The staged path's wait kernel, a program of its own: it compiles for every target (from
/// Turing, the oldest CUDA 13 compiles for), polls the word with system-scope acquire loads and a
/// pause between them, and keeps a deadline by the GPU's timer.
#[test]
fn wait_kernel_compiles_alone_and_polls_with_acquire_loads_and_a_deadline() {
    if !nvrtc_or_skip() {
        return;
    }
    for arch in ["compute_75", "compute_80", "compute_90", "compute_100"] {
        let ptx = compile_wait_ptx(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(
            ptx.matches(".entry").count(),
            1,
            "{arch}: only the wait kernel"
        );
        assert!(ptx.contains(&format!(".entry {WAIT_KERNEL}(")), "{arch}");
        for needle in [
            "%globaltimer",
            "ld.acquire.sys.u32",
            "nanosleep",
            "membar.sys",
        ] {
            assert!(
                ptx.contains(needle),
                "{arch}: the wait kernel's PTX lacks {needle}"
            );
        }
    }
    // Not part of the table's modules.
    assert!(!compile_ptx("compute_90")
        .expect("compiles")
        .contains(&format!(".entry {WAIT_KERNEL}(")));
}

/// fp8 rounding, and widening E4M3, run on the conversion instructions where the device has them
/// (sm_89 and later) and on the software conversions (checked on the host by tests/kernels/fp8.rs)
/// before.
#[test]
fn fp8_conversions_use_hardware_from_sm_89() {
    if !nvrtc_or_skip() {
        return;
    }
    let body = |ptx: &str, name: &str| {
        let start = ptx
            .find(&format!(".entry {name}("))
            .unwrap_or_else(|| panic!("{name} is in the PTX"));
        let rest = &ptx[start..];
        rest[..rest[1..].find(".entry").map_or(rest.len(), |e| e + 1)].to_string()
    };
    for (dtype, insn) in [
        ("f8e4m3", "cvt.rn.satfinite.e4m3x2.f32"),
        ("f8e4m3", "cvt.rn.f16x2.e4m3x2"),
        ("f8e5m2", "cvt.rn.satfinite.e5m2x2.f32"),
    ] {
        let name = format!("oxccl_reduce_{dtype}_sum");
        for arch in ["compute_89", "compute_90"] {
            let ptx = compile_ptx(arch).expect("compiles");
            assert!(
                body(&ptx, &name).contains(insn),
                "{arch} {name} lacks {insn}"
            );
        }
        let ptx = compile_ptx("compute_80").expect("compiles");
        let b = body(&ptx, &name);
        assert!(
            !b.contains("satfinite") && !b.contains(".e4m3x2"),
            "compute_80 {name}"
        );
    }
}
