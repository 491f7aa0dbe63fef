"""The small process that starts, times and samples one benchmarked process (`measure.measure` runs it).

    python -S benchmarks/launcher.py RESULT.json LIMIT_S SAMPLE_S CMD...

Linux folds the pre-exec image's RSS (for a vfork'd child: the parent's peak) into the child's
ru_maxrss, so children are started by this ~10 MB launcher, not by the runner (which imports
torch). It times its child and reports wait4's rusage and the machine's CPU ticks, and samples
RssAnon / RssFile / VmRSS (/proc/PID/status) over the child's process tree every SAMPLE_S seconds:
ru_maxrss counts mmapped input pages, which are page cache the kernel can drop, RssAnon is the
memory a merge needs. LIMIT_S > 0 kills the child after that many seconds.

Standard library only, and no more of it than this needs: the launcher's own image is what a child's
ru_maxrss starts from. `ticks`, `tree` and `memory` are imported by measure.py and profile_merge.py.
"""

import json
import os
import subprocess
import sys
import threading
import time

KEYS = ("RssAnon", "RssFile", "VmRSS")


def ticks():
    """(total, idle + iowait) CPU ticks of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]


def tree(pid):
    """The process and its descendants, from /proc/PID/task/TID/children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def memory(pids):
    """(RssAnon, RssFile, VmRSS) in KiB summed over the processes."""
    tot = [0, 0, 0]
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    k = line.split(":", 1)[0]
                    if k in KEYS:
                        tot[KEYS.index(k)] += int(line.split()[1])
        except (OSError, ValueError):
            pass
    return tot


def main(argv):
    t0 = ticks()
    start = time.perf_counter()
    limit, every = float(argv[2]), float(argv[3])
    proc = subprocess.Popen(argv[4:])
    timer = None
    if limit > 0:
        timer = threading.Timer(limit, proc.kill)
        timer.start()
    peak, samples, done = [0, 0, 0], [0], threading.Event()

    def sample():
        while not done.is_set():
            for i, v in enumerate(memory(tree(proc.pid))):
                peak[i] = max(peak[i], v)
            samples[0] += 1
            done.wait(every)

    sampler = threading.Thread(target=sample, daemon=True)
    if every > 0:
        sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    wall = time.perf_counter() - start
    if timer is not None:
        timer.cancel()  # else the launcher lingers until the limit, after the child is done
    t1 = ticks()
    proc.returncode = os.waitstatus_to_exitcode(status)
    with open(argv[1], "w") as f:
        json.dump({"wall_s": wall, "rc": proc.returncode, "maxrss_kib": usage.ru_maxrss, "user_s": usage.ru_utime,
                   "sys_s": usage.ru_stime, "busy_ticks": (t1[0] - t0[0]) - (t1[1] - t0[1]),
                   "majflt": usage.ru_majflt, "minflt": usage.ru_minflt, "inblock": usage.ru_inblock,
                   "oublock": usage.ru_oublock, "peak_rss_anon_kib": peak[0], "peak_rss_file_kib": peak[1],
                   "peak_rss_sampled_kib": peak[2], "samples": samples[0]}, f)


if __name__ == "__main__":
    main(sys.argv)
