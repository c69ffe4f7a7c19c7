#!/usr/bin/env bash
# local_sgd_bench.sh: post-local SGD against exact DDP and the compression hooks on 2 nodes of
# 2 ranks (network namespaces, scripts/netns.sh; needs root; another layout with NETNS) with
# each node's link limited to RATE: the wall time per step of 02_ddp_mlp (the 12.2 MiB MLP,
# --mode in-place), rank 0's, over steps 1 to STEPS-1 (step 0 warms up; the example's per-step
# loss all-reduce included), and its held-out loss at the end.
#
# Usage: scripts/local_sgd_bench.sh [ROUNDS] [RATE...]      (defaults: 3, 1gbit 10gbit)
# Env:   STEPS (41), BIN (target/release), HOOKS (the configurations, ';'-separated), ARGS,
#        NETNS (the layout, netns.sh options; default "--nodes 2 --nproc 2"; e.g.
#        "--nodes 4 --nproc 1 --racks 2 --rack-rate 1gbit": 2 racks of 2 nodes whose uplinks
#        are slower than the nodes' RATE).
# Build: cargo build --release --example 02_ddp_mlp --bin oxccl
# Output: one line per run: rate, round, configuration, mean ms, held-out loss; every
# configuration runs back to back in each round, the rates in turn.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
rates=("$@")
[ ${#rates[@]} -gt 0 ] || rates=(1gbit 10gbit)
BIN=${BIN:-target/release}
STEPS=${STEPS:-41}
ARGS=${ARGS:-"--mode in-place --hidden 1024 --layers 4 --batch 4 --bucket-mib 25"}
HOOKS=${HOOKS:-"exact;--local-sgd 4;--local-sgd 8;--powersgd 4;--compress bf16"}
NETNS=${NETNS:-"--nodes 2 --nproc 2"}
IFS=';' read -r -a hooks <<<"$HOOKS"
printf '%-8s %5s  %-16s %10s %12s\n' rate round config "ms/step" "held-out"
for round in $(seq 1 "$rounds"); do
    for rate in "${rates[@]}"; do
        for h in "${hooks[@]}"; do
            extra=$h
            [ "$h" = exact ] && extra=""
            # shellcheck disable=SC2086 # NETNS, ARGS and extra are word lists
            out=$(scripts/netns.sh run $NETNS --rate "$rate" --prefix lsgd \
                --timeout 600 -- "$BIN/examples/02_ddp_mlp" $ARGS --steps "$STEPS" $extra 2>&1) || {
                echo "run failed ($rate, $h):" >&2
                echo "$out" | tail -20 >&2
                exit 1
            }
            echo "$out" | awk -v rate="$rate" -v round="$round" -v cfg="$h" '
                /\[0\] wall time per step/ { for (i = 1; i <= NF; i++) if ($i == "ms") ms = $(i - 1) }
                /held-out loss/ { for (i = 1; i <= NF; i++) if ($i == "loss") h = $(i + 1) }
                END { printf "%-8s %5s  %-16s %10.2f %12s\n", rate, round, cfg, ms, h }'
        done
    done
done
