"""The derived numbers: steady windows, step-time rounds, paired and floor ratios to native,
bootstrap estimates, noise, and `finalize_workload` (the rows of one workload)."""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional

from lockstep import bootstrap_median_ci, step_verdict  # noqa: E402 (python/bench is on sys.path)

from .workloads import ALLOCATORS, CONTROL, LABELS, WARMUP
from .child import _median


def steady_indices(r: dict) -> List[int]:
    """Iterations whose step time counts: in a lockstep run, those timed in rounds; else after
    warm-up, and for auto after the switch."""
    if r.get("lockstep_iters"):
        return list(r["lockstep_iters"])
    n = len(r.get("step_s") or [])
    if r.get("alloc") == "auto":
        start = r.get("steady_from")
        if start is None:
            start = n  # never served a plan: no steady window
        return list(range(start, n))
    return list(range(min(WARMUP, max(0, n - 1)), n))


def round_indices(r: dict) -> List[int]:
    """Iterations a step-time round counts: `steady_indices`, or for auto that never served
    a plan (it stays online by design: MoE, variable lengths) its iterations after warm-up."""
    idx = steady_indices(r)
    n = len(r.get("step_s") or [])
    if not idx and r.get("alloc") == "auto" and r.get("steady_from") is None:
        idx = list(range(min(WARMUP, max(0, n - 1)), n))
    return idx


def steady_median(r: dict) -> Optional[float]:
    """Median step time over `round_indices` (None without any)."""
    if not r.get("ok"):
        return None
    st = r.get("step_s") or []
    return _median([st[i] for i in round_indices(r)])


def round_times(r: dict) -> Optional[dict]:
    """One round's per-iteration step times and the iterations that count (for pairing), with
    the run's per-iteration diagnostics."""
    if not r.get("ok"):
        return None
    out = {"step_s": r.get("step_s") or [], "steady": round_indices(r)}
    if r.get("diag"):
        out["diag"] = r["diag"]
        out["noise"] = run_noise(r)
    return out


def paired_ratio_groups(nat_rounds: list, rounds: list) -> List[List[float]]:
    """Per-iteration ratios allocator / native, pairing the same iteration of the same round
    (the same data: every run draws its batches from the same seed), one list per round."""
    out = []
    for n, a in zip(nat_rounds, rounds):
        if not n or not a:
            continue
        both = sorted(set(n["steady"]) & set(a["steady"]))
        g = [a["step_s"][i] / n["step_s"][i] for i in both if n["step_s"][i] > 0]
        if g:
            out.append(g)
    return out


def paired_ratios(nat_rounds: list, rounds: list) -> List[float]:
    """`paired_ratio_groups`, pooled over all rounds."""
    return [x for g in paired_ratio_groups(nat_rounds, rounds) for x in g]


def low_quantile(xs: List[float], q: float = 0.2) -> Optional[float]:
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))] if xs else None


def floor_ratios(nat_rounds: list, rounds: list, q: float = 0.2) -> List[float]:
    """Per round: the q-quantile of the allocator's counted iterations over native's (the same
    iterations). On a CPU-bound loop whose noise only ever adds time (session 5: the same work,
    no contention seen, up to +35 %), a low quantile tracks the undisturbed cost."""
    out = []
    for n, a in zip(nat_rounds, rounds):
        if not n or not a:
            continue
        both = sorted(set(n["steady"]) & set(a["steady"]))
        if len(both) >= 3:
            out.append(low_quantile([a["step_s"][i] for i in both], q)
                       / low_quantile([n["step_s"][i] for i in both], q))
    return out


def fmt_ci(ci: Optional[dict]) -> str:
    if not ci:
        return "–"
    return f"{ci['median']:.3f} [{ci['lo']:.3f}, {ci['hi']:.3f}]"


def step_estimates(entry: dict) -> Dict[str, dict]:
    """Per allocator: the paired per-iteration ratio to native over every round (the main run
    is round 0; without --step-rounds it is the only one), its CI and verdict."""
    iters = entry.get("step_rounds_iters")
    if not iters:
        iters = {a: [round_times(r)] for a, r in entry.get("runs", {}).items()}
    nat = iters.get("native") or []
    runs = entry.get("runs", {})
    nat_lockstep = bool((runs.get("native") or {}).get("lockstep_iters"))
    out = {}
    for alloc, rounds in iters.items():
        if alloc == "native":
            continue
        if bool((runs.get(alloc) or {}).get("lockstep_iters")) != nat_lockstep:
            continue  # one alone, one in lockstep: not paired (finalize_workload says so)
        ci = bootstrap_median_ci(paired_ratio_groups(nat, rounds))
        if ci:
            ci["verdict"] = step_verdict(ci)
            ci["lockstep"] = nat_lockstep
            ci["q20_ratios"] = floor_ratios(nat, rounds)
            out[alloc] = ci
    return out


def _cv(xs: List[float]) -> Optional[float]:
    return statistics.pstdev(xs) / statistics.mean(xs) if len(xs) >= 2 and statistics.mean(xs) > 0 else None


def run_noise(r: dict) -> dict:
    """What one process's counted iterations looked like: their median and coefficient of
    variation, and medians of the diagnostics (the share of the step spent launching before
    the final synchronisation, run-queue wait, the other CPUs' busy time, steal)."""
    st = r.get("step_s") or []
    idx = round_indices(r) if r.get("ok") else []
    times = [st[i] for i in idx]
    out: dict = {"n": len(times), "median_s": _median(times), "cv": _cv(times)}
    d = r.get("diag") or {}

    def med(key, f=lambda v, i: v):
        xs = d.get(key) or []
        vals = [f(xs[i], i) for i in idx if i < len(xs)]
        return _median(vals)

    out["launch_frac"] = med("launch_s", lambda v, i: v / st[i] if st[i] else 0.0)
    out["cpu_frac"] = med("cpu_s", lambda v, i: v / st[i] if st[i] else 0.0)
    out["runq_s"] = med("runq_s")
    out["nivcsw"] = med("nivcsw")
    if d.get("host_busy_s") and d.get("proc_cpu_s"):
        # CPUs' worth of busy time outside this process during the iteration
        hb, pc = d["host_busy_s"], d["proc_cpu_s"]
        out["others_cpus"] = _median([max(0.0, hb[i] - pc[i]) / st[i] for i in idx
                                      if i < len(hb) and i < len(pc) and st[i]])
    out["steal_s"] = med("steal_s")
    return out


def noise_note(r: dict) -> str:
    if not r.get("ok") or not r.get("diag"):
        return ""
    n = run_noise(r)
    parts = []
    if n.get("cv") is not None:
        parts.append(f"cv={100 * n['cv']:.1f}%")
    if n.get("launch_frac") is not None:
        parts.append(f"launch={100 * n['launch_frac']:.0f}%")
    if n.get("runq_s") is not None:
        parts.append(f"runq={1e3 * n['runq_s']:.1f}ms")
    if n.get("others_cpus") is not None:
        parts.append(f"others={n['others_cpus']:.2f}cpu")
    if r.get("quiet_wait_s") is not None:
        parts.append(f"quiet_wait={r['quiet_wait_s']:.1f}s")
    return (" " + " ".join(parts)) if parts else ""


def finalize_workload(entry: dict) -> None:
    """Derived numbers: lower bound, utilization, waste, step ratios, bitwise loss match."""
    runs = entry["runs"]
    pl = (entry.get("planner") or {}).get("summary") or {}
    lb = pl.get("lower_bound")
    basis = "stweaver plan on the trace run's trace (peak of live requested bytes)"
    if not lb:
        allocs = [r.get("max_allocated") for r in runs.values() if r.get("ok") and r.get("max_allocated")]
        lb = min(allocs) if allocs else None
        basis = "smallest max_memory_allocated among the runs (no trace planned)"
    entry["lower_bound"] = lb
    entry["lower_bound_basis"] = basis
    native = runs.get("native") or {}
    rows = []
    for alloc in ALLOCATORS + (CONTROL,):
        r = runs.get(alloc)
        if r is None:
            continue
        variants = [(alloc, "max_reserved", "max_allocated")]
        if alloc == "auto":
            variants.append(("auto_steady", "steady_max_reserved", "steady_max_allocated"))
        for key, rk, ak in variants:
            row = {"key": key, "alloc": alloc, "label": LABELS[key], "ok": bool(r.get("ok"))}
            if not r.get("ok"):
                row["error"] = r.get("error", "failed")
                rows.append(row)
                continue
            res, al = r.get(rk), r.get(ak)
            row["reserved"], row["allocated"] = res, al
            if key == "auto_steady" and res is None:
                row["ok"] = False
                last = (r.get("modes") or ["?"])[-1]
                if last.startswith("auto (online: "):
                    last = "served online, " + last[len("auto (online: "):-1].replace("cuda:0: ", "")
                if "no iteration section" in last:
                    # Auto mode by design: a run without a steady state (token-dependent
                    # or random shapes) has nothing to switch to and stays online; its
                    # whole-run row is the measurement.
                    row["error"] = (f"no switch: no steady state in {r['iterations']} iterations, "
                                    "stays online (see the whole-run row)")
                else:
                    row["error"] = f"no plan served in {r['iterations']} iterations ({last})"
                rows.append(row)
                continue
            if res:
                row["utilization"] = al / res if al else None
                if lb:
                    row["lb_over_reserved"] = lb / res
                    row["waste"] = res - lb
            if key == "auto_steady":
                idx = steady_indices(r)
            elif key == "auto":
                idx = r.get("lockstep_iters") or list(range(min(WARMUP, len(r["step_s"]) - 1), len(r["step_s"])))
            else:
                idx = steady_indices(r)
            times = [r["step_s"][i] for i in idx]
            row["step_s"] = _median(times)
            row["steady_iters"] = [idx[0], idx[-1]] if idx else None
            if native.get("ok") and times and bool(native.get("lockstep_iters")) != bool(r.get("lockstep_iters")):
                # One side trained alone, the other in lockstep (whose warm-up iterations
                # ran side by side with the others'): no iterations to compare.
                row["step_ratio_basis"] = "not comparable: only one of the two ran in lockstep"
            elif native.get("ok") and times:
                both = [i for i in idx if i < len(native["step_s"]) and i >= WARMUP]
                if len(both) >= 3:
                    row["step_ratio"] = _median([r["step_s"][i] for i in both]) / _median(
                        [native["step_s"][i] for i in both])
                    row["step_ratio_basis"] = f"same iterations {both[0]}..{both[-1]}"
                else:
                    row["step_ratio"] = row["step_s"] / _median(native["step_s"][WARMUP:])
                    row["step_ratio_basis"] = "different iterations (native ran fewer)"
            if native.get("ok"):
                n = min(len(native["losses"]), len(r["losses"]))
                row["losses_compared"] = n
                row["losses_match"] = n > 0 and native["losses"][:n] == r["losses"][:n]
                if r.get("param_digest") is not None and native.get("param_digest") is not None:
                    row["params_match"] = r["param_digest"] == native["param_digest"]
            if r.get("stweaver"):
                row["mode"] = r["stweaver"].get("mode")
                devs = r["stweaver"].get("devices") or []
                if devs and devs[0].get("plan"):
                    row["plan_stats"] = devs[0]["plan"]
            if r.get("nondeterministic_ops"):
                row["nondeterministic_ops"] = r["nondeterministic_ops"]
            rows.append(row)
    est = step_estimates(entry)
    entry["step_paired"] = est
    steady_ok = any(r["key"] == "auto_steady" and r["ok"] for r in rows)
    for row in rows:
        # auto's estimate goes on its after-switch row, or on the whole-run one when it never
        # switched (it stays online by design: no steady state).
        if row["ok"] and row["alloc"] in est and (row["key"] != "auto" or not steady_ok):
            row["step_paired"] = est[row["alloc"]]
    entry["rows"] = rows
