"""Long training loops that are not one iteration repeated (issue #18, item 3).

Five loops, 200 iterations each by default, small Hugging Face models (bf16, AdamW, random
token ids, seeded) so that a whole run's trace stays small enough to live in the repository:

- ``len5``: GPT-2 (1024 hidden, 8 layers), batch 8, the sequence length drawn per iteration
  from 5 buckets (256, 512, 768, 1024, 1536);
- ``len50``: the same model, the length drawn from 50 distinct values (128, 160, ..., 1696);
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
``auto_phases`` (auto mode with those markers: the one-line hint of ``stweaver.phase``).

Per run: ``memory_reserved`` / ``memory_allocated`` after every iteration, the peaks, stweaver's
mode after every iteration. The driver writes ``$OUT/long_loops.json``, copies the traces to
``$OUT/traces/`` (gzip'd) and prints a table last: reserved at iteration 20 and at the end, the
drift between them, the peak reserved, and the peak allocated of the native run (a lower
bound's stand-in on the GPU; the CPU replay computes the exact one).

    python python/bench/long_loops.py --out $OUT [--loops len5,eval10] [--allocs native,auto]
        [--iters 200] [--parallel 5] [--dry-run]

``--dry-run`` runs tiny models on the CPU (no allocator installed): it checks the plumbing.
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
    "eval10": dict(family="llama", hidden=1024, layers=8, heads=16, inter=2816, batch=8, seq=1024,
                   eval_every=10, eval_batch=16, eval_micro=2),
    "ckpt20": dict(family="llama", hidden=1024, layers=8, heads=16, inter=2816, batch=8, seq=1024,
                   ckpt_every=20),
    "moe": dict(family="qwen2moe", hidden=512, layers=2, heads=8, inter=1408, batch=8, seq=512,
                experts=8, topk=2, moe_inter=704),
}
ALLOCS = ("native", "expandable", "auto", "trace", "auto_phases")
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
            c["max_seq"] = 40
        else:
            c["seq"] = 16
        c["vocab"] = 1000
        c["eval_batch"] = 4 if "eval_batch" in c else None
    trace_path = os.path.join(out, f"trace_{loop}.stwt") if alloc == "trace" else None
    st = None
    if alloc in ("auto", "trace", "auto_phases") and not dry:
        import stweaver

        stweaver.install("trace" if alloc == "trace" else None, trace=trace_path, hook_optimizer=True)
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
    reserved, allocated, modes, lens, losses, events = [], [], [], [], [], []

    def phase(label):
        # Markers in the trace and auto_phases runs only (the auto run is the zero-code user's).
        marked = st is not None and alloc in ("trace", "auto_phases")
        return st.phase(label) if marked else contextlib.nullcontext()

    t0 = time.time()
    try:
        for i in range(iters):
            if "lengths" in c:
                L = c["lengths"][int(torch.randint(0, len(c["lengths"]), (1,), generator=gen))]
            else:
                L = c["seq"]
            lens.append(L)
            x = torch.randint(0, vocab, (c["batch"], L), generator=gen).to(device)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()  # stweaver's optimizer hook marks the iteration here
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach().float()))
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
            if st is not None:
                modes.append(st.mode())
        res["ok"] = True
    except torch.OutOfMemoryError as e:
        res["error"] = "OOM: " + str(e).splitlines()[0][:300]
    res["wall_s"] = time.time() - t0
    res.update(reserved=reserved, allocated=allocated, modes=modes, lengths=lens, losses=losses, events=events)
    if not dry:
        res["max_reserved"] = torch.cuda.max_memory_reserved()
        res["max_allocated"] = torch.cuda.max_memory_allocated()
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


def driver(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    work = os.path.join(args.out, "runs")
    os.makedirs(work, exist_ok=True)
    jobs = [(lp, al) for lp in args.loops.split(",") for al in args.allocs.split(",")]
    for lp, al in jobs:
        if lp not in LOOPS or al not in ALLOCS:
            raise SystemExit(f"unknown loop or allocator: {lp} / {al} (loops {list(LOOPS)}, allocators {ALLOCS})")
    running: List[tuple] = []
    results: List[dict] = []
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
                r = {"loop": lp, "alloc": al, "ok": False, "error": f"child exited {p.returncode}, no result"}
            print(f"[{time.time() - t0:6.0f} s] {lp}/{al}: {'ok' if r.get('ok') else r.get('error')} "
                  f"({time.time() - t:.0f} s)", flush=True)
            results.append(r)

    for lp, al in jobs:
        while len(running) >= args.parallel:
            time.sleep(0.2)
            reap()
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if al == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        env["PYTHONPATH"] = PY_DIR + os.pathsep + env.get("PYTHONPATH", "")
        path = os.path.join(work, f"{lp}_{al}.json")
        log = open(os.path.join(work, f"{lp}_{al}.log"), "w")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", lp, al, "--iters", str(args.iters),
               "--out", work] + (["--dry-run"] if args.dry_run else [])
        running.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), lp, al, path, time.time()))
        print(f"[{time.time() - t0:6.0f} s] started {lp}/{al}", flush=True)
    while running:
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
    with open(os.path.join(args.out, "long_loops.json"), "w") as f:
        json.dump({"iters": args.iters, "results": results}, f)
    print(table(results))
    return 0 if all(r.get("ok") for r in results) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "long-loops-out")
    ap.add_argument("--loops", default=",".join(LOOPS))
    ap.add_argument("--allocs", default=",".join(ALLOCS))
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--parallel", type=int, default=5, help="runs at a time")
    ap.add_argument("--dry-run", action="store_true", help="tiny models on the CPU, no allocator installed")
    ap.add_argument("--child", nargs=2, metavar=("LOOP", "ALLOC"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        lp, al = args.child
        r = child(lp, al, args.iters, args.out, args.dry_run)
        with open(os.path.join(args.out, f"{lp}_{al}.json"), "w") as f:
            json.dump(r, f)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
