#!/bin/bash
# Two builds of oxccl side by side, interleaved: `oxccl perf` from each binary on the same cases,
# the order of the two alternating from round to round, then the median and range of every case.
# Used to check that a change makes no figure worse.
#
# Usage: OLD=/path/to/old/oxccl NEW=target/release/oxccl [ROUNDS=5] scripts/compare_builds.sh
# CASES: a ;-separated list of "label|perf arguments" (default: shared-memory all-reduce of 8 B
# and 64 MiB with 2 and 4 ranks, TCP all-reduce of 64 MiB with 2 ranks, all blocking; a case
# with its own -z keeps it).
# Prints one line per run (round, case, build, out-of-place time in us and busbw in GB/s, then
# in place), then a summary: per case and build, the median time and busbw with their ranges,
# and the new/old ratio of the median busbw (time for 8 B cases, where busbw rounds to zero).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OLD=${OLD:?set OLD to the old oxccl binary}
NEW=${NEW:-target/release/oxccl}
ROUNDS=${ROUNDS:-5}
CASES=${CASES:-"shm np2 8B|all-reduce --np 2 -b 8 -e 8 -n 20000 -w 2000;\
shm np4 8B|all-reduce --np 4 -b 8 -e 8 -n 20000 -w 2000;\
shm np2 64M|all-reduce --np 2 -b 64M -e 64M -a 3;\
shm np4 64M|all-reduce --np 4 -b 64M -e 64M -a 3;\
tcp np2 64M|all-reduce --np 2 --transport tcp -b 64M -e 64M -a 3"}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
IFS=';' read -ra cases <<<"$CASES"
for round in $(seq 1 "$ROUNDS"); do
  if ((round % 2)); then order="old new"; else order="new old"; fi
  for c in "${cases[@]}"; do
    label=${c%%|*}
    args=${c#*|}
    for which in $order; do
      bin=$OLD
      [ "$which" = new ] && bin=$NEW
      z="-z 1" # blocking, unless the case says otherwise
      [[ " $args " == *" -z "* ]] && z=""
      # shellcheck disable=SC2086
      line=$($bin perf $args $z | grep -v '^#' | awk 'NF>5{print $6, $8, $10, $12, $9 + $13}')
      echo "R$round|$label|$which|$line" | tee -a "$out"
    done
  done
done
python3 - "$out" <<'PY'
import statistics, sys
rows = {}
for l in open(sys.argv[1]):
    _, label, which, vals = l.strip().split("|")
    t_oop, bw_oop, t_ip, bw_ip, wrong = vals.split()
    if int(float(wrong)):
        print(f"WRONG RESULTS: {l.strip()}")
    num = lambda v: float("nan") if v == "N/A" else float(v)  # no in-place form
    rows.setdefault(label, {}).setdefault(which, []).append(
        (num(t_oop), num(bw_oop), num(t_ip), num(bw_ip)))
print("\ncase | build | oop time us median (range) | oop busbw GB/s median (range) | in-place time | in-place busbw | new/old")
for label, by in rows.items():
    med = {}
    for which in ("old", "new"):
        v = by.get(which, [])
        if not v:
            continue
        cols = list(zip(*v))
        m = [statistics.median(c) for c in cols]
        med[which] = m
        rng = [f"{min(c):g}-{max(c):g}" for c in cols]
        print(f"{label} | {which} | {m[0]:g} ({rng[0]}) | {m[1]:g} ({rng[1]}) | {m[2]:g} ({rng[2]}) | {m[3]:g} ({rng[3]}) |", end="")
        if which == "new" and "old" in med:
            o, n = med["old"], med["new"]
            if o[1] > 0 and n[1] > 0:
                print(f" busbw x{n[1] / o[1]:.3f} (oop), x{n[3] / o[3]:.3f} (in place)")
            else:
                print(f" time x{n[0] / o[0]:.3f} (oop), x{n[2] / o[2]:.3f} (in place)")
        else:
            print()
PY
