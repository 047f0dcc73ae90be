#!/usr/bin/env python3
"""Summarizes a DISKFORMER_TRACE timeline of a split decode (GPU expert tier, --moe-miss split).

Usage: bench/trace-summary.py TRACE.tsv [--skip-steps N]

`DISKFORMER_TRACE=FILE diskformer bench ... --gpu-budget 4G` writes one line per mark (us, thread,
layer, mark). This prints, over the steady steps (the first N, default 10, skipped), the step's
length and per MoE layer the mean, median and 90th percentile of each phase: the host's
recording and encoding of the next layer (which overlap the CPU job), the wait at the join, the
submit, the trip from the readback's submit to the ids on the host, the CPU job's queueing and
run, and the critical path from one layer's submit to the next; plus what each step spends
before its first MoE layer (the refills) and after its last (the token's readback and the next
step's first recording).

Through the mailboxes (the default on a Vulkan GPU) the host hands each layer to the dispatcher
task and waits for nothing; the phases are then the dispatcher's (the chain from a CPU job's end
to the next layer's ids, the ids to the job's start, the job) and the host's (its recording per
layer, and how far ahead of the CPU it submits the next layer).
"""
import collections
import gzip
import statistics
import sys


def load(path):
    marks = []
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        next(f)  # header
        for line in f:
            us, thread, layer, what = line.rstrip("\n").split("\t")
            marks.append((float(us), int(thread), None if layer == "-" else int(layer), what))
    return marks


def layers_of(step):
    """Per MoE layer, the first time of each mark the main thread made during its split call;
    the flush marks (no layer) count for the layer whose call is open; the CPU jobs' marks apart."""
    per = collections.defaultdict(dict)
    jobs = collections.defaultdict(dict)
    current, last_end = None, None
    for at, _, layer, what in step:
        if what in ("job start", "job end"):
            jobs[layer].setdefault(what, at)
            continue
        if what == "split":
            current = layer
            per[layer]["split"] = at
            per[layer]["previous end"] = last_end
        elif layer is None and current is not None:
            n = 1
            while f"{what} {n}" in per[current]:
                n += 1
            per[current][f"{what} {n}"] = at
        elif layer is not None:
            per[layer].setdefault(what, at)
        if what == "split end":
            last_end = at
    return per, jobs


def dispatched_phases(per, jobs, phases):
    """Per layer of a step through the mailboxes: the dispatcher's marks ("ids", "job start",
    "job end") and the host's ("split", its first submit, "split end")."""
    for layer, p in sorted(per.items()):
        job, nxt = jobs.get(layer, {}), per.get(layer + 1, {})
        try:
            phases["host: split call to its submit"].append(p["submitted 1"] - p["split"])
            phases["host: split call"].append(p["split end"] - p["split"])
            if "split" in nxt:
                phases["host: records the next layer's attention"].append(nxt["split"] - p["split end"])
            if "ids" in p:
                phases["share submitted -> ids at the dispatcher"].append(p["ids"] - p["submitted 1"])
            if "job start" in job and "job end" in job:
                phases["ids -> CPU job start"].append(job["job start"] - p["ids"])
                phases["CPU job runs"].append(job["job end"] - job["job start"])
                if "ids" in nxt:
                    phases["chain: CPU job end -> next layer's ids"].append(nxt["ids"] - job["job end"])
                if "submitted 1" in nxt:
                    phases["host ahead: next layer submitted before the job's end"].append(
                        job["job end"] - nxt["submitted 1"]
                    )
            if "ids" in p and "ids" in nxt:
                phases["critical path: ids -> next layer's ids"].append(nxt["ids"] - p["ids"])
        except KeyError:
            phases["layers with marks missing"].append(0.0)


# The step boundary's marks, in the order they come after the last layer's CPU job ends.
BOUNDARY_MARKS = (
    "to_host",
    "to_host copied",
    "pollers joined",
    "step begins",
    "pollers spawned",
    "get_rows",
    "flush",
    "encoded",
    "submitted",
    "step",
)


def boundary_phases(marks, last_job_ends, phases):
    """Through the mailboxes: from the last MoE layer's CPU job end to the next step's first job
    start, the time at which each boundary mark first comes (us after that end): the token's
    readback, the step's end and start on the host (the pool's pollers), the first layer's
    recording, encoding and submits, the first split call, its ids and its job."""
    for end in last_job_ends:
        seen = {}
        for at, _, layer, what in marks:
            if at <= end:
                continue
            if what in BOUNDARY_MARKS and what not in seen:
                seen[what] = at
            if layer == 0 and what in ("split", "ids") and f"layer 0 {what}" not in seen:
                seen[f"layer 0 {what}"] = at
            if layer == 0 and what == "job start":
                seen["layer 0 job start"] = at
                break
        if "layer 0 job start" not in seen:
            continue
        for what in (*BOUNDARY_MARKS, "layer 0 split", "layer 0 ids", "layer 0 job start"):
            if what in seen:
                phases[f"boundary: last job end -> {what}"].append(seen[what] - end)


def warm_up(marks, starts, skip):
    """Every step from the first through the first steady one: its length, the CPU job's and
    the chain's mean, and how the split balanced (the dispatcher's "gpu first"/"gpu last" marks
    at each job's end, and the CPU's share by quarter), so that a slow start can be read."""
    print("steps up to the steady ones: length, CPU job and chain means (us), GPU first/last, CPU share by quarter")
    for i in range(min(skip + 1, len(starts) - 1)):
        step = marks[starts[i] : starts[i + 1]]
        counts = collections.Counter(m[3] for m in step if m[3].startswith(("gpu ", "share ")))
        ids, ends, begins = {}, {}, {}
        for at, _, layer, what in step:
            if what == "ids":
                ids.setdefault(layer, at)
            elif what == "job end":
                ends[layer] = at
            elif what == "job start":
                begins[layer] = at
        jobs = [ends[l] - begins[l] for l in ends if l in begins]
        chains = [ids[l + 1] - ends[l] for l in ends if l + 1 in ids]
        mean = lambda v: f"{statistics.mean(v):7.1f}" if v else "      -"
        shares = " ".join(f"{k[6:]}:{v}" for k, v in sorted(counts.items()) if k.startswith("share "))
        print(f"  step {i:3d} {(marks[starts[i + 1]][0] - marks[starts[i]][0]) / 1000:8.1f} ms  job {mean(jobs)}"
              f"  chain {mean(chains)}  gpu first {counts['gpu first']:3d} last {counts['gpu last']:3d}  {shares}")


def host_fill(marks):
    """The first call's host-tier fill, when the trace has its marks: per layer the buffer's
    allocation and the copy, and the staging waits in between (or, for imported pages, the
    writes and the import)."""
    per = collections.defaultdict(dict)
    waits, wait_start = [], None
    making = {}  # thread -> the layer whose buffer it is making (the allocation's mark has none)
    for t, thread, layer, what in marks:
        if what in ("host copy", "host buffer made", "host copy staged", "host pages written",
                    "host memory imported") and layer is not None:
            per[layer].setdefault(what, t)
            if what == "host copy":
                making[thread] = layer
            elif what == "host buffer made":
                making.pop(thread, None)
        elif what == "host memory allocated" and thread in making:
            per[making[thread]].setdefault(what, t)
        elif what == "staging wait":
            wait_start = t
        elif what == "staging ready" and wait_start is not None:
            waits.append((wait_start, t - wait_start))
            wait_start = None
    done = [p for p in per.values() if all(k in p for k in ("host copy", "host buffer made", "host copy staged"))]
    if not done:
        return
    first, last = min(p["host copy"] for p in done), max(p["host copy staged"] for p in done)
    alloc = sum(p["host buffer made"] - p["host copy"] for p in done)
    staged = sum(p["host copy staged"] - p["host buffer made"] for p in done)
    waited = sum(w for t, w in waits if first <= t <= last)
    # Mapped host buffers (Vulkan) mark the driver's allocation apart from the mapping.
    split = [p for p in done if "host memory allocated" in p]
    detail = ""
    if len(split) == len(done):
        allocated = sum(p["host memory allocated"] - p["host copy"] for p in done)
        detail = f" (allocated {allocated / len(done) / 1e3:.1f}, mapped {(alloc - allocated) / len(done) / 1e3:.1f})"
    # Imported pages (Vulkan's host-memory import) mark the fill's writes apart from the import.
    imported = [p for p in done if "host memory imported" in p and "host pages written" in p]
    copies = f"staging waits {waited / len(done) / 1e3:.1f} ms"
    if imported and len(imported) == len(done):
        written = sum(p["host pages written"] - p["host buffer made"] for p in done)
        pinned = sum(p["host memory imported"] - p["host pages written"] for p in done)
        copies = f"pages written {written / len(done) / 1e3:.1f} ms, imported {pinned / len(done) / 1e3:.1f} ms"
    print(f"host-tier fill: {len(done)} layers in {(last - first) / 1e6:.2f} s; per layer: buffer made "
          f"{alloc / len(done) / 1e3:.1f} ms{detail}, copies staged {staged / len(done) / 1e3:.1f} ms (of which "
          f"{copies}); between layers {((last - first) - alloc - staged) / max(len(done) - 1, 1) / 1e3:.1f} ms")


def main():
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if args else 2)
    skip = 10
    if "--skip-steps" in args:
        i = args.index("--skip-steps")
        skip = int(args[i + 1])
        del args[i : i + 2]
    marks = load(args[0])
    host_fill(marks)
    starts = [i for i, m in enumerate(marks) if m[3] == "step"]
    if len(starts) < skip + 2:
        sys.exit(f"{args[0]}: {len(starts)} steps, fewer than --skip-steps {skip} + 2")
    phases = collections.defaultdict(list)
    dispatched = not any(m[3] == "readback queued" for m in marks)
    step_us = []
    for a, b in zip(starts[skip:], starts[skip + 1 :]):
        step = marks[a:b]
        t0, t1 = marks[a][0], marks[b][0]
        step_us.append(t1 - t0)
        per, jobs = layers_of(step)
        if not per or any("split" not in p for p in per.values()):
            # Not a split step (another miss mode): nothing of the below applies.
            continue
        phases["step start -> first MoE call (refills)"].append(min(p["split"] for p in per.values()) - t0)
        phases["last MoE call's end -> next step"].append(t1 - max(p.get("split end", t0) for p in per.values()))
        if dispatched:
            dispatched_phases(per, jobs, phases)
            continue
        for layer, p in sorted(per.items()):
            try:
                encoded, submitted = p["encoded 1"], p["submitted 1"]
                joined = p.get("joined 1")
                if p["previous end"] is not None:
                    phases["host records the layer (during the job)"].append(p["split"] - p["previous end"])
                phases["host encodes it (during the job)"].append(encoded - p["split"])
                if joined is not None:
                    phases["host waits at the join"].append(joined - encoded)
                phases["submit after the join"].append(submitted - (joined if joined is not None else encoded))
                phases["GPU share recorded and submitted"].append(p["gpu share submitted"] - p["readback queued"])
                phases["readback submit -> ids on the host"].append(p["ids"] - submitted)
                phases["ids -> CPU job spawned"].append(p["spawn"] - p["ids"])
                job = jobs.get(layer, {})
                if "job start" in job and "job end" in job:
                    phases["CPU job queued"].append(job["job start"] - p["spawn"])
                    phases["CPU job runs"].append(job["job end"] - job["job start"])
                    nxt = per.get(layer + 1, {})
                    if "joined 1" in nxt:
                        phases["CPU job end -> joined"].append(nxt["joined 1"] - job["job end"])
                nxt = per.get(layer + 1, {})
                if "submitted 1" in nxt:
                    phases["critical path: submit -> next layer's submit"].append(nxt["submitted 1"] - submitted)
            except KeyError:
                phases["layers with marks missing"].append(0.0)
    if dispatched:
        # The last layer's job of each steady step (its layer is the highest with a job).
        last_layer = max((m[2] for m in marks if m[3] == "job end" and m[2] is not None), default=None)
        steady_from = marks[starts[skip]][0]
        ends = [m[0] for m in marks if m[3] == "job end" and m[2] == last_layer and m[0] > steady_from]
        boundary_phases(marks, ends, phases)
    print(f"{args[0]}: {len(step_us)} steps after the first {skip}: {statistics.mean(step_us):.0f} us per step "
          f"(median {statistics.median(step_us):.0f})")
    warm_up(marks, starts, skip)
    print(f"{'phase':52s} {'n':>6s} {'mean':>9s} {'median':>9s} {'p90':>9s}  (us)")
    for name, v in phases.items():
        v = sorted(v)
        print(f"{name:52s} {len(v):6d} {statistics.mean(v):9.1f} {statistics.median(v):9.1f} {v[int(len(v) * 0.9)]:9.1f}")


if __name__ == "__main__":
    main()
