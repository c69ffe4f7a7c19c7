#!/usr/bin/env bash
# The GPU checks of DDP on device gradients and candle on CUDA, in one device call of at most
# BUDGET seconds (default 480), from the binaries `SET=ddp CUDA_ROOT=... scripts/gpu_build.sh`
# made (target/gpu-bin):
#   run(carry=["target/gpu-bin"], timeout_s=560, command="scripts/gpu_ddp.sh")
# 1. DeviceDdp against exact averages: 2 and 4 ranks as threads sharing the GPU, fp16 compression;
#    DeviceZero (oxccl-zero) against DDP + the same optimizer, 2 and 4 ranks;
# 2. device_ddp_bench: sync of 100 MiB against one device all-reduce, and a synthetic backward
#    overlapped against backward-then-all-reduce (2 and 4 ranks);
# 3. the candle example: 2 ranks on CPU and on CUDA (processes; then 4 under MPS), each against
#    one process on the concatenated batch (--check), and the CUDA run's losses against the CPU
#    run's (candle_cuda_mlp.xz is only there when gpu_build.sh had a CUDA toolchain; it needs the
#    machine's CUDA 13 libraries: cuBLAS, cuRAND, NVRTC, the runtime, from PyTorch's wheels).
set -uo pipefail
bin=${BIN:-target/gpu-bin}
budget=${BUDGET:-480}
log=${OUT:-/tmp}/gpu_ddp.log
exec > >(tee -a "$log") 2>&1
export OXCCL_REQUIRE_GPU=1 OXCCL_CACHE_DIR=/tmp/oxccl-cache OXCCL_TIMEOUT=60
export CUDA_DEVICE_MAX_CONNECTIONS=32
. "$(dirname "${BASH_SOURCE[0]}")/gpu_steps.sh"
cuda_libs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "cores $(nproc); budget ${budget}s"
[ -e "$bin/ddp_cuda" ] && step 150 "$bin/ddp_cuda" --ignored device --test-threads 1
[ -e "$bin/zero_cuda" ] && step 90 "$bin/zero_cuda" --ignored device --test-threads 1
if [ -e "$bin/device_ddp_bench" ]; then
    step 90 "$bin/device_ddp_bench" --ranks 2
    step 90 "$bin/device_ddp_bench" --ranks 4
fi
if [ -e "$bin/candle_cuda_mlp.xz" ]; then
    python3 -c 'import lzma, sys; open(sys.argv[2], "wb").write(lzma.open(sys.argv[1]).read())' \
        "$bin/candle_cuda_mlp.xz" /tmp/candle_cuda_mlp && chmod +x /tmp/candle_cuda_mlp
    cpu=/tmp/candle_cpu.log gpu=/tmp/candle_gpu.log
    RAYON_NUM_THREADS=4 step 60 "$bin/oxccl" launch -n 2 -- /tmp/candle_cuda_mlp --check --steps 20 | tee "$cpu"
    step 90 "$bin/oxccl" launch -n 2 -- /tmp/candle_cuda_mlp --cuda --check --steps 20 | tee "$gpu"
    python3 - "$cpu" "$gpu" <<'PY'
import re, sys
def losses(p):
    return [float(m.group(1)) for m in re.finditer(r"loss ([0-9.]+)", open(p).read())]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
worst = max((abs(x - y) / max(abs(x), 1e-6) for x, y in zip(a, b)), default=float("nan"))
print(f"candle CUDA against CPU (the same initial weights and batches): {len(a)} and {len(b)} "
      f"steps, largest relative loss difference {worst:.2e}", "OK" if worst < 1e-4 else "DIFFERENT")
PY
    unset CUDA_DEVICE_MAX_CONNECTIONS
    mps_on
    step 90 "$bin/oxccl" launch -n 4 -- /tmp/candle_cuda_mlp --cuda --check --steps 20
    mps_off
else
    echo "### no $bin/candle_cuda_mlp.xz: the candle CUDA example was not built (CUDA_ROOT unset)"
fi
echo "### done after $SECONDS s"
