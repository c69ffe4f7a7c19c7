#!/bin/bash
# DDP overhead of the candle example (candle/examples/candle_mlp.rs): one process without DDP
# against DDP on 1 and 2 ranks, interleaved, 5 rounds; each prints its mean step after the first.
# Usage: cargo build --release --bin oxccl -p oxccl-candle --example candle_mlp &&
#        [STEPS=30] scripts/candle_overhead.sh [example flags, e.g. --hidden 1024 --layers 4]
# One rayon thread per rank (candle otherwise starts one per core in every rank).
# Prints per round the mean step of each (and its parts: forward, backward, sync, update).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
B=target/release/examples/candle_mlp
L=target/release/oxccl
ARGS="--steps ${STEPS:-30} $*"
export RAYON_NUM_THREADS=1
# glibc hands large freed blocks back to the kernel and candle faults them in again each step, by
# amounts that differ between the two programs: keep them, so the steps compare compute and DDP.
export MALLOC_MMAP_THRESHOLD_=4000000000 MALLOC_TRIM_THRESHOLD_=4000000000
for r in 1 2 3 4 5; do
  a=$($B --no-ddp $ARGS | grep "mean step" | cut -d: -f2-)
  b=$($L launch -n 1 -- $B $ARGS | grep "mean step" | cut -d: -f2-)
  c=$($L launch -n 2 -- $B $ARGS | grep "mean step" | cut -d: -f2-)
  printf "round %s\n  no DDP:       %s\n  DDP, 1 rank:  %s\n  DDP, 2 ranks: %s\n" "$r" "$a" "$b" "$c"
done
