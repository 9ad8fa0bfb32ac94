#!/usr/bin/env python3
"""Training under a memory budget below the run's peak (issue #16): stweaver with activation
offload vs torch's save_on_cpu, full activation checkpointing, and the native / expandable
allocators, each in a fresh process on one GPU.

    python python/bench/budget_bench.py [--out DIR] [--iters 8] [--fractions 0.9,0.8,0.7]
    python python/bench/budget_bench.py --dry-run --out DIR      (CPU, tiny models: plumbing)

Workloads (gpu_bench.py's model configs, imported): Llama 1B *without* recomputation and
GPT-2 XL, one micro-batch (``--batch``) that fits an 80 GB H100 unconstrained; bf16, AdamW,
random token ids, deterministic algorithms (as gpu_bench).

1. link: one child measures pinned 1 GiB host<->device copies (median of 5 each way).
2. per workload, ``unlimited``: PyTorch's allocator, no cap. LB = its
   ``torch.cuda.max_memory_allocated`` (the peak of live bytes).
3. per budget ``f x LB`` (f in --fractions), every row in a fresh process capped by
   ``torch.cuda.set_per_process_memory_fraction(budget / total)``:
   - ``stweaver_offload``: ``stweaver.install("auto", budget=...)`` (STWEAVER_BUDGET) before
     CUDA, with ``stweaver.offload``: at each iteration boundary, if the served plan carries an
     offload schedule the offloader follows it (``plan``), else it offloads every eligible saved
     tensor >= ``--min-bytes`` (``threshold``; also while auto mode records, since an
     un-offloaded iteration does not fit the budget). The row says which mode served each
     iteration (``offload_modes``) and the measured window's mode;
   - ``stweaver_plan``: the three explicit steps with the planner choosing what moves: a
     trace run (unlimited, once per workload: ``STWEAVER_MODE=trace``, which records every
     saved tensor's pack and unpack), ``stweaver plan TRACE --budget B`` (the fewest bytes
     so that the planned peak fits B; its report is kept in the row), then the plan run
     (``STWEAVER_PLAN`` + ``STWEAVER_BUDGET``: the plan's schedule is followed from the
     first iteration boundary on). Needs ``--stweaver-bin`` (the release CLI);
   - ``stweaver_hybrid``: ``stweaver_plan`` with the last k of the model's N repeated blocks
     recomputed in backward (``stweaver.recompute_blocks``): offload alone is bound by the
     link (everything off the device at the peak crosses it during forward), recomputing a
     few blocks takes their activations off the peak for ~k/N of a forward. A trace run per
     candidate k (0, ~N/8, N/4, 3N/8, N/2, 3N/4) and placement (``--hybrid-where``: the last
     k blocks, the first k), shared by the budgets and kept in --out; ``stweaver plan
     --budget`` on each, and the choice whose predicted step (k/N x forward's device time +
     the plan's planned copy waits) is least is run; the sweep stops once the best plan
     waits <= 2 % of the unlimited step or three larger k's did no better;
     ``--hybrid-k 6`` (or ``3,6``) tries only those k's (no plain trace when 0 is not
     among them): a choice an earlier sweep made, re-measured;
   - ``stweaver_auto``: the user's way with no offline step: ``stweaver.install("auto",
     budget=...)`` (its own offloader) and ``stweaver.recompute_blocks(model, "auto")``: auto
     mode records, plans, holds the plan and recomputes more blocks and records again while
     the plan would wait for the link (``stweaver._auto_recompute``), and measures a plan
     that moves bytes against more blocks recomputed (its trial); measured after the plan it
     settled on was served;
   - ``stweaver_auto_pycopy``: the same with ``STWEAVER_OFFLOAD_FAST=0``: the offload copies
     through torch's Python API instead of one extension call each (the A/B control of
     ``cpp/offload_copy.cpp``);
   - ``stweaver_auto_drvpin``: ``stweaver_auto`` with ``STWEAVER_PIN_THREADS=0``: the offload
     pool's pinned buffers from the driver's ``cuMemHostAlloc`` (what ``pin_memory=True``
     does) instead of the fast pin (a huge-page mapping faulted in by several threads, then
     registered): the A/B control of the first iterations' time;
   - ``stweaver_auto_trial``: ``stweaver_auto`` with ``STWEAVER_AUTO_TRIAL=1``: a plan that
     moves bytes is measured against more blocks recomputed (``stweaver._auto_recompute``,
     step 5);
   - ``stweaver_auto_wm``: ``stweaver_auto`` with ``STWEAVER_OFFLOAD_WATERMARK=1`` (opt-in):
     before the plan a saved tensor of at least 1 MiB is offloaded only when the device
     would otherwise come near the budget; the A/B of the first iterations' time and pinned
     host memory against ``stweaver_auto`` (every one offloaded);
   - ``stweaver_plan_at_pack``: the same with ``--reuse-offloaded at-pack`` (the plan reuses an
     offloaded tensor's memory right after its pack and compute waits for the copy on the
     device: the schedule before session 9, kept as the baseline);
   - ``stweaver_plan_devtime``: the plan made from a second trace run with
     ``CUDA_LAUNCH_BLOCKING=1`` (the host in step with the device, so the trace's time stamps
     are the device's) and ``stweaver plan --timing trace``: the schedule's clock measured
     instead of the iteration spread evenly over its requests;
   - ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around forward;
   - ``recompute``: full activation checkpointing (HF ``gradient_checkpointing_enable``);
   - ``native`` and ``expandable`` (``expandable_segments:True``): no offload (OOM or not);
   - ``recompute_k``: PyTorch's allocator, no cap, no offload, only the blocks of
     ``--hybrid-k`` (its first value; ``--hybrid-where``'s first placement) recomputed: what
     the recomputation of a hybrid row costs by itself;
   - ``unlimited_aa``: the unlimited run again, in its place among the rows (no cap): the
     A/A control, its ratio to the first unlimited run is the spread between two runs of the
     same thing on this machine.

Per row: fits or OOM (and at which iteration), peak reserved/allocated (over the whole run,
first iterations included), the first iteration's time (``first_step_s``; every step's in
``step_s``, the iterations before auto's switch in ``pre_plan_steps_s``), pinned host memory
after each iteration (``pinned_after``: torch's caching host allocator's bytes, in use and
cached, ``torch.cuda.host_memory_stats()``; ``host_capacity_after``: the offloader's pool)
and its most, step time min and
median over the measured iterations (after ``--warmup``) and their ratio to unlimited's, bytes
moved per iteration (host<-device + device<-host), achieved D2H/H2D bandwidth (stweaver's copy
events: bytes / copy time) vs the link peak, and whether the losses are bitwise those of the
unlimited run (compared over the iterations both ran). Each training child starts with
``STWEAVER_*`` and allocator settings cleared (as gpu_bench's); ``--child-env KEY=VALUE,...``
sets variables in every one (an experiment knob), the rows' own after them. Each step's host
side is kept too (``host_clock``, medians in ``host_clock_median``: the Python thread's CPU time,
its time waiting on the run queue, context switches, the machine's steal), and ``--train-cpus``
pins the training children to given CPUs. JSON goes to ``--out``
(default ``$OUT`` or .) as budget_bench.json; a short table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PY_DIR = os.path.join(REPO, "python")
for _p in (HERE, PY_DIR):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import gpu_bench as gb  # noqa: E402  (model configs and builder; imports no torch)
from gpubench.common import stweaver_stats, write_json, write_table  # noqa: E402

GiB = float(1 << 30)
MiB = float(1 << 20)


def _base(name: str) -> dict:
    return next(w for w in gb.WORKLOADS if w["name"] == name)


# gpu_bench's Llama 1B and GPT-2 XL configs, without recomputation, one micro-batch.
WORKLOADS = [
    dict(_base("llama1b_rcp"), name="llama1b_norcp", ckpt=False, batch=8, micro=1,
         note="Llama 1B, 8 x 2048 tokens, one micro-batch, no recomputation"),
    dict(_base("gpt2xl_rcp"), name="gpt2xl_norcp", ckpt=False, batch=8, micro=1,
         note="GPT-2 XL (gpu_bench config), 8 x 1024 tokens, one micro-batch, no recomputation"),
]
# Rows that serve a plan made by `stweaver plan` from a trace run; with the trace run itself.
PLAN_ROWS = ("stweaver_plan", "stweaver_plan_at_pack", "stweaver_plan_devtime", "stweaver_hybrid")
PLAN_RUN_ROWS = ("stweaver_trace",) + PLAN_ROWS
AUTO_ROWS = ("stweaver_auto", "stweaver_auto_pycopy", "stweaver_auto_wm", "stweaver_auto_drvpin",
             "stweaver_auto_trial")
ROWS = ("stweaver_plan", "stweaver_hybrid", "stweaver_auto", "stweaver_auto_pycopy", "stweaver_auto_wm",
        "stweaver_auto_drvpin", "stweaver_auto_trial",
        "stweaver_plan_at_pack",
        "stweaver_plan_devtime",
        "stweaver_offload",
        "save_on_cpu", "recompute", "native", "expandable", "unlimited_aa", "recompute_k")


def dry_workloads() -> List[dict]:
    out = []
    for w in WORKLOADS:
        d = dict(w)
        for k in ("hidden", "layers", "heads", "inter", "seq", "batch"):
            d[k] = gb.DRY[k]
        d["vocab"] = gb.DRY["vocab"]
        out.append(d)
    return out


# ------------------------------------------------------------------ child


class _DryBackend:
    """--dry-run: the offloader's backend on CPU (copies at once, events always passed)."""

    timing = False

    def __init__(self):
        self.copies = 0

    def is_device(self, t):
        return not t.is_cuda  # every tensor of a --dry-run is a CPU one (as cheap a read as CudaBackend's t.is_cuda)

    def current_stream(self, device):
        return "current"

    def side_stream(self, device, kind):
        return kind

    def wait_stream(self, waiter, waitee):
        pass

    def wait_event(self, stream, event):
        pass

    def event(self, stream):
        return stream

    def query(self, event):
        return True

    def elapsed_ms(self, a, b):
        return None

    def copy(self, dst, src, stream):
        dst.copy_(src)
        self.copies += 1

    def record_stream(self, t, stream):
        pass

    def empty_device(self, size, stride, dtype, device):
        import torch

        return torch.empty_strided(size, stride, dtype=dtype, device=device)


def link_probe(dry: bool) -> dict:
    """Pinned 1 GiB copies each way: the link's peak is the fastest of 10 (after one
    warm-up; noise only adds time: a median of 5 once read D2H at 39 GB/s in a call whose
    offload copies then ran at 54), the median beside it."""
    import torch

    if dry:
        return {"dry_run": True, "h2d_GBps": None, "d2h_GBps": None}
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {"bytes": n, "device": torch.cuda.get_device_name(0)}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for i in range(11):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            dst.copy_(src, non_blocking=True)
            e1.record()
            e1.synchronize()
            if i:
                times.append(e0.elapsed_time(e1) / 1e3)
        out[name + "_GBps"] = n / min(times) / 1e9
        out[name + "_median_GBps"] = n / statistics.median(times) / 1e9
    return out


class _PhaseMarks:
    """Where an iteration's time goes: a CUDA event on the current stream and the host
    clock at the end of each phase (forward, backward, optimizer); read once the step is
    synchronised. Device ms per phase say which phase offload slows; host ms say whether
    the host ran ahead of the device (host << device) or was held back."""

    def __init__(self, torch_mod, probe=None):
        self.torch = torch_mod
        self.names: List[str] = []
        self.host = [time.perf_counter()]
        self.events = []
        # ``probe()``: cumulative host counters (``_call_time_probe``), read at each mark.
        self.probe = probe
        self.counters = [probe()] if probe is not None else []
        if torch_mod is not None:
            e = torch_mod.cuda.Event(enable_timing=True)
            e.record()
            self.events.append(e)

    def mark(self, name: str) -> None:
        self.names.append(name)
        self.host.append(time.perf_counter())
        if self.probe is not None:
            self.counters.append(self.probe())
        if self.torch is not None:
            e = self.torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append(e)

    def done(self) -> dict:
        out = {}
        for i, n in enumerate(self.names):
            out["host_" + n] = (self.host[i + 1] - self.host[i]) * 1e3
            if self.events:
                out["device_" + n] = self.events[i].elapsed_time(self.events[i + 1])
            if self.counters:
                a, b = self.counters[i], self.counters[i + 1]
                for k in b:
                    d = b[k] - a.get(k, 0)
                    out[f"{k[:-3]}_ms_{n}" if k.endswith("_ns") else f"{k}_{n}"] = d / 1e6 if k.endswith("_ns") else d
        return out


def _call_time_probe(st):
    """With ``STWEAVER_TIME_CALLS=1`` in the child (``--child-env``): a function returning the
    cumulative host time in stweaver's malloc / free (``alloc_ns``, ``alloc_calls``) and in the
    offloader's pack / unpack hooks (``hooks_ns``, ``hooks_calls``), for the phase marks; else
    None."""
    if st is None:
        return None
    ext = st._extension()
    if not hasattr(ext, "call_times") or not ext.call_times().get("on"):
        return None
    from stweaver import _offload

    def probe() -> dict:
        t = ext.call_times()
        out = {"alloc_ns": t["malloc_ns"] + t["free_ns"], "alloc_calls": t["malloc_calls"] + t["free_calls"]}
        off = _offload.current()
        h = getattr(off, "hook_times", None) if off is not None else None
        if h:
            out["hooks_ns"], out["hooks_calls"] = h[0] + h[2], h[1] + h[3]
        return out

    return probe


class _GcClock:
    """Python's garbage collections, timed (``gc.callbacks``): cumulative ns, collections,
    and full (generation 2) collections, for the phase marks (``gc_ms_<phase>``,
    ``gc_calls_<phase>``, ``gc2_calls_<phase>``). A full collection walks every tracked
    object of the process (a Hugging Face model holds many), and an offloader's handles,
    which live from forward to backward, survive into the older generations."""

    def __init__(self):
        self.ns = 0
        self.calls = 0
        self.full = 0
        self._t0 = 0

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        else:
            self.ns += time.perf_counter_ns() - self._t0
            self.calls += 1
            self.full += int(info.get("generation") == 2)

    def install(self) -> "_GcClock":
        gc.callbacks.append(self._cb)
        return self

    def read(self) -> dict:
        return {"gc_ns": self.ns, "gc_calls": self.calls, "gc2_calls": self.full}


def _probes(*probes):
    """One probe reading every given one (None: skipped); None when none is given."""
    ps = [p for p in probes if p is not None]
    if not ps:
        return None

    def probe() -> dict:
        out: dict = {}
        for p in ps:
            out.update(p())
        return out

    return probe


def _phase_medians(phases: List[dict]) -> dict:
    keys = sorted({k for p in phases for k in p})
    return {k: round(statistics.median(p[k] for p in phases if k in p), 2) for k in keys}


def _timeline_steps(model, opt, spec, c, vocab, gen, torch, st, row, marks) -> dict:
    """``--timeline N``: N more training steps under ``torch.profiler`` (CUDA activity only),
    each phase's end marked on the device (``timeline.Marks``); the trace is summarised by
    ``timeline.summarize`` (the compute stream's busy and idle time per phase, and what was in
    flight while it idled) and kept gzipped as ``timeline_<workload>_<row>_<fraction>.json.gz``
    in ``--out``. ``marks``: the run's ``timeline.Marks``, made before its first iteration."""
    import gzip as _gzip

    import timeline as tl
    from torch.profiler import ProfilerActivity, profile

    name = f"{spec.get('workload', {}).get('name')}_{row}_{spec.get('fraction')}"
    path = os.path.join(spec.get("profile_dir") or tempfile.gettempdir(), f"timeline_{name}.json")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(int(spec["timeline"])):
            x = torch.randint(0, vocab, (c["batch"], c["seq"]), generator=gen).to("cuda")
            torch.cuda.synchronize()
            loss = model(input_ids=x, labels=x).loss
            marks.mark("forward")
            loss.backward()
            marks.mark("backward")
            opt.step()
            if st is not None and row in PLAN_RUN_ROWS and not st._settings.hook_optimizer:
                st.step()
            opt.zero_grad(set_to_none=True)
            marks.mark("optimizer")
            torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    summary = tl.summarize_file(path)
    with open(path, "rb") as src, _gzip.open(path + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)
    summary["trace"] = os.path.basename(path) + ".gz"
    return summary


def _profile_steps(model, opt, spec, c, vocab, gen, device, torch, st, row) -> dict:
    """``--profile N``: N more training steps, forward and backward each under its own
    cProfile; the top functions by own time and by cumulative time, per phase (text)."""
    import cProfile
    import io
    import pstats

    profs = {"forward": cProfile.Profile(), "backward": cProfile.Profile()}
    for _ in range(int(spec["profile"])):
        x = torch.randint(0, vocab, (c["batch"], c["seq"]), generator=gen).to(device)
        if device == "cuda":
            torch.cuda.synchronize()
        profs["forward"].enable()
        loss = model(input_ids=x, labels=x).loss
        profs["forward"].disable()
        profs["backward"].enable()
        loss.backward()
        profs["backward"].disable()
        opt.step()
        if st is not None and row in PLAN_RUN_ROWS and not st._settings.hook_optimizer:
            st.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
    out = {}
    for name, pr in profs.items():
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).strip_dirs().sort_stats(key).print_stats(int(spec.get("profile_top", 25)))
            out[f"{name}_{key}"] = buf.getvalue()[-6000:]
    return out


def run_row(spec: dict) -> dict:
    """One training run in this fresh process (CUDA first touched here)."""
    dry = spec["dry_run"]
    row, c = spec["row"], spec["workload"]
    res: dict = {"row": row, "workload": c["name"], "fraction": spec.get("fraction"),
                 "budget": spec.get("budget"), "ok": False}
    st = None
    # Before CUDA is touched: --child-env (every child), then the row's own.
    os.environ.update(spec.get("extra_env") or {})
    os.environ.update(spec.get("env") or {})
    if row in PLAN_RUN_ROWS and not dry:
        import stweaver

        if row == "stweaver_trace":
            # The first iteration offloads as the budgeted run's will (its prologue).
            os.environ["STWEAVER_OFFLOAD"] = "1"
            stweaver.install("trace", trace=spec["trace"])
        else:
            # With a served-trace path the run's own requests are recorded too (for a CPU
            # replay against the plan: why a plan conflicted or was given up).
            stweaver.install("plan", plan=spec["plan"], budget=str(spec["budget"]),
                             trace=spec.get("served_trace"))
        st = stweaver
    if row == "stweaver_auto_pycopy":
        # The A/B control of the extension's one-call offload copies: torch's Python API.
        os.environ["STWEAVER_OFFLOAD_FAST"] = "0"
    if row == "stweaver_auto_trial":
        # The measured trial of auto recompute (opt-in): plan A against more blocks recomputed.
        os.environ["STWEAVER_AUTO_TRIAL"] = "1"
    if row == "stweaver_auto_drvpin":
        # The A/B control of the fast pin: the driver's cuMemHostAlloc per pool buffer.
        os.environ["STWEAVER_PIN_THREADS"] = "0"
    if row == "stweaver_auto_wm":
        # The watermark (opt-in): before the plan, a saved tensor >= 1 MiB moves only when
        # the device would otherwise come near the budget.
        os.environ["STWEAVER_OFFLOAD_WATERMARK"] = "1"
    if row in AUTO_ROWS and not dry:
        import stweaver

        # The user's way, all in the run: auto mode under the budget with install()'s own
        # offloader (threshold while recording, then the plan's schedule), and
        # recompute_blocks(model, "auto") below (more blocks recomputed and recorded again
        # while the held plan would wait for the link).
        stweaver.install("auto", budget=str(spec["budget"]), hook_optimizer=True)
        st = stweaver
    if row == "stweaver_offload" and not dry:
        import stweaver

        # The harness drives the offloader itself (threshold while recording, then the
        # plan's schedule once served), so install() starts none of its own.
        os.environ["STWEAVER_OFFLOAD"] = "0"
        # The recorded trace is kept (for CPU replay of auto's planning).
        stweaver.install("auto", budget=str(spec["budget"]), hook_optimizer=True,
                         trace=spec.get("auto_trace"))
        st = stweaver
    import torch

    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.benchmark = False
    cuda = not dry
    device = "cuda" if cuda else "cpu"
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        res["device"] = torch.cuda.get_device_name(0)
        res["backend"] = torch.cuda.memory.get_allocator_backend()
        if spec.get("budget"):
            torch.cuda.set_per_process_memory_fraction(min(1.0, spec["budget"] / total), 0)
    c = dict(c, ckpt=(row == "recompute"))
    torch.manual_seed(0)
    model, _ = gb._build_model(c, device, torch)
    if spec.get("recompute"):
        # stweaver_hybrid and its trace runs: the last k blocks recomputed, the rest offloaded
        # as planned (the trace and its plan run recompute the same blocks).
        from stweaver._recompute import recompute_blocks

        res["recompute_where"] = spec.get("recompute_where", "last")
        res["recomputed"] = recompute_blocks(model, spec["recompute"], where=res["recompute_where"])
    if row in AUTO_ROWS and st is not None:
        from stweaver._recompute import recompute_blocks

        recompute_blocks(model, "auto")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1234)
    # --timeline's device marks: their buffers are made here, before the first iteration, in
    # every row and trace run alike, so a plan counts them as persistent. Made only for the
    # profiled steps (session 18), two 777 KB tensors took holes of the served plan's pool
    # that later requests were planned on: 542 conflicts in 11 iterations on GPT-2 XL's
    # hybrid row, 0 in the same row without --timeline (session 19).
    tl_marks = None
    if cuda and spec.get("timeline"):
        import timeline as tl

        tl_marks = tl.Marks(torch)

    from stweaver import _offload as off

    offloader = None
    moved: List[int] = []
    cpu_bytes = [0]
    if row == "stweaver_offload":
        kw = {"backend": _DryBackend(), "pool": off.PinnedPool(pin=lambda n: torch.empty(n, dtype=torch.uint8)),
              "ext": None} if dry else {}
        offloader = off.enable(min_bytes=spec["min_bytes"], hook_optimizer=False, **kw)
    save_cpu = None
    if row == "save_on_cpu":
        save_cpu = torch.autograd.graph.save_on_cpu(pin_memory=True)
        inner = save_cpu.pack_hook

        def counting_pack(t):  # torch's own pack, with the bytes counted
            cpu_bytes[0] += t.numel() * t.element_size()
            return inner(t)

        save_cpu.pack_hook = counting_pack

    n_total = spec["iters"] + spec["warmup"]
    max_n = n_total + (spec["extra_auto"] if row == "stweaver_offload" and st is not None else 0)
    if row in AUTO_ROWS and st is not None:
        from stweaver._auto_recompute import MAX_ROUNDS, TRIAL_SKIP, TRIAL_STEPS

        # A recording per round, and the measured trial's recording and two measurements.
        max_n = n_total + spec["extra_auto"] * (2 + MAX_ROUNDS) + 2 * (TRIAL_SKIP + TRIAL_STEPS)
    losses, steps, modes, offload_modes, reserved_after = [], [], [], [], []
    pinned_after: List[int] = []  # torch's pinned host bytes (in use + cached) after each iteration
    capacity_after: List[int] = []  # the offloader's pinned pool after each iteration
    phases: List[dict] = []
    offload_iters: List[dict] = []
    measured_from = spec["warmup"]
    switched_at = None
    # The gc.collect() before each step is outside the marks; collections inside a step are
    # Python's own (its thresholds), timed per phase.
    probe = _probes(_call_time_probe(st) if cuda else None, _GcClock().install().read)
    # The host's side of each step (gpu_bench's IterClock, read outside the timed window):
    # this thread's CPU time, its wait on the run queue, involuntary context switches and the
    # machine's steal, so a slow step can be told apart from a busy or noisy host.
    clock = gb.IterClock()
    host_clock: List[dict] = []
    i = 0
    try:
        while i < max_n:
            x = torch.randint(0, vocab, (c["batch"], c["seq"]), generator=gen).to(device)
            gc.collect()
            if cuda:
                torch.cuda.synchronize()
            c0 = clock.snap()
            t0 = time.perf_counter()
            marks = _PhaseMarks(torch if cuda else None, probe)
            if save_cpu is not None:
                with save_cpu:
                    loss = model(input_ids=x, labels=x).loss
            else:
                loss = model(input_ids=x, labels=x).loss
            marks.mark("forward")
            loss.backward()
            marks.mark("backward")
            opt.step()  # stweaver's optimizer hook marks its iteration here
            if st is not None and row in PLAN_RUN_ROWS:
                if not st._settings.hook_optimizer:
                    st.step()  # plan / trace mode: the boundary (and the offloader's)
            opt.zero_grad(set_to_none=True)
            marks.mark("optimizer")
            if cuda:
                torch.cuda.synchronize()
            steps.append(time.perf_counter() - t0)
            host_clock.append(gb.IterClock.delta(c0, clock.snap()))
            phases.append(marks.done())
            losses.append(float(loss.detach().float().item()).hex())
            if offloader is not None:
                it = offloader.iteration_end() or {}
                moved.append(it.get("bytes_out", 0) + it.get("bytes_in", 0))
                offload_modes.append(offloader.mode)
            elif save_cpu is not None:
                moved.append(2 * cpu_bytes[0])  # out in forward, back in backward
                cpu_bytes[0] = 0
            if cuda:
                reserved_after.append(torch.cuda.memory_reserved())
                try:
                    pinned_after.append(int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)))
                except Exception:  # a torch without host stats
                    pass
            if offloader is not None or (st is not None and (row in PLAN_ROWS or row in AUTO_ROWS)):
                o_now = offloader.stats() if offloader is not None else st.offload_stats()
                capacity_after.append(int(o_now.get("host_capacity") or 0))
            if st is not None and row in PLAN_ROWS:
                last = st.offload_stats().get("last_iteration") or {}
                offload_iters.append(last)
                moved.append(last.get("bytes_out", 0) + last.get("bytes_in", 0))
                o = st.offload_stats()
                offload_modes.append(o.get("mode"))
                modes.append(st.mode())
            elif st is not None and row in AUTO_ROWS + ("stweaver_offload",):
                m = st.mode()
                modes.append(m)
                if row in AUTO_ROWS:
                    last = st.offload_stats().get("last_iteration") or {}
                    offload_iters.append(last)
                    moved.append(last.get("bytes_out", 0) + last.get("bytes_in", 0))
                    offload_modes.append(st.offload_stats().get("mode"))
                else:
                    ext = st._extension()
                    sched = list(ext.offload_schedule()) if hasattr(ext, "offload_schedule") else []
                    if sched and offloader.mode == "threshold":
                        # The plan carries a schedule: follow it from the next iteration on.
                        off.disable()
                        offloader = off.enable(schedule="plan", hook_optimizer=False)
                # Auto rows: the plan auto recompute settled on (its measured trial done).
                settled = row not in AUTO_ROWS or (st.offload_stats().get("auto_recompute") or {}).get("done", True)
                if switched_at is None and m == "auto (plan)" and settled:
                    switched_at = i
                    # Measure the iterations after the switch (the online cache released).
                    measured_from = max(measured_from, i + 2)
                    max_n = min(max_n, measured_from + spec["iters"])
            i += 1
        res["ok"] = True
    except (torch.OutOfMemoryError, MemoryError) as e:
        res["oom"] = True
        res["oom_iter"] = i
        res["error"] = str(e).splitlines()[0][:300]
    if res["ok"] and spec.get("profile"):
        # Where the host's time goes: more iterations after the measured ones under cProfile
        # (excluded from the step statistics above; cProfile itself slows Python calls).
        res["profile"] = _profile_steps(model, opt, spec, c, vocab, gen, device, torch, st, row)
    if res["ok"] and spec.get("timeline") and cuda and row != "stweaver_trace":  # not in a recorded trace
        res["timeline"] = _timeline_steps(model, opt, spec, c, vocab, gen, torch, st, row, tl_marks)
    if st is not None and switched_at is None:
        measured_from = max(spec["warmup"], len(steps) - spec["iters"])  # never switched: the last ones
    res["iterations"] = i
    res["losses"] = losses
    res["step_s"] = steps
    res["measured_from"] = measured_from
    win = steps[measured_from:]
    res["step_min_s"] = min(win) if win else None
    res["first_step_s"] = steps[0] if steps else None
    res["pre_plan_steps_s"] = steps[:switched_at + 1] if switched_at is not None else None
    res["pinned_after"] = pinned_after
    res["pinned_max"] = max(pinned_after) if pinned_after else None
    res["host_capacity_after"] = capacity_after
    res["step_median_s"] = statistics.median(win) if win else None
    res["moved_bytes_per_iter"] = moved[measured_from:] or moved
    res["phases_ms"] = _phase_medians(phases[measured_from:])
    res["host_clock"] = host_clock
    res["host_clock_median"] = host_clock_median(host_clock[measured_from:], win)
    if spec.get("cpus"):
        res["cpus"] = sorted(os.sched_getaffinity(0))
    res["modes"] = modes
    res["switched_at"] = switched_at
    res["offload_modes"] = offload_modes
    if row in AUTO_ROWS and st is not None:
        from stweaver._recompute import recomputed

        res["recomputed"] = recomputed(model)
        res["recompute_where"] = "last"
    if st is not None and (row in PLAN_ROWS or row in AUTO_ROWS):
        res["offload"] = st.offload_stats()
        res["offload_iters"] = offload_iters
        res["offload_mode"] = res["offload"].get("mode")
    if st is not None and (row == "stweaver_trace" or spec.get("served_trace")):
        res["trace_files"] = st.flush_trace()
    if offloader is not None:
        res["offload"] = offloader.stats()
        res["offload_mode"] = (offload_modes[measured_from:] or offload_modes or [None])[-1]
        off.disable()
    if cuda:
        res["max_reserved"] = torch.cuda.max_memory_reserved()
        res["max_allocated"] = torch.cuda.max_memory_allocated()
        res["reserved_after"] = reserved_after
    else:
        res["max_reserved"] = res["max_allocated"] = 0
    if st is not None:
        res["stweaver"] = stweaver_stats(st)
    return res


def host_clock_median(clocks: List[dict], steps: List[float]) -> dict:
    """Medians over the measured iterations of the host clock's deltas, in ms (context switches
    as counts), beside the step's wall time: ``cpu_ms`` close to ``step_ms`` means the Python
    thread was busy all step (host-bound), ``runq_ms`` is time it was runnable but not running
    (another thread or process held its CPU), ``steal_ms`` the hypervisor's share."""
    out: Dict[str, float] = {}
    if steps:
        out["step_ms"] = round(statistics.median(steps) * 1e3, 3)
    for k in ("cpu_s", "proc_cpu_s", "runq_s", "steal_s", "host_busy_s"):
        xs = [c[k] for c in clocks if k in c]
        if xs:
            out[k[:-2] + "_ms"] = round(statistics.median(xs) * 1e3, 3)
    for k in ("nivcsw", "nvcsw"):
        xs = [c[k] for c in clocks if k in c]
        if xs:
            out[k] = statistics.median(xs)
    return out


def row_details(r: dict) -> List[str]:
    """What to print under a row (the JSON may not come back from the GPU machine): the
    error, the iterations and the offloader's per-iteration counters, stweaver's plan
    serving counters."""
    out = []
    if r.get("oom") or r.get("error"):
        out.append(f"at iteration {r.get('oom_iter')}: {str(r.get('error'))[:400]}")
    if r.get("planner"):
        p = r["planner"]
        o = p.get("offload") or {}
        for sw in p.get("sweep") or []:
            out.append(f"hybrid sweep: {sw['where']} {sw['k']} blocks recomputed: planned wait {sw['wait_ms']} ms, predicted "
                       f"+{sw['predicted_ms']} ms, bytes/it {sw['bytes_per_iteration']}"
                       f"{', refused' if sw['refused'] else ''}")
        out.append(f"planner: pool {p.get('pool')} tensors {o.get('tensors')} bytes/it {o.get('bytes_per_iteration')} "
                   f"planned copy-out wait {o.get('copy_out_wait_us')} us, copy-back stalls {o.get('stalls')} "
                   f"({o.get('stall_us')} us) timing {o.get('timing')} "
                   f"error {str(p.get('error'))[:200] if p.get('error') else None}")
    if r.get("step_s"):
        gib = lambda xs: ", ".join(f"{x / GiB:.2f}" for x in (xs or [])[:10])  # noqa: E731
        out.append(f"first iterations: step s {', '.join(f'{x:.2f}' for x in r['step_s'][:10])}; "
                   f"pinned host GiB after each (torch's host allocator, in use + cached) [{gib(r.get('pinned_after'))}]; "
                   f"offloader's pool GiB [{gib(r.get('host_capacity_after'))}]"
                   f"{'; plan served from iteration %d' % (r['switched_at'] + 1) if r.get('switched_at') is not None else ''}")
    o = r.get("offload") or {}
    if o.get("watermark"):
        out.append(f"watermark: kept {o.get('watermark_kept')} candidates on the device; {json.dumps(o['watermark'])[:600]}")
    for d in (o.get("auto_recompute") or {}).get("decisions") or []:
        out.append(f"auto recompute: {json.dumps(d)[:400]}")
    if o:
        keep = {k: v for k, v in o.items()
                if k not in ("last_iteration", "current_iteration", "auto_recompute", "watermark")}
        out.append(f"offload: {json.dumps(keep)[:900]}")
        for it in (r.get("offload_iters") or [])[:5]:
            out.append(f"  iteration: {json.dumps(it)[:400]}")
        out.append(f"  current: {json.dumps(o.get('current_iteration'))[:400]}")
    st = r.get("stweaver") or {}
    if st:
        dev = (st.get("devices") or [{}])[0]
        out.append("stweaver: mode " + str(st.get("mode")) + " " + json.dumps(dev)[:1200])
    if r.get("phases_ms"):
        out.append(f"phases (median ms): {json.dumps(r['phases_ms'])}")
    if r.get("host_clock_median"):
        out.append(f"host clock (median per measured step): {json.dumps(r['host_clock_median'])}"
                   + (f" on CPUs {_cpus(r['cpus'])}" if r.get("cpus") else ""))
    if r.get("timeline"):
        out.append(f"timeline (median per phase): {json.dumps(r['timeline'])}")
    out.append(f"modes: {r.get('modes', [])[:12]} offload_modes: {r.get('offload_modes', [])[:12]}")
    return out


def child_main() -> int:
    spec = json.loads(sys.stdin.readline())
    try:
        res = link_probe(spec["dry_run"]) if spec["row"] == "link" else run_row(spec)
    except Exception as e:
        import traceback

        traceback.print_exc()
        res = {"ok": False, "row": spec["row"], "error": f"{type(e).__name__}: {e}"[:2000]}
    with open(spec["result"], "w") as f:
        json.dump(res, f)
    return 0


# ------------------------------------------------------------------ driver


def parse_child_env(text: str) -> Dict[str, str]:
    """``--child-env``'s ``KEY=VALUE[,KEY=VALUE...]``; a malformed item is a ValueError."""
    env: Dict[str, str] = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not key.strip().replace("_", "").isalnum():
            raise ValueError(f"--child-env: {item!r} is not KEY=VALUE")
        env[key.strip()] = value.strip()
    return env


def _cpus(cpus: List[int]) -> str:
    return f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))


def train_cpus(text: str) -> Optional[List[int]]:
    """``--train-cpus``: the training children's CPUs (None: no pinning). The calling process
    (the driver, and the planner it runs) moves to the remaining CPUs, if any remain."""
    if not text:
        return None
    avail = sorted(os.sched_getaffinity(0))
    if text == "auto":
        cpus, spare = gb.cpu_split(avail)
    else:
        cpus = [c for c in gb.parse_cpus(text) if c in avail]
        if not cpus:
            raise SystemExit(f"--train-cpus {text}: none of these CPUs is available (available: {_cpus(avail)})")
        spare = [c for c in avail if c not in cpus]
    if spare and spare != cpus:
        os.sched_setaffinity(0, spare)
    return cpus


def child_env(row: str) -> dict:
    return gb.child_env(row)  # the same environment as gpu_bench's children


def spawn(spec: dict, tmp: str, timeout: float) -> dict:
    name = f"{spec.get('workload', {}).get('name', 'link')}_{spec['row']}_{spec.get('fraction')}"
    if spec.get("recompute"):
        name += f"_{spec.get('recompute_where', 'last')}{spec['recompute']}"
    spec = dict(spec, result=os.path.join(tmp, name + ".json"))
    log_path = os.path.join(tmp, name + ".log")
    t0 = time.time()
    with open(log_path, "w") as log:
        # --train-cpus: the child starts on its CPUs (the driver's own affinity excludes them).
        cpus = spec.get("cpus")
        pre = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "child"], stdin=subprocess.PIPE,
                             stdout=log, stderr=subprocess.STDOUT, env=child_env(spec["row"]), text=True,
                             preexec_fn=pre)
        try:
            p.stdin.write(json.dumps(spec) + "\n")
            p.stdin.close()
        except OSError:
            pass
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "timeout"
    try:
        with open(spec["result"]) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = {"ok": False, "row": spec["row"], "error": f"no result (rc={rc})"}
    res["rc"] = rc
    res["wall_s"] = time.time() - t0
    if res.get("profile") and spec.get("profile_dir"):
        with open(os.path.join(spec["profile_dir"], f"profile_{name}.txt"), "w") as f:
            for key, text in res["profile"].items():
                f.write(f"=== {key}\n{text}\n")
    if not res.get("ok") and not res.get("oom"):
        with open(log_path) as f:
            res["log_tail"] = f.read()[-3000:]
    return res


def planning_link_gbps(link: dict) -> float:
    """The link rate the planner assumes: 90 % of the slower direction measured (pinned
    copies of 1 GiB; the offloader's copies ran at 97-99 % of it on the H100), else the
    planner's conservative default."""
    rates = [link.get(k + "_GBps") for k in ("h2d", "d2h")]
    rates = [r for r in rates if r]
    return 0.9 * min(rates) if len(rates) == 2 else 25.0


def clock_args(phases: dict) -> List[str]:
    """`stweaver plan` options for the offload schedule's clock from the device time per
    phase of a run without offload: the iteration's duration and forward's share of it.
    Nothing when the phases were not measured (the planner then uses its defaults)."""
    fwd = phases.get("device_forward")
    total = sum(phases.get("device_" + k) or 0 for k in ("forward", "backward", "optimizer"))
    if not fwd or not total:
        return []
    return ["--iteration-ms", f"{total:.3f}", "--forward-share", f"{fwd / total:.4f}"]


def plan_command(args, src: str, budget: int, plan_path: str, row: str, phases: dict) -> List[str]:
    """`stweaver plan` for a plan row: the budget, the link, the schedule's clock."""
    cmd = [args.stweaver_bin, "plan", src, "--budget", str(budget), "--link-gbps",
           str(args.link_gbps), "--json", "-o", plan_path,
           "--reuse-offloaded", "at-pack" if row.endswith("at_pack") else "after-copy"]
    if row == "stweaver_plan_devtime":
        return cmd + ["--timing", "trace"]
    # The schedule's clock: the unlimited run's device time per iteration and forward's
    # share of it (CUDA events).
    return cmd + clock_args(phases)


def run_planner(cmd: List[str]) -> dict:
    """The planner's JSON report; ``{"error", "rc"}`` when it refused or failed."""
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if cp.returncode != 0:
        return {"error": (cp.stderr or cp.stdout)[-2000:], "rc": cp.returncode}
    try:
        return json.loads(cp.stdout)
    except ValueError:
        return {"error": (cp.stderr or cp.stdout)[-2000:], "rc": cp.returncode}


def planned_wait_ms(planned: dict) -> Optional[float]:
    """The planner's own estimate of the time its schedule leaves compute waiting on the link
    per iteration (copy-out waits + copy-back stalls); None when it refused."""
    if planned.get("error"):
        return None
    o = planned.get("offload") or {}
    return ((o.get("copy_out_wait_us") or 0) + (o.get("stall_us") or 0)) / 1e3


def hybrid_candidates(n_blocks: int) -> List[int]:
    """The numbers of recomputed blocks the hybrid row tries, in order: 0, then about 1/8,
    1/4, 3/8, 1/2 and 3/4 of the blocks (Llama 1B's 16: 0, 2, 4, 6, 8, 12)."""
    ks = [0]
    for f in (1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4):
        k = max(1, round(n_blocks * f))
        if k not in ks and k <= n_blocks:
            ks.append(k)
    return ks


def hybrid_choices(n_blocks: int, wheres: List[str]) -> List[tuple]:
    """(where, k) in the order tried: nothing recomputed first, then each k of
    :func:`hybrid_candidates` at each placement ("last" blocks, "first" blocks)."""
    return [(wheres[0], 0)] + [(wh, k) for k in hybrid_candidates(n_blocks)[1:] for wh in wheres]


def predicted_ms(k: int, n_blocks: int, forward_ms: float, wait_ms: Optional[float]) -> Optional[float]:
    """What k recomputed blocks are expected to add to a step: k/N of forward's device time
    (backward runs their forward again) plus the plan's planned waits; None if refused."""
    if wait_ms is None:
        return None
    return k / n_blocks * forward_ms + wait_ms


def sweep_done(sweep: List[dict], step_ms: float) -> bool:
    """Asked after each k, every placement tried: stop trying more recomputed blocks once the
    best plan found waits no more than 2 % of the unlimited step (more recomputation only
    adds time), or three k's larger than the best's were tried (predicted worse or refused (the
    prediction grows with k past its minimum; one k can be refused, or barely better, where
    a larger one is not: GPT-2 XL at 0.8 x LB, 3 blocks refused, 6 predicted worse than 0)."""
    ok = [s for s in sweep if s.get("predicted_ms") is not None]
    if not ok:
        return False
    best = min(ok, key=lambda s: s["predicted_ms"])
    if best["wait_ms"] <= 0.02 * step_ms:
        return True
    return len({s["k"] for s in sweep if s["k"] > best["k"]}) >= 3


def derive(row: dict, ref: dict, link: dict) -> dict:
    """The row's numbers relative to the unlimited run and the link."""
    d = {}
    if row.get("step_median_s") and ref.get("step_median_s"):
        d["step_median_ratio"] = row["step_median_s"] / ref["step_median_s"]
        d["step_min_ratio"] = row["step_min_s"] / ref["step_min_s"]
    a, b = row.get("losses") or [], ref.get("losses") or []
    n = min(len(a), len(b))
    d["losses_compared"] = n
    d["losses_equal"] = bool(n) and a[:n] == b[:n]
    mv = row.get("moved_bytes_per_iter") or []
    d["moved_bytes_per_iter"] = statistics.median(mv) if mv else 0
    o = row.get("offload") or {}
    for k in ("d2h", "h2d"):
        bw = o.get(k + "_GBps")
        d[k + "_GBps"] = bw
        peak = link.get(k + "_GBps")
        d[k + "_of_link"] = bw / peak if bw and peak else None
    if not o and mv and row.get("step_median_s"):
        # save_on_cpu: no copy events; bytes over the whole step (a lower bound of the rate)
        d["moved_GBps_over_step"] = d["moved_bytes_per_iter"] / row["step_median_s"] / 1e9
    return d


def cap_summary(doc: dict, cap_gib: float) -> dict:
    """Tokens/s each row kind reaches under the fixed cap: per kind, the batch that fits (every
    iteration ran) with the most tokens per second (median step)."""
    best: Dict[str, dict] = {}
    for w in doc["workloads"]:
        c = w["config"]
        base = c.get("base_name", c["name"])
        for r in w["rows"]:
            if not r.get("ok") or not r.get("step_median_s"):
                continue
            tps = c["batch"] * c["seq"] / r["step_median_s"]
            key = f"{base}/{r['row']}"
            if key not in best or tps > best[key]["tokens_per_s"]:
                best[key] = {"workload": base, "row": r["row"], "batch": c["batch"], "tokens_per_s": tps,
                             "step_median_s": r["step_median_s"], "max_reserved": r.get("max_reserved"),
                             "mode": r.get("offload_mode")}
    return {"cap_gib": cap_gib, "best": list(best.values())}


def fmt_cap(cap: dict) -> List[str]:
    lines = [f"tokens/s under a {cap['cap_gib']:.2f} GiB cap (the best batch each allocator fits):"]
    for b in sorted(cap["best"], key=lambda x: (x["workload"], -x["tokens_per_s"])):
        lines.append(f"  {b['workload']:<14} {b['row']:<17} batch {b['batch']:>3}  {b['tokens_per_s']:9.0f} tokens/s  "
                     f"step {b['step_median_s']:.3f}s  peak {(b.get('max_reserved') or 0) / GiB:.2f}G")
    return lines


def fmt_table(doc: dict) -> str:
    lines = [f"{'workload':<14} {'row':<17} {'budget':>9} {'fits':<5} {'peak res':>9} "
             f"{'step med':>9} {'x unlim':>8} {'1st it':>8} {'moved/it':>9} {'pinned':>8} {'D2H%':>5} {'H2D%':>5} "
             f"{'loss=':<6} mode"]
    for w in doc["workloads"]:
        ref = w["unlimited"]
        lines.append(f"{w['name']:<14} {'unlimited':<17} {'-':>9} {str(ref.get('ok')):<5} "
                     f"{(ref.get('max_reserved') or 0) / GiB:8.2f}G {_s(ref.get('step_median_s')):>9} "
                     f"{'1.000':>8} {_s(ref.get('first_step_s')):>8} {'-':>9} {'-':>8} {'-':>5} {'-':>5} {'-':<6}")
        for r in w["rows"]:
            d = r.get("derived", {})
            fits = "yes" if r.get("ok") else ("OOM" if r.get("oom") else "err")
            pct = lambda v: f"{100 * v:4.0f}" if v else "-"  # noqa: E731
            ratio = d.get("step_median_ratio")
            lines.append(
                f"{'':<14} {r['row']:<17} "
                f"{('uncapped' if r['row'] in ('unlimited_aa', 'recompute_k') else '%5.2fxLB' % r['fraction']):>9} {fits:<5} "
                f"{(r.get('max_reserved') or 0) / GiB:8.2f}G {_s(r.get('step_median_s')):>9} "
                f"{(f'{ratio:.3f}' if ratio else '-'):>8} {_s(r.get('first_step_s')):>8} "
                f"{d.get('moved_bytes_per_iter', 0) / GiB:8.2f}G "
                f"{_gib(r.get('pinned_max')):>8} "
                f"{pct(d.get('d2h_of_link')):>5} {pct(d.get('h2d_of_link')):>5} "
                f"{('yes' if d.get('losses_equal') else 'NO' if d.get('losses_compared') else '-'):<6} "
                f"{r.get('offload_mode') or ''}"
                f"{' + %d blocks recomputed (%s)' % (len(r['recomputed']), r.get('recompute_where')) if r.get('recomputed') else ''}"
                f"{_given_up(r)}")
    link = doc.get("link") or {}
    lines.append(f"link: H2D {_g(link.get('h2d_GBps'))} GB/s, D2H {_g(link.get('d2h_GBps'))} GB/s (pinned 1 GiB)")
    if doc.get("cap"):
        lines += fmt_cap(doc["cap"])
    return "\n".join(lines)


def _given_up(r: dict) -> str:
    """A warning when stweaver gave its plan up during the row (its later iterations
    were served online, whatever the offloader's mode says)."""
    for i, m in enumerate(r.get("modes") or []):
        if "given up" in str(m):
            return f"; PLAN GIVEN UP at iteration {i} (then online)"
    return ""


def _gib(x) -> str:
    return f"{x / GiB:7.2f}G" if x is not None else "-"


def _s(x) -> str:
    return f"{x:.3f}s" if x else "-"


def _g(x) -> str:
    return f"{x:.1f}" if x else "-"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    ap.add_argument("--dry-run", action="store_true", help="tiny models on CPU, no GPU: checks the plumbing")
    ap.add_argument("--iters", type=int, default=8, help="measured iterations per row")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--extra-auto", type=int, default=12, help="stweaver: iterations allowed for record+plan")
    ap.add_argument("--fractions", default="0.9,0.8,0.7", help="budgets as fractions of LB (--dry-run: 0.8)")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--child-env", default="",
                    help="KEY=VALUE[,KEY=VALUE...] set in every training child (whose environment is "
                         "otherwise cleared of STWEAVER_* and allocator settings): an experiment knob, "
                         "e.g. STWEAVER_PIN_THREADS=8")
    ap.add_argument("--workloads", default=",".join(w["name"] for w in WORKLOADS))
    ap.add_argument("--batch", type=int, default=None, help="override the micro-batch (sequences)")
    ap.add_argument("--batches", default="",
                    help="run each workload at each of these micro-batches (e.g. 5,6,7,8): with --cap-gib, "
                         "the tokens/s each allocator reaches at a fixed cap, at the best batch it fits")
    ap.add_argument("--cap-gib", type=float, default=None,
                    help="one fixed budget (GiB) for every workload and batch instead of --fractions of LB")
    ap.add_argument("--min-bytes", type=int, default=1 << 20, help="threshold offload: smallest tensor")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per child process")
    ap.add_argument("--profile", type=int, default=0,
                    help="N more steps per row after the measured ones, forward and backward under "
                         "cProfile (host time by function, in the JSON and profile_<row>.txt)")
    ap.add_argument("--timeline", type=int, default=0,
                    help="N more steps per row after the measured ones under torch.profiler: the "
                         "compute stream's busy / idle time per phase and the copies in flight "
                         "while it idles (python/bench/timeline.py; trace kept gzipped in --out)")
    ap.add_argument("--stweaver-bin", default="", help="the stweaver CLI (stweaver_plan row)")
    ap.add_argument("--hybrid-where", default="last,first",
                    help="stweaver_hybrid: which blocks to recompute, tried in turn at each k (last, first)")
    ap.add_argument("--hybrid-k", default="",
                    help="stweaver_hybrid: only these numbers of recomputed blocks (e.g. 6 or 3,6), "
                         "instead of the sweep from 0 (a choice a sweep made before, re-measured)")
    ap.add_argument("--served-traces", action="store_true",
                    help="plan rows: record each plan run's own requests (STWEAVER_TRACE in plan mode) "
                         "and keep them with the plan files in --out, for `stweaver replay` on a CPU")
    ap.add_argument("--train-cpus", default="",
                    help="pin every training child to these CPUs (e.g. 8-15; 'auto': the upper half, "
                         "as gpu_bench does, since CPU 0 takes most interrupts); the driver and the "
                         "planner move to the others. Default: no pinning")
    ap.add_argument("--link-gbps", type=float, default=None,
                    help="stweaver plan --link-gbps (default: 90 %% of the slower direction of the "
                         "link measured at the start, else 25)")
    args = ap.parse_args(argv)

    if args.dry_run and args.fractions == "0.9,0.8,0.7":
        args.fractions = "0.8"  # one budget: every row and workload still runs
    fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    rows = [r for r in args.rows.split(",") if r.strip()]
    try:
        extra_env = parse_child_env(args.child_env)
    except ValueError as e:
        ap.error(str(e))
    bad = [r for r in rows if r not in ROWS]
    if bad:
        ap.error(f"unknown rows {bad} (known: {', '.join(ROWS)})")
    names = [n for n in args.workloads.split(",") if n.strip()]
    pool = dry_workloads() if args.dry_run else [dict(w) for w in WORKLOADS]
    wls = [w for w in pool if w["name"] in names]
    if not wls:
        ap.error(f"no workload among {names}")
    if args.batch:
        for w in wls:
            w["batch"] = args.batch
    if args.batches:
        wls = [dict(w, batch=b, name=f"{w['name']}_b{b}", base_name=w["name"])
               for w in wls for b in (int(x) for x in args.batches.split(",") if x.strip())]
    if args.dry_run:
        args.iters, args.warmup, args.extra_auto = min(args.iters, 3), min(args.warmup, 1), 0
        args.min_bytes = 0  # tiny tensors: offload them all
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="stweaver-budget-")
    cpus = train_cpus(args.train_cpus)
    base = {"dry_run": args.dry_run, "iters": args.iters, "cpus": cpus, "warmup": args.warmup,
            "extra_auto": args.extra_auto, "min_bytes": args.min_bytes, "profile": args.profile,
            "timeline": args.timeline, "profile_dir": args.out, "extra_env": extra_env}
    doc = {"schema": 1, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "dry_run": args.dry_run,
           "fractions": fractions, "args": vars(args), "workloads": []}
    path = os.path.join(args.out, "budget_bench.json")

    def save():
        write_json(path, doc)

    doc["link"] = spawn(dict(base, row="link"), tmp, args.timeout_s)
    print(f"link: {doc['link']}", flush=True)
    if args.link_gbps is None:
        args.link_gbps = planning_link_gbps(doc["link"])
        print(f"planning with --link-gbps {args.link_gbps:.1f}", flush=True)
    for w in wls:
        entry = {"name": w["name"], "config": w, "rows": []}
        doc["workloads"].append(entry)
        ref = spawn(dict(base, row="unlimited", workload=w), tmp, args.timeout_s)
        entry["unlimited"] = ref
        if not ref.get("ok"):
            print(f"{w['name']}: the unlimited run failed: {ref.get('error')}", flush=True)
            save()
            continue
        lb = ref["max_allocated"]
        entry["lower_bound"] = lb
        entry["lower_bound_source"] = "torch.cuda.max_memory_allocated of the unlimited run"
        print(f"{w['name']}: unlimited ok, LB {lb / GiB:.2f} GiB, step {_s(ref.get('step_median_s'))}, "
              f"phases (median ms) {json.dumps(ref.get('phases_ms'))}, "
              f"host clock {json.dumps(ref.get('host_clock_median'))}", flush=True)
        if ref.get("timeline"):
            print(f"{w['name']}: unlimited timeline (median per phase) {json.dumps(ref['timeline'])}", flush=True)
        trace = None
        # The plain trace (nothing recomputed): every plan row's but the device-timed one's,
        # and the hybrid sweep's start (unless --hybrid-k leaves 0 out).
        hybrid_ks = [int(k) for k in args.hybrid_k.split(",") if k.strip()]
        plain = [r for r in rows if r in PLAN_ROWS and r != "stweaver_plan_devtime"
                 and not (r == "stweaver_hybrid" and hybrid_ks and 0 not in hybrid_ks)]
        if plain and not args.dry_run:
            trace = os.path.join(tmp, w["name"] + ".stwt")
            tr = spawn(dict(base, row="stweaver_trace", workload=w, trace=trace), tmp, args.timeout_s)
            entry["trace_run"] = {k: tr.get(k) for k in ("ok", "error", "max_allocated", "max_reserved",
                                                       "step_median_s", "trace_files", "log_tail")}
            print(f"{w['name']}: trace run {'ok' if tr.get('ok') else tr.get('error')}", flush=True)
            trace = (tr.get("trace_files") or [trace])[0] if tr.get("ok") else None
            if trace and os.path.isfile(trace):
                # Kept beside the results: the planner can be re-run on it on a CPU.
                shutil.copy(trace, os.path.join(args.out, os.path.basename(trace)))
        devtrace = None
        if "stweaver_plan_devtime" in rows and not args.dry_run:
            devtrace = os.path.join(tmp, w["name"] + "_devtime.stwt")
            tr = spawn(dict(base, row="stweaver_trace", workload=w, trace=devtrace,
                            env={"CUDA_LAUNCH_BLOCKING": "1"}), tmp, args.timeout_s)
            entry["devtime_trace_run"] = {k: tr.get(k) for k in ("ok", "error", "step_median_s", "log_tail")}
            print(f"{w['name']}: device-timed trace run (CUDA_LAUNCH_BLOCKING=1) "
                  f"{'ok' if tr.get('ok') else tr.get('error')}, step {_s(tr.get('step_median_s'))}", flush=True)
            devtrace = (tr.get("trace_files") or [devtrace])[0] if tr.get("ok") else None
            if devtrace and os.path.isfile(devtrace):
                shutil.copy(devtrace, os.path.join(args.out, os.path.basename(devtrace)))
        # stweaver_hybrid: a trace run per number of recomputed blocks, made when first needed
        # and shared by every budget.
        wheres = [x for x in args.hybrid_where.split(",") if x.strip()]
        traces = {(wh, 0): trace for wh in wheres}
        n_blocks = w["layers"]

        def trace_for(where: str, k: int) -> Optional[str]:
            if (where, k) not in traces:
                path = os.path.join(tmp, f"{w['name']}_{where}{k}.stwt")
                tr = spawn(dict(base, row="stweaver_trace", workload=w, trace=path, recompute=k,
                                recompute_where=where), tmp, args.timeout_s)
                entry.setdefault("hybrid_trace_runs", {})[f"{where}{k}"] = {
                    kk: tr.get(kk) for kk in ("ok", "error", "step_median_s", "max_allocated", "recomputed",
                                              "log_tail")}
                print(f"{w['name']}: trace run with the {where} {k} blocks recomputed "
                      f"{'ok' if tr.get('ok') else tr.get('error')}", flush=True)
                got = (tr.get("trace_files") or [path])[0] if tr.get("ok") else None
                if got and os.path.isfile(got):
                    shutil.copy(got, os.path.join(args.out, os.path.basename(got)))  # CPU re-planning
                traces[(where, k)] = got
            return traces[(where, k)]

        # A fixed cap: the one budget, as its fraction of this workload's LB.
        fracs = [args.cap_gib * GiB / lb] if args.cap_gib and lb else fractions
        for f in fracs:
            budget = int(f * lb) if lb else None
            for row in rows:
                extra = {}
                if row == "stweaver_hybrid" and args.dry_run:
                    # No planner on a CPU: the plumbing of recomputing a few blocks (losses
                    # bitwise those of the unlimited run) with nothing offloaded.
                    extra = {"recompute": hybrid_candidates(n_blocks)[1]}
                elif row in PLAN_ROWS:
                    if args.dry_run or not args.stweaver_bin:
                        continue
                    plan_path = os.path.join(tmp, f"{w['name']}_{f}_{row}.stwp")
                    phases = ref.get("phases_ms") or {}
                    sweep: List[dict] = []
                    if row == "stweaver_hybrid":
                        # Try more recomputed blocks until the planned waits stop paying for them.
                        fwd_ms = phases.get("device_forward") or 0.0
                        best = None
                        choices = hybrid_choices(n_blocks, wheres)
                        if hybrid_ks:
                            choices = [(wh, k) for k in hybrid_ks for wh in wheres]
                        for ci, (where, k) in enumerate(choices):
                            src = trace_for(where, k)
                            if src is not None:
                                kpath = os.path.join(tmp, f"{w['name']}_{f}_{row}_{where}{k}.stwp")
                                p = run_planner(plan_command(args, src, budget, kpath, row, phases))
                                wait = planned_wait_ms(p)
                                s = {"k": k, "where": where, "wait_ms": wait,
                                     "predicted_ms": predicted_ms(k, n_blocks, fwd_ms, wait),
                                     "bytes_per_iteration": (p.get("offload") or {}).get("bytes_per_iteration"),
                                     "refused": (p.get("error") or "")[-300:] or None}
                                sweep.append(s)
                                print(f"  {f:.2f} x LB hybrid {where} {k}: planned wait {wait} ms, predicted "
                                      f"+{s['predicted_ms']} ms{' (refused)' if wait is None else ''}", flush=True)
                                if wait is not None and (best is None or s["predicted_ms"] < best[0]["predicted_ms"]):
                                    best = (s, p, kpath, src)
                            level_done = ci + 1 == len(choices) or choices[ci + 1][1] != k
                            if level_done and sweep_done(sweep, (ref.get("step_median_s") or 0) * 1e3):
                                break
                        if best is None:
                            planned = {"error": "every number of recomputed blocks was refused: "
                                       + str(sweep[-1]["refused"] if sweep else "no trace"), "rc": 1, "sweep": sweep}
                        else:
                            planned = dict(best[1], sweep=sweep, recompute=best[0]["k"],
                                           recompute_where=best[0]["where"])
                            shutil.copy(best[2], plan_path)
                    else:
                        src = devtrace if row == "stweaver_plan_devtime" else trace
                        if src is None:
                            continue
                        planned = run_planner(plan_command(args, src, budget, plan_path, row, phases))
                    if planned.get("error"):
                        r = {"ok": False, "row": row, "error": "stweaver plan refused: " + planned["error"][-500:],
                             "planner": planned}
                        r["fraction"] = f
                        r["derived"] = {}
                        entry["rows"].append(r)
                        print(f"  {f:.2f} x LB {row}: planner refused: {planned['error'][-300:]}", flush=True)
                        save()
                        continue
                    extra = {"plan": plan_path, "planner": planned}
                    if planned.get("recompute"):
                        extra["recompute"] = planned["recompute"]
                        extra["recompute_where"] = planned["recompute_where"]
                    if args.served_traces:
                        extra["served_trace"] = os.path.join(tmp, f"{w['name']}_{f}_{row}_served.stwt")
                        shutil.copy(plan_path, args.out)
                if row == "stweaver_offload" and not args.dry_run:
                    extra = {"auto_trace": os.path.join(tmp, f"{w['name']}_auto_{f}.stwt")}
                if row == "unlimited_aa":  # the A/A control: the reference, uncapped, again
                    r = spawn(dict(base, row="unlimited", workload=w, fraction=f), tmp, args.timeout_s)
                    r["row"] = row
                elif row == "recompute_k":  # the hybrid's recomputation alone, uncapped
                    if not hybrid_ks:
                        ap.error("--rows recompute_k needs --hybrid-k")
                    r = spawn(dict(base, row="unlimited", workload=w, fraction=f, recompute=hybrid_ks[0],
                                   recompute_where=wheres[0]), tmp, args.timeout_s)
                    r["row"] = row
                else:
                    r = spawn(dict(base, row=row, workload=w, fraction=f, budget=budget, **extra), tmp,
                              args.timeout_s)
                for kept in ("auto_trace", "served_trace"):
                    if extra.get(kept) and os.path.isfile(extra[kept]):
                        shutil.copy(extra[kept], args.out)
                if extra.get("planner"):
                    r["planner"] = extra["planner"]
                r["fraction"] = f
                r["derived"] = derive(r, ref, doc["link"])
                entry["rows"].append(r)
                state = "ok" if r.get("ok") else ("OOM" if r.get("oom") else f"error: {r.get('error')}")
                print(f"  {f:.2f} x LB {row}: {state}", flush=True)
                for line in row_details(r):
                    print(f"    {line}", flush=True)
                save()
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if args.cap_gib:
        doc["cap"] = cap_summary(doc, args.cap_gib)
    save()
    table = fmt_table(doc)
    write_table(args.out, "budget_bench", table)
    print(f"\nwritten: {path}\n")
    print(table)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        sys.exit(child_main())
    sys.exit(main())
