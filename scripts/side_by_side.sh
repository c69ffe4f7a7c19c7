#!/bin/bash
# oxccl perf and OpenMPI side by side, interleaved, 3 rounds (the docs/PERF.md tables).
# Needs: cargo build --release --bin oxccl; OpenMPI (apt-get install openmpi-bin libopenmpi-dev)
# and the peer bench: mpicc -O2 -o /tmp/peers/mpi_coll_bench ../shared/peers/mpi_coll_bench.c
# Prints per case: oxccl out-of-place time, in-place time, out-of-place busbw, in-place busbw;
# MPI time and busbw.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OX=${OX:-target/release/oxccl}
MPI="mpirun --allow-run-as-root --oversubscribe --mca oob_tcp_if_include lo"
B=${MPI_BENCH:-/tmp/peers/mpi_coll_bench}
for round in 1 2 3; do
  for s in 8 1M 64M; do
    echo "R$round np2 all-reduce $s ox $($OX perf all-reduce --np 2 -b $s -e $s -z 1 -a 3 | grep -v '^#' | awk 'NF>5{print $6, $10, $8, $12}')"
    echo "R$round np2 all-reduce $s mpi $($MPI -np 2 $B -b $s -e $s -c all_reduce | grep -v '^#' | awk 'NF>5{print $6, $8}')"
  done
  for c in reduce-scatter all-gather broadcast; do
    echo "R$round np2 $c 64M ox $($OX perf $c --np 2 -b 64M -e 64M -z 1 -a 3 | grep -v '^#' | awk 'NF>5{print $6, $10, $8, $12}')"
    echo "R$round np2 $c 64M mpi $($MPI -np 2 $B -b 64M -e 64M -c ${c/-/_} | grep -v '^#' | awk 'NF>5{print $6, $8}')"
  done
  echo "R$round np4 all-reduce 8 ox $($OX perf all-reduce --np 4 -b 8 -e 8 -z 1 -a 3 | grep -v '^#' | awk 'NF>5{print $6, $10, $8, $12}')"
  echo "R$round np4 all-reduce 8 mpi $($MPI -np 4 $B -b 8 -e 8 -c all_reduce | grep -v '^#' | awk 'NF>5{print $6, $8}')"
  for c in all-reduce reduce-scatter all-gather broadcast; do
    echo "R$round np4 $c 64M ox $($OX perf $c --np 4 -b 64M -e 64M -z 1 -a 3 | grep -v '^#' | awk 'NF>5{print $6, $10, $8, $12}')"
    echo "R$round np4 $c 64M mpi $($MPI -np 4 $B -b 64M -e 64M -c ${c/-/_} | grep -v '^#' | awk 'NF>5{print $6, $8}')"
  done
done
