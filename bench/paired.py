#!/usr/bin/env python3
"""Builds of abnconvert compared round by round on a shared machine.

    python3 bench/paired.py ROUNDS CHECKPOINT BINARY...

Like bench/alternate.sh (cp and each build convert the same checkpoint in
turn, round after round, each round starting with the next tool, a sync
before each run), but it also reports, for each build, the median over the
rounds of its wall time minus the first build's in the same round, and the
median of its ratio to cp's: on a VM whose runs minutes apart differ by a
third, a difference of a few ms shows there where the medians of the
whole runs drown it. Times in ms, wall and CPU (user + system, the child's
own, from wait4) of the whole process. The output is written beside the
checkpoint and removed.
"""
import os
import statistics
import subprocess
import sys
import time


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    rounds, inp, builds = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    out = os.path.join(os.path.dirname(os.path.abspath(inp)), ".paired-out.pth")
    tools = ["cp"] + builds
    runs = {t: [] for t in tools}
    try:
        for r in range(rounds):
            k = r % len(tools)
            for t in tools[k:] + tools[:k]:
                if os.path.exists(out):
                    os.remove(out)
                os.sync()
                cmd = ["cp", inp, out] if t == "cp" else [t, "--input", inp, "--output", out]
                t0 = time.perf_counter()
                p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                _, status, ru = os.wait4(p.pid, 0)
                wall = (time.perf_counter() - t0) * 1000
                if status != 0:
                    sys.exit(f"{' '.join(cmd)}: exit status {status}")
                runs[t].append((wall, (ru.ru_utime + ru.ru_stime) * 1000))
    finally:
        if os.path.exists(out):
            os.remove(out)
    base = builds[0]
    print(f"| tool | wall min | wall median | CPU median | median of (wall - {base}'s) | median of wall / cp's |")
    print("|---|---|---|---|---|---|")
    for t in tools:
        wall = [w for w, _ in runs[t]]
        cpu = [c for _, c in runs[t]]
        diff = statistics.median(a[0] - b[0] for a, b in zip(runs[t], runs[base]))
        ratio = statistics.median(a[0] / b[0] for a, b in zip(runs[t], runs["cp"]))
        print(f"| {t} | {min(wall):.1f} | {statistics.median(wall):.1f} | {statistics.median(cpu):.0f} | {diff:+.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
