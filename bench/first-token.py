#!/usr/bin/env python3
"""Where a process's first decode step goes, from a DISKFORMER_TRACE of
`DISKFORMER_BENCH_WARMUP_MS=0 diskformer bench -p 0 -n N -r 1` (its "bench step" marks).

Usage: bench/first-token.py TRACE.tsv

Prints the pipeline compiles (count and time) before the first step, in it and after, and the
first step's longest gaps between consecutive marks."""
import sys
rows = []
with open(sys.argv[1]) as f:
    next(f)
    for line in f:
        us, th, layer, what = line.rstrip("\n").split("\t")
        rows.append((float(us), int(th), layer, what))
steps = [r[0] for r in rows if r[3] == "bench step"]
print("steps begun:", len(steps), "first at %.1f ms" % (steps[0] / 1e3) if steps else "")
bounds = steps[:3] + [float("inf")]
open_at = {}
comp = [[0, 0.0] for _ in range(5)]
def window(t):
    for i, b in enumerate(bounds):
        if t < b:
            return i
    return len(bounds)
for us, th, layer, what in rows:
    if what == "pipeline compile":
        open_at[th] = us
    elif what == "pipeline made" and th in open_at:
        w = window(open_at[th])
        comp[w][0] += 1
        comp[w][1] += us - open_at.pop(th)
names = ["before the first step", "first step", "second step", "later"]
for i, n in enumerate(names):
    print("pipelines compiled %s: %d, %.1f ms" % (n, comp[i][0], comp[i][1] / 1e3))
if len(steps) >= 2:
    first = [r for r in rows if steps[0] <= r[0] < steps[1]]
    print("first step: %.1f ms, %d marks; second step %.1f ms" % ((steps[1] - steps[0]) / 1e3, len(first),
          ((steps[2] if len(steps) > 2 else rows[-1][0]) - steps[1]) / 1e3))
    gaps = sorted(((b[0] - a[0], a, b) for a, b in zip(first, first[1:])), reverse=True)[:15]
    for g, a, b in gaps:
        print("  %.2f ms  %s (thread %d, layer %s) -> %s (thread %d, layer %s) at %.1f ms" % (
            g / 1e3, a[3], a[1], a[2], b[3], b[1], b[2], (a[0] - steps[0]) / 1e3))
    from collections import Counter
    print("first step's marks:", Counter(r[3] for r in first).most_common(12))
