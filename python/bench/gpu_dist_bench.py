#!/usr/bin/env python3
"""stweaver distributed benchmark: DDP and FSDP2 (``fully_shard``) training of the Llama config
of make_traces.py on N GPUs, under PyTorch native, expandable segments, stweaver auto and
stweaver trace -> ``stweaver plan`` (per rank) -> plan. ``scripts/gpu_dist_bench.sh`` runs it.

    python python/bench/gpu_dist_bench.py --gpus 2 --out DIR --stweaver-bin PATH [--budget-s S]
    python python/bench/gpu_dist_bench.py --gpus 2 --out DIR --dry-run     (CPU, gloo, native only)

Each run is one ``torchrun --standalone`` job (python/tests/gpu_dist/dist_worker.py), one at a
time (so step times are not disturbed), with a hard timeout. Per rank: peak reserved and peak
allocated (PyTorch's counters), utilization (= peak allocated / peak reserved), the median step
time (iterations after the warm-up; for auto, the iterations after its switch to the plan)
divided by native's, and whether every per-iteration loss is bitwise native's. For auto the
peaks are given over the whole run and over the window after the switch.
Writes DIR/gpu_dist_bench.json and DIR/bench_table.txt (printed last).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "gpu_dist"))
import distlaunch as dl  # noqa: E402

ALLOCS = ("native", "expandable", "trace", "plan", "auto")
# Variants run only when named in --allocators: plans of all streams in one joint solve
# (`stweaver plan --share-streams`, STWEAVER_SHARE_STREAMS=1 for auto), and plan mode with
# stream waits off (STWEAVER_PLAN_WAIT=0: conflicts instead, the behaviour before them).
VARIANTS = ("plan_joint", "auto_joint", "plan_nowait")
LABEL = {"native": "native", "expandable": "expandable segments", "trace": "stweaver online (trace run)",
         "plan": "stweaver trace -> plan", "auto": "stweaver auto (whole run)",
         "auto_steady": "stweaver auto (after switch)",
         "plan_joint": "stweaver trace -> joint plan", "auto_joint": "stweaver auto, joint (whole)",
         "auto_joint_steady": "stweaver auto, joint (after sw.)",
         "plan_nowait": "stweaver plan, waits off"}
GiB = float(1 << 30)


def run(a, strategy, alloc, fdir, timeout, suffix=""):
    name = f"{strategy}_{alloc}{suffix}"
    d = os.path.join(a.out, "runs", name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    extra, kind = {}, "stweaver"
    if alloc == "native":
        kind = "native"
    elif alloc == "expandable":
        kind = "native"
        extra["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    elif alloc == "trace":
        extra["STWEAVER_TRACE"] = os.path.join(fdir, f"{strategy}.stwt")
    elif alloc in ("plan", "plan_nowait"):
        extra["STWEAVER_PLAN"] = os.path.join(fdir, f"{strategy}.stwp")
        if alloc == "plan_nowait":
            extra["STWEAVER_PLAN_WAIT"] = "0"
    elif alloc == "plan_joint":
        extra["STWEAVER_PLAN"] = os.path.join(fdir, f"{strategy}.joint.stwp")
    elif alloc == "auto_joint":
        extra["STWEAVER_SHARE_STREAMS"] = "1"
    if kind == "stweaver":
        extra["STWEAVER_HOOK_OPTIMIZER"] = "1"
    args = ["--strategy", strategy, "--alloc", "native" if a.dry_run else kind, "--config", a.config,
            "--iters", str(a.iters), "--warmup", str(a.warmup), "--out", d]
    r = dl.torchrun(dl.WORKER, args, a.gpus, dl.base_env(extra), os.path.join(d, "log.txt"), timeout,
                    a.dry_run)
    r["alloc"] = alloc
    r["strategy"] = strategy
    r["ranks"] = dl.read_ranks(d, a.gpus)
    return r


def rows_of(doc):
    rows = []
    for s, runs in doc["runs"].items():
        native = runs.get("native")
        for alloc in ALLOCS + VARIANTS:
            r = runs.get(alloc)
            if r is None:
                continue
            variants = [(alloc, "max_reserved", "max_allocated", "step_median_s")]
            if alloc in ("auto", "auto_joint"):
                variants.append((alloc + "_steady", "steady_max_reserved", "steady_max_allocated",
                                 "steady_step_median_s"))
            for label, kr, ka, kt in variants:
                for rank, x in enumerate(r["ranks"]):
                    row = {"strategy": s, "alloc": label, "rank": rank}
                    if not x or not x.get("ok"):
                        row["error"] = (x or {}).get("error") or f"rc {r['rc']} timed_out {r['timed_out']}"
                        rows.append(row)
                        continue
                    ref = native["ranks"][rank] if native and native["ranks"][rank] else None
                    res, al = x.get(kr), x.get(ka)
                    row.update(peak_reserved=res, peak_allocated=al,
                               utilization=(al / res) if res and al else None,
                               step_s=x.get(kt), iterations=len(x["losses"]),
                               mode=(x.get("modes") or ["-"])[-1], switched_at=x.get("switched_at"))
                    if ref and ref.get("ok"):
                        row["losses_equal"] = x["losses"] == ref["losses"]
                        if x.get(kt) and ref.get("step_median_s"):
                            row["step_ratio"] = x[kt] / ref["step_median_s"]
                        if res and ref.get("max_reserved"):
                            row["reserved_vs_native"] = res / ref["max_reserved"]
                    rows.append(row)
    return rows


def render(doc) -> str:
    head = ("strategy", "allocator", "rank", "peak reserved", "peak allocated", "util.", "vs native",
            "step / native", "losses = native", "mode at end")
    out = []
    for r in doc["rows"]:
        if "error" in r:
            out.append((r["strategy"], LABEL[r["alloc"]], str(r["rank"]), "FAILED", r["error"][:60], "", "", "",
                        "", ""))
            continue
        g = lambda v: f"{v / GiB:.2f} GiB" if v else "-"  # noqa: E731
        out.append((r["strategy"], LABEL[r["alloc"]], str(r["rank"]), g(r["peak_reserved"]),
                    g(r["peak_allocated"]),
                    f"{100 * r['utilization']:.1f} %" if r.get("utilization") else "-",
                    f"{r['reserved_vs_native']:.3f}" if r.get("reserved_vs_native") else "-",
                    f"{r['step_ratio']:.3f}" if r.get("step_ratio") else "-",
                    {True: "yes", False: "NO", None: "-"}[r.get("losses_equal")], r.get("mode", "")[:22]))
    widths = [max(len(str(x[i])) for x in out + [head]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [f"distributed benchmark: {doc['gpus']} ranks, {doc['config']}, {doc['iters']} iterations "
             f"(step medians after {doc['warmup']} warm-up iterations; auto after its switch), "
             f"{doc['wall_s']:.0f} s"]
    if doc.get("skipped"):
        lines.append("skipped (budget): " + ", ".join(doc["skipped"]))
    lines += [fmt.format(*head)] + [fmt.format(*r) for r in out]
    lines += render_repeats(doc)
    return "\n".join(lines)


def step_of(r, alloc):
    """Per-rank step medians of run `r` (auto: after its switch), None where a rank failed."""
    key = "steady_step_median_s" if alloc in ("auto", "auto_joint") else "step_median_s"
    return [(x or {}).get(key) if x and x.get("ok") else None for x in r["ranks"]]


def repeat(a, doc, fdir, t0) -> None:
    """Extra interleaved rounds (native, then each allocator, per strategy) for step time: each
    round's ratio is against the same round's native run, so slow drifts of the machine cancel.
    Round 0 is the main run."""
    if a.repeat_rounds <= 0 or a.dry_run:
        return
    allocs = [x for x in a.repeat_allocators.split(",") if x]
    if "native" not in allocs:
        allocs.insert(0, "native")
    reps = doc.setdefault("repeats", {})
    for s, runs in doc["runs"].items():
        for alloc in allocs:
            if alloc in runs:
                reps.setdefault(s, {}).setdefault(alloc, []).append(step_of(runs[alloc], alloc))
    for k in range(1, a.repeat_rounds + 1):
        for s in list(doc["runs"]):
            for alloc in ["native"] + [x for x in allocs if x != "native"]:
                left = a.budget_s - (time.time() - t0)
                if left < a.est_run_s:
                    doc["skipped"].append(f"{s} {alloc} round {k}")
                    continue
                r = run(a, s, alloc, fdir, min(a.timeout_s, max(30.0, left)), suffix=f"_r{k}")
                steps = step_of(r, alloc)
                reps.setdefault(s, {}).setdefault(alloc, []).append(steps)
                print(f"{s} {alloc} round {k}: steps {steps}", flush=True)
        save(a, doc, t0)


def render_repeats(doc) -> list[str]:
    reps = doc.get("repeats")
    if not reps:
        return []
    lines = ["step time / native, per round (round 0 = the main run; ratio of the median over "
             "ranks to the same round's native), then the median over rounds:"]
    for s, by in reps.items():
        nat = by.get("native", [])
        for alloc, rounds in by.items():
            if alloc == "native":
                continue
            ratios = []
            for k, steps in enumerate(rounds):
                ok = [x for x in steps if x]
                base = [x for x in nat[k] if x] if k < len(nat) else []
                if ok and base:
                    ratios.append(sorted(ok)[len(ok) // 2] / sorted(base)[len(base) // 2])
            if ratios:
                med = sorted(ratios)[len(ratios) // 2] if len(ratios) % 2 else \
                    sum(sorted(ratios)[len(ratios) // 2 - 1:len(ratios) // 2 + 1]) / 2
                lines.append(f"  {s:<5} {LABEL.get(alloc, alloc) if alloc != 'auto' else LABEL['auto_steady']:<30} "
                             + " ".join(f"{x:.3f}" for x in ratios) + f"  -> median {med:.3f}")
    return lines


def save(a, doc, t0) -> None:
    doc["wall_s"] = time.time() - t0
    doc["rows"] = rows_of(doc)
    doc["table"] = render(doc)
    with open(os.path.join(a.out, "gpu_dist_bench.json"), "w") as f:
        json.dump(doc, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stweaver-bin", default=None)
    ap.add_argument("--config", default="llama1b")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--strategies", default="ddp,fsdp")
    ap.add_argument("--allocators", default=None,
                    help=f"comma-separated subset of {','.join(ALLOCS + VARIANTS)} (default: {','.join(ALLOCS)}); "
                         "plan_nowait needs plan's files, so run it after plan")
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--est-run-s", type=float, default=30, help="a run is not started with less left")
    ap.add_argument("--timeout-s", type=float, default=180)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--repeat-rounds", type=int, default=0,
                    help="after the main runs, this many extra rounds of --repeat-allocators, "
                         "interleaved, for step time alone (one run per configuration does not "
                         "resolve 1 %% on a shared machine)")
    ap.add_argument("--repeat-allocators", default="native,expandable,auto")
    ap.add_argument("--keep-traces", action="store_true",
                    help="gzip every rank's trace of the trace run into --out "
                         "({strategy}.rank{R}.stwt.gz), for a CPU replay of the plan run")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    fdir = os.path.join(a.out, "files")
    shutil.rmtree(fdir, ignore_errors=True)
    os.makedirs(fdir)
    doc = {"gpus": a.gpus, "config": a.config, "iters": a.iters, "warmup": a.warmup, "runs": {},
           "skipped": [], "plans": {}, "dry_run": a.dry_run}
    for s in a.strategies.split(","):
        runs = doc["runs"].setdefault(s, {})
        allocs = tuple(a.allocators.split(",")) if a.allocators else ALLOCS
        unknown = [x for x in allocs if x not in ALLOCS + VARIANTS]
        if unknown:
            ap.error(f"unknown allocators {unknown}")
        for alloc in (("native",) if a.dry_run else allocs):
            left = a.budget_s - (time.time() - t0)
            if left < a.est_run_s:
                doc["skipped"].append(f"{s} {alloc}")
                continue
            if alloc in ("plan", "plan_joint"):
                if not a.stweaver_bin:
                    doc["skipped"].append(f"{s} {alloc} (no planner binary)")
                    continue
                joint = alloc == "plan_joint"
                for r in range(a.gpus):
                    trace = os.path.join(fdir, f"{s}.rank{r}.stwt")
                    plan = os.path.join(fdir, f"{s}{'.joint' if joint else ''}.rank{r}.stwp")
                    doc["plans"][os.path.basename(plan)] = dl.plan_cli(
                        a.stweaver_bin, trace, plan, plan + ".log",
                        extra=("--share-streams",) if joint else ())
            r = run(a, s, alloc, fdir, min(a.timeout_s, max(30.0, left)))
            runs[alloc] = r
            if alloc == "trace" and a.keep_traces:
                for rk in range(a.gpus):
                    src = os.path.join(fdir, f"{s}.rank{rk}.stwt")
                    if os.path.isfile(src):
                        with open(src, "rb") as fi, gzip.open(os.path.join(a.out, os.path.basename(src) + ".gz"), "wb") as fo:
                            shutil.copyfileobj(fi, fo)
            oks = [x and x.get("ok") for x in r["ranks"]]
            print(f"{s} {alloc}: rc {r['rc']} {r['wall_s']} s ranks ok {oks}", flush=True)
            if not all(oks):
                print(dl.tail(r["log"], 25), flush=True)
            save(a, doc, t0)  # after every run: a killed call still leaves its results
    repeat(a, doc, fdir, t0)
    save(a, doc, t0)
    with open(os.path.join(a.out, "bench_table.txt"), "w") as f:
        f.write(doc["table"] + "\n")
    print(doc["table"])
    bad = [r for r in doc["rows"] if "error" in r or r.get("losses_equal") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
