#!/usr/bin/env python3
"""Summarises alloc_replay.py's JSON lines: per mode, the median seconds of the repetitions after
the first ``--skip`` (auto: also after its switch to the plan) and µs per allocation + free pair,
each process on its own line, then the ratio to the median native process.

    python python/bench/alloc_replay_summary.py alloc_replay.jsonl [--skip 6]
"""

import argparse
import json
import statistics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl")
    ap.add_argument("--skip", type=int, default=6)
    a = ap.parse_args()
    rows = [json.loads(line) for line in open(a.jsonl) if line.startswith("{")]
    per = []
    for r in rows:
        reps = r["rep_s"][a.skip:]
        if r["mode"] == "auto":
            reps = [t for t, m in zip(r["rep_s"], r["modes"]) if m == "auto (plan)"][1:] or reps
        med = statistics.median(reps)
        per.append((r["mode"], med, med / r["allocations"] * 1e6, len(reps), r.get("max_reserved", 0)))
    nat = statistics.median([m for mode, m, *_ in per if mode == "native"] or [float("nan")])
    print(f"{'mode':8} {'s per replay':>12} {'us per pair':>11} {'reps':>4} {'vs native':>9} {'max reserved GiB':>16}")
    for mode, med, us, k, res in per:
        print(f"{mode:8} {med:12.4f} {us:11.3f} {k:4d} {med / nat:9.3f} {res / 2**30:16.2f}")


if __name__ == "__main__":
    main()
