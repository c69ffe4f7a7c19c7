#!/bin/bash
# The flight recorder's cost (docs/PERF.md, "The flight recorder's cost"): 2-rank all-reduces
# timed by oxccl perf, ROUNDS (default 5) interleaved rounds of: OLD (an oxccl binary built
# before the recorder, any build: OXCCL_TRACE_BUFFER means nothing to it), NEW with
# OXCCL_TRACE_BUFFER=0 (off) and NEW with the default (on).
# Usage: OLD=/path/to/old/oxccl [NEW=target/release/oxccl] [ONLY=regex] scripts/trace_overhead.sh
# (ONLY keeps the cases whose name matches: shm8z1, shm8z0, tcp8z1, shm1Mz1).
# Prints per round and case: out-of-place and in-place time (us) for old | off | on.
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
NEW=${NEW:-target/release/oxccl}
: "${OLD:?set OLD to an oxccl binary built before the flight recorder}"
run() { # label binary buffer perf-args...
  local label=$1 bin=$2 buf=$3
  shift 3
  local line
  line=$(env OXCCL_TRACE_BUFFER="$buf" "$bin" perf all-reduce --np 2 "$@" 2>&1 |
    grep -E '^ +[0-9]+ ' | tail -1)
  echo "$label $(echo "$line" | awk '{print $6, $10}')"
}
CASES=(
  "shm8z1:-b 8 -e 8 -n 20000 -w 2000 -z 1"
  "shm8z0:-b 8 -e 8 -n 20000 -w 2000 -z 0"
  "tcp8z1:--transport tcp -b 8 -e 8 -n 5000 -w 500 -z 1"
  "shm1Mz1:-b 1M -e 1M -n 300 -w 30 -z 1"
)
for round in $(seq 1 "${ROUNDS:-5}"); do
  for c in "${CASES[@]}"; do
    name=${c%%:*}
    [[ $name =~ ${ONLY:-.} ]] || continue
    read -r -a args <<<"${c#*:}"
    echo "round $round $name $(run old "$OLD" 2000 "${args[@]}") | $(run off "$NEW" 0 "${args[@]}") | $(run on "$NEW" 2000 "${args[@]}")"
  done
done
