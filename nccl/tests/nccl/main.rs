//! oxccl-nccl's tests without a GPU: the shared library as a C program sees it (`abi.c`, built
//! here against `include/nccl.h` and linked through the SONAME `libnccl.so.2`), and the
//! library file itself (its SONAME, no symbol versions).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The shared library cargo built for this test, with its features (`target/<profile>/deps/
/// libnccl.so`, beside the test binary; `target/<profile>/libnccl.so` after a plain build).
fn library() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("target/<profile>/deps");
    let candidates = [deps.join("libnccl.so"), deps.join("../libnccl.so")];
    candidates
        .iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("libnccl.so was not built: looked for {candidates:?}"))
        .clone()
}

/// A directory holding `libnccl.so.2` (a link to [`library`]) and the C test built against it.
fn build_c_test() -> (tempdir::Dir, PathBuf) {
    let dir = tempdir::Dir::new();
    let lib = dir.path().join("libnccl.so.2");
    std::os::unix::fs::symlink(library(), &lib).expect("linking libnccl.so.2");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/nccl/abi.c");
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("include");
    let exe = dir.path().join("abi");
    let out = Command::new("cc")
        .args([
            "-std=c11",
            "-D_GNU_SOURCE",
            "-O1",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-I",
        ])
        .arg(&include)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", dir.path().display()))
        .args(["-l:libnccl.so.2", "-lpthread", "-ldl"])
        .arg(format!("-Wl,-rpath,{}", dir.path().display()))
        .output()
        .expect("running cc (a C compiler is needed)");
    assert!(
        out.status.success(),
        "cc failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (dir, exe)
}

/// Runs the C test (`args`, `env` added), asserts it printed "ALL OK", and shows its output.
fn run_c_test(args: &[&str], env: &[(&str, &str)]) {
    let (_dir, exe) = build_c_test();
    let out = Command::new(&exe)
        .args(args)
        .envs(env.iter().copied())
        .env("OXCCL_TIMEOUT", "30")
        .env_remove("OXCCL_DEBUG")
        .output()
        .expect("running the C test");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success() && text.contains("ALL OK"), "{text}");
    println!("{text}");
}

#[test]
fn a_c_program_built_against_nccl_h_runs_on_the_library_without_a_device() {
    run_c_test(&[], &[]);
}

/// Every collective on host buffers (`OXCCL_NCCL_HOST_MEMORY=1`), 3 ranks as threads, results
/// checked; a grouped ring of large sends and receives; an abort from another thread; shrink.
#[test]
fn every_call_on_host_buffers_from_c_without_a_device() {
    run_c_test(&["host"], &[("OXCCL_NCCL_HOST_MEMORY", "1")]);
}

#[test]
fn the_library_answers_to_libnccl_so_2_without_symbol_versions() {
    let out = Command::new("readelf")
        .args(["-d", "-V", "-W"])
        .arg(library())
        .output()
        .expect("running readelf");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("Library soname: [libnccl.so.2]"), "{text}");
    // Version definitions (`.gnu.version_d`) would give exported names versions; NCCL has
    // none, and neither may this library (references to glibc's versions are fine).
    assert!(!text.contains(".gnu.version_d"), "{text}");
}

/// A temporary directory removed when dropped (the C test's build).
mod tempdir {
    use std::path::{Path, PathBuf};

    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new() -> Dir {
            static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let p = std::env::temp_dir().join(format!("oxccl-nccl-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&p).expect("creating a temporary directory");
            Dir(p)
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
