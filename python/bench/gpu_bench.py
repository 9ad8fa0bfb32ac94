#!/usr/bin/env python3
"""stweaver GPU benchmark: real training loops under PyTorch native, expandable segments and
stweaver (auto; trace -> `stweaver plan` -> plan), each in a fresh process, on one GPU.

    python python/bench/gpu_bench.py run --out DIR --stweaver-bin PATH [--budget-s S]
    python python/bench/gpu_bench.py run --dry-run --out DIR     (CPU, tiny models, fake stweaver)
    python python/bench/gpu_bench.py report DIR/gpu_bench.json [--markdown]

`cargo xtask gpu-bench` prepares what the GPU machine needs and prints the device command
(`scripts/gpu_bench.sh`, which builds the extension and calls `run`).

Workloads: the training configs of data/traces/make_traces.py (Hugging Face transformers
models, random init, bf16, AdamW, random token ids), plus a variable-sequence-length loop. Per
workload and allocator one fresh process trains N iterations and reports peak reserved / peak
allocated (PyTorch's own counters), per-iteration step times (synchronised), the losses (bitwise,
as float.hex) and a digest of the parameters after iteration N-1. stweaver auto runs go on past N
(up to `max_iters`) until the plan has served a few iterations after the online cache was
released; its peaks are also reported over that window ("after switch"). Finally, for one dense
workload, the largest micro-batch that fits under a fixed cap
(`torch.cuda.set_per_process_memory_fraction`) per allocator, and tokens/s at it.

Fresh processes are spawned ahead (they import torch and transformers while the previous run
builds its model and warms up, then wait for their spec on stdin); nothing touches CUDA before
the spec arrives, so stweaver can still be installed and PYTORCH_CUDA_ALLOC_CONF (set at spawn)
applies.

Step time (see BENCHMARKS.md, "Session 5: step-time method"): the training child runs pinned
to one half of the CPUs, children importing and the driver on the other (`--no-pin`: no
pinning). Each child signals "imports done" through a ready file; with `--quiet` a run waits
for every pre-spawned child's before its first counted iteration (no import overlaps a timed
window; it costs ~9 s a run on the H200, and did not remove the noise there). Every iteration records wall time, the
time spent launching and then waiting for the GPU, CPU time, run-queue wait and the machine's
other CPU use (`diag`). The step-time verdict per workload and allocator is the median of
paired per-iteration ratios to native (the same iteration of the same round) with a 95 %
bootstrap CI that resamples rounds, then iterations: "within 1 %" only when the CI lies in
[0.99, 1.01]. `--step-rounds 2,gpt2xl_rcp=4` adds interleaved rounds (native first, then last,
alternately), more for the noisy loops.

Lockstep (`--lockstep 30,qwenmoe_eager_rcp=12`; lockstep.py, BENCHMARKS.md "Session 6"):
after the trace run, the other allocators and a second native process (the A/A control) train
side by side on the GPU, all pinned to the same training CPUs, and take turns: round r runs
iteration S + r of each, one at a time, in an order that rotates and reverses, so each
allocator's iteration is paired with native's from the same round, a second apart, on the same
data. Memory and losses come from the same processes.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

from lockstep import bootstrap_median_ci, step_verdict  # noqa: F401 (shared with gpu_dist_bench)

try:
    import resource
except ImportError:  # not on Linux: no per-thread context-switch counts
    resource = None

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PY_DIR = os.path.join(REPO, "python")
GiB = float(1 << 30)
MiB = float(1 << 20)

# ------------------------------------------------------------------ workloads

# The configs of make_traces.py (same names, sizes and loops); iterations scaled to fit one call.
WORKLOADS = [
    dict(name="llama1b_rcp", family="llama", hidden=2048, layers=16, heads=16, inter=5632,
         batch=8, seq=2048, ckpt=True, micro=2, iters=16, est_s=12,
         note="Llama 1B, 8 x 2048 tokens in 2 micro-batches, activation checkpointing"),
    dict(name="gpt2xl_rcp", family="gpt2", hidden=1600, layers=24, heads=25, inter=6400,
         batch=8, seq=1024, ckpt=True, micro=2, iters=16, est_s=10,
         note="GPT-2 XL, 8 x 1024 in 2 micro-batches, checkpointing"),
    dict(name="qwenmoe_eager_rcp", family="qwen2moe", hidden=1024, layers=12, heads=16, inter=2816,
         batch=8, seq=1024, ckpt=True, micro=2, experts=16, topk=4, moe_inter=1408,
         experts_impl="eager", iters=10, max_iters=24, est_s=16,
         note="Qwen2-MoE 16 experts top-4, eager experts (token-dependent shapes), checkpointing"),
    # make_traces' llama1b_1f1b is batch 16 (8 micro-batches of 2); halved here to fit the call.
    dict(name="llama1b_1f1b", family="llama", hidden=2048, layers=16, heads=16, inter=5632,
         batch=8, seq=2048, ckpt=True, micro=8, inflight=4, iters=12, est_s=12,
         note="Llama 1B, 1F1B-style: 8 micro-batches of 1 x 2048, 4 in flight (batch 16 -> 8)"),
    # Added: every micro-batch has its own sequence length (uniform in [256, 2048]), so the
    # request sizes change every iteration and never repeat with a short period.
    dict(name="llama1b_varlen", family="llama", hidden=2048, layers=16, heads=16, inter=5632,
         batch=8, seq=2048, seq_min=256, ckpt=True, micro=2, iters=16, est_s=10,
         note="Llama 1B, 2 micro-batches of 4 x L, L uniform in [256, 2048] per micro-batch"),
]

# The loops of the "memory you can spend" search: the largest micro-batch B that trains
# under a fixed cap (torch.cuda.set_per_process_memory_fraction), one micro-batch per
# iteration, checkpointing. Llama 1B (dense, B x 2048), GPT-2 XL (B x 1024) and Llama 1B
# with a sequence length drawn per iteration (B x L, L uniform in [256, 2048]: shapes that
# never repeat). `guess`: the first B tried when nothing better is known.
CAP_WORKLOAD = dict(name="llama1b_cap", family="llama", hidden=2048, layers=16, heads=16, inter=5632,
                    batch=1, seq=2048, ckpt=True, micro=1, iters=6, max_iters=18, est_s=10,
                    cap_bytes=16 * (1 << 30), guess=10)
CAP_WORKLOADS = [
    CAP_WORKLOAD,
    dict(name="gpt2xl_cap", family="gpt2", hidden=1600, layers=24, heads=25, inter=6400,
         batch=1, seq=1024, ckpt=True, micro=1, iters=6, max_iters=18, est_s=10,
         cap_bytes=12 * (1 << 30), guess=8),
    dict(name="llama1b_varlen_cap", family="llama", hidden=2048, layers=16, heads=16, inter=5632,
         batch=1, seq=2048, seq_min=256, ckpt=True, micro=1, iters=8, max_iters=18, est_s=10,
         cap_bytes=14 * (1 << 30), guess=7),
]
CAP_BYTES = CAP_WORKLOAD["cap_bytes"]
CAP_ALLOCATORS = ("native", "expandable", "auto")

# Tiny shapes for --dry-run (CPU).
DRY = dict(hidden=64, layers=2, heads=4, inter=128, moe_inter=32, experts=4, topk=2, vocab=1000,
           seq=32, seq_min=8, batch=4, iters=5, max_iters=10)

ALLOCATORS = ("native", "expandable", "trace", "plan", "auto")
LABELS = {
    "native": "PyTorch native",
    "expandable": "expandable segments",
    "trace": "stweaver online (trace run)",
    "auto": "stweaver auto (whole run)",
    "auto_steady": "stweaver auto (after switch)",
    "plan": "stweaver plan (trace -> plan)",
    "native_aa": "PyTorch native, 2nd process (A/A)",
}
# Lockstep's control: a second native process, compared with the first like any allocator.
CONTROL = "native_aa"
WARMUP = 3  # iterations left out of step-time medians


def dry_workloads() -> List[dict]:
    out = []
    for w in WORKLOADS:
        d = dict(w)
        for k in ("hidden", "layers", "heads", "inter", "moe_inter", "experts", "topk", "seq", "batch"):
            if k in d:
                d[k] = DRY[k]
        if "seq_min" in d:
            d["seq_min"] = DRY["seq_min"]
        d["vocab"] = DRY["vocab"]
        d["iters"] = DRY["iters"]
        if "max_iters" in d:
            d["max_iters"] = DRY["max_iters"]
        d["micro"] = min(d["micro"], d["batch"])
        out.append(d)
    return out


# ------------------------------------------------------------------ child (one training run)


class _FakeStweaver:
    """--dry-run stand-in for the stweaver module (CPU has no CUDA allocator to replace)."""

    def __init__(self, mode: str, trace: Optional[str]):
        self._mode, self._trace, self._steps = mode, trace, 0

    def step(self):
        self._steps += 1

    def mode(self) -> str:
        if self._mode != "auto":
            return self._mode
        if self._steps <= 4:
            return "auto (recording)"
        return "auto (planning)" if self._steps <= 5 else "auto (plan)"

    def stats(self) -> dict:
        return {"mode": self.mode(), "dry_run": True, "devices": []}

    def flush_trace(self) -> List[str]:
        return [self._trace] if self._trace and os.path.isfile(self._trace) else []


def _build_model(c: dict, device, torch):
    import transformers as tf

    fam = c["family"]
    if fam == "llama":
        cfg = tf.LlamaConfig(hidden_size=c["hidden"], num_hidden_layers=c["layers"],
                             num_attention_heads=c["heads"], num_key_value_heads=c["heads"],
                             intermediate_size=c["inter"], vocab_size=c.get("vocab", 32000),
                             max_position_embeddings=c["seq"])
        cls = tf.LlamaForCausalLM
    elif fam == "gpt2":
        cfg = tf.GPT2Config(n_embd=c["hidden"], n_layer=c["layers"], n_head=c["heads"],
                            n_inner=c["inter"], vocab_size=c.get("vocab", 50257), n_positions=c["seq"])
        cls = tf.GPT2LMHeadModel
    elif fam == "qwen2moe":
        cfg = tf.Qwen2MoeConfig(hidden_size=c["hidden"], num_hidden_layers=c["layers"],
                                num_attention_heads=c["heads"], num_key_value_heads=c["heads"],
                                intermediate_size=c["inter"], vocab_size=c.get("vocab", 32000),
                                num_experts=c["experts"], num_experts_per_tok=c["topk"],
                                moe_intermediate_size=c["moe_inter"],
                                shared_expert_intermediate_size=c["moe_inter"],
                                max_position_embeddings=c["seq"])
        if c.get("experts_impl"):
            cfg._experts_implementation = c["experts_impl"]
        cls = tf.Qwen2MoeForCausalLM
    else:
        raise ValueError(fam)
    # Initialised directly on the device in bf16 (seeded; the same bits under every allocator).
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            m = cls(cfg)
    finally:
        torch.set_default_dtype(prev)
    m = m.to(device=device, dtype=torch.bfloat16)
    if c["ckpt"]:
        m.gradient_checkpointing_enable()
    m.config.use_cache = False
    m.train()
    return m, getattr(m.config, "_experts_implementation", None)


def _median(xs: List[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


class IterClock:
    """Per-iteration diagnostics, read just outside the timed window: this thread's CPU time,
    the process's, this thread's wait on the run queue (/proc/thread-self/schedstat, ns),
    involuntary / voluntary context switches (getrusage of the thread), and from /proc/stat
    every CPU's busy and steal time (clock ticks). What cannot be read is left out."""

    KEYS = ("cpu_s", "proc_cpu_s", "runq_s", "nivcsw", "nvcsw", "host_busy_s", "steal_s")

    def snap(self) -> dict:
        s = {"cpu_s": time.thread_time(), "proc_cpu_s": time.process_time()}
        ss = _read("/proc/thread-self/schedstat")
        if ss:
            f = ss.split()
            if len(f) >= 2:
                s["runq_s"] = int(f[1]) / 1e9
        if resource is not None and hasattr(resource, "RUSAGE_THREAD"):
            ru = resource.getrusage(resource.RUSAGE_THREAD)
            s["nivcsw"], s["nvcsw"] = ru.ru_nivcsw, ru.ru_nvcsw
        st = _read("/proc/stat")
        if st and st.startswith("cpu "):
            f = [int(x) for x in st.split("\n", 1)[0].split()[1:]]
            if len(f) >= 8:
                # user nice system idle iowait irq softirq steal
                s["host_busy_s"] = (f[0] + f[1] + f[2] + f[5] + f[6]) / _CLK_TCK
                s["steal_s"] = f[7] / _CLK_TCK
        return s

    @staticmethod
    def delta(a: dict, b: dict) -> dict:
        return {k: b[k] - a[k] for k in IterClock.KEYS if k in a and k in b}


def pin_process(cpus: List[int]) -> List[int]:
    """Every thread of this process onto `cpus` (threads started later inherit it)."""
    cpus = sorted(set(cpus) & os.sched_getaffinity(0)) or sorted(os.sched_getaffinity(0))
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for t in tids:
        try:
            os.sched_setaffinity(t, cpus)
        except OSError:
            pass
    return cpus


def wait_ready(paths: List[str], timeout: float) -> Tuple[float, List[str]]:
    """Wait until every path exists (children that finished importing): seconds waited and the
    paths still missing at the timeout."""
    t0 = time.perf_counter()
    left = [p for p in paths if not os.path.exists(p)]
    while left and time.perf_counter() - t0 < timeout:
        time.sleep(0.02)
        left = [p for p in left if not os.path.exists(p)]
    return time.perf_counter() - t0, left


def run_spec(spec: dict) -> dict:
    """One training run in this (fresh) process. CUDA is first touched here."""
    import warnings

    dry = spec.get("dry_run", False)
    alloc = spec["alloc"]
    c = spec["workload"]
    res: dict = {"alloc": alloc, "workload": c["name"], "batch": c["batch"], "ok": False}
    if spec.get("cpus"):
        # Before CUDA and stweaver start their threads: they inherit the set.
        res["cpus"] = pin_process(spec["cpus"])
    st = None
    if alloc in ("auto", "trace", "plan"):
        if dry:
            st = _FakeStweaver(alloc, spec.get("trace"))
        else:
            import stweaver

            if spec.get("release_at_peak") is not None:  # read by the engine at install
                os.environ["STWEAVER_RELEASE_AT_PEAK"] = "1" if spec["release_at_peak"] else "0"
            stweaver.install(alloc, plan=spec.get("plan"), trace=spec.get("trace"), hook_optimizer=True)
            st = stweaver
    import torch

    nondet: set = set()
    _show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "determinis" in text.lower():
            nondet.add(text.splitlines()[0][:200])
        else:
            _show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    # Strict: SDPA's flash / memory-efficient backward only run their deterministic variants
    # when warn_only is off. An op with no deterministic implementation then raises; the
    # driver reruns the workload with warn_only (and the JSON says so).
    strict = c.get("strict", True)
    res["determinism"] = "strict" if strict else "warn_only"
    torch.use_deterministic_algorithms(True, warn_only=not strict)
    torch.utils.deterministic.fill_uninitialized_memory = False  # no NaN fill of torch.empty
    torch.backends.cudnn.benchmark = False
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    res["torch_threads"] = torch.get_num_threads()
    device = "cpu" if dry else "cuda"
    cuda = device == "cuda"
    res["backend"] = torch.cuda.memory.get_allocator_backend() if cuda else "cpu"
    if cuda:
        props = torch.cuda.get_device_properties(0)
        res["device"] = props.name
        res["total_memory"] = props.total_memory
        if spec.get("cap_bytes"):
            torch.cuda.set_per_process_memory_fraction(spec["cap_bytes"] / props.total_memory, 0)
    fake_cap = {"native": 3, "expandable": 4, "auto": 5}  # dry-run: simulated OOM above these

    torch.manual_seed(0)
    t_build = time.perf_counter()
    model, experts_impl = _build_model(c, device, torch)
    res["experts_impl"] = experts_impl
    res["params"] = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if isinstance(st, _FakeStweaver):
        opt.register_step_post_hook(lambda *a: st.step())  # as stweaver's optimizer hook
    if cuda:
        torch.cuda.synchronize()
    res["build_s"] = time.perf_counter() - t_build

    # Python's cyclic garbage collector runs when allocation counts say so, i.e. at a random
    # point of some iteration, and a full pass over a model's object graph takes tens of ms:
    # with --gc-outside-steps (the default) it is frozen after setup, off while an iteration
    # is timed, and run between iterations (untimed), the same for every allocator.
    gc_control = spec.get("gc_outside_steps", False)
    if gc_control:
        gc.collect()
        gc.freeze()
        gc.disable()
    res["gc_outside_steps"] = gc_control

    vocab = model.config.vocab_size
    micro, seq = c["micro"], c["seq"]
    mb = c["batch"] // micro
    inflight = c.get("inflight", 1)
    gen = torch.Generator().manual_seed(1234)
    base_n = c["iters"]
    max_n = c.get("max_iters", 2 * base_n) if alloc == "auto" else base_n
    deadline = spec.get("deadline", time.time() + 3600)
    steps, losses, seqlens, reserved, allocated, max_res, dev_used, modes = [], [], [], [], [], [], [], []
    # Per iteration: launch_s (t0 until the last op is queued) + sync_s (then waiting for the
    # GPU) = step_s; gpu_s: CUDA events around the iteration (the GPU's span, idle gaps
    # included); the IterClock deltas. sync_s near 0 means the GPU waited for the CPU
    # (launch-bound); runq_s > 0 means this thread was runnable but another one had its CPU.
    diag: Dict[str, list] = {"launch_s": [], "sync_s": [], "gpu_s": []}
    clock = IterClock()
    quiet = spec.get("quiet")
    if cuda:
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    switched_at = steady_from = None
    steady_peaks = pre_peaks = None
    digest = None
    # Lockstep (lockstep.py): once warm, every iteration waits for the driver's "go".
    turn = None
    if spec.get("lockstep"):
        from lockstep import Turn

        turn = Turn(spec["lockstep"]["cmd"], spec["lockstep"]["reply"])
    in_lockstep = False
    mode = None
    i = 0
    try:
        while True:
            if turn is not None:
                if not in_lockstep and lockstep_warm(alloc, i, mode, steady_from, max_n):
                    turn.ready(i, mode)
                    in_lockstep = True
                    res["lockstep_from"] = i
                if in_lockstep and turn.command() != "go":
                    break
            lens = []
            batches = []
            for _ in range(micro):
                L = seq
                if c.get("seq_min"):
                    L = int(torch.randint(c["seq_min"], seq + 1, (1,), generator=gen))
                lens.append(L)
                batches.append(torch.randint(0, vocab, (mb, L), generator=gen))
            if dry and spec.get("cap_bytes") and c["batch"] > fake_cap.get(alloc, 0) and i == 1:
                raise MemoryError("simulated out of memory (dry run)")
            if quiet and i == quiet.get("at", WARMUP):
                # From here on iterations count: no other child may still be importing.
                waited, missing = wait_ready(quiet.get("wait") or [], quiet.get("timeout", 60.0))
                res["quiet_wait_s"], res["quiet_missing"] = waited, missing
            if gc_control:
                gc.collect()
            if cuda:
                torch.cuda.synchronize()
            d0 = clock.snap()
            t0 = time.perf_counter()
            if cuda:
                ev0.record()
            pending, it_losses = [], []
            for x in batches:
                # 1F1B-like: keep up to `inflight` micro-batch graphs alive, backward the oldest
                x = x.to(device)
                loss = model(input_ids=x, labels=x).loss / micro
                it_losses.append(loss.detach())
                pending.append(loss)
                if len(pending) >= inflight:
                    pending.pop(0).backward()
            while pending:
                pending.pop(0).backward()
            opt.step()  # stweaver's optimizer hook marks the iteration here
            opt.zero_grad(set_to_none=True)
            t_launch = time.perf_counter()
            if cuda:
                ev1.record()
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            d1 = clock.snap()
            steps.append(t1 - t0)
            diag["launch_s"].append(t_launch - t0)
            diag["sync_s"].append(t1 - t_launch)
            if cuda:
                diag["gpu_s"].append(ev0.elapsed_time(ev1) / 1e3)
            for k, v in IterClock.delta(d0, d1).items():
                diag.setdefault(k, []).append(v)
            losses.append([float(v).hex() for v in torch.stack(it_losses).float().tolist()])
            seqlens.append(lens)
            if cuda:
                reserved.append(torch.cuda.memory_reserved())
                allocated.append(torch.cuda.memory_allocated())
                max_res.append(torch.cuda.max_memory_reserved())
                free, total = torch.cuda.mem_get_info()
                dev_used.append(total - free)
            if i == spec.get("digest_at", base_n - 1):
                # Bitwise digest of every parameter (int64 sums of the bf16 bit patterns),
                # computed on host copies: temporaries on the GPU here would be requests the
                # training loop never makes, served between two iterations (they grew stweaver's
                # pool by 1.2 GiB on Llama 1B when lockstep ran on past this iteration).
                with torch.no_grad():
                    acc = 0
                    for p in model.parameters():
                        acc += int(torch.sum(p.detach().to("cpu").view(torch.int16), dtype=torch.int64))
                    digest = acc
            mode = None
            if st is not None:
                mode = st.mode()
                modes.append(mode)
                if alloc == "auto":
                    if switched_at is None and mode == "auto (plan)":
                        switched_at = i
                    elif switched_at is not None and i == switched_at + 1:
                        # The plan served iteration i and the online cache was released at
                        # its end: measure the peaks from here on.
                        if cuda:
                            steady_peaks = (torch.cuda.memory_reserved(), torch.cuda.memory_allocated())
                            pre_peaks = (torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated())
                            torch.cuda.reset_peak_memory_stats()
                        steady_from = i + 1
            if in_lockstep:
                turn.done(i, steps[-1], mode)
            i += 1
            if turn is not None:
                if time.time() > deadline:
                    break
                continue  # the driver's "stop" ends a lockstep run
            if i < base_n:
                continue
            if alloc != "auto" or i >= max_n or time.time() > deadline:
                break
            if steady_from is not None and i - steady_from >= 4:
                break
            if mode is not None and mode.startswith("auto (online"):
                break
        res["ok"] = True
    except (torch.OutOfMemoryError, MemoryError) as e:
        res["oom"] = True
        res["oom_iter"] = i
        res["error"] = str(e).splitlines()[0][:300]
    except RuntimeError as e:
        if not (strict and "determinis" in str(e).lower()):
            raise
        res["determinism_error"] = str(e)[:500]
        res["error"] = "no deterministic implementation: " + str(e).splitlines()[0][:200]
        return res
    finally:
        if turn is not None:
            turn.close()
    res["iterations"] = i
    res["base_iters"] = base_n
    res["step_s"] = steps
    res["diag"] = diag
    res["losses"] = losses
    res["seqlens"] = seqlens if c.get("seq_min") else None
    res["param_digest"] = digest
    res["tokens_per_iter"] = [sum(L * mb for L in ls) for ls in seqlens]
    res["reserved"] = reserved
    res["allocated"] = allocated
    res["max_reserved_by_iter"] = max_res
    res["device_used"] = dev_used
    res["modes"] = modes
    res["nondeterministic_ops"] = sorted(nondet)
    if cuda:
        res["max_reserved"] = torch.cuda.max_memory_reserved()
        res["max_allocated"] = torch.cuda.max_memory_allocated()
    else:
        res["max_reserved"] = res["max_allocated"] = 0
    res["switched_at"] = switched_at
    res["steady_from"] = steady_from
    if alloc == "auto":
        if steady_from is not None and cuda:
            # reset_peak_memory_stats ran after iteration steady_from - 1: the peaks since
            # then are the window's (and the whole-run peaks are from the history below).
            res["steady_max_reserved"] = res["max_reserved"]
            res["steady_max_allocated"] = res["max_allocated"]
            res["steady_start_reserved"], res["steady_start_allocated"] = steady_peaks
            res["max_reserved"] = max(pre_peaks[0], res["max_reserved"])
            res["max_allocated"] = max(pre_peaks[1], res["max_allocated"])
        elif steady_from is not None:
            res["steady_max_reserved"] = res["steady_max_allocated"] = 0
    if st is not None:
        try:
            res["stweaver"] = st.stats()
        except Exception as e:  # report, do not lose the run
            res["stweaver"] = {"error": str(e)}
        if alloc == "trace":
            res["trace_files"] = st.flush_trace()
    return res


def lockstep_warm(alloc: str, i: int, mode: Optional[str], steady_from: Optional[int], max_n: int) -> bool:
    """May a lockstep participant start waiting for turns before iteration i? After the
    warm-up; auto also once the plan has served an iteration after the online cache was
    released, or it settled online (no steady state: MoE, variable lengths), or it ran out of
    iterations (then its rows say it never switched)."""
    if i < WARMUP:
        return False
    if alloc != "auto":
        return True
    if steady_from is not None:
        return i >= steady_from + 1
    return (mode or "").startswith("auto (online") or i >= max_n


def child_main(ready: Optional[str] = None) -> int:
    # Phase 1, before the spec arrives: imports only (no CUDA). Then `ready` is written (also
    # when an import failed), which a run in another child waits for before it times anything.
    t_imp = time.perf_counter()
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        from transformers import GPT2LMHeadModel, LlamaForCausalLM, Qwen2MoeForCausalLM  # noqa: F401
    finally:
        import_s = time.perf_counter() - t_imp
        if ready:
            with open(ready + ".tmp", "w") as f:
                json.dump({"import_s": import_s, "pid": os.getpid()}, f)
            os.replace(ready + ".tmp", ready)

    if PY_DIR not in sys.path:
        sys.path.insert(0, PY_DIR)
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # not needed: the driver closed stdin
    spec = json.loads(line)
    t0 = time.time()
    try:
        res = run_spec(spec)
    except Exception as e:
        import traceback

        traceback.print_exc()
        res = {"ok": False, "alloc": spec.get("alloc"), "workload": spec["workload"]["name"],
               "error": f"{type(e).__name__}: {e}"[:2000]}
    res["child_wall_s"] = time.time() - t0
    res["import_s"] = import_s
    with open(spec["result"], "w") as f:
        json.dump(res, f)
    return 0


# ------------------------------------------------------------------ driver


class Pool:
    """Children spawned ahead, per environment class (PYTORCH_CUDA_ALLOC_CONF differs). Each
    writes its ready file once its imports are done; `importing()` lists those still at it."""

    def __init__(self, logdir: str, dry: bool, spare_cpus: Optional[List[int]] = None):
        self.logdir, self.dry, self.ready, self.n = logdir, dry, {}, 0
        self.spare_cpus = spare_cpus

    def _env(self, kind: str) -> dict:
        env = dict(os.environ)
        for k in list(env):
            if k.startswith("STWEAVER_") or k == "PYTORCH_CUDA_ALLOC_CONF":
                del env[k]
        if kind == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        env["PYTHONUNBUFFERED"] = "1"
        env["TOKENIZERS_PARALLELISM"] = "false"
        env["PYTHONPATH"] = PY_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def _spawn(self, kind: str):
        self.n += 1
        base = os.path.join(self.logdir, f"child{self.n:03d}")
        log = open(base + ".log", "w")
        spare = self.spare_cpus
        # Imports run on the spare CPUs; the child moves itself to the training CPUs when its
        # spec says so.
        pre = (lambda: os.sched_setaffinity(0, spare)) if spare else None
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "child", base + ".ready"],
                             stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                             env=self._env(kind), text=True, preexec_fn=pre)
        return (p, log, base + ".ready")

    def warm(self, kinds):
        for kind in kinds:
            if kind not in self.ready:
                self.ready[kind] = self._spawn(kind)

    def take(self, alloc: str, respawn: bool = True):
        kind = "expandable" if alloc == "expandable" else "default"
        child = self.ready.pop(kind, None) or self._spawn(kind)
        if respawn:
            self.ready[kind] = self._spawn(kind)  # the next run of this kind imports meanwhile
        return child

    def importing(self) -> List[str]:
        """Ready files not written yet by children still alive."""
        return [r for p, _, r in self.ready.values() if p.poll() is None and not os.path.exists(r)]

    @staticmethod
    def import_s(ready: str) -> Optional[float]:
        try:
            with open(ready) as f:
                return json.load(f).get("import_s")
        except (OSError, ValueError):
            return None

    def close(self):
        for p, log, _ in self.ready.values():
            try:
                p.stdin.close()
                p.wait(timeout=60)
            except Exception:
                p.kill()
            log.close()
        self.ready = {}


def collect_result(child: tuple, alloc: str, workload: str, limit: float) -> Tuple[dict, Optional[float]]:
    """Wait for a training child `(process, log, ready file, result file)` and read its result
    (or say why there is none): a child that wrote its result gets 20 s to exit (a hung
    teardown must not eat the budget); any child is stopped at `limit` (time.time()). Returns
    the result and when it was written (None if never)."""
    p, log, ready, result = child
    rc, done_at = None, None
    while rc is None:
        try:
            rc = p.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            now = time.time()
            if done_at is None and os.path.exists(result):
                done_at = now
            if now > limit or (done_at is not None and now > done_at + 20):
                p.kill()
                p.wait()
                rc = "killed after its result" if done_at is not None else "timeout"
    log.close()
    try:
        with open(result) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = {"ok": False, "alloc": alloc, "workload": workload, "error": f"no result (rc={rc})"}
    res["rc"] = rc
    res["child_import_s"] = Pool.import_s(ready)
    if not res.get("ok") and not res.get("oom"):
        with open(log.name) as f:
            res["log_tail"] = f.read()[-4000:]
    return res, done_at


def cpu_split(cpus: List[int]) -> Tuple[List[int], List[int]]:
    """Training CPUs (the upper half: CPU 0 takes most interrupts) and spare CPUs (the rest)."""
    cpus = sorted(cpus)
    if len(cpus) < 4:
        return cpus, cpus
    h = len(cpus) // 2
    return cpus[h:], cpus[:h]


def parse_cpus(text: str) -> List[int]:
    """'8-15' or '0,2,4-7' -> CPU numbers."""
    out: List[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            out += list(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return sorted(set(out))


def parse_rounds(text) -> Tuple[int, Dict[str, int]]:
    """`--step-rounds`: '2' (every workload), '2,gpt2xl_rcp=4' (4 for that one) or
    'gpt2xl_rcp=4' (that one only)."""
    default, per = 0, {}
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if "=" in part:
            k, v = part.split("=", 1)
            per[k.strip()] = int(v)
        else:
            default = int(part)
    return default, per


class Driver:
    def __init__(self, args):
        self.args = args
        self.dry = args.dry_run
        self.t_start = time.time()
        self.deadline = self.t_start + args.budget_s
        self.tmp = tempfile.mkdtemp(prefix="stweaver-bench-")
        self.logdir = os.path.join(self.tmp, "logs")
        os.makedirs(self.logdir)
        avail = sorted(os.sched_getaffinity(0))
        self.train_cpus: Optional[List[int]] = None
        spare: Optional[List[int]] = None
        if not args.no_pin:
            self.train_cpus, spare = cpu_split(avail)
            if args.train_cpus:
                self.train_cpus = [c for c in parse_cpus(args.train_cpus) if c in avail] or self.train_cpus
                spare = [c for c in avail if c not in self.train_cpus] or spare
            os.sched_setaffinity(0, spare)  # the driver and `stweaver plan` stay off them too
        self.pool = Pool(self.logdir, self.dry, spare)
        self.out = args.out
        os.makedirs(self.out, exist_ok=True)
        self.doc: dict = {
            "schema": 1,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "dry_run": self.dry,
            "host": platform.node(),
            "python": sys.version.split()[0],
            "workloads": [],
            "cap_search": None,
            "skipped": [],
            "timing": {"quiet": args.quiet, "cpus": avail, "train_cpus": self.train_cpus,
                       "spare_cpus": spare, "threads": args.threads, "warmup": WARMUP,
                       "step_rounds": args.step_rounds, "order": "ABBA"},
        }

    def remaining(self) -> float:
        return self.deadline - time.time()

    def save(self):
        path = os.path.join(self.out, "gpu_bench.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.doc, f, indent=1)
        os.replace(path + ".tmp", path)

    def run_one(self, workload: dict, alloc: str, est_s: float, extra: Optional[dict] = None) -> dict:
        if self.remaining() < est_s + 15:
            msg = f"{workload['name']}/{alloc}: skipped, {self.remaining():.0f} s left (needs ~{est_s:.0f} s)"
            print(msg, flush=True)
            self.doc["skipped"].append(msg)
            return {"ok": False, "alloc": alloc, "workload": workload["name"], "skipped": True,
                    "error": "out of time"}
        result = os.path.join(self.tmp, f"{workload['name']}_{alloc}_{workload['batch']}_{time.time_ns()}.json")
        spec = self.child_spec(alloc, workload, result, min(self.deadline - 10, time.time() + 4 * est_s), extra)
        p, log, ready = self.pool.take(alloc)
        if self.args.quiet:
            # The replacement child just spawned (and any other still importing) must be done
            # before this run's first counted iteration.
            spec["quiet"] = {"at": WARMUP, "wait": self.pool.importing(), "timeout": 60.0}
        t0 = time.time()
        limit = t0 + max(5.0, min(self.remaining() - 3, max(180.0, 6 * est_s)))
        try:
            p.stdin.write(json.dumps(spec) + "\n")
            p.stdin.close()
        except OSError:
            pass  # the child died during its imports; its log says why
        res, done_at = collect_result((p, log, ready, result), alloc, workload["name"], limit)
        res["wall_s"] = (done_at or time.time()) - t0
        return res

    def child_spec(self, alloc: str, workload: dict, result: str, deadline: float,
                   extra: Optional[dict]) -> dict:
        """What a training child gets on stdin: the run, and the harness options it obeys."""
        spec = {"alloc": alloc, "workload": workload, "result": result, "dry_run": self.dry,
                "deadline": deadline}
        spec.update(extra or {})
        if self.args.no_release_at_peak:
            spec["release_at_peak"] = False
        spec["gc_outside_steps"] = not self.args.gc_in_steps
        if self.train_cpus:
            spec["cpus"] = self.train_cpus
        if self.args.threads:
            spec["threads"] = self.args.threads
        return spec

    def plan_trace(self, trace: str, plan: str) -> dict:
        cmd = [self.args.stweaver_bin, "plan", trace, "-o", plan, "--json", "--time-budget", "15"]
        t0 = time.time()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5.0, min(120.0, self.remaining() - 20)))
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"ok": False, "error": str(e), "wall_s": time.time() - t0}
        out = {"ok": r.returncode == 0, "wall_s": time.time() - t0, "rc": r.returncode}
        try:
            out["summary"] = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            out["stdout"] = r.stdout[-2000:]
        if r.returncode != 0:
            out["error"] = r.stderr[-2000:]
        return out

    def plan_extra(self, w: dict, entry: dict) -> Optional[dict]:
        """Plan the trace run's trace: the plan run's spec extras, or None (and a failed plan
        row saying why)."""
        plan = os.path.join(self.tmp, f"{w['name']}.stwp")
        t = entry["runs"].get("trace", {})
        files = t.get("trace_files") or []
        if not (t.get("ok") and files):
            entry["runs"]["plan"] = {"ok": False, "alloc": "plan", "error": "no trace to plan"}
            return None
        if not self.args.stweaver_bin or not os.path.isfile(self.args.stweaver_bin):
            entry["planner"] = {"ok": False, "error": f"no stweaver binary at {self.args.stweaver_bin!r}"}
            entry["runs"]["plan"] = {"ok": False, "alloc": "plan", "error": "no planner binary"}
            return None
        entry["planner"] = self.plan_trace(files[0], plan)
        pl = entry["planner"]
        print(f"  stweaver plan: {'ok' if pl['ok'] else 'FAILED'} in {pl['wall_s']:.1f} s"
              + (f", LB {pl['summary']['lower_bound'] / GiB:.3f} GiB, pool {pl['summary']['pool'] / GiB:.3f} GiB"
                 if pl.get("summary") else f" {pl.get('error', '')[-300:]}"), flush=True)
        if not pl["ok"] or self.dry:
            entry["runs"]["plan"] = {"ok": False, "alloc": "plan",
                                     "error": "planning failed" if not pl["ok"] else "dry run"}
            return None
        return {"plan": plan}

    def workload(self, w: dict) -> dict:
        entry = {"config": w, "runs": {}, "planner": None}
        self.doc["workloads"].append(entry)
        est = float(w.get("est_s", 15))
        trace = os.path.join(self.tmp, f"{w['name']}.stwt")
        allocs = self.args.allocators.split(",") if self.args.allocators else ALLOCATORS
        default, per = parse_rounds(self.args.lockstep)
        lock_rounds = per.get(w["name"], default)
        group: List[str] = []
        if lock_rounds > 0:
            # The trace run goes first, alone (its trace feeds the plan run); everything else
            # trains side by side in lockstep.
            group = [a for a in allocs if a != "trace"]
            if "native" in group and self.args.aa_control:
                group.append("native_aa")
            allocs = [a for a in allocs if a == "trace"]
        for alloc in allocs:
            extra = {}
            wr = w
            if alloc == "trace":
                extra = {"trace": self.args.dry_trace if self.dry else trace}
                t_def, t_per = parse_rounds(self.args.trace_iters)
                if t_per.get(w["name"], t_def) > 0:
                    wr = dict(w, iters=t_per.get(w["name"], t_def))
                    extra["digest_at"] = w["iters"] - 1  # the parameters every run compares
            if alloc == "plan":
                extra = self.plan_extra(w, entry)
                if extra is None:
                    continue
            r = self.run_one(wr, alloc, est * (2 if alloc == "auto" else 1) * wr["iters"] / w["iters"], extra)
            if r.get("determinism_error") and w.get("strict", True):
                print(f"{w['name']}: strict determinism failed ({r['error']}); rerunning with warn_only",
                      flush=True)
                self.doc["workloads"].remove(entry)
                return self.workload(dict(w, strict=False, strict_error=r["determinism_error"]))
            entry["runs"][alloc] = r
            if alloc == "trace" and r.get("ok") and self.args.save_traces:
                for f in r.get("trace_files") or []:
                    dst = os.path.join(self.args.save_traces, os.path.basename(f) + ".gz")
                    os.makedirs(self.args.save_traces, exist_ok=True)
                    with open(f, "rb") as src, gzip.open(dst, "wb") as out:
                        shutil.copyfileobj(src, out)
                    print(f"  saved {dst}", flush=True)
            if r.get("ok"):
                est = max(est, r["wall_s"])
            print(self.progress_line(w["name"], alloc, r), flush=True)
            self.save()
        if group:
            extras: Dict[str, dict] = {}
            for key in group:
                if key == "plan":
                    ex = self.plan_extra(w, entry)
                    if ex is None:
                        continue
                    extras[key] = ex
                else:
                    extras[key] = {}
            results = self.run_lockstep(w, list(extras), extras, lock_rounds, est)
            orders = results.pop("_orders", [])
            for key, r in results.items():
                if r.get("determinism_error") and w.get("strict", True):
                    print(f"{w['name']}: strict determinism failed ({r['error']}); rerunning with warn_only",
                          flush=True)
                    self.doc["workloads"].remove(entry)
                    return self.workload(dict(w, strict=False, strict_error=r["determinism_error"]))
            entry["runs"].update(results)
            entry["lockstep"] = {"keys": list(extras), "rounds_asked": lock_rounds, "orders": orders}
            for key in extras:
                if key in entry["runs"]:
                    print(self.progress_line(w["name"], key, entry["runs"][key]), flush=True)
            self.save()
        finalize_workload(entry)
        self.save()
        return entry

    def run_lockstep(self, w: dict, keys: List[str], extras: Dict[str, dict], rounds: int,
                     est: float) -> Dict[str, dict]:
        """Train `keys` side by side on the GPU, in lockstep (lockstep.py): each warms up on its
        own, the ones ahead wait until all reach the same iteration S, then round r runs
        iteration S + r of each, one at a time, in `round_order`. Returns each key's result
        (with `lockstep_iters`, the iterations timed in rounds) and "_orders"."""
        from lockstep import Seat, paired_ratios, parse_reply, round_order

        if not keys:
            return {}
        need = est * 2 + 60
        if self.remaining() < need:
            msg = f"{w['name']}/lockstep: skipped, {self.remaining():.0f} s left (needs ~{need:.0f} s)"
            print(msg, flush=True)
            self.doc["skipped"].append(msg)
            return {k: {"ok": False, "alloc": k, "workload": w["name"], "skipped": True,
                        "error": "out of time"} for k in keys}
        pipes = tempfile.mkdtemp(prefix="lockstep-", dir=self.tmp)
        seats: Dict[str, "Seat"] = {}
        kids: Dict[str, tuple] = {}
        out: Dict[str, dict] = {}
        t0 = time.time()
        print(f"  lockstep: {', '.join(keys)} side by side, {rounds} rounds", flush=True)
        for key in keys:
            alloc = "native" if key == "native_aa" else key
            seat = Seat(key, pipes)
            seats[key] = seat
            result = os.path.join(self.tmp, f"{w['name']}_{key}_lockstep_{time.time_ns()}.json")
            spec = self.child_spec(alloc, w, result, self.deadline - 15, extras.get(key))
            spec["lockstep"] = {"cmd": seat.cmd_path, "reply": seat.reply_path}
            p, log, ready = self.pool.take(alloc, respawn=False)
            try:
                p.stdin.write(json.dumps(spec) + "\n")
                p.stdin.close()
            except OSError:
                pass
            kids[key] = (p, log, ready, result)

        def alive(key):
            return lambda: kids[key][0].poll() is None

        # Warm-up, each on its own (concurrently; nothing is timed yet).
        nxt: Dict[str, int] = {}
        modes: Dict[str, str] = {}
        limit = max(120.0, 8 * est)
        for key in keys:
            rep = parse_reply(seats[key].read_line(max(1.0, min(limit - (time.time() - t0), self.remaining() - 20)),
                                                   alive(key)))
            if rep and rep[0] == "ready":
                nxt[key], modes[key] = rep[1], rep[3]
            else:
                print(f"  lockstep: {key} not ready (exited or timed out)", flush=True)
        live = [k for k in keys if k in nxt]
        times: Dict[str, Dict[int, float]] = {k: {} for k in keys}
        orders: List[List[str]] = []
        if live:
            start = max(nxt.values())
            # Catch up to iteration `start`, all laggards at once (untimed).
            while True:
                behind = [k for k in live if nxt[k] < start]
                if not behind:
                    break
                for k in behind:
                    seats[k].send("go")
                for k in behind:
                    rep = parse_reply(seats[k].read_line(max(30.0, 10 * est), alive(k)))
                    if rep and rep[0] == "done":
                        nxt[k] = rep[1] + 1
                    else:
                        live.remove(k)
                        print(f"  lockstep: {k} failed while catching up", flush=True)
            warm = ", ".join(f"{k}: {modes.get(k) or '?'}" for k in live)
            print(f"  lockstep: warm in {time.time() - t0:.0f} s; rounds from iteration {start} ({warm})",
                  flush=True)
            round_s = None
            for r in range(rounds):
                t_r = time.time()
                if round_s is not None and self.remaining() < 1.5 * round_s + 25:
                    msg = f"{w['name']}/lockstep: stopped after {r} of {rounds} rounds ({self.remaining():.0f} s left)"
                    print("  " + msg, flush=True)
                    self.doc["skipped"].append(msg)
                    break
                order = round_order(list(live), r)
                orders.append(order)
                for k in order:
                    seats[k].send("go")
                    rep = parse_reply(seats[k].read_line(max(30.0, 20 * est), alive(k)))
                    if rep and rep[0] == "done":
                        times[k][rep[1]] = rep[2]
                        modes[k] = rep[3]
                    else:
                        live.remove(k)
                        print(f"  lockstep: {k} failed in round {r}", flush=True)
                round_s = time.time() - t_r
                if r % 5 == 4 or r == rounds - 1:
                    nat = times.get("native") or {}
                    parts = []
                    for k in live:
                        if k == "native" or not nat:
                            continue
                        rs = paired_ratios(times, k)
                        if rs:
                            parts.append(f"{k} {statistics.median(rs):.3f}")
                    print(f"  lockstep: round {r + 1}/{rounds} ({round_s:.1f} s/round); median ratio to native: "
                          + (", ".join(parts) or "–"), flush=True)
        for key in keys:
            seats[key].send("stop")
        # Results, as run_one collects them.
        deadline = time.time() + 120
        for key in keys:
            res, _ = collect_result(kids[key], key, w["name"], deadline)
            res["wall_s"] = time.time() - t0
            res["lockstep_iters"] = sorted(times[key])
            if key == "native_aa":
                res["control_of"] = "native"
            out[key] = res
            seats[key].close()
        shutil.rmtree(pipes, ignore_errors=True)
        self.pool.warm(["default", "expandable"])
        out["_orders"] = orders
        return out

    @staticmethod
    def progress_line(name: str, alloc: str, r: dict) -> str:
        if not r.get("ok"):
            extra = ""
            if r.get("log_tail"):
                extra = " | " + r["log_tail"].strip().splitlines()[-1][-200:]
            return f"{name:18s} {alloc:10s} FAILED: {r.get('error', '')[:300]}{extra}"
        med = steady_median(r) or _median(r["step_s"])  # lockstep: its timed rounds only
        s = (f"{name:18s} {alloc:10s} res={r['max_reserved'] / GiB:7.3f}G "
             f"alloc={(r.get('max_allocated') or 0) / GiB:7.3f}G step={med * 1e3:8.1f}ms "
             f"iters={r['iterations']} wall={r['wall_s']:.0f}s")
        if r.get("steady_max_reserved") is not None:
            s += f" steady_res={r['steady_max_reserved'] / GiB:.3f}G from_it={r['steady_from']}"
        if r.get("stweaver"):
            s += f" mode={r['stweaver'].get('mode')!r}"
        return s + noise_note(r)

    # ---------------------------------------------------------- step-time rounds

    def step_rounds(self):
        """Extra interleaved rounds for step time alone: per round and workload, native and
        each allocator of --step-allocators (the plan run reuses the workload's plan file), a
        fresh process each, native first in even rounds and last in odd ones (round 0, the
        main run, has it first), so a slow drift of the machine cancels in the paired ratios.
        `--step-rounds 2,gpt2xl_rcp=4`: 2 rounds for every workload, 4 for gpt2xl_rcp."""
        allocs = [a for a in self.args.step_allocators.split(",") if a and a != "native"]
        default, per = parse_rounds(self.args.step_rounds)
        n_rounds = max([default] + list(per.values()))
        for k in range(1, n_rounds + 1):
            print(f"== step-time round {k}", flush=True)
            for entry in self.doc["workloads"]:
                w = entry["config"]
                if k > per.get(w["name"], default):
                    continue
                rounds = entry.setdefault("step_rounds", {})
                iters = entry.setdefault("step_rounds_iters", {})
                if not rounds:
                    for alloc, r in entry["runs"].items():
                        if alloc == "native" or alloc in allocs:
                            rounds[alloc] = [steady_median(r)]
                            iters[alloc] = [round_times(r)]
                est = float(w.get("est_s", 15))
                order = ["native"] + allocs if k % 2 == 0 else allocs + ["native"]
                entry.setdefault("step_rounds_order", [["native"] + allocs]).append(order)
                for alloc in order:
                    extra = {}
                    if alloc == "plan":
                        plan = os.path.join(self.tmp, f"{w['name']}.stwp")
                        if not os.path.isfile(plan):
                            continue
                        extra = {"plan": plan}
                    if alloc == "trace":
                        extra = {"trace": os.path.join(self.tmp, f"{w['name']}.round.stwt")}
                    r = self.run_one(w, alloc, est * (2 if alloc == "auto" else 1), extra)
                    rounds.setdefault(alloc, []).append(steady_median(r) if r.get("ok") else None)
                    iters.setdefault(alloc, []).append(round_times(r))
                    print(f"{w['name']:18s} {alloc:10s} round {k}: step "
                          f"{(steady_median(r) or 0) * 1e3:.1f} ms{noise_note(r)}", flush=True)
                    self.save()

    # ---------------------------------------------------------- memory you can spend

    def cap_search(self):
        """The cap search on every loop of CAP_WORKLOADS (or those --cap-workloads names)."""
        self.doc["cap_search"] = []
        names = self.args.cap_workloads.split(",") if self.args.cap_workloads else None
        for w0 in (DRY_CAPS if self.dry else CAP_WORKLOADS):
            if names and w0["name"] not in names:
                continue
            if self.remaining() < 60 and not self.dry:
                self.doc["skipped"].append(f"cap search {w0['name']}: {self.remaining():.0f} s left")
                continue
            self.cap_search_one(dict(w0))

    def cap_search_one(self, w0: dict):
        cap_bytes = w0["cap_bytes"]
        doc = {"workload": w0, "cap_bytes": cap_bytes, "allocators": {}, "note": ""}
        self.doc["cap_search"].append(doc)
        guess = self.cap_guess(w0)
        doc["first_guess"] = guess
        for alloc in CAP_ALLOCATORS:
            tried: Dict[int, dict] = {}
            b = guess
            while len(tried) < 5 and b >= 1 and b not in tried:
                w = dict(w0, batch=b)
                est = w0["est_s"] * (2 if alloc == "auto" else 1)
                r = self.run_one(w, alloc, est, {"cap_bytes": cap_bytes})
                if r.get("skipped"):
                    break
                tried[b] = r
                fits = bool(r.get("ok"))
                print(f"cap {cap_bytes / GiB:.0f} GiB {w0['name']} {alloc:10s} micro-batch {b:3d}: "
                      + ("fits" if fits else ("OOM" if r.get("oom") else "FAILED " + str(r.get("error", ""))[:200]))
                      + (f", peak reserved {r['max_reserved'] / GiB:.2f} GiB" if fits else ""), flush=True)
                if not fits and not r.get("oom"):
                    break  # a crash is not an answer
                nb = next_probe(b, fits, {k: bool(v.get("ok")) for k, v in tried.items()})
                if nb is None:
                    break
                b = nb
            summary = cap_summary(tried)
            doc["allocators"][alloc] = summary
            self.save()
            if summary.get("largest"):
                guess = summary["largest"] + 1
        doc["note"] = ("stweaver row: auto mode (records 4 iterations online, then serves its plan); "
                       "a batch fits when every iteration ran without an out-of-memory error")

    def cap_guess(self, w0: dict) -> int:
        """First micro-batch to try: --cap-guess, the loop's own guess, else from
        llama1b_rcp's native run (persistent bytes from the parameter count, activation
        bytes per sample from its lower bound), else 6."""
        if self.args.cap_guess:
            return self.args.cap_guess
        if self.dry:
            return 2
        if w0.get("guess"):
            return w0["guess"]
        CAP_BYTES = w0["cap_bytes"]
        for e in self.doc["workloads"]:
            if e["config"]["name"] != "llama1b_rcp":
                continue
            n = e["runs"].get("native", {})
            lb = e.get("lower_bound")
            if not (n.get("ok") and lb and n.get("params")):
                break
            persistent = 8 * n["params"]  # bf16 params, grads, exp_avg, exp_avg_sq
            per_sample = (lb - persistent) / (e["config"]["batch"] // e["config"]["micro"])
            util = lb / n["max_reserved"]
            if per_sample <= 0:
                break
            return max(1, min(32, int((CAP_BYTES * util - persistent) / per_sample)))
        return 6

    def main(self):
        self.pool.warm(["default", "expandable"])
        ws = dry_workloads() if self.dry else WORKLOADS
        if self.args.cap_only:
            ws = []
        elif self.args.only:
            ws = [w for w in ws if w["name"] in self.args.only.split(",")]
        for w in ws:
            print(f"== {w['name']}: {w['note']}", flush=True)
            self.workload(w)
        default, per = parse_rounds(self.args.step_rounds)
        if default > 0 or any(v > 0 for v in per.values()):
            self.step_rounds()
        if not self.args.no_cap:
            print("== memory you can spend", flush=True)
            if self.remaining() > 120 or self.dry:
                self.cap_search()
            else:
                msg = f"cap search: skipped, {self.remaining():.0f} s left"
                print(msg, flush=True)
                self.doc["skipped"].append(msg)
        self.pool.close()
        if not self.args.keep_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        self.doc["wall_s"] = time.time() - self.t_start
        for e in self.doc["workloads"]:
            for r in e["runs"].values():
                dev = r.get("device")
                if dev:
                    self.doc["device"] = dev
                    break
        self.save()
        text = render_table(self.doc, markdown=False)
        rounds = render_step_rounds(self.doc)
        if rounds:
            text += "\n" + "\n".join(rounds) + "\n"
        noise = render_noise(self.doc)
        if noise:
            text += "\n" + "\n".join(noise) + "\n"
        with open(os.path.join(self.out, "table.txt"), "w") as f:
            f.write(text)
        print("\n" + text, flush=True)
        return 0


DRY_CAP = dict(CAP_WORKLOAD, hidden=64, layers=2, heads=4, inter=128, vocab=1000, seq=32, iters=4, max_iters=8)
DRY_CAPS = [DRY_CAP, dict(DRY_CAP, name="varlen_cap", seq_min=8)]


def next_probe(b: int, fits: bool, tried: Dict[int, bool]) -> Optional[int]:
    """Galloping search by one: up while it fits, down while it does not; stop at the edge."""
    if fits:
        if tried.get(b + 1) is False:
            return None
        return b + 1 if (b + 1) not in tried else None
    if b - 1 < 1 or tried.get(b - 1) is True:
        return None
    return b - 1 if (b - 1) not in tried else None


def cap_summary(tried: Dict[int, dict]) -> dict:
    ok = {b: r for b, r in tried.items() if r.get("ok")}
    out = {"probes": [{"batch": b, "fits": bool(r.get("ok")), "oom_iter": r.get("oom_iter"),
                       "max_reserved": r.get("max_reserved"), "steady_max_reserved": r.get("steady_max_reserved"),
                       "mode": (r.get("stweaver") or {}).get("mode"), "error": None if r.get("ok") else r.get("error"),
                       "wall_s": r.get("wall_s"), "step_s": r.get("step_s"), "tokens_per_iter": r.get("tokens_per_iter")}
                      for b, r in sorted(tried.items())]}
    if not ok:
        out["largest"] = None
        return out
    b = max(ok)
    # The edge is proven only if b + 1 was tried and did not fit.
    out["largest"] = b
    out["edge_proven"] = (b + 1) in tried and not tried[b + 1].get("ok")
    r = ok[b]
    steady = steady_indices(r)
    out["tokens_basis"] = "steady iterations"
    if not steady and r.get("step_s"):
        # auto that never served a plan (e.g. rejected under the cap): its online iterations
        steady = list(range(min(WARMUP, len(r["step_s"]) - 1), len(r["step_s"])))
        out["tokens_basis"] = "iterations after warm-up (no plan served)"
    times = [r["step_s"][i] for i in steady]
    toks = [r["tokens_per_iter"][i] for i in steady]
    if times:
        out["step_s"] = statistics.median(times)
        out["tokens_per_s"] = statistics.median([t / s for t, s in zip(toks, times)])
    out["max_reserved"] = r.get("max_reserved")
    return out


# ------------------------------------------------------------------ analysis and report


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


# ------------------------------------------------------------------ entry points


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["child"]:
        return child_main(argv[1] if len(argv) > 1 else None)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the benchmark")
    r.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    r.add_argument("--stweaver-bin", default=os.path.join(REPO, "target/release/stweaver"))
    r.add_argument("--budget-s", type=float, default=480.0, help="stop starting runs after this")
    r.add_argument("--dry-run", action="store_true", help="CPU, tiny models, stweaver faked")
    r.add_argument("--dry-trace", default=None, help="dry run: a .stwt to feed `stweaver plan`")
    r.add_argument("--only", default=None, help="comma-separated workload names")
    r.add_argument("--no-cap", action="store_true", help="skip the memory-cap search")
    r.add_argument("--allocators", default=None,
                   help=f"comma-separated subset of {','.join(ALLOCATORS)} (default: all)")
    r.add_argument("--save-traces", default=None, help="copy each trace run's .stwt, gzipped, here")
    r.add_argument("--keep-tmp", action="store_true", help="keep traces, plans and child logs")
    r.add_argument("--step-rounds", default="0",
                   help="extra interleaved rounds of native + --step-allocators per workload, for "
                        "step time alone (one run per configuration does not resolve 1 %% here): "
                        "N, or N,NAME=M,... for M rounds of workload NAME")
    r.add_argument("--cap-only", action="store_true", help="the memory-cap search alone")
    r.add_argument("--quiet", action="store_true",
                   help="a run's counted iterations wait until no other child is importing (costs "
                        "~9 s a run on the H200, where imports take 10-11 s; off by default: "
                        "BENCHMARKS.md, session 5)")
    r.add_argument("--cap-workloads", default="",
                   help="comma-separated loops of the cap search (default: all of CAP_WORKLOADS)")
    r.add_argument("--cap-guess", type=int, default=0,
                   help="first micro-batch of the cap search (default: from llama1b_rcp's native run, else 6)")
    r.add_argument("--no-pin", action="store_true",
                   help="no CPU pinning (by default a training child runs on the upper half of "
                        "the CPUs, children importing and the driver on the lower half)")
    r.add_argument("--train-cpus", default=None, help="the training child's CPUs, e.g. 8-15")
    r.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in each child")
    r.add_argument("--step-allocators", default="plan,auto,expandable")
    r.add_argument("--lockstep", default="0",
                   help="step time in lockstep (lockstep.py): after the trace run, every other "
                        "allocator trains side by side on the GPU and they take turns, one timed "
                        "iteration each per round; N rounds, or N,NAME=M,... (0: off, each "
                        "allocator in a fresh process of its own, one after another)")
    r.add_argument("--trace-iters", default="0",
                   help="iterations of the trace run (default: the workload's), N or N,NAME=M: "
                        "a longer trace to replay on the CPU, and a trace row over as many "
                        "iterations as lockstep's runs make")
    r.add_argument("--no-aa-control", dest="aa_control", action="store_false",
                   help="lockstep without the second native process (the A/A control, whose "
                        "ratio to native shows the method's own noise)")
    r.add_argument("--gc-in-steps", action="store_true",
                   help="leave Python's garbage collector alone (by default it is frozen after "
                        "setup and run between iterations, outside the timed window)")
    r.add_argument("--no-release-at-peak", action="store_true",
                   help="stweaver runs with STWEAVER_RELEASE_AT_PEAK=0 (no giving holes back "
                        "before a new peak; it is on by default)")
    p = sub.add_parser("report", help="print the table of a result file")
    p.add_argument("json")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--targets", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        return Driver(a).main()
    with open(a.json) as f:
        doc = json.load(f)
    for e in doc["workloads"]:
        finalize_workload(e)  # recomputed: the report's rules may be newer than the run
    print(render_table(doc, a.markdown), end="")
    rounds = render_step_rounds(doc)
    if rounds:
        print("\n" + "\n".join(rounds))
    noise = render_noise(doc)
    if noise:
        print("\n" + "\n".join(noise))
    if a.targets:
        print("\n".join(targets(doc)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
