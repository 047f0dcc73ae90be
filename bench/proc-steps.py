#!/usr/bin/env python3
"""Per decode step of a DISKFORMER_TRACE timeline, what bench/proc-sampler.py saw meanwhile:
the process's cores busy and run-queue wait, its page faults, and the machine's user, system,
steal and idle shares.

Usage: proc-steps.py TRACE.tsv[.gz] SAMPLES.tsv [FIRST_STEPS]   (TRACE.start must lie beside
the trace, as `diskformer` writes it). Prints the first FIRST_STEPS (default 40) steps.
"""
import bisect
import collections
import gzip
import sys


def opener(path):
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path)


def main():
    trace, samples = sys.argv[1], sys.argv[2]
    first = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    start_path = trace[:-3] + ".start" if trace.endswith(".gz") else trace + ".start"
    with open(start_path) as f:
        t0 = float(f.readline())
        tids = {l.split()[3]: l.split()[1] for l in f if l.startswith("thread")}
    steps = []
    with opener(trace) as f:
        next(f)
        for line in f:
            us, _, _, what = line.rstrip("\n").split("\t")
            if what == "step begins":
                steps.append(t0 + float(us) / 1e6)
    times, cpu, vm, task = [], [], [], collections.defaultdict(dict)
    with open(samples) as f:
        for line in f:
            p = line.rstrip("\n").split("\t")
            t = float(p[0])
            if p[1] == "cpu":
                times.append(t)
                cpu.append([int(x) for x in p[2:]])
            elif p[1] == "vm":
                vm.append([int(x) for x in p[2:]])
            else:
                task[p[2]][t] = [int(x) for x in p[3:]]
    print("step   ms  | proc cores  rq-wait ms  minflt | machine user sys idle steal %  pgfault"
          " | busiest threads (trace no.: cores)")
    for n, (a, b) in enumerate(zip(steps, steps[1:])):
        if n >= first:
            break
        i = max(0, bisect.bisect_right(times, a) - 1)
        j = min(len(times) - 1, bisect.bisect_left(times, b))
        if j <= i:
            continue
        ta, tb = times[i], times[j]
        span = tb - ta
        d = [y - x for x, y in zip(cpu[i], cpu[j])]
        tot = sum(d) or 1
        user, sys_, idle, steal = (d[0] + d[1]) / tot, (d[2] + d[5] + d[6]) / tot, (d[3] + d[4]) / tot, d[7] / tot
        pgf = vm[j][0] - vm[i][0] if j < len(vm) else 0
        run = wait = flt = 0
        per = []
        for tid, s in task.items():
            if ta in s and tb in s:
                x, y = s[ta], s[tb]
                r = (y[0] - x[0]) / 1e9 / span
                run += r
                wait += (y[1] - x[1]) / 1e6
                flt += y[3] - x[3]
                per.append((r, tids.get(tid, "t" + tid)))
        per.sort(reverse=True)
        busy = " ".join("%s:%.2f" % (name, r) for r, name in per[:6])
        print("%4d %6.1f | %6.2f %9.2f %8d | %6.0f %4.0f %4.0f %4.0f   %8d | %s" % (
            n, (b - a) * 1e3, run, wait, flt, user * 100, sys_ * 100, idle * 100, steal * 100, pgf, busy))


if __name__ == "__main__":
    main()
