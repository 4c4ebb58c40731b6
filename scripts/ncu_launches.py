"""Kernel launches and GPU time per decode step, from two `ncu --csv` logs of `kvq bench-batch`.

    python3 scripts/ncu_launches.py SHORT.csv LONG.csv STEPS
SHORT and LONG are the same bench-batch run with --ntg differing by STEPS decode steps (e.g.
--ntg 2 and --ntg 4, --no-warmup): every launch and every nanosecond of kernel time they differ
by belongs to those decode steps. Prints launches per step, kernel time per step, and the
kernels by time per step.
"""
import csv, sys
from collections import defaultdict


def load(path):
    launches = defaultdict(int)
    ns = defaultdict(float)
    with open(path) as f:
        lines = [l for l in f if not l.startswith("==")]
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row["Kernel Name"].split("(")[0][:60]
        v = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "ns")
        scale = {"ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}.get(unit, 1)
        launches[name] += 1
        ns[name] += v * scale
    return launches, ns


short, long_, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
ls, ts = load(short)
ll, tl = load(long_)
names = set(ll) | set(ls)
per = {n: ((ll[n] - ls[n]) / steps, (tl[n] - ts[n]) / steps / 1e3) for n in names}
total_l = sum(v[0] for v in per.values())
total_us = sum(v[1] for v in per.values())
print(f"launches per decode step: {total_l:.1f}; kernel time per step: {total_us:.1f} us")
for n, (l, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:25]:
    if l:
        print(f"  {l:7.1f} launches {us:9.1f} us  {n}")
