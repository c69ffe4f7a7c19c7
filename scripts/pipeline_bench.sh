#!/usr/bin/env bash
# pipeline_bench.sh: the pipeline's two benchmarks (docs/PERF.md, "Pipeline"), on local ranks
# over shared memory.
#  1. Bubble: examples/08_pipeline_mlp --bench-bubble runs GPipe, 1F1B, interleaved 1F1B (2
#     chunks) and ZB-H1 on 4 ranks, 8 micro-batches, with stages that wait F_MS, B_MS and W_MS
#     per forward, input gradient and weight gradient (CPU idle, as an accelerator's stage), and
#     prints the measured bubble (1 - the ranks' mean compute time / the slowest rank's step,
#     median step) against the theory: with 64 KiB and with 1 MiB per message.
#  2. Exchange: --bench-exchange on 2 ranks: GPipe over 16 micro-batches with no computation
#     (16 messages one way, 16 back), per message, against the same messages as send/recv
#     calls, at 16 KiB and 1 MiB.
#
# Usage: scripts/pipeline_bench.sh [ROUNDS]      (default 5)
# Env:   BIN (target/release), F_MS B_MS W_MS (20 each)
# Build: cargo build --release --example 08_pipeline_mlp --bin oxccl
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
BIN=${BIN:-target/release}
fbw=(--f-ms "${F_MS:-20}" --b-ms "${B_MS:-20}" --w-ms "${W_MS:-20}")
for kib in 64 1024; do
    echo "== bubble, 4 ranks, 8 micro-batches, $kib KiB per message"
    "$BIN/oxccl" launch -n 4 -- "$BIN/examples/08_pipeline_mlp" --bench-bubble "$rounds" \
        --micro 8 --act-kib "$kib" "${fbw[@]}" | sed 's/^\[0\] //'
done
for kib in 16 1024; do
    echo "== exchange, 2 ranks, $kib KiB"
    "$BIN/oxccl" launch -n 2 -- "$BIN/examples/08_pipeline_mlp" --bench-exchange $((rounds * 4)) \
        --micro 16 --act-kib "$kib" | sed 's/^\[0\] //'
done
