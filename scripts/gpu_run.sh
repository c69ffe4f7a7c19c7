#!/usr/bin/env bash
# Runs, on the GPU machine, everything issues 5 and 6 measure, from the binaries
# scripts/gpu_build.sh made (argument: their folder). Output goes to stdout and, when $OUT is
# set (the device tool), to $OUT/gpu_run.log. Each step runs even if an earlier one failed.
set -uo pipefail
bin=${1:-target/gpu-bin}
log=${OUT:-/tmp}/gpu_run.log
exec > >(tee "$log") 2>&1
# NVRTC: the toolkit's, else a pip wheel's.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13/lib") for p in nvidia.__path__))' 2>/dev/null); do
    [ -e "$d/libnvrtc.so.13" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export OXCCL_REQUIRE_GPU=1 OXCCL_CACHE_DIR=/tmp/oxccl-cache
# Ranks as threads share one GPU: give every stream a hardware queue of its own, so a spinning
# cuda_ipc barrier never holds up another rank's work (the default is 8 queues).
export CUDA_DEVICE_MAX_CONNECTIONS=32
step() { echo; echo "== $*"; local t=$SECONDS; "$@"; echo "== exit $? after $((SECONDS - t)) s"; }
step nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv
# Issue 5: kernels against the host, then bandwidth against a device-to-device copy.
step "$bin/kernels_cuda_gpu" --test-threads 1
step "$bin/cuda_bench" 256
# Issue 6: device collectives, 2, 4 and 8 ranks (threads) on one GPU, every collective and dtype,
# over CUDA IPC and staged.
step "$bin/comm_cuda" --ignored --test-threads 1
# Issue 6: oxccl perf on device buffers, ranks as processes (cuIpcOpenMemHandle): every
# collective checked over CUDA IPC (required), then the all-reduce tables, IPC and staged.
for coll in all-reduce reduce-scatter all-gather broadcast reduce gather scatter all-to-all; do
    step env OXCCL_CUDA_IPC=1 "$bin/oxccl" perf "$coll" --np 4 --device cuda -b 8 -e 16M -f 64 -c 1 -n 3 -w 1 -d all
done
for np in 2 4; do
    step env OXCCL_CUDA_IPC=1 "$bin/oxccl" perf all-reduce --np "$np" --device cuda -b 8 -e 1G -f 4 -c 1 -n 20 -w 5 --rotate 0
    step env OXCCL_CUDA_IPC=1 "$bin/oxccl" perf all-reduce --np "$np" --device cuda -b 256K -e 256K -c 1 -n 200 -w 20 --rotate 0
    step env OXCCL_CUDA_IPC=1 "$bin/oxccl" perf all-reduce --np "$np" --device cuda -b 256M -e 256M -c 1 -n 10 -w 3 --rotate 0
done
step env OXCCL_CUDA_IPC=0 "$bin/oxccl" perf all-reduce --np 2 --device cuda -b 8 -e 1G -f 4 -c 1 -n 20 -w 5 --rotate 0
step env OXCCL_CUDA_IPC=0 "$bin/oxccl" perf all-reduce --np 2 --device cuda -b 256M -e 256M -c 1 -n 10 -w 3 --rotate 0
# For scale: NCCL's single-rank all-reduce (PyTorch wheel) on the same GPU.
step python3 "$bin/nccl_single_rank.py"
