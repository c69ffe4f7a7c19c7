#!/usr/bin/env bash
# The GPU tests of the kernels and device collectives in one device call of at most BUDGET
# seconds (default 240), from the binaries `scripts/gpu_build.sh` made (target/gpu-bin):
#   run(carry=["target/gpu-bin"], timeout_s=300, command="scripts/gpu_verify.sh")
# 1. kernels: every (dtype, op) against the host, avg / scale / copy, fp8 patterns;
# 2. comm: every device collective and dtype (pre-multiplied sums included) against the host
#    calls, over CUDA IPC and staged, 2 to 8 ranks as threads on GPU 0, faults and stream order.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin=${BIN:-target/gpu-bin}
budget=${BUDGET:-240}
log=${OUT:-/tmp}/gpu_verify.log
exec > >(tee -a "$log") 2>&1
export OXCCL_REQUIRE_GPU=1 OXCCL_CACHE_DIR=/tmp/oxccl-cache OXCCL_TIMEOUT=30
export CUDA_DEVICE_MAX_CONNECTIONS=32
. scripts/gpu_steps.sh
cuda_libs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ -e "$bin/kernels_cuda_gpu" ] && step 90 "$bin/kernels_cuda_gpu" cuda_gpu --test-threads 1
[ -e "$bin/comm_cuda" ] && step 150 "$bin/comm_cuda" --ignored cuda --test-threads 1
echo "### done after $SECONDS s"
