#!/usr/bin/env bash
# zero_bench.sh: node-local ZeRO against DDP + AdamW on 2 nodes of 2 ranks (network namespaces,
# scripts/netns.sh; needs root) with each node's link limited to RATE: examples/07_zero_mlp
# --bench (a 48 MiB MLP, 12.7 M f32 parameters, 8 MiB buckets) times DDP followed by AdamW on
# every rank, node-local ZeRO-2 and ZeRO-1, and ZeRO-2 over every rank, interleaved, and prints
# each one's median step (the slowest rank's), the optimizer state per rank, and the resident
# memory its creation and first step added (its parameters left out). Each rate runs twice:
# with the tuner's algorithms (reduce-scatter and all-gather hierarchical across the nodes),
# then with OXCCL_ALGO=reduce-scatter=ring,all-gather=ring (a flat ring through both nodes, the
# traffic of classic ZeRO across nodes). Last, one node of 4 ranks (shared memory only, no
# namespaces): the memory figures at a shard group of 4.
#
# Usage: scripts/zero_bench.sh [ROUNDS] [RATE...]      (defaults: 3, 1gbit 10gbit)
# Env:   BIN (target/release), ARGS (the example's model and bucket arguments)
# Build: cargo build --release --example 07_zero_mlp --bin oxccl
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
rates=("$@")
[ ${#rates[@]} -gt 0 ] || rates=(1gbit 10gbit)
BIN=${BIN:-target/release}
ARGS=${ARGS:-"--hidden 2048 --layers 4 --batch 16 --bucket-mib 8"}
export OXCCL_BIN="$BIN/oxccl"
for rate in "${rates[@]}"; do
    for algo in tuner flat-ring; do
        echo "== 2 nodes x 2 ranks, $rate, reduce-scatter and all-gather: $algo"
        env_algo=()
        [ "$algo" = tuner ] || env_algo=(OXCCL_ALGO=reduce-scatter=ring,all-gather=ring)
        # shellcheck disable=SC2086
        env "${env_algo[@]}" bash scripts/netns.sh run --nodes 2 --nproc 2 --rate "$rate" \
            --prefix zerob --timeout 900 -- "$BIN/examples/07_zero_mlp" --bench "$rounds" $ARGS |
            grep 'ms/step' | sed 's/^\[node 0\] \[0\] //'
    done
done
echo "== 1 node x 4 ranks, shared memory"
# shellcheck disable=SC2086
"$BIN/oxccl" launch -n 4 -- "$BIN/examples/07_zero_mlp" --bench "$rounds" $ARGS |
    grep 'ms/step' | sed 's/^\[0\] //'
