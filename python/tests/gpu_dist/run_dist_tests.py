#!/usr/bin/env python3
"""The distributed GPU tests (``scripts/gpu_dist_test.sh`` runs this on an N-GPU machine).

    python python/tests/gpu_dist/run_dist_tests.py --gpus 2 --out DIR --stweaver-bin PATH
    python python/tests/gpu_dist/run_dist_tests.py --gpus 2 --out DIR --dry-run   (CPU, gloo)

Every case is a ``torchrun --standalone --nproc-per-node N`` job (dist_worker.py, the Llama
config of make_traces.py scaled down, 24 iterations, deterministic), with a hard timeout (a hang
fails the case). Cases, for DDP and for FSDP2 (``fully_shard``):

- native: the reference losses, per rank.
- online / trace / auto: stweaver installed by ``stweaver.install()`` alone, the mode from
  STWEAVER_MODE (auto: nothing set at all); trace writes ``trace.rank{R}.stwt`` per rank.
- plan: ``stweaver plan`` on each rank's trace, then STWEAVER_PLAN=DIR/plan.stwp, which each
  rank resolves to its own ``plan.rank{R}.stwp``.
- shared: one plan for every rank (rank 0's plan copied to a plain name): every rank serves it.
- refused: STWEAVER_PLAN=plan.rank0.stwp on every rank: rank 0 serves it, the other ranks
  refuse it (named for another rank) and train online.
- joint: per-rank plans of all streams in one joint solve (``stweaver plan --share-streams``):
  streams reuse each other's ranges, waiting on the device for the earlier stream's work.

Each stweaver case must give every rank's per-iteration losses bitwise equal to native's, no
error, no hang, and the expected mode. Plus the NCCL stream-safety job (nccl_stream_safety.py).
Independent jobs run a few at a time (correctness only: nothing here is timed).
Writes DIR/dist_tests.json and DIR/summary.txt (the table, printed last).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import distlaunch as dl  # noqa: E402

STRATEGIES = ("ddp", "fsdp")


def run_case(a, name, strategy, alloc, env_extra, timeout):
    d = os.path.join(a.out, "cases", name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    env = dl.base_env(env_extra)
    if alloc == "stweaver":
        env.setdefault("STWEAVER_HOOK_OPTIMIZER", "1")
    args = ["--strategy", strategy, "--alloc", alloc, "--config", a.config, "--iters", str(a.iters),
            "--out", d]
    r = dl.torchrun(dl.WORKER, args, a.gpus, env, os.path.join(d, "log.txt"), timeout, a.dry_run)
    r["name"] = name
    r["strategy"] = strategy
    r["ranks"] = dl.read_ranks(d, a.gpus)
    return r


def run_safety(a, alloc, timeout):
    d = os.path.join(a.out, "cases", f"stream_safety_{alloc}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    env = dl.base_env({"STWEAVER_MODE": "online"} if alloc == "stweaver" else {})
    r = dl.torchrun(dl.SAFETY, ["--alloc", alloc, "--out", d], a.gpus, env,
                    os.path.join(d, "log.txt"), timeout)
    r["name"] = f"stream_safety_{alloc}"
    r["ranks"] = dl.read_ranks(d, a.gpus)
    return r


def check_case(case, native, expect):
    """Problems of one training case (empty: passed)."""
    probs = []
    if case["timed_out"]:
        probs.append(f"hang: killed after {case['wall_s']} s")
    if case["rc"] != 0:
        probs.append(f"exit code {case['rc']}")
    for r, res in enumerate(case["ranks"]):
        if res is None:
            probs.append(f"rank {r}: no result")
            continue
        if not res.get("ok"):
            probs.append(f"rank {r}: {res.get('error')}")
            continue
        if len(res["losses"]) < 20:
            probs.append(f"rank {r}: only {len(res['losses'])} iterations")
        ref = native["ranks"][r] if native and native["ranks"][r] else None
        if case is not native:
            if ref is None or not ref.get("ok"):
                probs.append(f"rank {r}: no native reference")
            else:
                diff = [i for i, (x, y) in enumerate(zip(res["losses"], ref["losses"])) if x != y]
                if diff or len(res["losses"]) != len(ref["losses"]):
                    probs.append(f"rank {r}: losses differ from native at iterations {diff[:5]}")
        if expect:
            mode = (res.get("modes") or ["?"])[-1]
            want = expect(r)
            if want and not mode.startswith(want):
                probs.append(f"rank {r}: mode {mode!r}, expected {want!r}")
    return probs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stweaver-bin", default=None)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--iters", type=int, default=24)
    ap.add_argument("--jobs", type=int, default=4, help="torchrun jobs at once")
    ap.add_argument("--timeout-s", type=float, default=150)
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    n = a.gpus
    tdir = os.path.join(a.out, "files")
    shutil.rmtree(tdir, ignore_errors=True)
    os.makedirs(tdir)

    # Phase 1: native and the stweaver modes that need no plan file, and stream safety.
    jobs = []
    for s in STRATEGIES:
        jobs.append((run_case, a, f"{s}_native", s, "native", {}, a.timeout_s))
        if a.dry_run:
            continue
        jobs.append((run_case, a, f"{s}_online", s, "stweaver", {"STWEAVER_MODE": "online"}, a.timeout_s))
        jobs.append((run_case, a, f"{s}_trace", s, "stweaver",
                     {"STWEAVER_TRACE": os.path.join(tdir, f"{s}_trace.stwt")}, a.timeout_s))
        jobs.append((run_case, a, f"{s}_auto", s, "stweaver", {}, a.timeout_s))
    if not a.dry_run:
        jobs.append((run_safety, a, "stweaver", a.timeout_s))
        jobs.append((run_safety, a, "native", a.timeout_s))
    results = {r["name"]: r for r in dl.parallel(jobs, a.jobs)}

    # Phase 2: trace -> `stweaver plan` per rank -> plan runs (own, shared, refused).
    plans = {}
    if not a.dry_run and a.stweaver_bin:
        pjobs = []
        for s in STRATEGIES:
            for r in range(n):
                trace = os.path.join(tdir, f"{s}_trace.rank{r}.stwt")
                plan = os.path.join(tdir, f"{s}_plan.rank{r}.stwp")
                pjobs.append((dl.plan_cli, a.stweaver_bin, trace, plan, plan + ".log"))
                joint = os.path.join(tdir, f"{s}_joint.rank{r}.stwp")
                pjobs.append((dl.plan_cli, a.stweaver_bin, trace, joint, joint + ".log", 60,
                              ("--share-streams",)))
        for job, res in zip(pjobs, dl.parallel(pjobs, 4)):
            plans[os.path.basename(job[3])] = res
        jobs = []
        for s in STRATEGIES:
            jobs.append((run_case, a, f"{s}_plan", s, "stweaver",
                         {"STWEAVER_PLAN": os.path.join(tdir, f"{s}_plan.stwp")}, a.timeout_s))
            shared_dir = os.path.join(tdir, f"{s}_shared")
            os.makedirs(shared_dir, exist_ok=True)
            src = os.path.join(tdir, f"{s}_plan.rank0.stwp")
            if os.path.isfile(src):
                shutil.copy(src, os.path.join(shared_dir, "plan.stwp"))
            jobs.append((run_case, a, f"{s}_shared", s, "stweaver",
                         {"STWEAVER_PLAN": os.path.join(shared_dir, "plan.stwp")}, a.timeout_s))
            jobs.append((run_case, a, f"{s}_refused", s, "stweaver", {"STWEAVER_PLAN": src}, a.timeout_s))
            jobs.append((run_case, a, f"{s}_joint", s, "stweaver",
                         {"STWEAVER_PLAN": os.path.join(tdir, f"{s}_joint.stwp")}, a.timeout_s))
        for r in dl.parallel(jobs, a.jobs):
            results[r["name"]] = r

    expect = {
        "online": lambda r: "online",
        "trace": lambda r: "trace",
        "auto": lambda r: "auto (plan)",
        "plan": lambda r: "plan",
        "shared": lambda r: "plan",
        "joint": lambda r: "plan",
        "refused": lambda r: "plan" if r == 0 else "online (plan rejected",
    }
    rows = []
    failed = 0
    for s in STRATEGIES:
        native = results.get(f"{s}_native")
        for kind in ("native", "online", "trace", "auto", "plan", "shared", "refused", "joint"):
            case = results.get(f"{s}_{kind}")
            if case is None:
                continue
            probs = check_case(case, native, expect.get(kind))
            ok = not probs
            failed += not ok
            ranks = [x for x in case["ranks"] if x]
            iters = min((len(x.get("losses") or []) for x in ranks), default=0)
            modes = ", ".join(sorted({(x.get("modes") or ["-"])[-1][:24] for x in ranks})) or "-"
            peaks = "/".join(f"{x.get('max_reserved', 0) / 2**20:.0f}" for x in ranks) if not a.dry_run else "-"
            case["problems"] = probs
            rows.append((f"{s} {kind}", "PASS" if ok else "FAIL", str(iters), modes, peaks,
                         f"{case['wall_s']:.0f}", "; ".join(probs)[:140]))
            if not ok:
                print(f"--- {case['name']} failed: {probs}\n{dl.tail(case['log'])}")
    for alloc in ("stweaver", "native"):
        case = results.get(f"stream_safety_{alloc}")
        if case is None:
            continue
        probs = []
        detail = []
        if case["timed_out"] or case["rc"] != 0:
            probs.append(f"rc {case['rc']} timed_out {case['timed_out']}")
        for r, res in enumerate(case["ranks"]):
            if not res or not res.get("ok"):
                probs.append(f"rank {r}: {res and res.get('error')}")
                continue
            c = res["cases"]
            for k in ("collective_input", "side_read"):
                if c[k]["clobbered"]:
                    probs.append(f"rank {r}: {k} clobbered {c[k]['clobbered']}/{c[k]['rounds']}")
            detail.append(f"r{r}: " + ", ".join(f"{k} {v['clobbered']}/{v['rounds']}" for k, v in c.items()))
        # The control must detect the clobbering (stweaver reuses the freed block at once).
        if alloc == "stweaver" and not probs:
            if not any(res["cases"]["side_read_unprotected"]["clobbered"] for res in case["ranks"]):
                probs.append("control (no record_stream) was not detected: the check may be blind")
        ok = not probs
        failed += not ok
        case["problems"] = probs
        rows.append((f"NCCL stream safety ({alloc})", "PASS" if ok else "FAIL", "-",
                     "clobbered rounds", "-", f"{case['wall_s']:.0f}", "; ".join(probs or detail)[:140]))
        if not ok:
            print(f"--- {case['name']} failed: {probs}\n{dl.tail(case['log'])}")

    head = ("case", "result", "iters", "mode at end", "peak res. MiB/rank", "wall s", "notes")
    widths = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [f"distributed tests: {a.gpus} ranks, config {a.config}, {a.iters} iterations, "
             f"{len(rows) - failed}/{len(rows)} passed, {time.time() - t0:.0f} s",
             fmt.format(*head)] + [fmt.format(*r) for r in rows]
    table = "\n".join(lines)
    doc = {"gpus": n, "config": a.config, "iters": a.iters, "dry_run": a.dry_run,
           "cases": results, "plans": plans, "failed": failed, "table": table}
    with open(os.path.join(a.out, "dist_tests.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(a.out, "summary.txt"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
