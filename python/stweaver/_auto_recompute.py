"""Auto mode under a budget picks how many blocks to recompute by itself (issue #16).

    import stweaver
    stweaver.install(budget="0.8")             # auto mode, offload on (STWEAVER_OFFLOAD)
    model = build_model().cuda()
    stweaver.recompute_blocks(model, "auto")   # after install, before training
    ...                                        # train; stweaver.offload_stats()["auto_recompute"]

Why
===
Offload alone is bound by the host link: what must be off the device at the peak crosses it
during forward, and when forward is too short for those bytes, compute waits for the copies
(Llama 1B at 0.8 x its peak on an H100: 1.28x the unlimited step with offload alone, 1.09x
with the last 4 of its 16 blocks recomputed; BENCHMARKS.md, session 11). The right number of
recomputed blocks depends on the model, the batch, the budget and the link; the benchmark
found it by recording and planning each candidate in a separate process. Here the run finds
it itself, from the plan auto mode makes anyway.

Algorithm
=========
1. Auto mode records (the offloader offloads by threshold meanwhile, to fit the budget) and
   plans in the background. With the *plan gate* on (``ext.set_plan_gate(True)``), the
   finished plan is held (mode ``auto (plan held)``) instead of served; the offloader keeps
   offloading by threshold.
2. While recording, the schedule's clock is measured and given to the planner
   (``ext.set_offload_timing``): the link, 90 % of the slower direction of the offloader's
   timed copies (as the benchmark plans), and the device time of an iteration, 3 x (a
   third of an iteration is forward, the planner's default share) N x the median device
   time of one block's forward (CUDA events on the current stream at each block's forward
   pre-hook and forward hook, read only once they have passed; per iteration the 20th
   percentile of its blocks, the ones not slowed by the recording's own copies; the
   smallest of the recorded iterations). Without it the planner would time the schedule by the recording's
   host clock, which the recording's threshold offload stretches several times (GPT-2 XL at
   0.8 x LB: 1.35 s recorded iterations for a 0.18 s step, a plan "without waits" that ran
   at 1.96x; BENCHMARKS.md, session 12); a block's compute is what its copies race.
   At the boundary where the plan is held, its offload outcome (``info_json``) gives the
   planned waits per iteration, ``w = copy_out_wait_us + stall_us``. If ``w`` is at most ``wait_share`` (2 %) of the
   median recorded iteration (host wall time between boundaries), the plan is served
   (``release_held_plan(True)``), as auto mode would have.
3. Else more blocks are recomputed: each block's saved bytes are measured in forward (the
   offloader's counted pack bytes between the block's forward pre-hook and forward hook; the
   median over blocks not recomputed), and the bytes the link could not move in time are
   ``w x link``, at most the bytes the plan moves; ``k += ceil(that / block bytes)`` (a
   refused plan, no offload within the budget, or a link-bound one, ``w`` over the
   iteration's own time: ``k += ceil(N / 8)``), at most N. The model's blocks are recomputed
   (:func:`stweaver.recompute_blocks`, ``where`` as given), the held plan is dropped and
   auto mode records again from this boundary (``release_held_plan(False)``): the recording
   is of the model as it will run.
   **3b.** A plan that waits little but moves bytes is weighed against recomputing the blocks
   those bytes are: each offloaded tensor costs about ``TENSOR_MS`` (0.15 ms) per iteration
   beyond the planned waits (its two hooks with their copies and events, and the compute
   stream's waits on them: on the H100, GPT-2 XL at 0.8 x LB with 34 tensors moved and 6
   blocks recomputed ran 1-5 ms over the 6 blocks' recomputation, BENCHMARKS.md session 19),
   while ``ceil(bytes / block bytes)`` more blocks recomputed cost that many blocks' forward
   (the measured device time of a block). When the blocks are cheaper, they are recomputed
   and auto mode records again (a round). ``STWEAVER_AUTO_TENSOR_MS`` sets the per-tensor
   cost (0: never).
4. After ``max_rounds`` re-recordings (default 2), or when k cannot grow, the held plan is
   served whatever it waits.
5. **A measured trial** when the plan served moves bytes (its ``bytes_per_iteration``, one
   way): the planner's clock is a model, and on the H100 the same choice ran 1.10-1.15x on
   GPT-2 XL at 0.8 x LB with 1-2 GB moved, once 2.29x, where recomputing the blocks whose
   bytes moved instead ran 1.09-1.10x (BENCHMARKS.md, sessions 15 and 17); on Llama 1B the
   offload was the cheaper one (1.08x). So the run measures both: plan A (k blocks, its
   offload) is served for ``TRIAL_SKIP`` + ``TRIAL_STEPS`` iterations (host wall time
   between boundaries, the median of the last ``TRIAL_STEPS``); then
   ``k_B = k + ceil(bytes / block bytes)`` blocks are recomputed, auto mode records again
   (``ext.record_again()``: plan A is kept), plan B is served (whatever it waits) and
   measured the same way. B stays when its median step is at most A's; else the model goes
   back to k blocks and plan A is served again at that boundary
   (``ext.serve_kept_plan()``: no third recording). Plan A given up while measured (its
   pool at the memory limit after conflicts; on the H100 GPT-2 XL's plan was, in some runs)
   goes to B at once, and B stays; B given up or without a plan goes back to A. A plan that
   moves nothing, or ``k_B = k``, or ``trial=False`` skips this. **Opt-in**
   (``STWEAVER_AUTO_TRIAL=1``, experimental): on the H100 (session 17) it kept B on Llama
   1B (1.083x), but on GPT-2 XL plan A was given up in both runs and B, served without a
   conflict, ran 1.256x where the online run after A's give-up had run 1.112x.

Each decision is printed to stderr (one line) and kept in :meth:`AutoRecompute.stats`.
Cost: two module hooks per block per forward, and while recording two CUDA events per
block (read at later boundaries, never waited for); one ``info_json`` read at the boundary
where a plan is held; nothing per saved tensor beyond the offloader's byte count. The trial
costs one more recording (~``auto_iterations`` iterations at the recording's pace) and, when
A wins, B's ``TRIAL_SKIP + TRIAL_STEPS`` iterations.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from typing import List, Optional

# The benchmark's rule (budget_bench.sweep_done): a plan waiting at most this share of the
# step is as good as recomputing more.
WAIT_SHARE = 0.02
MAX_ROUNDS = 2
# The planner's link, from the measured rate: 90 % of the slower direction (the benchmark's
# planning_link_gbps).
LINK_SHARE = 0.9
# Forward's share of an iteration's device time, as the planner assumes
# (stweaver_planner::offload::DEFAULT_FORWARD_SHARE).
FORWARD_SHARE = 1.0 / 3.0
# The host and device cost of one offloaded tensor per iteration, ms (module doc, step 3b):
# its pack and unpack hooks with their copies and events, and the compute stream's waits on
# them. Measured on the H100 (BENCHMARKS.md, session 19): GPT-2 XL at 0.8 x LB, 6 blocks
# recomputed and 34 tensors (1.64 GB) moved ran 0.192-0.195 s in three calls where the 6
# blocks alone cost ~11 ms over a 0.178-0.180 s step: 1-5 ms for the 34 tensors, 0.03-0.15 ms
# each; the larger is taken. (Session 18's 0.7-0.9 ms came from runs with the copy-queue
# stall since fixed, call timing on, and --timeline's marks in the plan's pool.)
# STWEAVER_AUTO_TENSOR_MS overrides it.
TENSOR_MS = 0.15
# The measured trial (module doc, step 5): served iterations skipped (the switch settles:
# the online cache released, the pool mapped), then the iterations whose median is the step.
TRIAL_SKIP = 2
TRIAL_STEPS = 6


class AutoRecomputeError(RuntimeError):
    """recompute_blocks(model, "auto") without auto mode, a budget and the offloader."""


class AutoRecompute:
    """The decision loop of the module doc, driven by the offloader's boundaries."""

    def __init__(self, model, offloader, ext, *, where: str = "last", max_rounds: int = MAX_ROUNDS,
                 wait_share: float = WAIT_SHARE, log=None, event=None, trial: bool = True,
                 tensor_ms: Optional[float] = None):
        from ._recompute import RecomputeError, find_blocks, recomputed

        if where not in ("last", "first"):
            raise RecomputeError(f"where must be 'last' or 'first', not {where!r}")
        self.model = model
        self.off = offloader
        self.ext = ext
        self.where = where
        self.max_rounds = max_rounds
        self.wait_share = wait_share
        if tensor_ms is None:
            env_ms = os.environ.get("STWEAVER_AUTO_TENSOR_MS", "").strip()
            try:
                tensor_ms = float(env_ms) if env_ms else TENSOR_MS
            except ValueError:
                raise AutoRecomputeError(f"STWEAVER_AUTO_TENSOR_MS={env_ms!r} is not a number of ms")
        self.tensor_ms = max(0.0, tensor_ms)
        self.log = log if log is not None else (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.list_name, self.blocks = find_blocks(model)
        self.n = len(self.blocks)
        self.k = len(recomputed(model))
        self.rounds = 0
        self.decisions: List[dict] = []
        self.done = False
        # The measured trial (module doc, step 5): None (not started), or its state:
        # stage "a" (plan A served, measured), "b_rec" (recording for B), "b" (B measured).
        self.trial_on = trial and hasattr(ext, "record_again") and hasattr(ext, "serve_kept_plan")
        self.trial: Optional[dict] = None
        self._iter_ms: List[float] = []
        self._t = time.perf_counter()
        self._start: dict = {}
        self._block_bytes: dict = {}  # block index -> counted pack bytes in forward, this iteration
        self._per_block: List[float] = []  # medians of recent iterations
        # Device timing of each block's forward: ``event()`` makes a recorded-on-demand event
        # (``record()``, ``query()``, ``elapsed_time(later)``, as torch.cuda.Event); default:
        # CUDA events when the model is on a GPU, else no timing.
        if event is None:
            event = _cuda_event_factory(model)
        self._event = event
        self._ev_start: dict = {}
        self._ev_iter: List[tuple] = []  # (block, start, end) of this iteration's forward
        self._ev_pending: List[List[tuple]] = []  # earlier iterations' events not read yet
        self._block_ms: List[float] = []  # per recorded iteration: a block's forward ms
        self._handles = []
        for i, b in enumerate(self.blocks):
            self._handles.append(b.register_forward_pre_hook(self._pre(i)))
            self._handles.append(b.register_forward_hook(self._post(i)))
        ext.set_plan_gate(True)
        offloader.boundary_hooks.append(self.boundary)

    # -- forward hooks: a block's counted pack bytes (forward only: no unpack yet)
    def _pre(self, i: int):
        def hook(module, args):
            if self.off.j == 0:
                self._start[i] = self.off.packed_bytes
                if self._event is not None and not self.done and not self._measuring():
                    e = self._event()
                    e.record()
                    self._ev_start[i] = e
        return hook

    def _post(self, i: int):
        def hook(module, args, out):
            s = self._start.pop(i, None)
            if s is not None and self.off.j == 0:
                self._block_bytes[i] = self._block_bytes.get(i, 0) + self.off.packed_bytes - s
                e0 = self._ev_start.pop(i, None)
                if e0 is not None:
                    e1 = self._event()
                    e1.record()
                    self._ev_iter.append((i, e0, e1))
        return hook

    def _measuring(self) -> bool:
        """Whether a served plan's steps are being measured (no block events then)."""
        return self.trial is not None and self.trial["stage"] in ("a", "b")

    def remove(self) -> None:
        """Removes the block hooks and the gate; a plan held now is served (auto mode's own
        course), so nothing stays held without a decider."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.boundary in self.off.boundary_hooks:
            self.off.boundary_hooks.remove(self.boundary)
        self._finish()

    def _finish(self) -> None:
        """Done deciding: the gate off, and a plan held now served."""
        self.done = True
        try:
            self.ext.set_plan_gate(False)
            if str(self.ext.mode()) == "auto (plan held)":
                self.ext.release_held_plan(True)
        except Exception as e:  # report; never stop training
            self.log(f"stweaver: auto recompute: could not release the plan gate: {e}")

    # -- the boundary
    def boundary(self, off) -> None:
        """Called by the offloader at each iteration boundary (before it reads the plan)."""
        now = time.perf_counter()
        self._iter_ms.append((now - self._t) * 1e3)
        self._t = now
        recomputed_now = set(range(self.n - self.k, self.n)) if self.where == "last" else set(range(self.k))
        stored = [v for i, v in self._block_bytes.items() if i not in recomputed_now and v > 0]
        if stored:
            self._per_block.append(statistics.median(stored))
        self._block_bytes = {}
        self._read_block_times()
        if self.done:
            return
        mode = str(self.ext.mode())
        if self._measuring():
            try:
                self._trial_step(mode)
            except Exception as e:  # never stop training: serve what is served now
                self.log(f"stweaver: auto recompute: the trial failed ({e!r}); keeping what is served")
                self._finish()
            return
        if mode == "auto (recording)":
            self._set_link(off)
            return
        if mode != "auto (plan held)":
            if not mode.startswith("auto (planning"):
                if self.trial is not None and self.trial["stage"] == "b_rec" and not self.trial.get("a_given_up"):
                    # B's recording ended without a plan: back to plan A.
                    self._back_to_a(f"no plan with {self.k} blocks ({mode})")
                    return
                self._finish()  # served, refused, or given up: nothing left to decide
            return
        try:
            self._decide()
        except Exception as e:
            # Never leave the plan held (online serving with threshold offload for good).
            self.log(f"stweaver: auto recompute: deciding failed ({e!r}); serving the plan as it is")
            self._finish()

    def _read_block_times(self) -> None:
        """Moves this iteration's block events to the pending list and reads those that have
        passed (never waits): one block forward time per iteration."""
        if self._ev_iter:
            self._ev_pending.append(self._ev_iter)
            self._ev_iter = []
        self._ev_start = {}
        keep = []
        for evs in self._ev_pending:
            if not all(e1.query() for _, _, e1 in evs):
                keep.append(evs)
                continue
            ms = sorted(e0.elapsed_time(e1) for _, e0, e1 in evs)
            if ms:
                # The fastest fifth: the blocks that ran before the recording's own copies
                # held memory up (later ones wait for frees pending on copies; GPT-2 XL at
                # 0.8 x LB: 24 x the median block was 115.8 ms in recording, against an
                # unlimited forward of 60.8 ms).
                self._block_ms.append(ms[len(ms) // 5])
        self._ev_pending = keep

    def forward_ms(self) -> Optional[float]:
        """The device time of forward's blocks, N x the block time (20th percentile) of the fastest
        recorded iteration (the first after a (re)start aside when there are more); None
        before any was read."""
        times = self._block_ms[1:] if len(self._block_ms) > 1 else self._block_ms
        return self.n * min(times) if times else None

    def _set_link(self, off) -> None:
        rates = [r for r in off.link_rates() if r]
        link = LINK_SHARE * min(rates) if rates else 0.0
        fwd = self.forward_ms()
        iteration_us = fwd * 1e3 / FORWARD_SHARE if fwd else 0.0
        if link or iteration_us:
            try:
                self.ext.set_offload_timing(link, iteration_us)
            except Exception as e:  # never stop training for a timing hint
                self.log(f"stweaver: auto recompute: cannot set the offload timing: {e}")

    def _outcome(self) -> Optional[dict]:
        try:
            info = json.loads(self.ext.info_json())
        except Exception:
            return None
        for d in info.get("devices") or []:
            if d.get("offload") is not None:
                return d["offload"]
        return None

    def _decide(self) -> None:
        o = self._outcome() or {}
        planned = bool(o.get("planned"))
        wait_ms = (o.get("copy_out_wait_us", 0.0) + o.get("stall_us", 0.0)) / 1e3 if planned else None
        # The recorded iterations since the last (re)start, the first of them aside (its
        # prologue pins host memory).
        # The iteration's device time as the planner was told it (forward's blocks / its
        # share), else the recorded iterations' host time (the first after a (re)start
        # aside: its prologue pins host memory), which the recording's offload stretches.
        fwd = self.forward_ms()
        recent = self._iter_ms[-4:] if len(self._iter_ms) > 4 else self._iter_ms[1:] or self._iter_ms
        iter_ms = fwd / FORWARD_SHARE if fwd else (statistics.median(recent) if recent else 0.0)
        block = statistics.median(self._per_block[-4:]) if self._per_block else 0.0
        link = o.get("link_gbps") or 0.0
        d = {"round": self.rounds, "k": self.k, "planned": planned, "wait_ms": wait_ms,
             "iteration_ms": iter_ms, "forward_device_ms": self.forward_ms(), "block_bytes": block,
             "link_gbps": link,
             "bytes_per_iteration": o.get("bytes_per_iteration"), "reason": o.get("reason")}
        k_new = self.k
        moved = int(o.get("bytes_per_iteration") or 0) if planned else 0
        tensors = int(o.get("tensors") or 0) if planned else 0
        # Step 3b: recomputing the blocks whose bytes the plan moves vs moving them.
        k_off = math.ceil(moved / block) if block > 0 and moved > 0 else 0
        block_ms = (fwd / self.n) if fwd and self.n else 0.0
        off_ms, rcp_ms = tensors * self.tensor_ms, k_off * block_ms
        d["offload_cost_ms"], d["recompute_cost_ms"] = off_ms, rcp_ms
        blocks_cheaper = k_off > 0 and block_ms > 0 and rcp_ms < off_ms
        if (planned and wait_ms <= self.wait_share * iter_ms and blocks_cheaper
                and self.k < self.n and self.rounds < self.max_rounds):
            k_new = min(self.n, self.k + k_off)
            why = ""
            d["why"] = (f"moving {moved / 1e9:.2f} GB in {tensors} tensors costs ~{off_ms:.1f} ms per "
                        f"iteration, recomputing {k_off} more blocks ~{rcp_ms:.1f} ms")
        elif planned and wait_ms <= self.wait_share * iter_ms:
            why = f"plans {wait_ms:.1f} ms of copy waits per {iter_ms:.0f} ms iteration"
        elif self.rounds >= self.max_rounds:
            why = f"{self.rounds} re-recordings made; serving the plan as it is"
        else:
            if planned and block > 0 and link > 0 and wait_ms <= iter_ms:
                # The bytes the link could not move in time, at most the bytes moved.
                late = wait_ms * 1e-3 * link * 1e9
                k_add = math.ceil((min(late, moved) if moved > 0 else late) / block)
                if blocks_cheaper:
                    # Step 3b too: the blocks of every byte moved, when cheaper than moving
                    # them (so that the rounds are not spent a block at a time).
                    k_add = max(k_add, k_off)
            else:
                # Refused, or link-bound (waits longer than the iteration itself): step by an
                # eighth and measure again. On the H100, GPT-2 XL at 0.7 x LB planned 291 ms
                # of waits per 184 ms iteration with nothing recomputed; recomputing the 14
                # blocks its bytes are ran 1.268x, stepping 3 then 12 blocks 1.129x (one run
                # each, BENCHMARKS.md session 19).
                k_add = math.ceil(self.n / 8)
            k_new = min(self.n, self.k + max(1, k_add))
            why = ""
        if self.trial is not None and self.trial["stage"] == "b_rec":
            # Plan B of the trial: served whatever it waits, then measured.
            d["action"] = "trial_b"
            self.decisions.append(d)
            self.log(f"stweaver: auto recompute: trial: serving the plan with {self.k} of {self.n} blocks "
                     f"recomputed ({(o.get('bytes_per_iteration') or 0) / 1e9:.2f} GB moved per iteration), "
                     f"measuring its step")
            self.trial.update(stage="b", steps=[])
            self.ext.release_held_plan(True)
            return
        if k_new == self.k:
            k_b = min(self.n, self.k + k_off)
            if self.trial_on and self.trial is None and k_b > self.k:
                d["action"] = "trial_a"
                d["k_b"] = k_b
                self.decisions.append(d)
                self.log(f"stweaver: auto recompute: {self.k} of {self.n} blocks recomputed, serving the plan "
                         f"({why or 'no more blocks to recompute'}; {moved / 1e9:.2f} GB moved per iteration); "
                         f"trial: measuring its step against {k_b} blocks recomputed")
                self.trial = {"stage": "a", "k_a": self.k, "k_b": k_b, "moved_a": moved, "steps": []}
                self.ext.release_held_plan(True)  # the gate stays on: B's plan will be held
                return
            d["action"] = "serve"
            self.decisions.append(d)
            self.log(f"stweaver: auto recompute: {self.k} of {self.n} blocks recomputed, serving the plan "
                     f"({why or 'no more blocks to recompute'})")
            self._finish()  # serves the held plan, gate off
            return
        self._recompute(k_new)
        d["action"] = "recompute"
        d["k_new"] = k_new
        self.decisions.append(d)
        if "why" in d:
            cause = d["why"]
        elif planned:
            cause = "waits %.1f ms per iteration for copies" % wait_ms
        else:
            cause = "offloads nothing (" + str(o.get("reason")) + ")"
        self.log(f"stweaver: auto recompute: the plan under the budget {cause}; "
                 f"recomputing the {self.where} {k_new} of {self.n} blocks and recording again")
        self.rounds += 1
        self._restart()
        self.ext.release_held_plan(False)

    def _recompute(self, k: int) -> None:
        """Recomputes the model's ``k`` blocks (``where``) from the next iteration on."""
        from ._recompute import recompute_blocks

        recompute_blocks(self.model, k, where=self.where)
        self.k = k
        # The program changed (more or fewer recomputed in backward): the offloader's
        # watermark learns its level again, from the first iteration's headroom.
        forget = getattr(self.off, "program_changed", None)
        if forget is not None:
            forget()

    def _restart(self) -> None:
        """A new recording starts: its measurements start afresh."""
        self._iter_ms = []
        self._per_block = []
        self._block_ms = []

    def _trial_step(self, mode: str) -> None:
        """At a boundary while a served plan is measured (module doc, step 5)."""
        t = self.trial
        if mode != "auto (plan)":
            if t["stage"] == "a":
                # Plan A given up (its pool at the memory limit after conflicts; the run went
                # on online): B, with more recomputed, has more room under the budget.
                t["a_given_up"] = mode
                self.decisions.append({"action": "trial_a_given_up", "k": self.k, "mode": mode})
                self.log(f"stweaver: auto recompute: trial: the plan with {self.k} blocks was given up "
                         f"({mode}); recomputing {t['k_b']} blocks and recording again")
                self._to_b()
            elif not t.get("a_given_up"):
                self._back_to_a(f"the plan with {self.k} blocks ended ({mode})")
            else:
                # Both given up: nothing left to compare; what runs now stays.
                t["stage"] = "ended"
                self.decisions.append({"action": "trial_ended", "k": self.k, "mode": mode})
                self.log(f"stweaver: auto recompute: trial ended ({mode}); keeping {self.k} blocks recomputed")
                self._finish()
            return
        t["steps"].append(self._iter_ms[-1])
        if len(t["steps"]) < TRIAL_SKIP + TRIAL_STEPS:
            return
        median = statistics.median(t["steps"][TRIAL_SKIP:])
        if t["stage"] == "a":
            t["step_ms_a"] = median
            self.decisions.append({"action": "trial_measured_a", "k": self.k, "step_ms": median})
            self.log(f"stweaver: auto recompute: trial: {self.k} blocks + {t['moved_a'] / 1e9:.2f} GB moved "
                     f"ran {median:.1f} ms per iteration; recomputing {t['k_b']} blocks and recording again")
            self._to_b()
            return
        t["step_ms_b"] = median
        a = t.get("step_ms_a")  # None: plan A was given up
        against = (f"against {a:.1f} ms with {t['k_a']} blocks + offload" if a is not None
                   else f"(the plan with {t['k_a']} blocks was given up)")
        if a is not None and median > a:
            self._back_to_a(f"{self.k} blocks ran {median:.1f} ms per iteration {against}", step_ms=median)
            return
        self.decisions.append({"action": "trial_keep_b", "k": self.k, "step_ms": median, "step_ms_a": a})
        self.log(f"stweaver: auto recompute: trial: {self.k} blocks ran {median:.1f} ms per iteration "
                 f"{against}: keeping {self.k} blocks")
        t["stage"] = "ended"
        self._finish()

    def _to_b(self) -> None:
        """The trial goes to B: its blocks recomputed, auto mode recording again (plan A
        kept by the extension)."""
        self._recompute(self.trial["k_b"])
        self.trial["stage"] = "b_rec"
        self._restart()
        self.ext.record_again()

    def _back_to_a(self, why: str, step_ms: Optional[float] = None) -> None:
        """The trial ends on plan A: its blocks recomputed again and its kept plan served
        from this boundary (no recording)."""
        t = self.trial
        self.decisions.append({"action": "trial_back_to_a", "k": self.k, "step_ms": step_ms,
                               "step_ms_a": t.get("step_ms_a")})
        self.log(f"stweaver: auto recompute: trial: {why}: going back to {t['k_a']} blocks and their plan")
        self._recompute(t["k_a"])
        self.ext.serve_kept_plan()
        t["stage"] = "ended"
        self._finish()

    def stats(self) -> dict:
        trial = None
        if self.trial is not None:
            trial = {k: v for k, v in self.trial.items() if k != "steps"}
        return {"blocks": self.n, "recomputed": self.k, "where": self.where, "rounds": self.rounds,
                "done": self.done, "decisions": list(self.decisions), "trial": trial}


def _cuda_event_factory(model):
    """torch.cuda.Event with timing when the model's parameters are on a GPU, else None."""
    import torch

    p = next(iter(model.parameters()), None)
    if p is None or not p.is_cuda:
        return None
    return lambda: torch.cuda.Event(enable_timing=True)


def start(model, *, where: str = "last", max_rounds: int = MAX_ROUNDS) -> AutoRecompute:
    """``recompute_blocks(model, "auto")``: the offloader stweaver started under a budget in
    auto mode decides, at the boundary where auto mode's plan is ready, how many of the
    model's blocks to recompute (module doc)."""
    import stweaver

    from . import _offload

    off = _offload.current()
    mode = stweaver.mode() if stweaver.is_installed() else None
    if off is None or mode is None or not str(mode).startswith("auto") or off.ext is None:
        raise AutoRecomputeError(
            "recompute_blocks(model, 'auto') needs stweaver installed in auto mode under a budget "
            "(stweaver.install(budget=...), or STWEAVER_BUDGET with python -m stweaver run) with "
            f"offload on (STWEAVER_OFFLOAD not 0); now: mode {mode!r}, offloader "
            f"{'on' if off is not None else 'off'}")
    if not (str(mode).startswith("auto (recording") or str(mode).startswith("auto (planning")):
        raise AutoRecomputeError(
            f"recompute_blocks(model, 'auto') must be called before auto mode serves its plan "
            f"(right after install, before training); now: {mode!r}")
    if off.auto_recompute is not None:
        off.auto_recompute.remove()
    # Opt-in (experimental): on the H100 it kept the better choice on Llama 1B, but on GPT-2
    # XL plan A was given up in both runs and B, served cleanly, ran slower than the online
    # run it replaced (BENCHMARKS.md, session 17).
    trial = os.environ.get("STWEAVER_AUTO_TRIAL", "0").strip() == "1"
    ar = AutoRecompute(model, off, off.ext, where=where, max_rounds=max_rounds, trial=trial)
    off.auto_recompute = ar
    return ar
