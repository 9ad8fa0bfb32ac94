#!/usr/bin/env python3
"""Plot a gpu_bench.json: peak reserved vs the lower bound, per workload and allocator (left),
and steady step time relative to PyTorch native (right).

    python python/bench/plot_bench.py RESULT.json -o docs/gpu_bench.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_bench import GiB, finalize_workload  # noqa: E402

SERIES = [
    ("native", "PyTorch native", "#9e9e9e"),
    ("expandable", "expandable segments", "#5b8db8"),
    ("trace", "stweaver online (trace run)", "#f2b36b"),
    ("auto_steady", "stweaver auto (after switch)", "#e07b39"),
    ("plan", "stweaver plan (trace → plan)", "#b3431e"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(a.json) as f:
        doc = json.load(f)
    ws = doc["workloads"]
    for e in ws:
        finalize_workload(e)
    names = [e["config"]["name"] for e in ws]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 5.2), gridspec_kw={"width_ratios": [2.2, 1]})
    width = 0.8 / len(SERIES)
    for k, (key, label, color) in enumerate(SERIES):
        xs, ys, over, ratios = [], [], [], []
        for i, e in enumerate(ws):
            row = next((r for r in e.get("rows", []) if r["key"] == key and r["ok"] and r.get("reserved")), None)
            x = i - 0.4 + width * (k + 0.5)
            if row is None:
                # say why the bar is missing instead of leaving a silent gap
                lb = e.get("lower_bound")
                if lb and any(r["key"] == key for r in e.get("rows", [])):
                    ax.text(x, lb / GiB * 0.82, "no plan served", ha="center", va="bottom",
                            fontsize=6.5, rotation=90, color=color)
                continue
            xs.append(x)
            ys.append(row["reserved"] / GiB)
            lb = e.get("lower_bound")
            over.append(None if not lb else row["reserved"] / lb - 1)
            ratios.append((x, row.get("step_ratio")))
        ax.bar(xs, ys, width * 0.92, label=label, color=color)
        for x, y, o in zip(xs, ys, over):
            if o is not None:
                ax.text(x, y, f"+{100 * o:.1f}%" if o >= 0.0005 else f"{100 * o:+.2f}%",
                        ha="center", va="bottom", fontsize=6.5, rotation=90)
        rx = [x for x, r in ratios if r is not None]
        ry = [r for _, r in ratios if r is not None]
        ax2.vlines(rx, 1.0, ry, colors=color, linewidth=2)
        ax2.plot(rx, ry, "o", color=color, markersize=5)
    for i, e in enumerate(ws):
        lb = e.get("lower_bound")
        if lb:
            ax.hlines(lb / GiB, i - 0.45, i + 0.45, colors="black", linewidth=1.6,
                      label="lower bound (peak live bytes)" if i == 0 else None)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=15, fontsize=8)
    ax.set_ylabel("peak reserved (GiB)")
    lbs = [e.get("lower_bound") for e in ws if e.get("lower_bound")]
    if lbs:
        ax.set_ylim(min(lbs) / GiB * 0.8, None)
    ax.set_title("Peak reserved vs lower bound (% over the bound on each bar)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    ax2.axhline(1.0, color="black", linewidth=1)
    ax2.axhspan(0.99, 1.01, color="green", alpha=0.12, label="±1 %")
    ax2.set_xticks(range(len(names)))
    ax2.set_xticklabels(names, rotation=15, fontsize=8)
    ax2.set_ylabel("steady step time / native")
    lo = min([0.97] + [r["step_ratio"] for e in ws for r in e.get("rows", []) if r.get("step_ratio")])
    hi = max([1.03] + [r["step_ratio"] for e in ws for r in e.get("rows", []) if r.get("step_ratio")])
    ax2.set_ylim(lo - 0.01, hi + 0.01)
    ax2.set_title("Step time vs PyTorch native", fontsize=10)
    ax2.legend(fontsize=7, loc="upper right")
    ax2.grid(axis="y", alpha=0.3)
    dev = doc.get("device", "?")
    fig.suptitle(f"stweaver GPU benchmark — {dev}, {doc.get('started', '')[:10]}"
                 + (" (DRY RUN: CPU, tiny models, no allocator)" if doc.get("dry_run") else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
