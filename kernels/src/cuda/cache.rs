//! The disk cache of compiled PTX: where a part's PTX is kept between processes (keyed by its
//! source, the architecture and NVRTC's version), and how it is stored.

/// FNV-1a, 64 bits: a hash that is the same in every build (std's hasher is not), for cache keys.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Where the PTX of `src` (one part) for `arch` is kept between processes (compiling the whole
/// table takes NVRTC about 10 s of CPU): `$OXCCL_CACHE_DIR`, else `$XDG_CACHE_HOME/oxccl`, else
/// `$HOME/.cache/oxccl`; `OXCCL_CACHE_DIR=off` (or no usable directory) disables it. The key is
/// the source, the architecture and NVRTC's version.
pub(super) fn disk_cache_path(src: &str, arch: &str) -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    let dir = match std::env::var_os("OXCCL_CACHE_DIR") {
        Some(d) if d == "off" => return None,
        Some(d) => PathBuf::from(d),
        None => match std::env::var_os("XDG_CACHE_HOME") {
            Some(x) => PathBuf::from(x).join("oxccl"),
            None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/oxccl"),
        },
    };
    let (mut major, mut minor) = (0i32, 0i32);
    // SAFETY: nvrtcVersion writes two ints through valid pointers; NVRTC is loaded (checked by
    // the caller through `nvrtc_available`).
    let _ = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    let version = format!("{major}.{minor}");
    let key = fnv1a(&[src.as_bytes(), arch.as_bytes(), version.as_bytes()]);
    Some(dir.join(format!("kernels-{arch}-{key:016x}.ptx")))
}

/// Writes `text` to `path` through a temporary file and a rename, so a concurrent reader sees
/// the whole file or none; failures only cost the cache.
pub(super) fn store_atomically(path: &std::path::Path, text: &str) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    // Unique per process and write: two threads may store the same part at once.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
    if std::fs::write(&tmp, text).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}
