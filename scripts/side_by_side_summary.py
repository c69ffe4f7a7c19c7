#!/usr/bin/env python3
"""Medians, ranges and ratios of a side-by-side log (scripts/side_by_side.sh or
scripts/side_by_side_tcp.sh output), one line per case.

Usage: scripts/side_by_side.sh ... | tee run.log; scripts/side_by_side_summary.py run.log

Reads lines `R<round> <case...> <source> <values...>`, where source is `ox` (out-of-place time,
in-place time in us, out-of-place busbw, in-place busbw in GB/s), `mpi` or `gloo` (time, busbw),
or `floor` (form, time, busbw, wrong=N). For each case it prints the median and range over the
rounds, and per-round ratios summarised the same way:
  - oxccl against a peer: time ratio (oxccl / peer) for 8 B cases, busbw ratio above that;
  - an `-async` case against its blocking case of the same round: time ratio;
  - the floor against the peer and oxccl against the floor: busbw ratios (out of place and in
    place; the peer's one figure is its own form);
  - a `-registered` case (oxccl with registered buffers, `perf -R 1`) against the peer's and the
    floor's rows of the case without the suffix, the same way.
A ratio's range is over the rounds; the median of the ratios is not the ratio of the medians.
"""

import statistics
import sys
from collections import defaultdict


def parse(path):
    """{(case, source): {round: values}} and the membw lines by round."""
    rows = defaultdict(dict)
    membw = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            t = line.split()
            if len(t) < 3 or not t[0].startswith("R") or not t[0][1:].isdigit():
                continue
            rnd = int(t[0][1:])
            if t[1] == "membw":
                membw[rnd] = " ".join(t[2:])
                continue
            for i, tok in enumerate(t):
                if tok in ("ox", "mpi", "gloo", "floor"):
                    case, source, vals = " ".join(t[1:i]), tok, t[i + 1:]
                    break
            else:
                continue
            if source == "floor":
                form, nums = vals[0], vals[1:3]
                case, source = f"{case} {form}", "floor"
                vals = nums
            try:
                rows[(case, source)][rnd] = [float(v) for v in vals]
            except ValueError:
                continue  # a failed run printed nothing usable
    return rows, membw


def fmt(xs, digits=2):
    if not xs:
        return "-"
    med = statistics.median(xs)
    return f"{med:.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def column(rows, key, idx):
    return {r: v[idx] for r, v in rows.get(key, {}).items() if len(v) > idx}


def ratios(a, b):
    return [a[r] / b[r] for r in sorted(a) if r in b and b[r] > 0]


def small(case):
    return case.split()[-1] in ("8", "8B")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    rows, membw = parse(sys.argv[1])
    for r in sorted(membw):
        print(f"R{r} membw {membw[r]}")
    cases = dict.fromkeys(c for c, _ in rows)  # in the log's order
    for case in cases:
        ox = rows.get((case, "ox"))
        if ox:
            print(f"{case} | oxccl time us oop {fmt(list(column(rows, (case, 'ox'), 0).values()))}"
                  f" ip {fmt(list(column(rows, (case, 'ox'), 1).values()))}"
                  f" | busbw oop {fmt(list(column(rows, (case, 'ox'), 2).values()))}"
                  f" ip {fmt(list(column(rows, (case, 'ox'), 3).values()))}")
        for peer in ("mpi", "gloo"):
            if (case, peer) not in rows:
                continue
            t, bw = column(rows, (case, peer), 0), column(rows, (case, peer), 1)
            print(f"{case} | {peer} time us {fmt(list(t.values()))}"
                  f" busbw {fmt(list(bw.values()), 3)}")
            if ox:
                if small(case):
                    o = ratios(column(rows, (case, "ox"), 0), t)
                    i = ratios(column(rows, (case, "ox"), 1), t)
                    print(f"{case} | oxccl/{peer} time oop {fmt(o)} ip {fmt(i)}")
                else:
                    o = ratios(column(rows, (case, "ox"), 2), bw)
                    i = ratios(column(rows, (case, "ox"), 3), bw)
                    print(f"{case} | oxccl/{peer} busbw oop {fmt(o)} ip {fmt(i)}")
        if case.endswith(("out-of-place", "in-place")) and (case, "floor") in rows:
            base = case.rsplit(" ", 1)[0]
            fl = column(rows, (case, "floor"), 1)
            print(f"{case} | floor time us {fmt(list(column(rows, (case, 'floor'), 0).values()))}"
                  f" busbw {fmt(list(fl.values()))}")
            if (base, "mpi") in rows:
                print(f"{case} | floor/mpi busbw {fmt(ratios(fl, column(rows, (base, 'mpi'), 1)))}")
            if (base, "ox") in rows:
                idx = 2 if case.endswith("out-of-place") else 3
                oxf = ratios(column(rows, (base, "ox"), idx), fl)
                print(f"{case} | oxccl/floor busbw {fmt(oxf)}")
        if "-registered" in case and ox:
            base = case.replace("-registered", "")
            for peer in ("mpi", "gloo"):
                if (base, peer) in rows:
                    bw = column(rows, (base, peer), 1)
                    o = ratios(column(rows, (case, "ox"), 2), bw)
                    i = ratios(column(rows, (case, "ox"), 3), bw)
                    print(f"{case} | oxccl/{peer} busbw oop {fmt(o)} ip {fmt(i)}")
            for idx, form in ((2, "out-of-place"), (3, "in-place")):
                if (f"{base} {form}", "floor") in rows:
                    fl = column(rows, (f"{base} {form}", "floor"), 1)
                    oxf = ratios(column(rows, (case, "ox"), idx), fl)
                    print(f"{case} | oxccl/floor busbw {form} {fmt(oxf)}")
        if "-async" in case and ox:
            blocking = case.replace("-async", "")
            if (blocking, "ox") in rows:
                o = ratios(column(rows, (case, "ox"), 0), column(rows, (blocking, "ox"), 0))
                i = ratios(column(rows, (case, "ox"), 1), column(rows, (blocking, "ox"), 1))
                print(f"{case} | async/blocking time oop {fmt(o)} ip {fmt(i)}")


if __name__ == "__main__":
    main()
