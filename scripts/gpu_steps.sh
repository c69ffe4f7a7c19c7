# Sourced by the one-call GPU scripts (gpu_ddp.sh, gpu_nccl.sh, gpu_verify.sh): `step LIMIT
# CMD...` runs CMD for at most LIMIT seconds and never past the script's `budget` (seconds since
# it started), saying what ran, its exit status and its time; `mps_on` / `mps_off` start and stop
# the MPS daemon; `cuda_libs` puts the CUDA libraries (NVRTC, cuBLAS, the runtime: the toolkit's,
# or those of PyTorch's wheels) on LD_LIBRARY_PATH.
step() {
    local limit=$1 left=$((budget - SECONDS))
    shift
    [ "$left" -le 5 ] && { echo "### SKIPPED (budget spent): $*"; return; }
    [ "$limit" -gt "$left" ] && limit=$left
    echo; echo "### $* (at most ${limit}s)"
    local t=$SECONDS
    timeout -k 5 "$limit" "$@"
    echo "### exit $? after $((SECONDS - t)) s"
}
mps_on() {
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    timeout 20 nvidia-cuda-mps-control -d && echo "MPS daemon started"
}
mps_off() { echo quit | timeout 20 nvidia-cuda-mps-control && echo "MPS daemon stopped"; }
cuda_libs() {
    local d
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
        $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13/lib") for p in nvidia.__path__))' 2>/dev/null); do
        [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
    done
}
