#!/usr/bin/env python3
"""Link stubs of the CUDA libraries cudarc links against (driver, NVRTC, cuBLAS, cuBLASLt, cuRAND,
runtime), for building programs with cudarc's `dynamic-linking` (candle's `cuda` feature) on a
machine without those libraries. Each stub has the real library's SONAME and an empty function
for every name cudarc's bindings declare, so the linker records the dependency; at run time, on
a machine with CUDA, the loader finds the real libraries by that SONAME (the driver's libcuda.so.1
and, for the others, the toolkit's or the PyPI wheels' nvidia/cu13/lib on LD_LIBRARY_PATH).
The stubs are never run. Usage: scripts/cuda_stubs.py OUT_DIR (then RUSTFLAGS="-L native=OUT_DIR").
"""
import glob
import os
import re
import subprocess
import sys

# The CUDA runtime's entry points that nvcc-compiled host code calls (candle's `moe` kernels, a
# static library: kernel registration from its constructors, per-thread-stream forms) and
# cudarc's bindings do not declare (`nm -u` of candle-kernels' libmoe.a, candle 0.11.1).
RUNTIME_INTERNAL = [
    "__cudaGetKernel", "__cudaLaunchKernel_ptsz", "__cudaPopCallConfiguration",
    "__cudaPushCallConfiguration", "__cudaRegisterFatBinary", "__cudaRegisterFatBinaryEnd",
    "__cudaRegisterFunction", "__cudaRegisterVar", "__cudaUnregisterFatBinary",
    "cudaFreeAsync_ptsz", "cudaMallocAsync_ptsz", "cudaMemsetAsync_ptsz",
    "cudaStreamSynchronize_ptsz",
]

# (cudarc module, library name, SONAME, symbol prefixes)
LIBS = [
    ("driver", "cuda", "libcuda.so.1", ("cu",)),
    ("nvrtc", "nvrtc", "libnvrtc.so.13", ("nvrtc",)),
    ("cublas", "cublas", "libcublas.so.13", ("cublas",)),
    ("cublaslt", "cublasLt", "libcublasLt.so.13", ("cublasLt",)),
    ("curand", "curand", "libcurand.so.10", ("curand",)),
    ("runtime", "cudart", "libcudart.so.13", ("cuda",)),
]


def cudarc_src():
    home = os.environ.get("CARGO_HOME", os.path.expanduser("~/.cargo"))
    found = sorted(glob.glob(os.path.join(home, "registry/src/*/cudarc-0.19.*/src")))
    if not found:
        sys.exit("cuda_stubs: cudarc 0.19 sources not found (run a cargo fetch first)")
    return found[-1]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "target/cuda-stubs"
    os.makedirs(out, exist_ok=True)
    src = cudarc_src()
    for module, name, soname, prefixes in LIBS:
        text = open(os.path.join(src, module, "sys", "mod.rs")).read()
        names = {m for m in re.findall(r"\bfn (\w+)\(", text) if m.startswith(prefixes)}
        if name == "cudart":
            names.update(RUNTIME_INTERNAL)
        names = sorted(names)
        c = os.path.join(out, f"{name}.c")
        with open(c, "w") as f:
            f.write("".join(f"void {n}(void) {{}}\n" for n in names))
        so = os.path.join(out, soname)
        subprocess.run(["cc", "-shared", "-fPIC", "-o", so, f"-Wl,-soname,{soname}", c], check=True)
        link = os.path.join(out, f"lib{name}.so")
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(soname, link)
        print(f"{link} -> {soname}: {len(names)} symbols")


if __name__ == "__main__":
    main()
