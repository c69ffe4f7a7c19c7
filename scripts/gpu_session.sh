#!/usr/bin/env bash
# One device call for the open GPU and many-core checks of issues 4, 6 and 7, in priority order,
# inside a budget of BUDGET seconds (default 420): a step starts only while the budget lasts, and
# runs at most until it ends, so the whole script fits one device call (10 minutes at most) and
# leaves room, inside a session's 15 minutes of device time, for the machine's start and a short
# second call. Uses the binaries scripts/gpu_build.sh made. Usage, with the device tool:
#   run(carry=["target/gpu-bin"], timeout_s=480, command="scripts/gpu_session.sh")
# and, for the netns phase where the machine has no iproute2 (the lent ones), after
# scripts/netns_tools.sh here:
#   run(carry=["target/gpu-bin", ".netns-tools"], timeout_s=480,
#       command="NETNS_TOOLS=.netns-tools scripts/gpu_session.sh")
# PHASES (default "ddpshape chbind waitkernel channels threads cold tcpdev netns cpu mps kernels
# nccl") picks and orders the phases:
#   chbind   TCP channels on loopback by binding (--bind block / core), 1, 4 and auto channels, and
#            gloo;
#   waitkernel staged calls whose streams wait in the wait kernel: the GPU tests that force it,
#            the fixed cost against host waits (1 and 2 processes, shm and TCP, each bound as
#            `oxccl perf` binds by default), every collective checked over TCP, a traced run, the
#            TCP sweep to 256 MiB (waitquick: the short form);
#   cold     first, on a fresh machine: how long the first device collective spends compiling and
#            loading the kernels (empty caches);
#   threads  device collectives with ranks as threads of one process: 2, 3, 4 and 8 ranks, every
#            collective and dtype, CUDA IPC and staged (the 4-rank runs traced, where each rank
#            stopped printed if one hangs), faults and stream order;
#   flake    the 2-rank barrier-kernel test between threads, FLAKE_RUNS (40) times, untraced
#            (FLAKE_TRACE=1: traced); with FLAKE_AB=1 (the default) alternately without and with
#            the test's host barriers around each device call (without them it timed out in 22
#            of 138 runs on an H100: a rank in driver calls while its peer's barrier kernel spun);
#   channels TCP with 1, 2, 4 and 8 channels (OXCCL_SOCKET_CHANNELS), interleaved: 2 ranks on
#            loopback 1 MiB..64 MiB, then gloo at 64 MiB, 2 rounds; and 2 namespaces x 2 ranks,
#            hierarchical and flat ring with 1 and 4;
#   sendthread TCP with and without the send thread (OXCCL_SOCKET_SEND_THREAD), interleaved: 2
#            ranks on loopback 1 MiB..64 MiB, then gloo at 64 MiB; and 2 namespaces x 2 ranks,
#            hierarchical and flat ring with it;
#   ddpshape the DDP overlap by model shape (hidden x layers 768 x 8, 512 x 16), batch 4 and
#            --balance, 2 MiB buckets, --bind none and block, DDP_REPS (3) times, after one traced
#            run (oxccl trace --last: each bucket's all-reduce on the ranks' time line);
#            DDPSHAPE_SHARE (240) seconds at most (330 lets 3 repetitions finish on 16 cores);
#   ddpsize  the DDP overlap at batch 1 and 2 (1024 x 4, 768 x 8);
#   chdiag   CPU time of 2 ranks on loopback by channels and sockets, and hierarchical against
#            ring between namespaces with 4 channels;
#   kernels  the kernel tests (fp8 included) and kernel bandwidth for f32 / bf16 / fp8;
#   mps      ranks as processes under MPS over CUDA IPC: 4 ranks 8 B..1 GiB, one-shot latency,
#            256 MiB, every other collective checked, fp8 all-reduce, the slot size at 256 MiB
#            and 1 GiB;
#   tcpdev   device collectives staged through pinned host memory over TCP (the path between
#            nodes): the 2-rank staged test with OXCCL_TRANSPORT=tcp, and a 2-process sweep;
#   nccl     NCCL's single-rank all-reduce (PyTorch), for scale;
#   cpu      the DDP overlap table (4 ranks over shared memory) and TCP against torch/gloo;
#   netns    hierarchical against the flat ring, 2 network namespaces x 2 ranks, 64 MiB, with auto
#            and 1 channels and with a 4 Gbit/s line rate (needs iproute2 and tc, or NETNS_TOOLS:
#            a carried folder from scripts/netns_tools.sh);
# Since 2026-11-26 (night) OXCCL_SOCKET_CHANNELS defaults to auto: 4 channels for TCP ranks with
# 8 CPUs each (unbound on 16 cores, or --bind block with 2 ranks), so netns, sendthread, cpu and
# tcp figures are not comparable with earlier logs' (1 channel) unless the phase sets it.
# and, not in the default, the follow-ups of a first run:
#   tune     CUDA IPC slot size and one-shot threshold, 2 and 4 processes;
#   ddp      the DDP overlap table by bucket size;
#   tcp      TCP on loopback by sockets per direction, against gloo;
# and, after a second:
#   defaults CUDA IPC all-reduce with the default slot and one-shot sizes (2 and 4 processes);
#   ddp2     the DDP overlap table, buckets of 2, 4 and 25 MiB, 5 rounds, twice;
#   tcp2     TCP on loopback: Python's rate each way, oxccl by setting, and gloo;
#   ddpspin  the DDP overlap at batch 4, 2 MiB buckets, OXCCL_SPIN auto / 0 x --bind none / core
#            (run on the H100, 2026-11-26: --bind core overlaps nothing);
#   coldperf 2 processes' first device collective on a fresh machine with OXCCL_TIMEOUT=12 (less
#            than the kernel load), then the default all-reduce sweep.
# Output: stdout and $OUT/session.log; traces of the 4-rank runs as $OUT/trace4_*.log.gz.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin=${BIN:-target/gpu-bin}
budget=${BUDGET:-420}
phases=${PHASES:-ddpshape chbind waitkernel channels threads cold tcpdev netns cpu mps kernels nccl}
out=${OUT:-/tmp}
exec > >(tee -a "$out/session.log") 2>&1
tee_pid=$!
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13/lib") for p in nvidia.__path__))' 2>/dev/null); do
    [ -e "$d/libnvrtc.so.13" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
# NETNS_TOOLS: a folder with the `ip` and `tc` to use (scripts/netns.sh needs iproute2).
[ -n "${NETNS_TOOLS:-}" ] && export PATH="$PWD/$NETNS_TOOLS:$PATH"
export OXCCL_REQUIRE_GPU=1 OXCCL_CACHE_DIR=/tmp/oxccl-cache OXCCL_TIMEOUT=20 RUST_BACKTRACE=0

# Each phase may use at most its share (seconds from its start), and no step runs past the budget.
declare -A share=([threads]=120 [kernels]=80 [mps]=140 [nccl]=30 [cpu]=70 [netns]=110 [cold]=110
    [tune]=200 [ddp]=120 [tcp]=120 [defaults]=120 [flake]=${FLAKE_SHARE:-100} [ddp2]=90 [tcp2]=90 [coldperf]=100 [tcpdev]=80 [sendthread]=100
    [ddpspin]=100 [ddpshape]=${DDPSHAPE_SHARE:-240} [channels]=110 [waitkernel]=120 [waitquick]=70 [chbind]=110 [ddpsize]=90
    [chdiag]=70)
phase_end=$budget
# step LIMIT CMD...: runs CMD for at most LIMIT seconds, never past the phase's share or the budget.
step() {
    local limit=$1 left=$((budget - SECONDS))
    shift
    [ $((phase_end - SECONDS)) -lt "$left" ] && left=$((phase_end - SECONDS))
    if [ "$left" -lt 8 ]; then
        echo "### SKIPPED (budget spent): $*"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "### [t=${SECONDS}s, limit ${limit}s] $*"
    local t=$SECONDS
    timeout -k 3 "$limit" "$@"
    echo "### rc $? after $((SECONDS - t)) s"
}
# Test output, shortened: the result lines and the first failure.
short() {
    cut -c1-300 | awk '/^###|^test |test result|rror|FAILED/ {print; next} /panicked/ {print; p=1; next} p {print; p=0}' |
        head -"${1:-14}"
}
ctest() { local limit=$1 t=$2; shift 2; step "$limit" "$bin/comm_cuda" --ignored --exact "cuda::$t" "$@" 2>&1 | short; }
perf() { local limit=$1; shift; step "$limit" "$bin/oxccl" perf "$@" 2>&1 | grep -E "^###|^ +[0-9]|rror|wrong|Avg bus|Out of bounds|Send thread|channels \(OXCCL" | cut -c1-200; }

# Ranks as processes on one GPU need MPS (without it the driver time-slices their contexts).
mps_on() {
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    timeout 20 nvidia-cuda-mps-control -d && echo "MPS daemon started"
}
mps_off() { echo quit | timeout 20 nvidia-cuda-mps-control && echo "MPS daemon stopped"; }
# torch/gloo's 64 MiB all-reduce between 2 ranks on loopback (the peer bench gpu_build.sh copies).
gloo64() {
    GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 step 40 python3 "$bin/gloo_bench.py" -np 2 -b 64M -e 64M \
        -c all_reduce 2>&1 | grep -vE "^#" | tail -2
}

# The staged path's fixed cost: streams waiting on the GPU against calls waiting on the host
# (OXCCL_CUDA_STREAM_WAIT=1 / 0), 1 process twice, then 2 over shared memory and TCP, each bound
# as `oxccl perf` binds by default; then 1 + 6 back-to-back 8 B calls of 1 process, traced.
staged_cost() {
    local round w t
    for round in 1 2; do
        for w in 1 0; do
            echo "round $round 1 process, OXCCL_CUDA_STREAM_WAIT=$w"
            OXCCL_CUDA_IPC=0 OXCCL_CUDA_STREAM_WAIT=$w perf 20 all-reduce --np 1 --device cuda \
                -b 8 -e 1M -f 16 -c 1 -n 20 -w 5 --rotate 0
        done
    done
    for w in 1 0; do
        for t in shm tcp; do
            echo "OXCCL_CUDA_STREAM_WAIT=$w transport $t"
            OXCCL_CUDA_IPC=0 OXCCL_CUDA_STREAM_WAIT=$w perf 20 all-reduce --np 2 --transport $t \
                --device cuda -b 8 -e 16M -f 16 -c 1 -n 20 -w 5 --rotate 0
        done
    done
    echo "traced: 1 process, OXCCL_CUDA_STREAM_WAIT=1, 8 B, 1 + 6 calls"
    OXCCL_CUDA_IPC=0 OXCCL_CUDA_STREAM_WAIT=1 OXCCL_DEBUG=trace step 20 "$bin/oxccl" perf \
        all-reduce --np 1 --device cuda -b 8 -e 8 -c 1 -n 6 -w 1 --rotate 0 >"$out/waittrace.log" 2>&1
    grep -E "cuda: |wait kernel" "$out/waittrace.log" | tail -30 | cut -c1-200
    gzip -f "$out/waittrace.log"
}

# A 4-rank threaded run, traced: NAME TEST [VAR=VALUE...]; on failure, where every rank stopped.
run4() {
    local name=$1 t=$2
    shift 2
    local log="$out/trace4_$name.log"
    step 35 env "$@" OXCCL_DEBUG=trace OXCCL_TEST_TRACE=1 "$bin/comm_cuda" --ignored --exact "cuda::$t" --nocapture >"$log" 2>&1
    grep -E "^###|^test |test result|panicked" "$log" | head -6 | cut -c1-300
    if ! grep -q "test result: ok" "$log"; then
        echo "### $name did not pass: the barrier chosen, then the last test step and oxccl CUDA step of each rank"
        grep -E "barrier=" "$log" | head -4 | cut -c1-200
        for r in 0 1 2 3; do
            grep "rank $r/4" "$log" | tail -1 | cut -c1-160
            grep "cuda: " "$log" | grep -E "rank=${r}([^0-9]|\$)" | tail -2 | cut -c1-200
        done
    fi
    gzip -f "$log"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -2
echo "cores $(nproc); kernel $(uname -r); budget ${budget}s; phases: $phases"
for phase in $phases; do
    echo
    phase_end=$((SECONDS + ${share[$phase]:-60}))
    echo "#### phase $phase (t=${SECONDS}s, share ${share[$phase]:-60}s)"
    case $phase in
    threads)
        # Ranks as threads share one context: a hardware queue per stream.
        export CUDA_DEVICE_MAX_CONNECTIONS=32
        ctest 20 two_ranks_on_one_gpu_every_collective_and_dtype
        ctest 20 cuda_ipc_two_ranks_on_one_gpu_every_collective_and_dtype
        ctest 25 three_ranks_on_one_gpu_every_collective_and_dtype
        run4 staged four_ranks_on_one_gpu_every_collective_and_dtype
        run4 ipc cuda_ipc_four_ranks_on_one_gpu_every_collective_and_dtype
        ctest 35 cuda_ipc_eight_ranks_with_default_slots
        for t in cuda_ipc_ring_steps_two_ranks_every_collective_and_dtype \
            cuda_ipc_device_barrier_two_ranks_every_collective_and_dtype \
            staged_calls_with_stream_waits_give_the_same_results \
            calls_that_wait_for_their_host_collectives_give_the_same_results \
            cuda_ipc_barriers_wait_for_a_peer_whose_stream_is_behind \
            back_to_back_operations_stay_in_stream_order \
            cuda_ipc_mismatched_collectives_are_reported_not_hung \
            cuda_ipc_a_missing_rank_times_out_naming_it \
            a_bad_call_is_refused_before_anything_is_enqueued; do
            ctest 25 "$t"
        done
        unset CUDA_DEVICE_MAX_CONNECTIONS
        ;;
    kernels)
        step 60 "$bin/kernels_cuda_gpu" cuda_gpu:: --test-threads 1 2>&1 | short 20
        step 30 "$bin/cuda_bench" 256 f32,bf16,f8e4m3,f8e5m2 2>&1 | cut -c1-200
        ;;
    mps)
        # MPS gives each client CUDA_DEVICE_MAX_CONNECTIONS connections out of a fixed number:
        # keep the default.
        mps_on
        export OXCCL_CUDA_IPC=1
        perf 60 all-reduce --np 4 --device cuda -b 8 -e 1G -f 8 -c 1 -n 10 -w 3 --rotate 0
        perf 25 all-reduce --np 4 --device cuda -b 8 -e 8 -c 1 -n 1000 -w 50 --rotate 0
        perf 25 all-reduce --np 4 --device cuda -b 256K -e 256K -c 1 -n 300 -w 30 --rotate 0
        perf 30 all-reduce --np 4 --device cuda -b 256M -e 256M -c 1 -n 10 -w 3 --rotate 0
        for coll in reduce-scatter all-gather broadcast reduce gather scatter all-to-all; do
            perf 25 "$coll" --np 4 --device cuda -b 8 -e 16M -f 64 -c 1 -n 3 -w 1 -d all
        done
        perf 40 all-reduce --np 2 --device cuda -d f8e4m3,f8e5m2 -o all -b 8 -e 64M -f 64 -c 1 -n 5 -w 2 --rotate 0
        for slot in 4194304 16777216 67108864; do
            echo "slot $slot"
            OXCCL_CUDA_IPC_SLOT=$slot perf 30 all-reduce --np 2 --device cuda -b 256M -e 1G -f 4 -c 1 -n 10 -w 3 --rotate 0
        done
        OXCCL_ALGO=ring perf 40 all-reduce --np 4 --device cuda -b 8 -e 256M -f 8 -c 1 -n 10 -w 3 --rotate 0
        unset OXCCL_CUDA_IPC
        mps_off
        grep -ihE "fail|error|exceed" "$CUDA_MPS_LOG_DIRECTORY"/*.log 2>/dev/null | tail -5 | cut -c1-200
        ;;
    nccl)
        step 60 python3 scripts/nccl_single_rank.py
        ;;
    cpu)
        # DDP overlap, 4 ranks over shared memory on 16 cores (4 MiB buckets: with 25 MiB this
        # 12 MiB model is one bucket and nothing overlaps); then TCP against gloo.
        for b in 4 8; do
            for mib in 4 25; do
                step 40 "$bin/oxccl" launch -n 4 -- "$bin/02_ddp_mlp" --mode all --hidden 1024 \
                    --layers 4 --batch "$b" --steps 8 --rounds 5 --bucket-mib "$mib" 2>&1 | tail -14
            done
        done
        OX="$bin/oxccl" PEERS="$bin" GLOO_PY="$(command -v python3)" ROUNDS=2 SIZES="8 64M" \
            step 60 scripts/side_by_side_tcp.sh
        ;;
    ddpshape)
        # DDP overlap by model shape (2 MiB buckets): the last bucket (the first layers'
        # gradients, ready when backward ends) can never overlap, and with more, smaller layers
        # it is less of the bytes. Batch 4, and --balance (the batch at which backward takes as
        # long as the all-reduce: where overlap can hide the most; the example prints the best
        # ratio possible and how much of it was reached). Each rank unbound, or on its own
        # block of 4 CPUs (--bind block). Interleaved, DDP_REPS times. Since 2026-11-27 every
        # run also times overlap off and the gradients computed in their bucket slots.
        # First, the last steps' buckets on the ranks' time line: when each all-reduce started
        # and how long it ran beside backward (gradients in their slots, overlap on, 768 x 8,
        # --bind block).
        rm -rf /tmp/ddptrace
        step 30 "$bin/oxccl" launch -n 4 --bind block --trace-dir /tmp/ddptrace -- "$bin/02_ddp_mlp" \
            --mode in-place --overlap on --hidden 768 --layers 8 --batch 4 --steps 10 --bucket-mib 2 2>&1 | tail -2
        step 20 "$bin/oxccl" trace --last 20 /tmp/ddptrace 2>&1 | tail -88 | cut -c1-160
        for rep in $(seq "${DDP_REPS:-3}"); do
            for shape in "768 8" "512 16"; do
                for bind in none block; do
                    for batch in "--batch 4" "--batch 4 --balance"; do
                        set -- $shape
                        echo "rep $rep hidden $1 layers $2 --bind $bind $batch"
                        step 30 "$bin/oxccl" launch -n 4 --bind "$bind" -- "$bin/02_ddp_mlp" --mode all \
                            --hidden "$1" --layers "$2" $batch --steps 8 --rounds 5 --bucket-mib 2 2>&1 |
                            grep -E "^###|rror|balance:|batch|ms$|^\[0\] #" | grep -v "median step" | tail -18
                    done
                done
            done
        done
        ;;
    ddpspin)
        # DDP overlap at its best setting so far (batch 4, 2 MiB buckets: 0.760 on 16 cores),
        # with the ranks' waits spinning (OXCCL_SPIN=auto, spinning where cores suffice) or
        # sleeping (0), and bound to cores or not: does a spinning progress thread slow the
        # backward pass beside it (a hyperthread sibling, say)? Interleaved, twice.
        for rep in 1 2; do
            for spin in auto 0; do
                for bind in none core; do
                    echo "rep $rep OXCCL_SPIN=$spin --bind $bind"
                    OXCCL_SPIN=$spin step 30 "$bin/oxccl" launch -n 4 --bind "$bind" -- \
                        "$bin/02_ddp_mlp" --mode all --hidden 1024 --layers 4 --batch 4 --steps 8 \
                        --rounds 5 --bucket-mib 2 2>&1 | tail -14
                done
            done
        done
        ;;
    netns)
        # Hierarchical against the flat ring, 2 namespaces x 2 ranks, 64 MiB: with the default
        # channels (auto: 4 each on 16 cores), with 1, and with a 4 Gbit/s line rate on every
        # node's link (network-bound, as between real nodes; 1.49-1.50x on the development
        # machine).
        for round in $(seq 1 "${NETNS_ROUNDS:-2}"); do
            for v in auto ch1 rate; do
                for a in hierarchical ring; do
                    echo "round $round $a $v"
                    ch=auto rate=()
                    [ "$v" = ch1 ] && ch=1
                    [ "$v" = rate ] && rate=(--rate 4gbit)
                    OXCCL_SOCKET_CHANNELS=$ch OXCCL_BIN="$bin/oxccl" OXCCL_ALGO=all-reduce=$a \
                        step 25 scripts/netns.sh run --nodes 2 --nproc 2 --prefix gp "${rate[@]}" -- \
                        "$bin/oxccl" perf all-reduce -b 64M -e 64M -z 1 -n 10 -w 2 2>&1 |
                        grep -E "^###|\] +[0-9]|rror|SKIP|channels \(OXCCL" | cut -c1-200
                done
            done
        done
        ;;
    cold)
        # The first device collective on a fresh machine (empty OXCCL_CACHE_DIR and driver cache):
        # how long loading the kernels takes (NVRTC, then the driver's PTX compiler), then the
        # same test again, warm.
        # Empty caches even on a machine used before: a new oxccl cache and driver cache.
        export CUDA_DEVICE_MAX_CONNECTIONS=32
        log="$out/cold.log"
        rm -rf "$OXCCL_CACHE_DIR" /tmp/cold-driver-cache
        step 90 env OXCCL_DEBUG=trace CUDA_CACHE_PATH=/tmp/cold-driver-cache "$bin/comm_cuda" --ignored \
            --exact cuda::cuda_ipc_two_ranks_on_one_gpu_every_collective_and_dtype >"$log" 2>&1
        grep -E "^###|test result|loading the kernels|allocating scratch" "$log" | head -8 | cut -c1-200
        gzip -f "$log"
        ctest 30 cuda_ipc_two_ranks_on_one_gpu_every_collective_and_dtype
        unset CUDA_DEVICE_MAX_CONNECTIONS
        ;;
    tune)
        # Slot size and one-shot threshold of CUDA IPC all-reduce, 2 and 4 processes under MPS.
        mps_on
        export OXCCL_CUDA_IPC=1
        for np in 4 2; do
            for slot in 4194304 16777216 33554432 67108864; do
                echo "np $np slot $slot"
                OXCCL_CUDA_IPC_SLOT=$slot perf 25 all-reduce --np $np --device cuda -b 1M -e 1G -f 4 -c 1 -n 10 -w 3 --rotate 0
            done
        done
        for np in 2 4; do
            for os in 0 4194304; do
                echo "np $np one-shot up to $os"
                OXCCL_CUDA_IPC_ONE_SHOT=$os perf 25 all-reduce --np $np --device cuda -b 64K -e 4M -f 2 -c 1 -n 200 -w 20 --rotate 0
            done
        done
        unset OXCCL_CUDA_IPC
        mps_off
        ;;
    ddp)
        # DDP overlap on 16 cores by bucket size (the example's 12 MiB of gradients fit one
        # 25 MiB bucket after the 1 MiB first one: nothing left to overlap).
        for b in 4 16; do
            for mib in 1 2 4 25; do
                echo "batch $b bucket $mib MiB"
                step 40 "$bin/oxccl" launch -n 4 -- "$bin/02_ddp_mlp" --mode all --hidden 1024 \
                    --layers 4 --batch "$b" --steps 8 --rounds 3 --bucket-mib "$mib" 2>&1 | tail -14
            done
        done
        ;;
    waitkernel | waitquick)
        # Staged calls whose streams wait in the wait kernel (oxccl_wait_flag): the GPU tests
        # that force it, the fixed cost against the host wait (see staged_cost), then (waitkernel
        # only) every collective checked over TCP with forced stream waits and the sweep to
        # 256 MiB over TCP.
        export CUDA_DEVICE_MAX_CONNECTIONS=32
        OXCCL_TIMEOUT=8 ctest 20 staged_calls_with_stream_waits_give_the_same_results
        [ "$phase" = waitkernel ] && ctest 40 back_to_back_operations_stay_in_stream_order
        unset CUDA_DEVICE_MAX_CONNECTIONS
        mps_on
        staged_cost
        if [ "$phase" = waitkernel ]; then
            for coll in reduce-scatter all-gather broadcast reduce all-to-all; do
                OXCCL_CUDA_IPC=0 OXCCL_CUDA_STREAM_WAIT=1 perf 25 "$coll" --np 2 --transport tcp \
                    --device cuda -b 8 -e 16M -f 64 -c 1 -n 3 -w 1 -d all | grep -E "^###|rror|Out of bounds" | head -5
            done
            OXCCL_CUDA_IPC=0 perf 40 all-reduce --np 2 --transport tcp --device cuda -b 8 -e 256M -f 8 -c 1 \
                -n 10 -w 3 --rotate 0
        fi
        mps_off
        ;;
    chbind)
        # TCP channels on loopback by binding: with a core per rank (what `oxccl perf --np` did
        # until 2026-11-26) a rank's channel threads share its core and 4 channels gained
        # nothing; with a block of CPUs per rank (its default now where there are 2 per rank)
        # they can run at once. 1 and 4 channels and auto (the default since 2026-11-26, night:
        # 4 with blocks of 8, 1 with a core each), --bind block and core, 4 and 64 MiB, then
        # gloo; twice, interleaved.
        for round in 1 2; do
            for k in 1 4 auto; do
                for b in block core; do
                    echo "round $round OXCCL_SOCKET_CHANNELS=$k --bind $b"
                    OXCCL_SOCKET_CHANNELS=$k perf 15 all-reduce --np 2 --bind $b --transport tcp \
                        -b 4M -e 64M -f 16 -z 1 -n 10 -w 3
                done
            done
            echo "round $round gloo"
            gloo64
        done
        ;;
    ddpsize)
        # The DDP overlap with backward compute and the all-reduce of comparable length, as
        # issue 7 asks (at batch 4 compute took 15-25 ms and the all-reduce 7): batch 1 and 2,
        # 2 MiB buckets, ranks unbound. Interleaved, twice.
        for rep in 1 2; do
            for shape in "1024 4" "768 8"; do
                for b in 1 2; do
                    set -- $shape
                    echo "rep $rep hidden $1 layers $2 batch $b"
                    step 30 "$bin/oxccl" launch -n 4 -- "$bin/02_ddp_mlp" --mode all --hidden "$1" \
                        --layers "$2" --batch "$b" --steps 8 --rounds 5 --bucket-mib 2 2>&1 | tail -14
                done
            done
        done
        ;;
    chdiag)
        # Channels gained 3x between namespaces but nothing on loopback (2 ranks, 64 MiB): the
        # CPU time the ranks used (user, sys) against the wall time, by channels and sockets
        # per direction; then hierarchical against ring between namespaces with 4 channels.
        for k in 1 4; do
            for ns in 2 1; do
                echo "OXCCL_SOCKET_CHANNELS=$k OXCCL_NSOCKS=$ns"
                OXCCL_SOCKET_CHANNELS=$k OXCCL_NSOCKS=$ns step 20 bash -c 'TIMEFORMAT="cpu: %R s wall, %U s user, %S s sys"
                    time "$0" perf all-reduce --np 2 --transport tcp -b 64M -e 64M -z 1 -n 20 -w 3' \
                    "$bin/oxccl" 2>&1 | grep -E "^###|^ +[0-9]|cpu:|channels \(OXCCL" | cut -c1-200
            done
        done
        for round in 1 2; do
            for a in hierarchical ring; do
                echo "round $round channels 4 $a"
                OXCCL_SOCKET_CHANNELS=4 OXCCL_BIN="$bin/oxccl" OXCCL_ALGO=all-reduce=$a step 15 \
                    scripts/netns.sh run --nodes 2 --nproc 2 --prefix cd -- "$bin/oxccl" perf all-reduce \
                    -b 64M -e 64M -z 1 2>&1 | grep -E "^###|\] +[0-9]|rror|SKIP" | cut -c1-200
            done
        done
        ;;
    channels)
        # Large all-reduces cut across several sets of connections, each driven by a thread of
        # its own: on this machine's cores the kernel's socket copies of several channels can run
        # at once (on the 2-core development machine, at 64 MiB, 2 channels cost 18-22 % and 4 cost
        # 33-37 %).
        for round in 1 2; do
            for k in 1 2 4 8; do
                echo "round $round OXCCL_SOCKET_CHANNELS=$k"
                OXCCL_SOCKET_CHANNELS=$k perf 15 all-reduce --np 2 --transport tcp -b 1M -e 64M -f 8 -z 1 -n 10 -w 3
            done
            echo "round $round gloo"
            gloo64
        done
        for k in 4 1; do
            for a in hierarchical ring; do
                echo "channels $k $a"
                OXCCL_SOCKET_CHANNELS=$k OXCCL_BIN="$bin/oxccl" OXCCL_ALGO=all-reduce=$a step 15 \
                    scripts/netns.sh run --nodes 2 --nproc 2 --prefix ch -- "$bin/oxccl" perf all-reduce \
                    -b 64M -e 64M -z 1 2>&1 | grep -E "^###|\] +[0-9]|rror|SKIP" | cut -c1-200
            done
        done
        ;;
    sendthread)
        # Large sends to TCP peers on a thread of their own, or not: on this machine's cores the
        # kernel's copies into the sockets can run beside the receives and reductions (on the
        # 2-core development machine they cannot, and the thread cost up to 28 %).
        for round in 1 2; do
            for t in 0 1; do
                echo "round $round OXCCL_SOCKET_SEND_THREAD=$t"
                OXCCL_SOCKET_SEND_THREAD=$t perf 20 all-reduce --np 2 --transport tcp -b 1M -e 64M -f 8 -z 1 -n 10 -w 3
            done
            echo "round $round gloo"
            gloo64
        done
        for t in 1 0; do
            for a in hierarchical ring; do
                echo "send thread $t $a"
                OXCCL_SOCKET_SEND_THREAD=$t OXCCL_BIN="$bin/oxccl" OXCCL_ALGO=all-reduce=$a step 20 \
                    scripts/netns.sh run --nodes 2 --nproc 2 --prefix st -- "$bin/oxccl" perf all-reduce \
                    -b 64M -e 64M -z 1 2>&1 | grep -E "^###|\] +[0-9]|rror|SKIP" | cut -c1-200
            done
        done
        ;;
    tcp)
        # TCP on loopback, 2 ranks, 64 MiB, by sockets per direction, against gloo, interleaved.
        for round in 1 2; do
            for ns in 1 2 4 8; do
                echo "round $round nsocks $ns"
                OXCCL_NSOCKS=$ns perf 25 all-reduce --np 2 --transport tcp -b 64M -e 64M -z 1 -n 10 -w 3
            done
            echo "round $round gloo"
            gloo64
        done
        ;;
    defaults)
        # CUDA IPC all-reduce with the default slot and one-shot sizes, 2 and 4 processes (MPS).
        mps_on
        export OXCCL_CUDA_IPC=1
        for np in 2 4; do
            perf 30 all-reduce --np $np --device cuda -b 8 -e 1G -f 4 -c 1 -n 20 -w 5 --rotate 0
            perf 20 all-reduce --np $np --device cuda -b 8 -e 8 -c 1 -n 1000 -w 50 --rotate 0
            perf 20 all-reduce --np $np --device cuda -b 256K -e 256K -c 1 -n 300 -w 30 --rotate 0
            perf 20 all-reduce --np $np --device cuda -b 256M -e 256M -c 1 -n 20 -w 3 --rotate 0
        done
        perf 25 reduce --np 4 --device cuda -b 8 -e 64M -f 8 -c 1 -n 5 -w 2 -d float,bf16,f8e4m3
        unset OXCCL_CUDA_IPC
        mps_off
        export CUDA_DEVICE_MAX_CONNECTIONS=32
        ctest 25 cuda_ipc_eight_ranks_with_default_slots
        ctest 25 cuda_ipc_four_ranks_on_one_gpu_every_collective_and_dtype
        unset CUDA_DEVICE_MAX_CONNECTIONS
        ;;
    flake)
        # FLAKE_RUNS (default 40) repeats of the barrier kernel between rank threads (not the
        # default for threads), with a short time-out.
        export CUDA_DEVICE_MAX_CONNECTIONS=32
        for k in $(seq 1 "${FLAKE_RUNS:-40}"); do
            log="$out/flake$k.log"
            # Untraced by default, as the threads phase runs it; FLAKE_TRACE=1: every step traced.
            tr="OXCCL_DEBUG=trace OXCCL_TEST_TRACE=1"
            [ "${FLAKE_TRACE:-0}" = 0 ] && tr="OXCCL_DEBUG=warn"
            # FLAKE_AB=1: odd runs without the test's host barriers around each device call
            # (OXCCL_TEST_UNGATED=1: the hazard), even ones with them, to compare.
            if [ "${FLAKE_AB:-1}" = 1 ]; then tr="$tr OXCCL_TEST_UNGATED=$((k % 2))"; echo "run $k: $tr"; fi
            # shellcheck disable=SC2086
            step 18 env OXCCL_TIMEOUT=8 $tr "$bin/comm_cuda" --ignored --exact \
                cuda::cuda_ipc_device_barrier_two_ranks_every_collective_and_dtype --nocapture >"$log" 2>&1
            grep -E "^###|test result|panicked" "$log" | head -3 | cut -c1-200
            # Budget spent: no log to keep, and no later run would start either.
            if grep -q '^### SKIPPED' "$log"; then
                rm -f "$log"
                break
            fi
            if grep -q "test result: ok" "$log"; then rm -f "$log"; else
                grep -A2 "panicked" "$log" | head -6 | cut -c1-400
                for r in 0 1; do
                    grep "rank $r/2" "$log" | tail -1 | cut -c1-160
                    grep "cuda: " "$log" | grep -E "rank=${r}([^0-9]|\$)" | tail -3 | cut -c1-200
                done
                gzip -f "$log"
            fi
        done
        unset CUDA_DEVICE_MAX_CONNECTIONS
        ;;
    ddp2)
        # DDP overlap by bucket size, more rounds, interleaved.
        for rep in 1 2; do
            for b in 8 16; do
                for mib in 2 4 25; do
                    echo "rep $rep batch $b bucket $mib MiB"
                    step 30 "$bin/oxccl" launch -n 4 -- "$bin/02_ddp_mlp" --mode all --hidden 1024 \
                        --layers 4 --batch "$b" --steps 8 --rounds 5 --bucket-mib "$mib" 2>&1 | tail -14
                done
            done
        done
        ;;
    tcp2)
        # TCP on loopback: what Python threads move each way at once, then oxccl by setting,
        # and gloo, interleaved.
        step 40 python3 scripts/tcp_loopback_ceiling.py 1024 1,2,4
        for round in 1 2; do
            for v in "OXCCL_NSOCKS=2" "OXCCL_NSOCKS=4" "OXCCL_SPIN=0" "OXCCL_SOCKET_BUFFER=0" "OXCCL_SOCKET_BUFFER=16777216"; do
                echo "round $round $v"
                (export "${v?}"; step 25 "$bin/oxccl" perf all-reduce --np 2 --transport tcp -b 64M -e 64M -z 1 -n 10 -w 3) 2>&1 |
                    grep -E "^ +[0-9]"
            done
            echo "round $round bind core"
            step 25 "$bin/oxccl" perf all-reduce --np 2 --bind core --transport tcp -b 64M -e 64M -z 1 -n 10 -w 3 2>&1 | grep -E "^ +[0-9]"
            echo "round $round gloo"
            gloo64
        done
        ;;
    tcpdev)
        export CUDA_DEVICE_MAX_CONNECTIONS=32
        OXCCL_TRANSPORT=tcp ctest 30 two_ranks_on_one_gpu_every_collective_and_dtype
        unset CUDA_DEVICE_MAX_CONNECTIONS
        mps_on
        OXCCL_CUDA_IPC=0 perf 40 all-reduce --np 2 --transport tcp --device cuda -b 8 -e 256M -f 8 -c 1 -n 10 -w 3 --rotate 0
        mps_off
        ;;
    coldperf)
        # First thing on a fresh machine: 2 processes whose first device collective compiles and
        # loads the kernels at once, with a time-out shorter than that load; then the default
        # sweep.
        mps_on
        rm -rf "$OXCCL_CACHE_DIR" /tmp/cold-driver-cache
        CUDA_CACHE_PATH=/tmp/cold-driver-cache OXCCL_TIMEOUT=12 OXCCL_CUDA_IPC=1 perf 60 all-reduce --np 2 --device cuda -b 8 -e 8 -c 1 -n 10 -w 1 --rotate 0
        OXCCL_CUDA_IPC=1 perf 30 all-reduce --np 2 --device cuda -b 8 -e 1G -f 4 -c 1 -n 20 -w 5 --rotate 0
        mps_off
        ;;
    *) echo "unknown phase $phase" ;;
    esac
done
echo "#### done at t=${SECONDS}s"
# Let tee write the last lines before the call returns.
exec >&- 2>&-
wait "$tee_pid"
