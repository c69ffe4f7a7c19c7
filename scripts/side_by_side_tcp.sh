#!/bin/bash
# oxccl perf over TCP, OpenMPI over TCP and torch/gloo side by side, interleaved, 2 ranks on
# loopback (the issue-4 TCP tables in docs/PERF.md). ROUNDS (default 5) rounds of sizes SIZES
# (default "8 1M 64M").
# Needs: cargo build --release --bin oxccl (or OX=path); OpenMPI (apt-get install openmpi-bin
# libopenmpi-dev; skipped without mpirun)
# and the peer bench: mpicc -O2 -o /tmp/peers/mpi_coll_bench ../shared/peers/mpi_coll_bench.c;
# torch in GLOO_PY's environment (../shared/peers/run_all.sh setup, or any venv with torch).
# Prints per case: oxccl out-of-place time (us), in-place time, out-of-place busbw (GB/s),
# in-place busbw; MPI and gloo time and busbw.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OX=${OX:-target/release/oxccl}
MPI="mpirun --allow-run-as-root --oversubscribe --mca oob_tcp_if_include lo --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo"
B=${MPI_BENCH:-/tmp/peers/mpi_coll_bench}
PEERS=${PEERS:-../shared/peers}
GLOO_PY=${GLOO_PY:-$PEERS/.venv/bin/python}
# oxccl's iterations per size: enough for about a quarter of a second, as the MPI bench times.
iters() {
  case "$1" in
    *G|*[0-9][0-9]M|[4-9]M) echo "-n 20 -w 5" ;;
    *M|*[0-9][0-9][0-9]K) echo "-n 200 -w 20" ;;
    *) echo "-n 20000 -w 1000" ;;
  esac
}
for round in $(seq 1 "${ROUNDS:-5}"); do
  for s in ${SIZES:-8 1M 64M}; do
    # shellcheck disable=SC2046
    echo "R$round tcp np2 all-reduce $s ox $($OX perf all-reduce --np 2 --transport tcp -b $s -e $s -z 1 -a 3 $(iters "$s") | grep -v '^#' | awk 'NF>5{print $6, $10, $8, $12}')"
    if command -v mpirun >/dev/null; then
      echo "R$round tcp np2 all-reduce $s mpi $($MPI -np 2 $B -b $s -e $s -c all_reduce | grep -v '^#' | awk 'NF>5{print $6, $8}')"
    fi
    if [ -x "$GLOO_PY" ]; then
      echo "R$round tcp np2 all-reduce $s gloo $(GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 "$GLOO_PY" "$PEERS/gloo_bench.py" -np 2 -b $s -e $s -c all_reduce | grep -v '^#' | awk 'NF>5{print $6, $8}')"
    fi
  done
done
