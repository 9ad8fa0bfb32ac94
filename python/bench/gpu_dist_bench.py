#!/usr/bin/env python3
"""stweaver distributed benchmark: DDP and FSDP2 (``fully_shard``) training of the Llama config
of make_traces.py on N GPUs, under PyTorch native, expandable segments, stweaver auto and
stweaver trace -> ``stweaver plan`` (per rank) -> plan. ``scripts/gpu_dist_bench.sh`` runs it.

    python python/bench/gpu_dist_bench.py --gpus 2 --out DIR --stweaver-bin PATH [--budget-s S]
    python python/bench/gpu_dist_bench.py --gpus 2 --out DIR --dry-run     (CPU, gloo, native only)

Each run is one ``torchrun --standalone`` job (python/tests/gpu_dist/dist_worker.py), one at a
time (so step times are not disturbed; ``--lockstep`` below runs them side by side, taking
turns), with a hard timeout. Per rank: peak reserved and peak
allocated (PyTorch's counters), utilization (= peak allocated / peak reserved), the median step
time (iterations after the warm-up; for auto, the iterations after its switch to the plan)
divided by native's, and whether every per-iteration loss is bitwise native's. For auto the
peaks are given over the whole run and over the window after the switch.
Writes DIR/gpu_dist_bench.json and DIR/bench_table.txt (printed last).

``--lockstep N`` (step time; lockstep.py says why): per strategy the trace job runs alone
first (its per-rank traces feed ``stweaver plan``), then the other allocators' jobs, plus a
second native job as an A/A control (``--no-aa-control``: without), train CONCURRENTLY on the
same GPUs, each its own ``torchrun --standalone`` (own rendezvous port and id, own output
dir), and take turns. Every rank of a job is one lockstep participant (seat JOB.r{RANK}, its
pipes' directory and JOB reach the worker through STWEAVER_BENCH_LOCKSTEP_DIR / _KEY). The jobs
warm up side by side, untimed, until all ranks of each say "ready"; the ones ahead wait while
the laggards catch up (untimed "go"s, all at once) to a common iteration S; then round r runs
iteration S + r of one job after another, in ``round_order`` (rotated, reversed every other
round): "go" to each rank of the job, "done" read back from each, while every other job blocks
on its pipe. Consecutive jobs' iterations are about a second apart, so a slow phase of the
machine (seconds to minutes) hits all of a round's jobs alike. Then "stop" to all, and each
job writes its usual per-rank results. A job's step time in a round is the max over its ranks
(data-parallel ranks finish an iteration together, at the slowest one's pace). Step time per
allocator = the median over rounds of (job step / native job step of the same round), with a
95 % bootstrap CI over rounds: "within 1 %" only when the CI lies in [0.99, 1.01] (and there
are 8 rounds or more: fewer get no verdict); the A/A row
shows what the method resolves. Memory rows and the bitwise loss check (over the iterations
both jobs ran) are as without lockstep. The rounds stop early, with "stop" to all, when the
strategy's share of --budget-s would run out.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "gpu_dist"))
sys.path.insert(0, HERE)
import distlaunch as dl  # noqa: E402
from lockstep import (  # noqa: E402
    Seat, bootstrap_median_ci, paired_ratios, parse_reply, round_order, step_verdict,
)

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
         "plan_nowait": "stweaver plan, waits off", "native_aa": "native, 2nd job (A/A)"}
# Lockstep's control: a second native job, compared with the first like any allocator.
CONTROL = "native_aa"
GiB = float(1 << 30)
# Lockstep: seconds one turn (or one catch-up step) may take before the job counts as failed,
# and what is kept back from the budget for "stop" and the jobs' exit (result files, barrier,
# process group teardown).
TURN_TIMEOUT_S = 60.0
STOP_RESERVE_S = 30.0
# Fewer rounds than this get no verdict: a percentile bootstrap over a handful of values
# gives CIs far narrower than the spread it has not seen.
MIN_VERDICT_ROUNDS = 8


def job_setup(a, strategy, alloc, fdir, suffix="", key=None):
    """The run directory (emptied), worker arguments and extra environment of one job.
    `key` names the job's directory (default `alloc`; lockstep's control is native under its
    own name)."""
    name = f"{strategy}_{key or alloc}{suffix}"
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
    return d, args, extra


def run(a, strategy, alloc, fdir, timeout, suffix=""):
    d, args, extra = job_setup(a, strategy, alloc, fdir, suffix)
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
        for alloc in ALLOCS + VARIANTS + (CONTROL,):
            r = runs.get(alloc)
            if r is None:
                continue
            variants = [(alloc, "max_reserved", "max_allocated", "step_median_s")]
            if alloc in ("auto", "auto_joint"):
                variants.append((alloc + "_steady", "steady_max_reserved", "steady_max_allocated",
                                 "steady_step_median_s"))
            ls = r.get("lockstep")
            for label, kr, ka, kt in variants:
                if ls:
                    # Every iteration timed in rounds is after the warm-up (auto: after its
                    # switch, see dist_worker.lockstep_warm), so both auto rows count them.
                    kt = "lockstep_step_median_s"
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
                        if ls or native.get("lockstep"):
                            # Lockstep jobs stop at the driver's "stop" (and the trace job ran
                            # alone, --iters): compare the iterations both ran.
                            n = min(len(x["losses"]), len(ref["losses"]))
                            row["losses_equal"] = n > 0 and x["losses"][:n] == ref["losses"][:n]
                            row["losses_compared"] = n
                        else:
                            row["losses_equal"] = x["losses"] == ref["losses"]
                        if ls and native.get("lockstep"):
                            # This rank over native's same rank, paired by round.
                            rs = paired_ratios({"a": rank_times(r, rank), "n": rank_times(native, rank)},
                                               "a", "n")
                            if rs:
                                row["step_ratio"] = statistics.median(rs)
                        elif not ls and not native.get("lockstep") and x.get(kt) and ref.get("step_median_s"):
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
    if doc.get("lockstep_rounds"):
        how = (f"lockstep, up to {doc['lockstep_rounds']} rounds after the warm-up; step / native: "
               f"per rank, the median over rounds of the ratio to native's same rank")
    else:
        how = f"step medians after {doc['warmup']} warm-up iterations; auto after its switch"
    lines = [f"distributed benchmark: {doc['gpus']} ranks, {doc['config']}, {doc['iters']} iterations "
             f"({how}), {doc['wall_s']:.0f} s"]
    if doc.get("skipped"):
        lines.append("skipped (budget, or as noted): " + ", ".join(doc["skipped"]))
    lines += [fmt.format(*head)] + [fmt.format(*r) for r in out]
    lines += render_repeats(doc)
    lines += render_lockstep(doc)
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


# ------------------------------------------------------------------ lockstep


def job_step(rank_steps: List[Optional[float]]) -> Optional[float]:
    """A job's step time in one round: the max over its ranks. Every rank times its iteration
    between two device synchronisations and the ranks meet in the iteration's collectives, so
    the iteration of the job is over when its slowest rank's is (and the driver's turn ends
    only when the last rank's "done" is in). None when a rank did not report."""
    if not rank_steps or any(x is None for x in rank_steps):
        return None
    return max(rank_steps)


def fmt_ci(ci: Optional[dict]) -> str:
    if not ci:
        return "-"
    return f"{ci['median']:.3f} [{ci['lo']:.3f}, {ci['hi']:.3f}]"


def lockstep_estimates(times: Dict[str, Dict[int, float]], base: str = "native",
                       tol: float = 0.01) -> Dict[str, dict]:
    """Per job but `base`: the median over rounds of (job step / `base`'s job step in the same
    round; rounds are keyed by their iteration, which every job of the round ran), its 95 %
    bootstrap CI over rounds, the verdict and the ratios themselves."""
    out = {}
    for key in times:
        if key == base:
            continue
        rs = paired_ratios(times, key, base)
        ci = bootstrap_median_ci([[x] for x in rs])
        if ci:
            ci["verdict"] = step_verdict(ci, tol) if len(rs) >= MIN_VERDICT_ROUNDS else \
                f"too few rounds ({len(rs)} < {MIN_VERDICT_ROUNDS})"
            ci["ratios"] = rs
            out[key] = ci
    return out


def rank_times(r: dict, rank: int) -> Dict[int, float]:
    """A lockstep job's step times of one rank, by iteration (the rounds')."""
    ls = r.get("lockstep") or {}
    return {i: v[rank] for i, v in zip(ls.get("iters", []), ls.get("rank_step_s", []))
            if rank < len(v) and v[rank] is not None}


def _read_all(seats: List[Seat], want: str, timeout: float, alive: Callable[[], bool]):
    """One `want` reply from every rank's seat, within `timeout` s in all: the replies, or an
    error string."""
    end = time.monotonic() + timeout
    reps = []
    for rank, seat in enumerate(seats):
        line = seat.read_line(max(0.1, end - time.monotonic()), alive)
        rep = parse_reply(line)
        if not rep or rep[0] != want:
            why = "exited" if not alive() else ("timed out" if line is None else f"said {line!r}")
            return f"rank {rank} {why} (waiting for {want!r})"
        reps.append(rep)
    return reps


def _job_iteration(seats: List[Seat], alive: Callable[[], bool], timeout: float):
    """One iteration of a job: "go" to every rank, then "done" from every rank. Returns
    (iteration, per-rank step times, mode) or an error string."""
    for seat in seats:
        seat.send("go")
    reps = _read_all(seats, "done", timeout, alive)
    if isinstance(reps, str):
        return reps
    its = sorted({rep[1] for rep in reps})
    if len(its) != 1:
        return f"ranks ran different iterations {its}"
    return its[0], [rep[2] for rep in reps], reps[0][3]


def drive_lockstep(seats: Dict[str, List[Seat]], alive: Dict[str, Callable[[], bool]], rounds: int,
                   time_left: Callable[[], float], ready_timeout: float,
                   turn_timeout: float = TURN_TIMEOUT_S, reserve_s: float = STOP_RESERVE_S,
                   base: str = "native", label: str = "", progress_every: int = 5,
                   log: Callable[[str], None] = lambda m: print(m, flush=True)) -> dict:
    """The driver's side of lockstep for whole jobs (gpu_bench.py's `Driver.run_lockstep`, one
    seat per rank). `seats[job]`: the job's seats, rank order; `alive[job]()`: is its torchrun
    still running. Warm-up (concurrent, untimed) until every rank of every job says "ready";
    catch-up of the laggards to the common iteration S (untimed "go"s, all laggards at once);
    then `rounds` rounds, round r running iteration S + r of one job after another in
    `round_order`, while `time_left()` leaves room for another round and `reserve_s`; then
    "stop" to every seat, always (also when this raises). A job that fails (a rank exits, times
    out, or says something else) leaves the rounds; the others go on.

    Returns {start_iter, warm_s, rounds_run, orders, round_s, times (job: {iteration: job
    step}), rank_times (job: {iteration: [per-rank step]}), modes, ready_modes, failed (job:
    why), stopped_early (why, or None)}."""
    keys = list(seats)
    t0 = time.time()
    out = {"start_iter": None, "warm_s": None, "rounds_run": 0, "orders": [], "round_s": [],
           "times": {k: {} for k in keys}, "rank_times": {k: {} for k in keys}, "modes": {},
           "ready_modes": {}, "failed": {}, "stopped_early": None}
    failed = out["failed"]
    pre = f"  lockstep{' ' + label if label else ''}:"
    try:
        # Warm-up, the jobs side by side (nothing timed): the jobs warm up concurrently, so one
        # timeout covers all of them.
        nxt: Dict[str, int] = {}
        for key in keys:
            left = min(ready_timeout - (time.time() - t0), time_left() - reserve_s)
            reps = _read_all(seats[key], "ready", max(1.0, left), alive[key])
            if isinstance(reps, str):
                failed[key] = "not ready: " + reps
            elif len({rep[1] for rep in reps}) != 1:
                # The workers agree on their first waiting iteration (dist_worker.py); if they
                # ever did not, one rank's catch-up "go" would wait for the others forever.
                failed[key] = f"ranks ready at different iterations {[rep[1] for rep in reps]}"
            else:
                nxt[key] = reps[0][1]
                out["ready_modes"][key] = out["modes"][key] = reps[0][3]
            if key in failed:
                log(f"{pre} {key} {failed[key]}")
        live = [k for k in keys if k in nxt]
        if not live:
            return out
        start = max(nxt.values())
        out["start_iter"] = start
        # Catch up to iteration `start`, all laggards at once (untimed).
        while True:
            behind = [k for k in live if nxt[k] < start]
            if not behind:
                break
            for k in behind:
                for seat in seats[k]:
                    seat.send("go")
            for k in behind:
                reps = _read_all(seats[k], "done", turn_timeout, alive[k])
                if isinstance(reps, str):
                    failed[k] = "while catching up: " + reps
                    live.remove(k)
                    log(f"{pre} {k} failed {failed[k]}")
                else:
                    nxt[k] = reps[0][1] + 1
        out["warm_s"] = time.time() - t0
        log(f"{pre} warm in {out['warm_s']:.0f} s; rounds from iteration {start} ("
            + ", ".join(f"{k}: {out['modes'].get(k) or '?'}" for k in live) + ")")
        for r in range(rounds):
            if not live:
                break
            last = out["round_s"][-1] if out["round_s"] else None
            if last is not None and time_left() < 1.5 * last + reserve_s:
                out["stopped_early"] = f"stopped after {r} of {rounds} rounds ({time_left():.0f} s left)"
                log(f"{pre} {out['stopped_early']}")
                break
            t_r = time.time()
            order = round_order(list(live), r)
            out["orders"].append(order)
            for k in order:
                got = _job_iteration(seats[k], alive[k], turn_timeout)
                if isinstance(got, str):
                    failed[k] = f"in round {r}: {got}"
                    live.remove(k)
                    log(f"{pre} {k} failed {failed[k]}")
                    continue
                it, steps, mode = got
                out["rank_times"][k][it] = steps
                out["times"][k][it] = job_step(steps)
                out["modes"][k] = mode
            out["round_s"].append(time.time() - t_r)
            out["rounds_run"] = r + 1
            if (r + 1) % progress_every == 0 or r == rounds - 1:
                parts = []
                for k in live:
                    rs = paired_ratios(out["times"], k, base) if k != base else []
                    if rs:
                        parts.append(f"{k} {statistics.median(rs):.3f}")
                log(f"{pre} round {r + 1}/{rounds} ({out['round_s'][-1]:.2f} s/round); "
                    "median ratio to native: " + (", ".join(parts) or "-"))
        return out
    finally:
        for key in keys:
            for seat in seats[key]:
                seat.send("stop")


def make_plans(a, doc, s, fdir, joint) -> None:
    """`stweaver plan` on each rank's trace of strategy `s`."""
    for r in range(a.gpus):
        trace = os.path.join(fdir, f"{s}.rank{r}.stwt")
        plan = os.path.join(fdir, f"{s}{'.joint' if joint else ''}.rank{r}.stwp")
        doc["plans"][os.path.basename(plan)] = dl.plan_cli(
            a.stweaver_bin, trace, plan, plan + ".log", extra=("--share-streams",) if joint else ())


def keep_traces(a, s, fdir) -> None:
    for rk in range(a.gpus):
        src = os.path.join(fdir, f"{s}.rank{rk}.stwt")
        if os.path.isfile(src):
            with open(src, "rb") as fi, gzip.open(os.path.join(a.out, os.path.basename(src) + ".gz"), "wb") as fo:
                shutil.copyfileobj(fi, fo)


def report_run(s, alloc, r) -> None:
    oks = [x and x.get("ok") for x in r["ranks"]]
    print(f"{s} {alloc}: rc {r['rc']} {r['wall_s']} s ranks ok {oks}", flush=True)
    if not all(oks):
        print(dl.tail(r["log"], 25), flush=True)


def lockstep_strategy(a, doc, s, allocs, fdir, t0, share_end) -> None:
    """Strategy `s` in lockstep (module docstring): the trace job alone, the plans, then every
    other allocator's job (and the A/A control) side by side, in turns, until `share_end`."""
    runs = doc["runs"].setdefault(s, {})
    group = [x for x in allocs if x != "trace"]
    if "native" not in group:
        group.insert(0, "native")  # the base of every ratio
    if a.dry_run:
        # No stweaver on the CPU: every job trains native (job_setup), and there is nothing
        # to trace or plan.
        nothing = [x for x in allocs if x in ("trace", "plan", "plan_joint", "plan_nowait")]
        group = [x for x in group if x not in nothing]
        doc["skipped"] += [f"{s} {x} (dry run)" for x in nothing]
    elif "trace" in allocs:
        left = a.budget_s - (time.time() - t0)
        if left < a.est_run_s:
            doc["skipped"].append(f"{s} trace")
        else:
            r = run(a, s, "trace", fdir, min(a.timeout_s, max(30.0, left)))
            runs["trace"] = r
            if a.keep_traces:
                keep_traces(a, s, fdir)
            report_run(s, "trace", r)
            save(a, doc, t0)
    for alloc in ("plan", "plan_joint"):
        if alloc in group:
            if not a.stweaver_bin:
                doc["skipped"].append(f"{s} {alloc} (no planner binary)")
                group.remove(alloc)
            else:
                make_plans(a, doc, s, fdir, alloc == "plan_joint")
    if a.aa_control:
        group.append(CONTROL)
    left = share_end - time.time()
    if left < 2 * a.est_run_s + STOP_RESERVE_S:
        doc["skipped"].append(f"{s} lockstep group {','.join(group)} ({left:.0f} s left)")
        return
    print(f"{s}: lockstep, {', '.join(group)} side by side, {a.lockstep} rounds, ~{left:.0f} s", flush=True)
    pipes = tempfile.mkdtemp(prefix="stweaver-dist-lockstep-")
    seats: Dict[str, List[Seat]] = {}
    jobs: Dict[str, "dl.Job"] = {}
    dirs: Dict[str, str] = {}
    t_start = time.time()
    try:
        for key in group:
            alloc = "native" if key == CONTROL else key
            d, args, extra = job_setup(a, s, alloc, fdir, key=key)
            seats[key] = [Seat(f"{key}.r{rk}", pipes) for rk in range(a.gpus)]
            extra.update({dl.LOCKSTEP_DIR_VAR: pipes, dl.LOCKSTEP_KEY_VAR: key})
            jobs[key] = dl.start(dl.WORKER, args, a.gpus, dl.concurrent_env(dl.base_env(extra)),
                                 os.path.join(d, "log.txt"), a.dry_run)
            dirs[key] = d
        ls = drive_lockstep(seats, {k: jobs[k].alive for k in jobs}, a.lockstep,
                            time_left=lambda: share_end - time.time(),
                            ready_timeout=max(120.0, a.timeout_s), label=s)
    finally:
        # Results as `run` collects them: every job got "stop" (drive_lockstep; again here,
        # harmless, for a failure before it ran); give them the time to write their results
        # and leave, then kill what is left.
        for ss in seats.values():
            for seat in ss:
                seat.send("stop")
        deadline = time.time() + max(STOP_RESERVE_S, min(90.0, a.budget_s - (time.time() - t0) - 5))
        for key, job in jobs.items():
            r = dl.finish(job, deadline - time.time())
            alloc = "native" if key == CONTROL else key
            r.update(alloc=alloc, strategy=s, ranks=dl.read_ranks(dirs[key], a.gpus))
            runs[key] = r
        for ss in seats.values():
            for seat in ss:
                seat.close()
        shutil.rmtree(pipes, ignore_errors=True)
    rounds = []
    for i, order in enumerate(ls["orders"]):
        it = ls["start_iter"] + i
        steps = {k: ls["rank_times"][k][it] for k in order if it in ls["rank_times"][k]}
        rounds.append({"iter": it, "order": order, "rank_step_s": steps})  # per job, per rank
    for key in group:
        r = runs[key]
        its = sorted(ls["rank_times"][key])
        r["lockstep"] = {"iters": its, "rank_step_s": [ls["rank_times"][key][i] for i in its],
                         "job_step_s": [ls["times"][key][i] for i in its],
                         "ready_mode": ls["ready_modes"].get(key), "failed": ls["failed"].get(key)}
        if key == CONTROL:
            r["control_of"] = "native"
        for rank, x in enumerate(r["ranks"]):
            if x and x.get("ok"):
                ts = list(rank_times(r, rank).values())
                x["lockstep_step_median_s"] = statistics.median(ts) if ts else None
        report_run(s, key, r)
    if ls["stopped_early"]:
        doc["skipped"].append(f"{s} lockstep: {ls['stopped_early']}")
    doc.setdefault("lockstep", {})[s] = {
        "keys": group, "rounds_asked": a.lockstep, "rounds_run": ls["rounds_run"],
        "start_iter": ls["start_iter"], "warm_s": ls["warm_s"], "wall_s": time.time() - t_start,
        "round_s": ls["round_s"], "failed": ls["failed"], "stopped_early": ls["stopped_early"],
        "estimates": lockstep_estimates(ls["times"]), "rounds": rounds}
    save(a, doc, t0)


def render_lockstep(doc) -> List[str]:
    by = doc.get("lockstep")
    if not by:
        return []
    lines = ["lockstep step time, per strategy: a job's step in a round = the max over its ranks; "
             "ratio = median over rounds of (job step / native job step, same round), 95 % "
             f"bootstrap CI over rounds; \"within 1 %\" only when the CI lies in [0.99, 1.01] "
             f"({MIN_VERDICT_ROUNDS} rounds at least):"]
    head = ("strategy", "allocator", "rounds", "job step (median)", "step / native [95 % CI]", "verdict")
    out = []
    for s, ls in by.items():
        runs = doc["runs"].get(s, {})
        out.append((s, "", str(ls["rounds_run"]), "", "",
                    f"from iteration {ls['start_iter']}, {statistics.median(ls['round_s']):.2f} s/round"
                    if ls["round_s"] else "no rounds"))
        for key in ls["keys"]:
            r = runs.get(key) or {}
            js = [x for x in (r.get("lockstep") or {}).get("job_step_s", []) if x is not None]
            med = f"{1e3 * statistics.median(js):.1f} ms" if js else "-"
            if key == "native":
                ci, verdict = None, "(base)"
            else:
                ci = ls["estimates"].get(key)
                verdict = ci["verdict"] if ci else "no data"
            if ls["failed"].get(key):
                verdict += "; FAILED " + ls["failed"][key][:60]
            label = LABEL.get(key + "_steady", LABEL.get(key, key))  # auto: after its switch
            out.append((s, label, str(len(js)), med, fmt_ci(ci), verdict))
    widths = [max(len(str(x[i])) for x in out + [head]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return lines + ["  " + fmt.format(*head)] + ["  " + fmt.format(*r) for r in out]


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
    ap.add_argument("--lockstep", type=int, default=0, metavar="N",
                    help="step time in lockstep: per strategy, after the trace job, the other "
                         "allocators' jobs train concurrently and take turns, N rounds of one "
                         "timed iteration each (module docstring); 0: one job at a time")
    ap.add_argument("--no-aa-control", dest="aa_control", action="store_false",
                    help="lockstep without the second native job (the A/A control)")
    a = ap.parse_args(argv)
    allocs = tuple(a.allocators.split(",")) if a.allocators else ALLOCS
    unknown = [x for x in allocs if x not in ALLOCS + VARIANTS]
    if unknown:
        ap.error(f"unknown allocators {unknown}")
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    fdir = os.path.join(a.out, "files")
    shutil.rmtree(fdir, ignore_errors=True)
    os.makedirs(fdir)
    doc = {"gpus": a.gpus, "config": a.config, "iters": a.iters, "warmup": a.warmup, "runs": {},
           "skipped": [], "plans": {}, "dry_run": a.dry_run, "lockstep_rounds": a.lockstep}
    strategies = a.strategies.split(",")
    for si, s in enumerate(strategies):
        runs = doc["runs"].setdefault(s, {})
        if a.lockstep > 0:
            # Each strategy gets an equal share of what is left (a share it does not use
            # goes to the next), so the first one's rounds cannot eat the second's.
            share_end = time.time() + (a.budget_s - (time.time() - t0)) / (len(strategies) - si)
            lockstep_strategy(a, doc, s, allocs, fdir, t0, share_end)
            continue
        for alloc in (("native",) if a.dry_run else allocs):
            left = a.budget_s - (time.time() - t0)
            if left < a.est_run_s:
                doc["skipped"].append(f"{s} {alloc}")
                continue
            if alloc in ("plan", "plan_joint"):
                if not a.stweaver_bin:
                    doc["skipped"].append(f"{s} {alloc} (no planner binary)")
                    continue
                make_plans(a, doc, s, fdir, alloc == "plan_joint")
            r = run(a, s, alloc, fdir, min(a.timeout_s, max(30.0, left)))
            runs[alloc] = r
            if alloc == "trace" and a.keep_traces:
                keep_traces(a, s, fdir)
            report_run(s, alloc, r)
            save(a, doc, t0)  # after every run: a killed call still leaves its results
    if a.lockstep > 0 and a.repeat_rounds > 0:
        print("--repeat-rounds is ignored with --lockstep (the rounds are lockstep's)", flush=True)
    else:
        repeat(a, doc, fdir, t0)
    save(a, doc, t0)
    with open(os.path.join(a.out, "bench_table.txt"), "w") as f:
        f.write(doc["table"] + "\n")
    print(doc["table"])
    bad = [r for r in doc["rows"] if "error" in r or r.get("losses_equal") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
