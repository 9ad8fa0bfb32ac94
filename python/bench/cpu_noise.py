#!/usr/bin/env python3
"""How steady is each CPU of this machine? Fixed CPU work, timed unit by unit, per CPU.

    python python/bench/cpu_noise.py [--cpus 0-15] [--seconds 2] [--unit-ms 20] [--json OUT]

For each CPU in turn, this process pins itself there and repeats one unit of pure-Python work
(integer arithmetic and a list of small objects, about --unit-ms long) for --seconds; it
prints per CPU the median unit time, its coefficient of variation and the 90th percentile over
the median. On a quiet machine every unit takes the same time on every CPU (CV well under
1 %); on a virtual machine whose host runs other work on our vCPUs' cores, or whose cache and
memory bandwidth are shared, units slow down for no reason the guest can see. A launch-bound
training loop (GPT-2 XL, MoE eager, 1F1B and variable lengths in gpu_bench.py) is exactly this
kind of CPU work, so its step time cannot be steadier than this (BENCHMARKS.md, session 6).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def parse_cpus(text: str):
    out = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            a, b = part.split("-", 1)
            out += list(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return out


def unit(n: int) -> int:
    """Fixed work: arithmetic and allocation of small objects, like an interpreter loop."""
    acc = 0
    xs = []
    for i in range(n):
        acc = (acc * 31 + i) & 0xFFFFFFFF
        if i & 7 == 0:
            xs.append((i, acc))
    return acc + len(xs)


def calibrate(target_s: float) -> int:
    n = 10000
    while True:
        t0 = time.perf_counter()
        unit(n)
        dt = time.perf_counter() - t0
        if dt >= target_s / 4:
            return max(1000, int(n * target_s / dt))
        n *= 2


def measure(cpu: int, n: int, seconds: float) -> dict:
    os.sched_setaffinity(0, {cpu})
    unit(n)  # settle onto the CPU
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        unit(n)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    srt = sorted(times)
    return {"cpu": cpu, "units": len(times), "median_ms": 1e3 * med,
            "min_ms": 1e3 * srt[0],
            "cv": statistics.pstdev(times) / statistics.mean(times),
            "p90_over_median": srt[int(0.9 * (len(srt) - 1))] / med,
            "max_over_median": srt[-1] / med}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpus", default=None, help="e.g. 0-15 (default: every CPU this process may use)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--unit-ms", type=float, default=20.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    allowed = sorted(os.sched_getaffinity(0))
    cpus = [c for c in (parse_cpus(a.cpus) if a.cpus else allowed) if c in allowed]
    if not cpus:
        print("no usable CPU", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, {cpus[0]})
    n = calibrate(a.unit_ms / 1e3)
    rows = []
    print(f"unit: {n} loop steps (~{a.unit_ms:g} ms), {a.seconds:g} s per CPU")
    print("cpu  units  median ms  min ms  CV      p90/med  max/med")
    for c in cpus:
        r = measure(c, n, a.seconds)
        rows.append(r)
        print(f"{c:3d}  {r['units']:5d}  {r['median_ms']:9.2f}  {r['min_ms']:6.2f}  {100 * r['cv']:5.2f} %"
              f"  {r['p90_over_median']:7.3f}  {r['max_over_median']:7.3f}", flush=True)
    meds = [r["median_ms"] for r in rows]
    print(f"medians across CPUs: {min(meds):.2f}-{max(meds):.2f} ms "
          f"({100 * (max(meds) / min(meds) - 1):.1f} % apart); CV median {100 * statistics.median(r['cv'] for r in rows):.2f} %")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"unit_steps": n, "seconds": a.seconds, "cpus": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
