#!/usr/bin/env bash
# Quick GPU checks for the open work (see scripts/gpu_run.sh for the full set), from the binaries
# scripts/gpu_build.sh made. Usage: scripts/gpu_diag.sh [PHASE...], PHASE one of
#   kernels  the kernel tests (fp8 included) and kernel bandwidth for f32 / bf16 / fp8, then the
#            2-rank CUDA IPC tests of the barriers' failure paths and stream order (a peer whose
#            stream is far behind, back-to-back calls) with barriers on the host and the device;
#   hang     the 2- and 3-rank device collectives (ranks as threads), then the 4-rank ones,
#            which hung with stream waits and the barrier kernel: traced (OXCCL_DEBUG=trace logs
#            every CUDA step of oxccl's device path as "cuda: ..."), with the defaults for threads
#            (waits on the host), then with OXCCL_CUDA_STREAM_WAIT=1 and
#            OXCCL_CUDA_IPC_BARRIER=device (the barrier kernel also with 8 hardware queues instead
#            of 32), then 8 ranks, and the state of every thread 30 s into a 4-rank run with
#            stream waits; each 4-rank run shows the barrier every rank chose (barrier=...);
#   mps      ranks as processes under MPS: 4 ranks (whose contexts failed with
#            CUDA_ERROR_OUT_OF_MEMORY when CUDA_DEVICE_MAX_CONNECTIONS=32 was exported: MPS gives
#            each client that many connections, and the server has a fixed number), fp8 device
#            all-reduce, and 256 MiB / 1 GiB by slot size.
# Default: all three. Every step has a time limit; each phase alone stays under the device tool's
# 10 minutes per call even when every step runs to its limit (hang about 550 s, kernels 400 s,
# mps 580 s), two together do not: run one phase per call. Logs go to $OUT.
set -uo pipefail
bin=target/gpu-bin
phases=${*:-kernels hang mps}
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13/lib") for p in nvidia.__path__))' 2>/dev/null); do
    [ -e "$d/libnvrtc.so.13" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export OXCCL_REQUIRE_GPU=1 OXCCL_CACHE_DIR=/tmp/oxccl-cache OXCCL_TIMEOUT=20 RUST_BACKTRACE=0
out=${OUT:-/tmp}
step() { echo; echo "### $*"; local t=$SECONDS; "$@"; echo "### rc $? after $((SECONDS - t)) s"; }
t4=four_ranks_on_one_gpu_every_collective_and_dtype

# One 4-rank run: NAME MODE(staged|ipc) SECONDS [VAR=VALUE...]; prints where every rank stopped.
run4() {
    local name=$1 mode=$2 secs=$3 t=$t4
    shift 3
    [ "$mode" = ipc ] && t=cuda_ipc_$t4
    local log="$out/trace4_$name.log"
    local t0=$SECONDS
    env "$@" OXCCL_DEBUG=trace OXCCL_TEST_TRACE=1 timeout -k 5 "$secs" \
        $bin/comm_cuda --ignored --exact $t --nocapture > "$log" 2>&1
    echo "### 4 ranks $name ($mode; $*): rc $? after $((SECONDS - t0)) s; the barrier chosen, then the last test step and last oxccl CUDA step of each rank:"
    grep -E "barrier=" "$log" | head -4 | cut -c1-200
    for r in 0 1 2 3; do
        grep "rank $r/4" "$log" | tail -1 | cut -c1-160
        grep "cuda: " "$log" | grep -E "rank=${r}([^0-9]|\$)" | tail -2 | cut -c1-200
    done
    grep -vE "rank [0-9]/4|cuda: " "$log" | grep -v '^\s*$' | tail -6 | cut -c1-300
    gzip -f "$log"
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -2
for phase in $phases; do
    echo; echo "#### phase $phase"
    case $phase in
    kernels)
        step timeout 200 $bin/kernels_cuda_gpu --test-threads 1 2>&1 | cut -c1-400 | grep -v '^\s*$' | tail -12
        step timeout 60 $bin/cuda_bench 256 f32,bf16,f8e4m3,f8e5m2
        for t in cuda_ipc_barriers_wait_for_a_peer_whose_stream_is_behind back_to_back_operations_stay_in_stream_order \
            cuda_ipc_mismatched_collectives_are_reported_not_hung cuda_ipc_a_missing_rank_times_out_naming_it; do
            step timeout 35 $bin/comm_cuda --ignored --exact $t 2>&1 | cut -c1-300 | grep -v '^\s*$' | tail -4
        done
        ;;
    hang)
        # Ranks as threads now wait on the host by default (staged: calls wait for their host
        # collectives; cuda_ipc: barriers met on the host, CUDA events between the streams) and
        # load every kernel at set-up (cuFuncLoad). The default runs first, then the settings that
        # hung 4 ranks before (stream waits, the barrier kernel), to tell which change fixed what.
        export CUDA_DEVICE_MAX_CONNECTIONS=32
        for t in two_ranks_on_one_gpu_every_collective_and_dtype staged_calls_with_stream_waits_give_the_same_results \
            cuda_ipc_two_ranks_on_one_gpu_every_collective_and_dtype cuda_ipc_device_barrier_two_ranks_every_collective_and_dtype \
            cuda_ipc_ring_steps_two_ranks_every_collective_and_dtype; do
            step timeout 35 $bin/comm_cuda --ignored --exact $t 2>&1 | cut -c1-300 | grep -v '^\s*$' | tail -4
        done
        step timeout 40 $bin/comm_cuda --ignored --exact three_ranks_on_one_gpu_every_collective_and_dtype 2>&1 | cut -c1-300 | grep -v '^\s*$' | tail -4
        run4 staged staged 40
        run4 ipc ipc 40
        run4 staged_streamwait staged 40 OXCCL_CUDA_STREAM_WAIT=1
        run4 ipc_devbarrier ipc 40 OXCCL_CUDA_IPC_BARRIER=device
        run4 ipc_devbarrier_8q ipc 40 OXCCL_CUDA_IPC_BARRIER=device CUDA_DEVICE_MAX_CONNECTIONS=8
        step timeout 50 $bin/comm_cuda --ignored --exact cuda_ipc_eight_ranks_with_default_slots 2>&1 | cut -c1-300 | grep -v '^\s*$' | tail -4
        echo "### 4 ranks staged with stream waits: thread states 30 s in"
        OXCCL_CUDA_STREAM_WAIT=1 OXCCL_DEBUG=trace OXCCL_TEST_TRACE=1 $bin/comm_cuda --ignored --exact $t4 --nocapture > "$out/trace4_snap.log" 2>&1 &
        pid=$!
        sleep 30
        if kill -0 $pid 2>/dev/null; then
            for t in /proc/$pid/task/*; do echo "$(cat $t/comm) $(cat $t/wchan 2>/dev/null) $(cut -d' ' -f3 $t/stat)"; done | sort | uniq -c
            command -v gdb >/dev/null && timeout 30 gdb -p $pid -batch -ex "thread apply all bt 12" 2>/dev/null | grep -E "^Thread|^#" | cut -c1-160 | head -150
            kill $pid
        fi
        wait $pid; echo "rc $?"
        gzip -f "$out/trace4_snap.log"
        unset CUDA_DEVICE_MAX_CONNECTIONS
        ;;
    mps)
        # MPS splits a fixed number of connections among its clients: keep the default per client.
        unset CUDA_DEVICE_MAX_CONNECTIONS
        export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
        mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
        nvidia-cuda-mps-control -d && echo "MPS started"
        echo "### perf ipc np4 (MPS), then every collective checked"
        OXCCL_CUDA_IPC=1 timeout 60 $bin/oxccl perf all-reduce --np 4 --device cuda -b 8 -e 256M -f 8 -c 1 -n 10 -w 3 --rotate 0 2>&1 | grep -E "^ +[0-9]|rror|Device coll|Out of" | cut -c1-300
        echo "### ring steps (OXCCL_ALGO=ring) np2 and np4 (MPS), all-reduce checked and timed"
        for np in 2 4; do
            OXCCL_ALGO=ring OXCCL_CUDA_IPC=1 timeout 50 $bin/oxccl perf all-reduce --np $np --device cuda -b 8 -e 256M -f 8 -c 1 -n 10 -w 3 --rotate 0 2>&1 | grep -E "^ +[0-9]|rror" | cut -c1-300
        done
        for coll in reduce-scatter all-gather broadcast all-to-all; do
            OXCCL_CUDA_IPC=1 timeout 40 $bin/oxccl perf $coll --np 4 --device cuda -b 8 -e 16M -f 64 -c 1 -n 3 -w 1 2>&1 | grep -E "^ +[0-9]|rror" | cut -c1-200
        done
        for d in f8e4m3 f8e5m2; do
            echo "### perf ipc np2 $d (MPS)"
            OXCCL_CUDA_IPC=1 timeout 60 $bin/oxccl perf all-reduce --np 2 --device cuda -d $d -o all -b 8 -e 256M -f 8 -c 1 -n 10 -w 3 --rotate 0 2>&1 | grep -E "^ +[0-9]|rror|Device coll|Out of"
        done
        echo "### perf ipc np2 256 MiB and 1 GiB f32 by slot size (MPS)"
        for slot in 4194304 16777216 33554432 67108864; do
            echo "slot $slot"
            OXCCL_CUDA_IPC=1 OXCCL_CUDA_IPC_SLOT=$slot timeout 35 $bin/oxccl perf all-reduce --np 2 --device cuda -b 64M -e 1G -f 4 -c 1 -n 10 -w 3 --rotate 0 2>&1 | grep -E "^ +[0-9]|rror"
        done
        echo quit | nvidia-cuda-mps-control && echo "MPS stopped"
        echo "### MPS server log (tail)"
        tail -15 $CUDA_MPS_LOG_DIRECTORY/server.log 2>/dev/null | cut -c1-200
        grep -iE "fail|error|limit|exceed" $CUDA_MPS_LOG_DIRECTORY/*.log 2>/dev/null | tail -10 | cut -c1-200
        ;;
    *) echo "unknown phase $phase" ;;
    esac
done
