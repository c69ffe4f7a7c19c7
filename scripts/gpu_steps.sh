# Sourced by the one-call GPU scripts (gpu_ddp.sh, gpu_nccl.sh): `step LIMIT CMD...` runs CMD for
# at most LIMIT seconds and never past the script's `budget` (seconds since it started), saying
# what ran, its exit status and its time; `mps_on` / `mps_off` start and stop the MPS daemon.
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
