#!/usr/bin/env bash
# Quick GPU checks for the open work (see scripts/gpu_run.sh for the full set): the kernel tests
# (fp8 included), kernel bandwidth for f32 / bf16 / fp8, the 2-rank device collectives, a traced
# 4-rank run (where does it stop?), and fp8 device all-reduce between processes under MPS.
set -uo pipefail
bin=target/gpu-bin
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13/lib") for p in nvidia.__path__))' 2>/dev/null); do
    [ -e "$d/libnvrtc.so.13" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export OXCCL_REQUIRE_GPU=1 OXCCL_CACHE_DIR=/tmp/oxccl-cache OXCCL_TIMEOUT=20 CUDA_DEVICE_MAX_CONNECTIONS=32 RUST_BACKTRACE=0
out=${OUT:-/tmp}
step() { echo; echo "### $*"; local t=$SECONDS; "$@"; echo "### rc $? after $((SECONDS - t)) s"; }
step timeout 200 $bin/kernels_cuda_gpu --test-threads 1 2>&1 | cut -c1-400 | grep -v '^\s*$' | tail -12
step timeout 60 $bin/cuda_bench 256 f32,bf16,f8e4m3,f8e5m2
for t in two_ranks_on_one_gpu_every_collective_and_dtype cuda_ipc_two_ranks_on_one_gpu_every_collective_and_dtype; do
    step timeout 120 $bin/comm_cuda --ignored --exact $t 2>&1 | cut -c1-300 | grep -v '^\s*$' | tail -4
done
for mode in staged ipc; do
    t=four_ranks_on_one_gpu_every_collective_and_dtype
    [ $mode = ipc ] && t=cuda_ipc_$t
    OXCCL_TEST_TRACE=1 timeout 60 $bin/comm_cuda --ignored --exact $t --nocapture > "$out/trace4_$mode.log" 2>&1
    echo "### 4 ranks $mode: rc $?, last step of each rank:"
    for r in 0 1 2 3; do grep "rank $r/4" "$out/trace4_$mode.log" | tail -1 | cut -c1-200; done
    grep -vE "rank [0-9]/4" "$out/trace4_$mode.log" | grep -v '^\s*$' | tail -5 | cut -c1-300
    gzip -f "$out/trace4_$mode.log"
done
echo "### 4 ranks staged: thread states 40 s in"
OXCCL_TEST_TRACE=1 $bin/comm_cuda --ignored --exact four_ranks_on_one_gpu_every_collective_and_dtype --nocapture > "$out/trace4_snap.log" 2>&1 &
pid=$!
sleep 40
if kill -0 $pid 2>/dev/null; then
    for t in /proc/$pid/task/*; do echo "$(cat $t/comm) $(cat $t/wchan 2>/dev/null) $(cut -d' ' -f3 $t/stat)"; done | sort | uniq -c
    command -v gdb >/dev/null && timeout 60 gdb -p $pid -batch -ex "thread apply all bt 12" 2>/dev/null | grep -E "^Thread|^#" | cut -c1-160 | head -150
    kill $pid
fi
wait $pid; echo "rc $?"
for r in 0 1 2 3; do grep "rank $r/4" "$out/trace4_snap.log" | tail -1 | cut -c1-200; done
gzip -f "$out/trace4_snap.log"
echo "### 4 ranks staged, OXCCL_CUDA_STREAM_WAIT=0"
OXCCL_CUDA_STREAM_WAIT=0 OXCCL_TEST_TRACE=1 timeout 60 $bin/comm_cuda --ignored --exact four_ranks_on_one_gpu_every_collective_and_dtype --nocapture > "$out/trace4_nowait.log" 2>&1
echo "rc $?"; for r in 0 1 2 3; do grep "rank $r/4" "$out/trace4_nowait.log" | tail -1 | cut -c1-200; done
gzip -f "$out/trace4_nowait.log"
echo "### MPS"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && echo "MPS started"
for d in f8e4m3 f8e5m2; do
    echo "### perf ipc np2 $d (MPS)"
    OXCCL_CUDA_IPC=1 timeout 60 $bin/oxccl perf all-reduce --np 2 --device cuda -d $d -o all -b 8 -e 256M -f 8 -c 1 -n 10 -w 3 --rotate 0 2>&1 | grep -E "^ +[0-9]|rror|Device coll|Out of"
done
echo "### perf ipc np2 256 MiB f32 by slot size (MPS)"
for slot in 4194304 16777216 33554432 67108864; do
    echo "slot $slot"
    OXCCL_CUDA_IPC=1 OXCCL_CUDA_IPC_SLOT=$slot timeout 40 $bin/oxccl perf all-reduce --np 2 --device cuda -b 64M -e 1G -f 4 -c 1 -n 10 -w 3 --rotate 0 2>&1 | grep -E "^ +[0-9]|rror"
done
echo quit | nvidia-cuda-mps-control && echo "MPS stopped"
