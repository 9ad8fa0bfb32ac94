"""The tables and notes: the result table (plain or markdown), step-time rounds, noise, and
the targets (met / missed) for BENCHMARKS.md."""

from __future__ import annotations

import statistics
from typing import List

from lockstep import bootstrap_median_ci, step_verdict  # noqa: E402 (python/bench is on sys.path)

from .common import GiB
from .workloads import LABELS
from .stats import floor_ratios, fmt_ci, paired_ratio_groups, round_times


def render_noise(doc: dict) -> List[str]:
    """Per workload and allocator over every process that ran it (main run and rounds): the
    per-process CV of counted iterations, the spread of the processes' medians, and medians of
    the diagnostics. Tells a launch-bound loop (launch ~100 %) from a GPU-bound one, and CPU
    contention (runq, others) from noise with no visible cause."""
    out = []
    for e in doc["workloads"]:
        iters = e.get("step_rounds_iters") or {a: [round_times(r)] for a, r in e.get("runs", {}).items()}
        for alloc, rounds in iters.items():
            ns = [r["noise"] for r in rounds if r and r.get("noise") and r["noise"].get("n")]
            if not ns:
                continue
            meds = [n["median_s"] for n in ns if n.get("median_s")]
            cvs = [n["cv"] for n in ns if n.get("cv") is not None]

            def m(key, scale=1.0, fmt="{:.1f}"):
                xs = [n[key] for n in ns if n.get(key) is not None]
                return fmt.format(scale * statistics.median(xs)) if xs else "–"

            out.append(f"{e['config']['name']:18s} {alloc:10s} procs={len(ns)} "
                       f"median {1e3 * statistics.median(meds):.1f} ms, process medians spread "
                       f"{100 * (max(meds) / min(meds) - 1):.1f} %, CV per process "
                       + "/".join(f"{100 * c:.1f}" for c in cvs) + " %"
                       + f", launch {m('launch_frac', 100, '{:.0f}')} %, cpu {m('cpu_frac', 100, '{:.0f}')} %"
                       + f", runq {m('runq_s', 1e3)} ms, nivcsw {m('nivcsw', 1, '{:.0f}')}"
                       + f", others {m('others_cpus', 1, '{:.2f}')} CPUs, steal {m('steal_s', 1e3)} ms")
    if out:
        out.insert(0, "noise per workload and allocator (counted iterations; launch: share of the "
                      "step before the final synchronisation; cpu: this thread's CPU time / step; "
                      "runq: its run-queue wait per iteration; others: CPUs busy outside the process):")
    return out


def render_step_rounds(doc: dict) -> List[str]:
    """Per workload and allocator: each round's step ratio to that round's native, and the
    median over rounds (`run --step-rounds`)."""
    out = []
    for e in doc["workloads"]:
        rounds = e.get("step_rounds")
        if not rounds or "native" not in rounds:
            continue
        nat = rounds["native"]
        for alloc, steps in rounds.items():
            if alloc == "native":
                continue
            ratios = [s / n for s, n in zip(steps, nat) if s and n]
            if not ratios:
                continue
            srt = sorted(ratios)
            med = srt[len(srt) // 2] if len(srt) % 2 else (srt[len(srt) // 2 - 1] + srt[len(srt) // 2]) / 2
            label = "stweaver auto (after switch*)" if alloc == "auto" else LABELS.get(alloc, alloc)
            line = (f"{e['config']['name']:18s} {label:30s} "
                    + " ".join(f"{x:.3f}" for x in ratios) + f"  -> median {med:.3f}")
            iters = e.get("step_rounds_iters") or {}
            groups = paired_ratio_groups(iters.get("native") or [], iters.get(alloc) or [])
            pairs = [x for g in groups for x in g]
            if pairs:
                q = statistics.quantiles(pairs, n=4) if len(pairs) >= 2 else [pairs[0]] * 3
                line += (f"; paired iterations: median {statistics.median(pairs):.3f} "
                         f"(IQR {q[0]:.3f}-{q[2]:.3f}, n={len(pairs)})")
                ci = bootstrap_median_ci(groups)
                line += (f", 95 % CI [{ci['lo']:.3f}, {ci['hi']:.3f}] over {ci['rounds']} rounds: "
                         f"{step_verdict(ci)}")
                fl = floor_ratios(iters.get("native") or [], iters.get(alloc) or [])
                if fl:
                    line += "; q20 per round " + " ".join(f"{x:.3f}" for x in fl)
            out.append(line)
    if out:
        out.insert(0, "step time / native per round (round 0 = the main run), median over rounds; "
                      "paired: the same iteration of the same round, over all rounds, with a "
                      "bootstrap CI resampling rounds then iterations "
                      "(* auto that never switches: its iterations after warm-up):")
    return out


def _gib(x) -> str:
    return "–" if x is None else f"{x / GiB:.3f}"


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.2f} %"


def _ratio(x) -> str:
    return "–" if x is None else f"{x:.3f}"


def render_table(doc: dict, markdown: bool) -> str:
    head = ["workload", "allocator", "peak reserved GiB", "peak alloc GiB", "util", "LB/res",
            "waste GiB", "step ms", "vs native", "paired vs native [95 % CI]", "losses = native"]
    lines = []
    for e in doc["workloads"]:
        for row in e.get("rows", []):
            name = e["config"]["name"]
            if not row["ok"]:
                lines.append([name, row["label"], "failed: " + str(row.get("error", ""))[:110]] + [""] * 8)
                continue
            match = row.get("losses_match")
            m = "–" if match is None else ("yes" if match else "NO")
            if match and row.get("params_match") is False:
                m = "losses yes, params NO"
            lines.append([
                name, row["label"], _gib(row.get("reserved")), _gib(row.get("allocated")),
                _pct(row.get("utilization")), _pct(row.get("lb_over_reserved")), _gib(row.get("waste")),
                "–" if row.get("step_s") is None else f"{row['step_s'] * 1e3:.1f}",
                _ratio(row.get("step_ratio")), fmt_ci(row.get("step_paired")), m,
            ])
    caps = doc.get("cap_search") or []
    if isinstance(caps, dict):  # one search (results written before several loops)
        caps = [caps]
    cap_tables = []
    for cap in caps:
        cap_lines = []
        for alloc, s in cap["allocators"].items():
            probes = ", ".join(f"{p['batch']}{'+' if p['fits'] else '-'}" for p in s["probes"])
            cap_lines.append([alloc, str(s.get("largest") or "none") + ("" if s.get("edge_proven", True) else " (edge not probed)"),
                              "–" if s.get("tokens_per_s") is None else f"{s['tokens_per_s']:.0f}",
                              _gib(s.get("max_reserved")), probes])
        if cap_lines:
            cap_tables.append((cap, cap_lines))
    out = []
    if markdown:
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        out += ["| " + " | ".join(l) + " |" for l in lines]
        for cap, cap_lines in cap_tables:
            w = cap["workload"]
            out.append("")
            out.append(f"Largest micro-batch under a {cap['cap_bytes'] / GiB:.0f} GiB cap "
                       f"({w['name']}: {w['family']}, B x {w['seq']} tokens"
                       + (f", length uniform in [{w['seq_min']}, {w['seq']}]" if w.get("seq_min") else "")
                       + ", checkpointing):")
            out.append("")
            out.append("| allocator | largest micro-batch | tokens/s at it | peak reserved GiB | probes (+ fits, - OOM) |")
            out.append("|---|---|---|---|---|")
            out += ["| " + " | ".join(l) + " |" for l in cap_lines]
    else:
        short = ["workload", "allocator", "reserved", "alloc", "util", "LB/res", "waste", "step ms", "vs nat",
                 "paired [95% CI]", "loss="]
        rows = [short] + [l for l in lines]
        good = [r for r in rows if not r[2].startswith("failed")]
        widths = [max(len(r[i]) for r in good) for i in range(len(short))]
        widths[1] = min(widths[1], 30)
        for r in rows:
            if r[2].startswith("failed"):
                out.append(f"{r[0]:<{widths[0]}}  {r[1][:30]:<{widths[1]}}  {r[2]}")
                continue
            out.append("  ".join(r[i][:30].ljust(widths[i]) for i in range(len(short))).rstrip())
        for cap, cap_lines in cap_tables:
            out.append(f"cap {cap['cap_bytes'] / GiB:.0f} GiB, {cap['workload']['name']}: allocator, largest micro-batch, tokens/s, reserved, probes")
            out += ["  " + "  ".join(l) for l in cap_lines]
        if doc.get("skipped"):
            out.append("skipped: " + "; ".join(doc["skipped"]))
    return "\n".join(out) + "\n"


def targets(doc: dict) -> List[str]:
    """The issue's targets, each with the measured number and met / missed."""
    out = []
    for e in doc["workloads"]:
        rows = {r["key"]: r for r in e.get("rows", []) if r["ok"]}
        name = e["config"]["name"]
        need = 0.98 if "moe" in name else 0.99
        exp = rows.get("expandable", {}).get("reserved")
        for key in ("plan", "auto_steady"):
            r = rows.get(key)
            if not r:
                out.append(f"{name} {key}: no result")
                continue
            u = r.get("utilization")
            lbu = r.get("lb_over_reserved")
            parts = [f"util {_pct(u)} (LB/res {_pct(lbu)}) {'met' if u and u >= need else 'MISSED'} (>= {need:.0%})"]
            if exp:
                parts.append(f"reserved {_gib(r['reserved'])} vs expandable {_gib(exp)} GiB: "
                             f"{'met' if r['reserved'] < exp else 'MISSED'}")
            sp = r.get("step_paired")
            if sp:
                v = sp["verdict"]
                how = f"lockstep, {sp['n']} rounds" if sp.get("lockstep") else f"{sp['rounds']} rounds, n={sp['n']}"
                parts.append(f"step paired x{fmt_ci(sp)} ({how}): "
                             + ("met, " if v.startswith("within") else ("MISSED, " if v.startswith("slower") else ""))
                             + v)
            elif r.get("step_ratio") is not None:
                parts.append(f"step x{r['step_ratio']:.3f} (one run, no CI): not resolved")
            if r.get("losses_match") is not None:
                parts.append(f"losses {'identical' if r['losses_match'] else 'DIFFER'}")
            out.append(f"{name} {key}: " + "; ".join(parts))
    caps = doc.get("cap_search") or []
    for cap in ([caps] if isinstance(caps, dict) else caps):
        a = cap["allocators"]
        n, s = (a.get("native") or {}).get("largest"), (a.get("auto") or {}).get("largest")
        x = (a.get("expandable") or {}).get("largest")
        name = cap["workload"]["name"]
        if n is not None and s is not None:
            out.append(f"cap {name}: stweaver {s} vs native {n}: {'met' if s > n else 'MISSED'}"
                       + (f"; vs expandable {x}: {'met (>=)' if s >= x else 'MISSED (<)'}"
                          + (", larger" if s > x else "") if x is not None else ""))
    return out
