#!/usr/bin/env bash
# Diagnostics and measurements on the GPU machine (see scripts/gpu_run.sh for the full set).
set -uo pipefail
bin=target/gpu-bin
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13/lib") for p in nvidia.__path__))' 2>/dev/null); do
    [ -e "$d/libnvrtc.so.13" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export OXCCL_REQUIRE_GPU=1 OXCCL_CACHE_DIR=/tmp/oxccl-cache OXCCL_TIMEOUT=20 CUDA_DEVICE_MAX_CONNECTIONS=32 RUST_BACKTRACE=0
out=${OUT:-/tmp}
echo "### kernels"
timeout 120 $bin/kernels_cuda_gpu --test-threads 1 2>&1 | cut -c1-300 | grep -v '^\s*$' | tail -8
for t in cuda_ipc_four_ranks_on_one_gpu_every_collective_and_dtype four_ranks_on_one_gpu_every_collective_and_dtype; do
  echo "### $t"; s=$SECONDS
  timeout 120 $bin/comm_cuda --ignored --exact $t 2>&1 | cut -c1-300 | grep -v '^\s*$' | tail -6
  echo "### rc $? after $((SECONDS-s)) s"
done
echo "### MPS"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && echo "MPS started"
echo "### perf ipc np4 (MPS)"
OXCCL_CUDA_IPC=1 timeout 90 $bin/oxccl perf all-reduce --np 4 --device cuda -b 8 -e 256M -f 4 -c 1 -n 20 -w 5 --rotate 0 2>&1 | grep -E "^ +[0-9]|error|Device coll"
OXCCL_CUDA_IPC=1 timeout 40 $bin/oxccl perf all-reduce --np 4 --device cuda -b 256K -e 256K -c 1 -n 500 -w 50 --rotate 0 2>&1 | grep -E "^ +[0-9]|error"
echo "### perf ipc np2, 64 MiB slots (MPS)"
OXCCL_CUDA_IPC=1 OXCCL_CUDA_IPC_SLOT=67108864 timeout 40 $bin/oxccl perf all-reduce --np 2 --device cuda -b 256M -e 256M -c 1 -n 20 -w 3 --rotate 0 2>&1 | grep -E "^ +[0-9]|error"
echo "### perf ipc np2 other collectives checked (MPS)"
for coll in reduce-scatter all-gather broadcast all-to-all; do
  OXCCL_CUDA_IPC=1 timeout 40 $bin/oxccl perf $coll --np 2 --device cuda -b 8 -e 16M -f 64 -c 1 -n 3 -w 1 2>&1 | grep -E "^ +[0-9]|error|Out of"
done
echo quit | nvidia-cuda-mps-control && echo "MPS stopped"
