#!/bin/bash
# oxccl perf and OpenMPI side by side, interleaved, 3 rounds (the docs/PERF.md tables).
# Needs: cargo build --release --bin oxccl; OpenMPI (apt-get install openmpi-bin libopenmpi-dev)
# and the peer bench: mpicc -O2 -o /tmp/peers/mpi_coll_bench ../shared/peers/mpi_coll_bench.c
# Prints per case: oxccl out-of-place time, in-place time, out-of-place busbw, in-place busbw;
# MPI time and busbw. `all-reduce-async` rows are oxccl's async form (-z 0), to read against
# its blocking row of the same round.
# ROUNDS (default 3); ROTATE: oxccl perf --rotate (default: perf's own, 64M; 0 reuses one
# buffer set per size, as the MPI bench does); MEMBW: a membw binary (cc -O3 -march=native
# -pthread -o membw ../shared/peers/membw.c) run with 2 threads at the start of every round.
# FLOOR: the copy_floor example (cargo build --release -p oxccl-comm --example copy_floor; e.g.
# FLOOR=target/release/examples/copy_floor), run for 2 ranks at 64 MiB after OpenMPI's broadcast
# in every round: the all-gather's and broadcast's data movement with nothing else, the best any
# implementation could reach in that round (median time and busbw, out of place and in place).
# REGISTER=1: after each all-gather row and each all-reduce row above 8 B, the same with
# registered buffers (-R 1: the mapped algorithms), as `all-gather-registered` and
# `all-reduce-registered`, read against the same OpenMPI (and floor) rows.
# SIZES, NP2, NP4: the all-reduce sizes and the 64 MiB collectives at 2 and 4 ranks (defaults: all
# of docs/PERF.md's; empty runs none).
# SMALL=1: only the 8 B rows (blocking, async and OpenMPI, 2 and 4 ranks), for more rounds of the
# noisiest figures. scripts/side_by_side_summary.py turns the output into medians and ratios.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OX=${OX:-target/release/oxccl}
MPI="mpirun --allow-run-as-root --oversubscribe --mca oob_tcp_if_include lo"
B=${MPI_BENCH:-/tmp/peers/mpi_coll_bench}
OX_PERF() { local c=$1; shift; $OX perf "$c" ${ROTATE:+--rotate "$ROTATE"} "$@"; }
# One oxccl row: out-of-place time, in-place time (us), out-of-place busbw, in-place busbw
# (GB/s), read from perf's JSON at full precision (the table prints 0.01 us, a twentieth of an
# 8 B call here).
JSON=$(mktemp /tmp/side_by_side.XXXXXX.json)
trap 'rm -f "$JSON"' EXIT
OX_ROW() {
  OX_PERF "$@" --json "$JSON" >/dev/null || return
  python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["rows"][0]; o,i=r["out_of_place"],r["in_place"]; print(o["time_us"], i["time_us"], o["busbw"], i["busbw"])' "$JSON"
}
# Iterations by size, so that a size is timed over about as many calls as the MPI bench makes
# (it picks its count from a warm-up run for about 0.25 s, up to 100000: at 8 B, 100000).
ITERS() { case $1 in 8) echo "-n 100000 -w 10000" ;; 1M) echo "-n 200 -w 20" ;; *) echo "" ;; esac; }
sizes=${SIZES-8 1M 64M} np2=${NP2-reduce-scatter all-gather broadcast}
np4=${NP4-all-reduce reduce-scatter all-gather broadcast}
if [ -n "${SMALL:-}" ]; then sizes=8 np2= np4= FLOOR=; fi
for round in $(seq 1 "${ROUNDS:-3}"); do
  if [ -n "${MEMBW:-}" ]; then
    echo "R$round membw $($MEMBW -t 2 -r 3 | awk '$2==2{printf "%s %s ", $1, $5}')"
  fi
  for s in $sizes; do
    # shellcheck disable=SC2046
    echo "R$round np2 all-reduce $s ox $(OX_ROW all-reduce --np 2 -b $s -e $s -z 1 -a 3 $(ITERS $s))"
    if [ -n "${REGISTER:-}" ] && [ "$s" != 8 ]; then
      # shellcheck disable=SC2046
      echo "R$round np2 all-reduce-registered $s ox $(OX_ROW all-reduce --np 2 -b $s -e $s -z 1 -a 3 -R 1 $(ITERS $s))"
    fi
    if [ "$s" = 8 ]; then
      # The async form (-z 0: each call waited at once), right after the blocking one it is
      # read against.
      # shellcheck disable=SC2046
      echo "R$round np2 all-reduce-async 8 ox $(OX_ROW all-reduce --np 2 -b 8 -e 8 -z 0 -a 3 $(ITERS 8))"
    fi
    echo "R$round np2 all-reduce $s mpi $($MPI -np 2 $B -b $s -e $s -c all_reduce | grep -v '^#' | awk 'NF>5{print $6, $8}')"
  done
  for c in $np2; do
    echo "R$round np2 $c 64M ox $(OX_ROW $c --np 2 -b 64M -e 64M -z 1 -a 3)"
    if [ -n "${REGISTER:-}" ] && [ "$c" = all-gather ]; then
      echo "R$round np2 $c-registered 64M ox $(OX_ROW $c --np 2 -b 64M -e 64M -z 1 -a 3 -R 1)"
    fi
    echo "R$round np2 $c 64M mpi $($MPI -np 2 $B -b 64M -e 64M -c ${c/-/_} | grep -v '^#' | awk 'NF>5{print $6, $8}')"
  done
  if [ -n "${FLOOR:-}" ]; then
    $FLOOR --np 2 --bytes 64M --iters 10 | awk -v r="$round" '{sub("median_us=","",$6); sub("busbw_GBps=","",$8); print "R" r " np2 " $2 " 64M floor " $5, $6, $8, $9}'
  fi
  # shellcheck disable=SC2046
  echo "R$round np4 all-reduce 8 ox $(OX_ROW all-reduce --np 4 -b 8 -e 8 -z 1 -a 3 $(ITERS 8))"
  # shellcheck disable=SC2046
  echo "R$round np4 all-reduce-async 8 ox $(OX_ROW all-reduce --np 4 -b 8 -e 8 -z 0 -a 3 $(ITERS 8))"
  echo "R$round np4 all-reduce 8 mpi $($MPI -np 4 $B -b 8 -e 8 -c all_reduce | grep -v '^#' | awk 'NF>5{print $6, $8}')"
  for c in $np4; do
    echo "R$round np4 $c 64M ox $(OX_ROW $c --np 4 -b 64M -e 64M -z 1 -a 3)"
    if [ -n "${REGISTER:-}" ] && { [ "$c" = all-gather ] || [ "$c" = all-reduce ]; }; then
      echo "R$round np4 $c-registered 64M ox $(OX_ROW $c --np 4 -b 64M -e 64M -z 1 -a 3 -R 1)"
    fi
    echo "R$round np4 $c 64M mpi $($MPI -np 4 $B -b 64M -e 64M -c ${c/-/_} | grep -v '^#' | awk 'NF>5{print $6, $8}')"
  done
done
