#!/usr/bin/env bash
# Runs, on the GPU machine, everything issues 5 and 6 measure, from the binaries
# scripts/gpu_build.sh made. Usage: scripts/gpu_run.sh DIR [PHASE...], PHASE one of kernels,
# comm, perf-ipc, perf-staged, nccl, cpu, netns (default: all, in that order; split them over several device
# calls when they would pass the 10-minute limit). Output goes to stdout and, when $OUT is set
# (the device tool), to $OUT/gpu_run.log. Every step has a time limit and runs even if an
# earlier one failed.
set -uo pipefail
bin=${1:-target/gpu-bin}
shift || true
phases=${*:-kernels comm perf-ipc perf-staged nccl cpu netns}
log=${OUT:-/tmp}/gpu_run.log
exec > >(tee -a "$log") 2>&1
# NVRTC: the toolkit's, else a pip wheel's.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13/lib") for p in nvidia.__path__))' 2>/dev/null); do
    [ -e "$d/libnvrtc.so.13" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export OXCCL_REQUIRE_GPU=1 OXCCL_CACHE_DIR=/tmp/oxccl-cache OXCCL_TIMEOUT=30
# Ranks as threads share one GPU: give every stream a hardware queue of its own, so a spinning
# cuda_ipc barrier never holds up another rank's work (the default is 8 queues).
export CUDA_DEVICE_MAX_CONNECTIONS=32
limit=300
step() { echo; echo "== $*"; local t=$SECONDS; timeout -k 5 "$limit" "$@"; echo "== exit $? after $((SECONDS - t)) s"; }
perf() { step "$bin/oxccl" perf "$@"; }
# Ranks as processes on one GPU need MPS: without it the driver time-slices their contexts and
# every wait for another rank costs a slice (about 2.3 ms on the H100).
# MPS shares a fixed number of hardware connections among its clients, as many to each as
# CUDA_DEVICE_MAX_CONNECTIONS asks: at 32, contexts past the first few fail to be created (with
# CUDA_ERROR_OUT_OF_MEMORY), so MPS phases run with the default.
mps_on() {
    unset CUDA_DEVICE_MAX_CONNECTIONS
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && echo "MPS daemon started"
}
mps_off() {
    echo quit | nvidia-cuda-mps-control && echo "MPS daemon stopped"
    grep -iE "fail|error|exceed" "$CUDA_MPS_LOG_DIRECTORY"/*.log 2>/dev/null | tail -5
    export CUDA_DEVICE_MAX_CONNECTIONS=32
}
for phase in $phases; do
    echo; echo "#### phase $phase"
    case $phase in
    kernels)
        step nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv
        # Issue 5: kernels against the host, then bandwidth against a device-to-device copy.
        step "$bin/kernels_cuda_gpu" cuda_gpu:: --test-threads 1
        step "$bin/cuda_bench" 256
        ;;
    comm)
        # Issue 6: 2, 4 and 8 ranks (threads) on one GPU, every collective and dtype, over CUDA
        # IPC and staged; faults.
        limit=400 step "$bin/comm_cuda" --ignored cuda:: --test-threads 1
        ;;
    perf-ipc)
        # Ranks as processes (cuIpcOpenMemHandle): every collective checked over CUDA IPC
        # (required), then all-reduce tables, 256 KiB and 256 MiB.
        mps_on
        export OXCCL_CUDA_IPC=1
        for coll in all-reduce reduce-scatter all-gather broadcast reduce gather scatter all-to-all; do
            limit=60 perf "$coll" --np 4 --device cuda -b 8 -e 16M -f 64 -c 1 -n 3 -w 1 -d all
        done
        for np in 2 4; do
            limit=120 perf all-reduce --np "$np" --device cuda -b 8 -e 1G -f 4 -c 1 -n 20 -w 5 --rotate 0
            limit=60 perf all-reduce --np "$np" --device cuda -b 8 -e 8 -c 1 -n 1000 -w 50 --rotate 0
            limit=60 perf all-reduce --np "$np" --device cuda -b 256K -e 256K -c 1 -n 200 -w 20 --rotate 0
            limit=60 perf all-reduce --np "$np" --device cuda -b 256M -e 256M -c 1 -n 10 -w 3 --rotate 0
            # Ring steps (each rank reads only the previous rank's slot), same sweep.
            OXCCL_ALGO=ring limit=120 perf all-reduce --np "$np" --device cuda -b 8 -e 1G -f 4 -c 1 -n 20 -w 5 --rotate 0
        done
        unset OXCCL_CUDA_IPC
        mps_off
        ;;
    perf-staged)
        mps_on
        export OXCCL_CUDA_IPC=0
        limit=180 perf all-reduce --np 2 --device cuda -b 8 -e 1G -f 4 -c 1 -n 20 -w 5 --rotate 0
        limit=60 perf all-reduce --np 2 --device cuda -b 256M -e 256M -c 1 -n 10 -w 3 --rotate 0
        unset OXCCL_CUDA_IPC
        mps_off
        ;;
    cpu)
        # Issues 4 and 7 on this machine's 16 cores (the development machine has 2, where ranks
        # and their progress threads compete for the same cores): DDP overlap of the example MLP
        # with 4 ranks over shared memory, sized as in docs/PERF.md and larger, then TCP between
        # 2 ranks on loopback against torch/gloo (no OpenMPI here).
        step nproc
        # Buckets of 4 MiB (with 25 MiB this 12 MiB model is one bucket: nothing to overlap).
        for b in 4 8 16; do
            for mib in 4 25; do
                limit=120 step "$bin/oxccl" launch -n 4 -- "$bin/02_ddp_mlp" --mode all --hidden 1024 \
                    --layers 4 --batch "$b" --steps 8 --rounds 5 --bucket-mib "$mib"
            done
        done
        # The same script as the development machine's TCP table; it skips OpenMPI when absent.
        OX="$bin/oxccl" PEERS="$bin" GLOO_PY="$(command -v python3)" ROUNDS=3 limit=600 \
            step scripts/side_by_side_tcp.sh
        ;;
    netns)
        # Issue 4 on 16 cores: hierarchical against the flat ring, 2 network namespaces x 2
        # ranks, 64 MiB, 3 interleaved rounds (netns.sh needs root and iproute2: it prints SKIP
        # and exits 77 without them).
        for round in 1 2 3; do
            for a in hierarchical ring; do
                echo "round $round $a"
                OXCCL_BIN="$bin/oxccl" OXCCL_ALGO=all-reduce=$a limit=120 step scripts/netns.sh run \
                    --nodes 2 --nproc 2 --prefix gp -- "$bin/oxccl" perf all-reduce -b 64M -e 64M -z 1
            done
        done
        ;;
    nccl)
        # For scale: NCCL's single-rank all-reduce (PyTorch wheel) on the same GPU.
        step python3 "$bin/nccl_single_rank.py"
        ;;
    *) echo "unknown phase $phase" ;;
    esac
done
