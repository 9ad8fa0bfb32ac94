"""Long training loops that are not one iteration repeated (issue #18, item 3).

Five loops, 200 iterations each by default, small Hugging Face models (bf16, AdamW, random
token ids, seeded) so that a whole run's trace stays small enough to live in the repository:

- ``len5``: GPT-2 (1024 hidden, 8 layers), batch 8, the sequence length drawn per iteration
  from 5 buckets (256, 512, 768, 1024, 1536);
- ``len50``: the same model, the length drawn from 50 distinct values (128, 160, ..., 1696);
- ``len5new``: len5, and from iteration 60 on every fifth iteration of a length never seen
  before (320, 640 or 1920, drawn): classes first seen after auto's switch (issue #18 item 2);
- ``eval10``: Llama (1024 hidden, 8 layers), 8 x 1024 training steps, and after every 10th
  step an eval pass (``torch.no_grad``, 16 x 1024, 2 micro-batches);
- ``ckpt20``: the same training, and after every 20th step a checkpoint save: the model's and
  the optimizer's ``state_dict`` copied to CPU memory;
- ``moe``: Qwen2-MoE (512 hidden, 2 layers, 8 experts top-2, eager experts: token-dependent
  shapes), 8 x 512.

Each (loop, allocator) pair runs in its own process; ``--parallel`` of them at a time (the
numbers here are memory, which one process's neighbours do not change). Allocators: ``native``,
``expandable`` (``expandable_segments:True``), ``auto`` (``stweaver.install()``: the default
mode, zero code changes, the optimizer hook marking iterations) and ``trace`` (stweaver's trace
mode: online serving, and the whole run written as a ``.stwt`` file, with ``stweaver.phase``
markers around eval and checkpoint passes: the file the CPU replay tests read) and
``auto_phases`` (auto mode with those markers: the one-line hint of ``stweaver.phase``), and
``online`` / ``online_aa`` (stweaver's online mode twice: the A/A pair the report's step time
inside auto's planning window is compared with).

Per run: ``memory_reserved`` / ``memory_allocated`` after every iteration, the peaks, stweaver's
mode after every iteration, each training step's time (the previous iteration's end to the loss
read, which waits for the step's device work) and ``torch.cuda.memory_stats()``'s driver calls
and synchronisations. The driver writes ``$OUT/long_loops.json``, copies the traces to
``$OUT/traces/`` (gzip'd) and prints a table last: reserved at iteration 20 and at the end, the
drift between them, the peak reserved, and the peak allocated of the native run (a lower
bound's stand-in on the GPU; the CPU replay computes the exact one).

    python python/bench/long_loops.py --out $OUT [--loops len5,eval10] [--allocs native,auto]
        [--iters 200] [--parallel 2] [--budget-s S] [--work DIR] [--dry-run]
    python python/bench/long_loops.py --report long_loops.json [MORE.json ...] [--stweaver-bin BIN]

On the GPU machine, ``scripts/long_loops.sh`` (``cargo xtask gpu-bench --long-loops`` prints
the commands) builds the extension and runs two calls' worth: ``--parallel 2 --loops
len5,len50`` (len50's native run grows to 48 GB: at most two of the length loops share an
80 GB card) and ``--parallel 4 --loops eval10,ckpt20,moe``. ``--budget-s`` bounds a call: no
run is started that the longest finished one says would end past it, and runs still going at
the budget are stopped (both named in the table), so the JSON and the table are always
written. ``--work`` keeps the per-run files (results, logs, raw traces) out of ``--out``, which
then holds ``long_loops.json``, ``table.txt`` and ``traces/`` only.

``--report`` prints the Markdown table for BENCHMARKS.md with issue #18's targets per loop, met
or missed, for the zero-code auto run (and the ``auto_phases`` run where there is one): peak
reserved <= 1.01 x the lower bound; no drift (reserved after the last iteration within 0.5 % of
after iteration 20); reserved <= expandable segments' after every recorded iteration. The lower
bound is the trace's peak of live bytes (``stweaver inspect --json`` on ``trace_<loop>.stwt.gz``
in ``traces/`` beside the JSON or beside it directly, as in ``data/traces/long/``), else the
least peak allocated of the loop's runs (stweaver's runs count requested bytes: the same to
within rounding). Several files merge (the two calls), a later file's run replacing an
earlier one's.

``--dry-run`` runs tiny models on the CPU (no allocator installed): it checks the plumbing. Its
"memory" numbers are stand-ins (the bytes of the parameters and the optimizer state after each
iteration), not GPU memory; the JSON says ``"dry_run": true`` and the report says so.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
PY_DIR = os.path.dirname(HERE)  # python/ (the stweaver package's parent)

LOOPS = {
    "len5": dict(family="gpt2", hidden=1024, layers=8, heads=16, inter=4096, batch=8,
                 lengths=[256, 512, 768, 1024, 1536], max_seq=1536),
    "len50": dict(family="gpt2", hidden=1024, layers=8, heads=16, inter=4096, batch=8,
                  lengths=[128 + 32 * i for i in range(50)], max_seq=1696),
    "len5new": dict(family="gpt2", hidden=1024, layers=8, heads=16, inter=4096, batch=8,
                    lengths=[256, 512, 768, 1024, 1536], max_seq=1920,
                    late_lengths=[320, 640, 1920], late_from=60, late_every=5),
    "eval10": dict(family="llama", hidden=1024, layers=8, heads=16, inter=2816, batch=8, seq=1024,
                   eval_every=10, eval_batch=16, eval_micro=2),
    "ckpt20": dict(family="llama", hidden=1024, layers=8, heads=16, inter=2816, batch=8, seq=1024,
                   ckpt_every=20),
    "moe": dict(family="qwen2moe", hidden=512, layers=2, heads=8, inter=1408, batch=8, seq=512,
                experts=8, topk=2, moe_inter=704),
}
ALLOCS = ("native", "expandable", "auto", "trace", "auto_phases", "online", "online_aa")
DRY = dict(hidden=64, layers=2, heads=4, inter=128, moe_inter=32, experts=4, topk=2, batch=2)


def build_model(c: dict, device: str, torch):
    """The model of loop config `c`, built by the GPU benchmark's builder (bf16 on the
    device, seeded; no activation checkpointing; eager MoE experts)."""
    sys.path.insert(0, HERE)
    from gpubench.child import _build_model

    cfg = dict(c, seq=c.get("max_seq", c.get("seq", 1024)), ckpt=False)
    if c["family"] == "qwen2moe":
        cfg["experts_impl"] = "eager"
    model, _ = _build_model(cfg, device, torch)
    return model


def child(loop: str, alloc: str, iters: int, out: str, dry: bool) -> dict:
    """One run; returns its result dict (also written to out/<loop>_<alloc>.json)."""
    c = dict(LOOPS[loop])
    if dry:
        c.update(DRY)
        if "lengths" in c:
            c["lengths"] = [8 * (1 + i % 5) for i in range(len(c["lengths"]))]
            c["max_seq"] = 48
            if "late_lengths" in c:
                c["late_lengths"] = [12, 20, 48]
        else:
            c["seq"] = 16
        c["vocab"] = 1000
        c["eval_batch"] = 4 if "eval_batch" in c else None
    trace_path = os.path.join(out, f"trace_{loop}.stwt") if alloc == "trace" else None
    st = None
    if alloc in ("auto", "trace", "auto_phases", "online", "online_aa") and not dry:
        import stweaver

        mode = {"trace": "trace", "online": "online", "online_aa": "online"}.get(alloc)
        stweaver.install(mode, trace=trace_path, hook_optimizer=True)
        st = stweaver
    import contextlib

    import torch

    device = "cpu" if dry else "cuda"
    torch.manual_seed(0)
    model = build_model(c, device, torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1234)
    res = {"loop": loop, "alloc": alloc, "iters": iters, "ok": False}
    if not dry:
        res["backend"] = torch.cuda.memory.get_allocator_backend()
        res["device"] = torch.cuda.get_device_name(0)
    reserved, allocated, modes, lens, losses, events, step_s = [], [], [], [], [], [], []

    def phase(label):
        # Markers in the trace and auto_phases runs only (the auto run is the zero-code user's).
        marked = st is not None and alloc in ("trace", "auto_phases")
        return st.phase(label) if marked else contextlib.nullcontext()

    t0 = time.time()
    t_prev = time.perf_counter()
    try:
        for i in range(iters):
            if "late_lengths" in c and i >= c["late_from"] and i % c["late_every"] == 0:
                # A length the run has not had before (issue #18 item 2).
                late = c["late_lengths"]
                L = late[int(torch.randint(0, len(late), (1,), generator=gen))]
            elif "lengths" in c:
                L = c["lengths"][int(torch.randint(0, len(c["lengths"]), (1,), generator=gen))]
            else:
                L = c["seq"]
            lens.append(L)
            x = torch.randint(0, vocab, (c["batch"], L), generator=gen).to(device)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()  # stweaver's optimizer hook marks the iteration here
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach().float()))  # waits for the step's device work
            now = time.perf_counter()
            step_s.append(now - t_prev)  # the training step (eval / checkpoint passes come after)
            if c.get("eval_every") and (i + 1) % c["eval_every"] == 0:
                with phase("eval"), torch.no_grad():
                    model.eval()
                    mb = c["eval_batch"] // c["eval_micro"]
                    for _ in range(c["eval_micro"]):
                        y = torch.randint(0, vocab, (mb, L), generator=gen).to(device)
                        model(input_ids=y, labels=y).loss.float().item()
                    model.train()
                events.append([i, "eval"])
            if c.get("ckpt_every") and (i + 1) % c["ckpt_every"] == 0:
                with phase("checkpoint"):
                    sd = {"model": {k: v.to("cpu") for k, v in model.state_dict().items()},
                          "optim": {k: ({kk: (vv.to("cpu") if torch.is_tensor(vv) else vv) for kk, vv in s.items()})
                                    for k, s in opt.state_dict()["state"].items()}}
                    del sd
                events.append([i, "checkpoint"])
            if not dry:
                reserved.append(torch.cuda.memory_reserved())
                allocated.append(torch.cuda.memory_allocated())
            else:  # stand-ins for the report's plumbing: the bytes the model and optimizer hold
                held = sum(p.nbytes for p in model.parameters()) + sum(
                    t.nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
                reserved.append(held)
                allocated.append(held)
            if st is not None:
                modes.append(st.mode())
            t_prev = time.perf_counter()
        res["ok"] = True
    except torch.OutOfMemoryError as e:
        res["error"] = "OOM: " + str(e).splitlines()[0][:300]
    res["wall_s"] = time.time() - t0
    res.update(reserved=reserved, allocated=allocated, modes=modes, lengths=lens, losses=losses, events=events,
               step_s=step_s)
    if not dry:
        res["max_reserved"] = torch.cuda.max_memory_reserved()
        res["max_allocated"] = torch.cuda.max_memory_allocated()
        # How often the allocator went to the driver and synchronised (why a step is slow).
        ms = torch.cuda.memory_stats()
        res["driver_calls"] = {k: ms.get(k) for k in ("num_device_alloc", "num_device_free",
                                                      "num_sync_all_streams", "num_alloc_retries", "num_ooms")}
    else:
        res["dry_run"] = True
        res["max_reserved"] = max(reserved, default=0)
        res["max_allocated"] = max(allocated, default=0)
    if st is not None:
        try:
            res["stweaver"] = json.loads(json.dumps(st.stats(), default=str))
        except Exception as e:  # diagnostics only
            res["stweaver_error"] = str(e)
        if alloc == "trace":
            res["trace_files"] = st.flush_trace()
    return res


def at(xs: List[int], i: int) -> Optional[int]:
    return xs[i] if len(xs) > i else None


def gib(x: Optional[int]) -> str:
    return "-" if x is None else f"{x / (1 << 30):.3f}"


def table(results: List[dict]) -> str:
    rows = ["| loop | allocator | reserved @20 GiB | reserved @end GiB | drift | peak reserved GiB | "
            "peak allocated GiB | mode at end |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        r20, rend = at(r.get("reserved", []), 19), (r.get("reserved") or [None])[-1]
        drift = f"{100 * (rend / r20 - 1):+.2f} %" if r20 and rend else "-"
        mode = (r.get("modes") or ["-"])[-1]
        if not r.get("ok"):
            mode = r.get("error", "failed")[:60]
        rows.append(f"| {r['loop']} | {r['alloc']} | {gib(r20)} | {gib(rend)} | {drift} | "
                    f"{gib(r.get('max_reserved'))} | {gib(r.get('max_allocated'))} | {mode} |")
    return "\n".join(rows)


def _log_tail(path: str, n: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def driver(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    work = args.work or os.path.join(args.out, "runs")
    os.makedirs(work, exist_ok=True)
    jobs = [(lp, al) for lp in args.loops.split(",") for al in args.allocs.split(",")]
    for lp, al in jobs:
        if lp not in LOOPS or al not in ALLOCS:
            raise SystemExit(f"unknown loop or allocator: {lp} / {al} (loops {list(LOOPS)}, allocators {ALLOCS})")
    running: List[tuple] = []
    results: List[dict] = []
    walls: dict = {}  # loop -> the longest finished run of it (s, start to end, start-up included)
    killed: set = set()
    budget = args.budget_s or 0.0
    t0 = time.time()

    def reap():
        """Collect every finished child's result."""
        for k in range(len(running) - 1, -1, -1):
            p, lp, al, path, t = running[k]
            if p.poll() is None:
                continue
            running.pop(k)
            try:
                with open(path) as f:
                    r = json.load(f)
            except (OSError, ValueError):
                why = (f"stopped at the budget ({budget:.0f} s)" if (lp, al) in killed
                       else f"child exited {p.returncode}, no result")
                r = {"loop": lp, "alloc": al, "ok": False, "error": why}
            took = time.time() - t
            r["driver_wall_s"] = took
            if r.get("ok"):
                walls[lp] = max(walls.get(lp, 0.0), took)
            print(f"[{time.time() - t0:6.0f} s] {lp}/{al}: {'ok' if r.get('ok') else r.get('error')} "
                  f"({took:.0f} s)", flush=True)
            if not r.get("ok"):
                tail = _log_tail(path[: -len(".json")] + ".log")
                if tail:
                    print("  | " + tail.rstrip().replace("\n", "\n  | "), flush=True)
            results.append(r)

    def stop_at_budget():
        if budget and time.time() - t0 > budget:
            for p, lp, al, _, _ in running:
                if p.poll() is None and (lp, al) not in killed:
                    killed.add((lp, al))
                    p.kill()

    for lp, al in jobs:
        while len(running) >= args.parallel:
            time.sleep(0.2)
            stop_at_budget()
            reap()
        if budget:
            # The longest finished run of this loop (else of any) says how long this one takes.
            est = walls.get(lp, max(walls.values(), default=0.0))
            if time.time() - t0 + est > budget:
                why = f"skipped: the budget ({budget:.0f} s) would be exceeded (a run takes ~{est:.0f} s)"
                print(f"[{time.time() - t0:6.0f} s] {lp}/{al}: {why}", flush=True)
                results.append({"loop": lp, "alloc": al, "ok": False, "error": why})
                continue
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if al == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        env["PYTHONPATH"] = PY_DIR + os.pathsep + env.get("PYTHONPATH", "")
        path = os.path.join(work, f"{lp}_{al}.json")
        if os.path.exists(path):
            os.remove(path)  # a result left by an earlier run in the same folder is not this one's
        log = open(os.path.join(work, f"{lp}_{al}.log"), "w")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", lp, al, "--iters", str(args.iters),
               "--out", work] + (["--dry-run"] if args.dry_run else [])
        running.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), lp, al, path, time.time()))
        print(f"[{time.time() - t0:6.0f} s] started {lp}/{al}", flush=True)
    while running:
        stop_at_budget()
        reap()
        time.sleep(0.2)
    order = {(lp, al): k for k, (lp, al) in enumerate(jobs)}
    results.sort(key=lambda r: order.get((r["loop"], r["alloc"]), 0))
    tdir = os.path.join(args.out, "traces")
    for r in results:
        for f in r.get("trace_files") or []:
            os.makedirs(tdir, exist_ok=True)
            dst = os.path.join(tdir, os.path.basename(f) + ".gz")
            with open(f, "rb") as src, gzip.open(dst, "wb", compresslevel=9) as g:
                shutil.copyfileobj(src, g)
            r.setdefault("trace_gz", []).append(dst)
    doc = {"iters": args.iters, "command": " ".join(sys.argv[1:]), "wall_s": time.time() - t0,
           "results": results}
    if args.dry_run:
        doc["dry_run"] = True
    with open(os.path.join(args.out, "long_loops.json"), "w") as f:
        json.dump(doc, f)
    t = table(results)
    with open(os.path.join(args.out, "table.txt"), "w") as f:
        f.write(t + "\n")
    print(t)
    return 0 if all(r.get("ok") for r in results) else 1


# --- the report: issue #18's targets per loop -------------------------------------------------

PEAK_TARGET = 1.01  # peak reserved <= 1.01 x the lower bound
DRIFT_TARGET = 0.005  # reserved after the last iteration within 0.5 % of after iteration 20
JUDGED = ("auto", "auto_phases")  # the runs the targets are checked on (stweaver's auto mode)


def load_runs(paths: List[str]) -> tuple:
    """(runs by (loop, alloc), documents): the files merged, a later file's run replacing an
    earlier one's."""
    runs: dict = {}
    docs = []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        d["_path"] = p
        docs.append(d)
        for r in d.get("results", []):
            runs[(r["loop"], r["alloc"])] = dict(r, _path=p)
    return runs, docs


def trace_lower_bound(loop: str, runs: List[dict], dirs: List[str], stweaver_bin: Optional[str]):
    """(bytes, file): the peak of live bytes of the loop's trace (`stweaver inspect --json`),
    or None when there is no trace here or no CLI."""
    if not stweaver_bin:
        return None
    cands = []
    for d in dirs:
        cands += [os.path.join(d, "traces", f"trace_{loop}.stwt.gz"), os.path.join(d, f"trace_{loop}.stwt.gz")]
    for r in runs:
        cands += list(r.get("trace_gz") or []) + list(r.get("trace_files") or [])
    for f in dict.fromkeys(cands):
        if not os.path.isfile(f):
            continue
        try:
            out = subprocess.run([stweaver_bin, "inspect", "--json", f], capture_output=True, text=True, check=True)
            return int(json.loads(out.stdout)["devices"][0]["lower_bound"]["bytes"]), f
        except (OSError, subprocess.CalledProcessError, ValueError, KeyError, IndexError) as e:
            print(f"long_loops report: {stweaver_bin} inspect {f}: {e}", file=sys.stderr)
    return None


def _short_mode(m: Optional[str]) -> str:
    if not m:
        return "-"
    if m.startswith("auto (") and m.endswith(")"):
        m = m[len("auto ("):-1]
    return m.split(":")[0]


def check_targets(run: dict, expandable: Optional[dict], lb: Optional[int]) -> dict:
    """Issue #18's three targets for one stweaver run: each a (met: bool or None, text) pair
    (None: not measurable here, e.g. a failed run)."""
    out = {}
    if not run.get("ok"):
        why = (run.get("error") or "failed")[:80]
        return {"peak": (None, f"run failed: {why}"), "drift": (None, "-"), "vs_expandable": (None, "-")}
    peak = run.get("max_reserved")
    if lb and peak:
        ratio = peak / lb
        out["peak"] = (ratio <= PEAK_TARGET, f"{ratio:.3f} x")
    else:
        out["peak"] = (None, "no lower bound" if not lb else "no peak")
    res = run.get("reserved") or []
    iters = run.get("iters") or len(res)
    if len(res) >= 20 and res[19] and len(res) >= iters:
        d = res[-1] / res[19] - 1
        text = f"{100 * d:+.2f} %"
        if expandable and expandable.get("ok") and len(expandable.get("reserved") or []) >= 20:
            er = expandable["reserved"]
            text += f" (expandable {100 * (er[-1] / er[19] - 1):+.2f} %)"
        out["drift"] = (abs(d) <= DRIFT_TARGET, text)
    else:
        out["drift"] = (None, f"{len(res)} of {iters} iterations recorded")
    if not expandable:
        out["vs_expandable"] = (None, "no expandable run")
    elif not expandable.get("ok"):
        out["vs_expandable"] = (None, "expandable run failed")
    else:
        er = expandable.get("reserved") or []
        n = min(len(res), len(er))
        over = [i for i in range(n) if res[i] > er[i]]
        if n == 0:
            out["vs_expandable"] = (None, "no iterations recorded")
        elif not over:
            out["vs_expandable"] = (True, f"{n} of {n} iterations")
        else:
            worst = max(res[i] / er[i] - 1 for i in over)
            out["vs_expandable"] = (False, f"above at {len(over)} of {n} (first after iteration {over[0] + 1}, "
                                           f"worst +{100 * worst:.1f} %)")
    return out


def _cell(t: tuple) -> str:
    met, text = t
    if met is None:
        return text
    return f"met: {text}" if met else f"**missed**: {text}"


def _median(xs: List[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])


def planning_window(runs: dict) -> List[str]:
    """Issue #18 item 2: the step time of auto's iterations that began while its plan was
    being made in the background (mode ``auto (planning)`` at the end of the previous
    iteration), against the same iterations of an online run (the mode auto falls back to),
    and the A/A control (a second online run against the first). Ratios of the medians and
    of the minima; only loops with step times of an auto and an online run, of one device call
    (a row's ``call``, where rows from several calls were merged)."""
    lines = []
    for lp in dict.fromkeys(k[0] for k in runs):
        auto, onl, aa = runs.get((lp, "auto")), runs.get((lp, "online")), runs.get((lp, "online_aa"))
        if not (auto and onl and auto.get("ok") and onl.get("ok") and auto.get("step_s") and onl.get("step_s")):
            continue
        if auto.get("call") != onl.get("call"):
            # Step times of different device calls (other machines, other neighbours) do
            # not compare: rows merged from several calls say which one they came from.
            lines.append(f"| {lp} | auto and online ran in different device calls "
                         f"({auto.get('call') or '-'}, {onl.get('call') or '-'}): not compared | | | | |")
            continue
        modes, a, o = auto.get("modes") or [], auto["step_s"], onl["step_s"]
        win = [i for i in range(1, min(len(a), len(o), len(modes) + 1)) if "planning" in (modes[i - 1] or "")]
        if not win:
            lines.append(f"| {lp} | no iteration began while planning | | | | |")
            continue
        after = [i for i in range(win[-1] + 1, min(len(a), len(o)))]

        def ratio(xs, ys, idx, f):
            return f([xs[i] for i in idx]) / f([ys[i] for i in idx]) if idx else float("nan")

        aa_text = "-"
        if aa and aa.get("ok") and aa.get("step_s") and len(aa["step_s"]) > win[-1]:
            aa_text = (f"{ratio(aa['step_s'], o, win, _median):.3f} / {ratio(aa['step_s'], o, win, min):.3f}")
        lines.append(
            f"| {lp} | {win[0] + 1}-{win[-1] + 1} ({len(win)}) | "
            f"{1e3 * _median([a[i] for i in win]):.1f} vs {1e3 * _median([o[i] for i in win]):.1f} | "
            f"{ratio(a, o, win, _median):.3f} / {ratio(a, o, win, min):.3f} | {aa_text} | "
            f"{ratio(a, o, after, _median):.3f} / {ratio(a, o, after, min):.3f} |")
    if not lines:
        return []
    return ["", "Step time inside auto's planning window (issue #18 item 2): auto's iterations that began "
            "while its plan was being made in the background, against the same iterations of an online run; "
            "A/A: a second online run against the first. Ratios median / min.", "",
            "| loop | iterations (count) | median ms, auto vs online | auto / online | A/A (online_aa / online) | "
            "after the window, auto / online |", "|---|---|---|---|---|---|"] + lines


def report(paths: List[str], stweaver_bin: Optional[str] = None) -> str:
    runs, docs = load_runs(paths)
    if not runs:
        raise SystemExit(f"no results in {', '.join(paths)}")
    dirs = [os.path.dirname(os.path.abspath(p)) for p in paths]
    loops = [lp for lp in LOOPS if any(k[0] == lp for k in runs)]
    loops += sorted({k[0] for k in runs} - set(loops))
    devices = sorted({r["device"] for r in runs.values() if r.get("device")})
    iters = sorted({r.get("iters") for r in runs.values() if r.get("iters")})
    dry = any(d.get("dry_run") for d in docs) or any(r.get("dry_run") for r in runs.values())
    lines = []
    if dry:
        lines.append("**DRY RUN** (tiny models on the CPU): the numbers are stand-ins (the bytes of the "
                     "parameters and optimizer state), not GPU memory; only the plumbing is checked.\n")
    lines.append(f"Long loops ({', '.join(map(str, iters)) or '?'} iterations; "
                 f"{', '.join(devices) or 'no device named'}; {', '.join(paths)}). Targets (issue #18): peak "
                 f"reserved <= {PEAK_TARGET} x LB; no drift (reserved after the last iteration within "
                 f"{100 * DRIFT_TARGET:.1f} % of after iteration 20); reserved <= expandable segments' after "
                 f"every iteration. Peaks in GiB.\n")
    lines.append("| loop | stweaver run | LB | native | expandable | stweaver | peak <= 1.01 x LB | "
                 "no drift (@20 -> end) | <= expandable at every iteration | mode at the end |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    met = total = 0
    notes = []
    for lp in loops:
        mine = [r for (l2, _), r in runs.items() if l2 == lp]
        tlb = trace_lower_bound(lp, mine, dirs, stweaver_bin)
        if tlb:
            lb, src = tlb
            rel = os.path.relpath(src)
            notes.append(f"{lp}: LB {gib(lb)} GiB, the peak of live bytes of "
                         f"{src if rel.startswith('..') else rel}")
            lb_text = gib(lb)
        else:
            allocs = [r["max_allocated"] for r in mine if r.get("ok") and r.get("max_allocated")]
            lb = min(allocs) if allocs else None
            lb_text = gib(lb) + ("*" if lb else "")
            if lb:
                notes.append(f"{lp}: LB* {gib(lb)} GiB, the least peak allocated of its runs (no trace or no "
                             "stweaver CLI here)")
        nat, exp = runs.get((lp, "native")), runs.get((lp, "expandable"))

        def peak(r):
            return gib(r.get("max_reserved")) if r and r.get("ok") else ("failed" if r else "-")

        judged = [a for a in JUDGED if (lp, a) in runs]
        if not judged:
            lines.append(f"| {lp} | none | {lb_text} | {peak(nat)} | {peak(exp)} | - | - | - | - | - |")
            continue
        for a in judged:
            r = runs[(lp, a)]
            t = check_targets(r, exp, lb)
            for k in ("peak", "drift", "vs_expandable"):
                total += 1
                met += t[k][0] is True
            label = "auto (zero code)" if a == "auto" else "auto, phases marked"
            lines.append(f"| {lp} | {label} | {lb_text} | {peak(nat)} | {peak(exp)} | {peak(r)} | "
                         f"{_cell(t['peak'])} | {_cell(t['drift'])} | {_cell(t['vs_expandable'])} | "
                         f"{_short_mode((r.get('modes') or [None])[-1])} |")
    lines.append("")
    lines.append(f"Targets met: {met} of {total}." + (" (Dry run: the plumbing only.)" if dry else ""))
    lines += [f"- {n}" for n in notes]
    lines += planning_window(runs)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "long-loops-out")
    ap.add_argument("--work", help="per-run files (results, logs, raw traces); default OUT/runs")
    ap.add_argument("--loops", default=",".join(LOOPS))
    ap.add_argument("--allocs", default=",".join(ALLOCS))
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--parallel", type=int, default=2,
                    help="runs at a time (len50's native run alone reaches 48 GB: 2 for the length loops)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="start no run that would end past this many seconds, stop those still going (0: none)")
    ap.add_argument("--dry-run", action="store_true", help="tiny models on the CPU, no allocator installed")
    ap.add_argument("--report", nargs="+", metavar="JSON", help="the Markdown table and issue #18's targets")
    ap.add_argument("--stweaver-bin", default=os.environ.get("STWEAVER_BIN"),
                    help="the stweaver CLI, for --report's lower bound from the traces")
    ap.add_argument("--child", nargs=2, metavar=("LOOP", "ALLOC"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.report, args.stweaver_bin))
        return 0
    if args.child:
        lp, al = args.child
        r = child(lp, al, args.iters, args.out, args.dry_run)
        with open(os.path.join(args.out, f"{lp}_{al}.json"), "w") as f:
            json.dump(r, f)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
