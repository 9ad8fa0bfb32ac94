"""One training run in a fresh process: the model builder, the per-iteration clock and
diagnostics, `run_spec` (train, measure, report) and the child's loop (`child_main`: wait for a
spec on stdin, run it). Imports torch only inside the functions, once a spec arrives."""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Tuple

try:
    import resource
except ImportError:  # not on Linux: no per-thread context-switch counts
    resource = None

from . import common
from .common import PY_DIR
from .workloads import WARMUP


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
        res["stweaver"] = common.stweaver_stats(st)
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
