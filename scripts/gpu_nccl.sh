#!/usr/bin/env bash
# The GPU checks of oxccl's libnccl.so.2 (docs/NCCL.md), in one device call of at most BUDGET
# seconds (default 480), from what `SET=nccl scripts/gpu_build.sh` made (target/gpu-bin):
#   run(carry=["target/gpu-bin"], timeout_s=560, command="scripts/gpu_nccl.sh")
# 1. The C test (nccl/tests/nccl/abi.c), built there against the library: the checks without a
#    device, and every collective on host buffers.
# 2. nccl-tests (source carried in target/gpu-bin/nccl-tests, built there with the machine's nvcc
#    against NCCL's header from its wheel and this library): all_reduce, all_gather,
#    reduce_scatter, broadcast, reduce, alltoall, sendrecv with one rank (`-g 1`, no MPI on the
#    machine), `-d all -o all -c 1`, then the same with `-G 5` (CUDA graphs: refused, a clear
#    error expected). With mpirun there: 2 and 4 processes on GPU 0 under MPS.
# 3. PyTorch with its wheel's libnccl.so.2 replaced by this library: scripts/nccl_torch_check.py
#    under torchrun with 2 processes on GPU 0: every collective and batch_isend_irecv checked
#    exactly; 10 DDP steps against the same on gloo; a rank that skips an all_reduce makes the
#    other fail within the time-out instead of hanging. The wheel's library is put back after.
# Untested as a whole: written without a GPU (the steps' commands are those of docs/NCCL.md).
set -uo pipefail
bin=${BIN:-target/gpu-bin}
budget=${BUDGET:-480}
log=${OUT:-/tmp}/gpu_nccl.log
exec > >(tee -a "$log") 2>&1
lib=$(readlink -f "$bin/libnccl.so.2")
export OXCCL_CACHE_DIR=/tmp/oxccl-cache OXCCL_TIMEOUT=60
. "$(dirname "${BASH_SOURCE[0]}")/gpu_steps.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
wheel=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])' 2>/dev/null)
echo "NCCL wheel: ${wheel:-none}; cores $(nproc); budget ${budget}s"
home=/tmp/ncclhome && mkdir -p "$home/lib" "$home/include"
ln -sf "$lib" "$home/lib/libnccl.so.2" && ln -sf "$lib" "$home/lib/libnccl.so"
[ -n "$wheel" ] && cp -r "$wheel/include/." "$home/include/"
export LD_LIBRARY_PATH="$home/lib:${LD_LIBRARY_PATH:-}"

# 1. The C test.
cc -std=c11 -D_GNU_SOURCE -O1 -Inccl/include nccl/tests/nccl/abi.c -o /tmp/abi \
    -L"$home/lib" -l:libnccl.so.2 -lpthread -ldl -Wl,-rpath,"$home/lib" && {
    step 60 /tmp/abi
    OXCCL_NCCL_HOST_MEMORY=1 step 60 /tmp/abi host
}

# 2. nccl-tests.
tests="all_reduce all_gather reduce_scatter broadcast reduce alltoall sendrecv"
if [ -d "$bin/nccl-tests" ]; then
    mpi=0
    command -v mpicc >/dev/null && mpi=1
    step 180 make -s -C "$bin/nccl-tests" MPI=$mpi NCCL_HOME="$home" CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" BUILDDIR=/tmp/nccl-tests
    for t in $tests; do
        [ -x /tmp/nccl-tests/${t}_perf ] || continue
        step 40 /tmp/nccl-tests/${t}_perf -b 8 -e 16M -f 8 -g 1 -d all -o all -c 1 -n 5 -w 2
    done
    [ -x /tmp/nccl-tests/all_reduce_perf ] &&
        step 40 /tmp/nccl-tests/all_reduce_perf -b 8 -e 16M -f 8 -g 1 -c 1 -G 5
    if [ "$mpi" = 1 ]; then
        mps_on
        for np in 2 4; do
            for t in $tests; do
                NCCL_TESTS_DEVICE=0 step 60 mpirun --allow-run-as-root --oversubscribe -np $np \
                    -x LD_LIBRARY_PATH -x NCCL_TESTS_DEVICE /tmp/nccl-tests/${t}_perf \
                    -b 8 -e 64M -f 8 -g 1 -t 1 -d float -c 1 -n 5 -w 2
            done
        done
        mps_off
    fi
else
    echo "### no $bin/nccl-tests: SET=nccl NCCL_TESTS_SRC=... scripts/gpu_build.sh carries it"
fi

# 3. PyTorch.
torch_lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
if [ -n "$torch_lib" ] && [ -e "$torch_lib" ]; then
    cp "$torch_lib" /tmp/libnccl.so.2.wheel && cp "$lib" "$torch_lib"
    ddp=/tmp/ddp_nccl.log gloo=/tmp/ddp_gloo.log
    step 90 torchrun --nproc_per_node 2 scripts/nccl_torch_check.py collectives
    step 60 torchrun --nproc_per_node 2 scripts/nccl_torch_check.py ddp | tee "$ddp"
    step 60 torchrun --nproc_per_node 2 scripts/nccl_torch_check.py ddp --backend gloo | tee "$gloo"
    python3 - "$ddp" "$gloo" <<'PY'
import re, sys
get = lambda p: [float(x) for x in re.search(r"PARAMS (\S+) (\S+)", open(p).read()).groups()]
a, b = get(sys.argv[1]), get(sys.argv[2])
rel = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
print(f"DDP nccl-on-oxccl {a} against gloo {b}: largest relative difference {rel:.2e}",
      "OK" if rel < 1e-5 else "DIFFERENT")
PY
    OXCCL_TIMEOUT=15 step 90 torchrun --nproc_per_node 2 scripts/nccl_torch_check.py timeout
    echo "(timeout: rank 0 must have failed above, within about 10-40 s; rank 1 printed OK)"
    cp /tmp/libnccl.so.2.wheel "$torch_lib"
else
    echo "### no NCCL wheel found for PyTorch"
fi
echo "### done in ${SECONDS}s"
