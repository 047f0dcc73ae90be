#!/usr/bin/env python3
"""Samples what the kernel says about a process and the machine, every few milliseconds, for
lining up with a DISKFORMER_TRACE timeline (bench/proc-steps.py does that).

Why: a trace shows when the host's marks happened, not what else ran. This shows each of the
process's threads' CPU time and run-queue wait (/proc/PID/task/TID/schedstat), their page
faults, and the machine's user/system/steal/idle time and fault counters.

Usage: proc-sampler.py OUT.tsv CMD ARGS...   (runs CMD and samples it until it exits)
Lines: unix_s, then `cpu user nice system idle iowait irq softirq steal` (jiffies),
`vm pgfault pgmajfault ...`, or `task TID run_ns wait_ns slices minflt majflt cpu`.
"""
import os
import subprocess
import sys
import time

PERIOD = float(os.environ.get("SAMPLE_PERIOD_S", "0.005"))
VM_KEYS = ("pgfault", "pgmajfault", "thp_fault_alloc", "compact_stall", "pgscan_kswapd",
           "pgscan_direct", "nr_dirty", "nr_writeback", "numa_hint_faults", "pgmigrate_success")


def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def main():
    out_path, cmd = sys.argv[1], sys.argv[2:]
    proc = subprocess.Popen(cmd)
    pid = proc.pid
    with open(out_path, "w") as out:
        while proc.poll() is None:
            t = time.time()
            lines = []
            stat = read("/proc/stat")
            if stat:
                lines.append("%.6f\tcpu\t%s" % (t, "\t".join(stat.split("\n", 1)[0].split()[1:9])))
            vm = read("/proc/vmstat")
            if vm:
                d = dict(l.split() for l in vm.splitlines() if l)
                lines.append("%.6f\tvm\t%s" % (t, "\t".join(d.get(k, "0") for k in VM_KEYS)))
            try:
                tids = os.listdir("/proc/%d/task" % pid)
            except OSError:
                tids = []
            for tid in tids:
                sched = read("/proc/%d/task/%s/schedstat" % (pid, tid))
                st = read("/proc/%d/task/%s/stat" % (pid, tid))
                if not sched or not st:
                    continue
                f = st.rsplit(")", 1)[1].split()
                # After the name: state is f[0]; minflt f[7], majflt f[9], processor f[36].
                lines.append("%.6f\ttask\t%s\t%s\t%s\t%s\t%s" % (
                    t, tid, "\t".join(sched.split()[:3]), f[7], f[9], f[36]))
            out.write("\n".join(lines) + "\n")
            time.sleep(max(0.0, PERIOD - (time.time() - t)))
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
