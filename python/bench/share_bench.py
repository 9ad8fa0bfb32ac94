#!/usr/bin/env python3
"""Sharing one GPU (issue #17 item 3): how fast stweaver gives memory back and takes it again,
and two trainers taking turns on a GPU their peaks together exceed. Each allocator runs in
its own fresh process (the allocator is chosen before CUDA starts).

    OUT=/tmp/sb bash scripts/share_bench.sh .carry [share_bench.py ARGS...]
    python python/bench/share_bench.py --out DIR [--parts speed,share] [--sizes 1,10,40]
    python python/bench/share_bench.py --dry-run --out DIR     (CPU, tiny: the plumbing only)

Part 1, ``speed``: release and restore of one tensor of 1, 10 and 40 GiB (``--sizes``; a size
over the device's free memory is skipped, and the kept-contents rows of a size over the host's
available memory too). Per row, ``--reps`` repetitions (``--big-reps`` from 20 GiB on; after
``--child-budget-s`` seconds a child runs only the first repetition of a row, after twice that
no new row), each call timed alone between ``torch.cuda.synchronize()``; min and median
seconds, GB/s = bytes / median time (10^9 B/s), the device memory given back
(``torch.cuda.mem_get_info`` after the release minus before, first repetition) and, for kept
contents, whether the bytes came back (the int64 sums of every 2 MiB of random contents,
compared). Rows:

- ``stweaver``: ``stweaver.install("online")``; the tensor made in ``stweaver.region(tag)``;
  release = ``stweaver.pause(tag, keep_contents=...)``, restore = ``stweaver.resume(tag)``
  (``kept``: the engine copies through pageable host memory; ``dropped``: contents undefined);
- ``native``: PyTorch's own allocator; release = ``del`` + ``torch.cuda.empty_cache()``,
  restore = ``torch.empty`` again; ``kept`` adds a copy to (from) a pinned host buffer
  (``cudaHostRegister``-ed once, outside the timing) before the release (after the restore);
- ``driver 2MiB``: the physical limit, a hand-written driver loop through ctypes on libcuda
  (``vmm_probe.py``'s structs): release = ``cuMemUnmap`` of every 2 MiB granule, restore =
  ``cuMemCreate`` + ``cuMemMap`` + ``cuMemRelease`` per granule and one ``cuMemSetAccess``
  over the range; ``kept`` adds the same pinned copies as ``native``;
- ``driver 1 handle``: the same with one handle for the whole range (the fewest calls);
- ``torch_memory_saver``: when it imports, or else from the wheel in
  ``third_party/torch_memory_saver/`` (installed with ``pip install --no-index --no-deps
  --target`` into a temporary folder, never into site-packages); ``hook_mode = "torch"``,
  the tensor made in ``torch_memory_saver.region(tag, enable_cpu_backup=kept)``, release =
  ``pause(tag)``, restore = ``resume(tag)``.

The native child also measures the pinned link (1 GiB each way, budget_bench's probe).

Part 2, ``share``: two trainers (``A`` and ``B``: gpu_bench's Llama 1B config without
recomputation, bf16, AdamW, random token ids, deterministic algorithms, seeds 0 and 1), each
in its own process under ``stweaver.install("online")`` -- online mode because a pause while
a plan is served (plan and auto modes) is refused -- with every allocation inside
``stweaver.region("train")`` (untagged memory is never paused), so that ``stweaver.pause()``
(no tag: every region) gives back weights, optimizer state and the cache. The micro-batch is
sized so that each trainer's peak is about ``--share-frac`` (0.58) of the GPU: a calibration
(one training step at each of ``--cal-batches`` 4 and 8 sequences of ``--seq`` tokens, peak
reserved each, the cache emptied before each) gives the bytes per sequence; every trainer
process runs it before building its model (the same history alone and shared). Runs:

1. ``alone``: A, then B, each alone for ``--rounds`` x ``--steps`` steps (no pause);
2. ``shared``: A and B started together; A trains ``--steps`` steps and pauses
   (``keep_contents=True``), B resumes (the first time: builds its model), trains ``--steps``
   steps and pauses, A resumes, ... for ``--rounds`` rounds; the parent drives the turns
   over pipes.

Reported: each trainer's losses compared bitwise with its alone run, the per-switch pause and
resume times and bytes, the device memory free after each pause, each trainer's peak
reserved and their sum against the GPU's total, the step time alone and shared (the first
step after a resume apart: it maps its activations' memory again) and the throughput (steps /
seconds of the train calls alone; steps / seconds of the train, pause and resume calls shared).

Time: about 7.5 minutes on one H100 with the defaults: ``--deadline-s`` (460) stops what is
left and still prints the table (part 2 stops at a turn boundary when the next turn would not
fit, and says so), and the speed part leaves ``--share-reserve-s`` (190) of it to part 2 (first
H100 run, 6 rounds: the speed part took 170 s, part 2 about 30 s for the two calibrations and
builds, 18 s of training per trainer alone and about 10 s per turn shared, 5 s of it the pause); ``--parts speed`` or ``--parts share`` runs one
part, ``--rounds``, ``--steps``, ``--sizes``, ``--reps`` and ``--kinds`` shrink them. Every
row runs on its own: a failing row prints its error and the rest go on. JSON goes to ``--out``
(default ``$OUT`` or .) as share_bench.json, the table to share_bench.txt and last on stdout
(child logs and results in share_bench_logs/ there). ``--dry-run`` runs the native speed
row and both runs of part 2 on the CPU with a tiny model (no stweaver: pause and resume do
nothing there).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PY_DIR = os.path.join(REPO, "python")
for _p in (HERE, PY_DIR):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import gpu_bench as gb  # noqa: E402  (model configs, builder, child environment; no torch)
from gpubench.common import write_json, write_table  # noqa: E402

GiB = float(1 << 30)
MiB = 1 << 20
TMS_DIR = os.path.join(REPO, "third_party", "torch_memory_saver")
SPEED_KINDS = ("stweaver", "tms", "native", "driver")
LABELS = {"stweaver": "stweaver", "native": "native empty_cache", "driver_2m": "driver 2MiB loop",
          "driver_1h": "driver 1 handle", "tms": "torch_memory_saver"}
# Trainer A and B: gpu_bench's Llama 1B, no recomputation; batch and seq set at run time.
TRAINER = dict(next(w for w in gb.WORKLOADS if w["name"] == "llama1b_rcp"), name="llama1b_share",
               ckpt=False, micro=1)


# ------------------------------------------------------------------ speed child


def _mem_available() -> Optional[int]:
    """MemAvailable of /proc/meminfo in bytes (None when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class _Sess:
    """One tensor of `n` bytes that a kind releases and restores (speed part)."""

    def __init__(self, torch, n: int, device: str):
        self.torch, self.n, self.device, self.x = torch, n, device, None
        self.info: dict = {}

    def ctx(self):
        import contextlib

        return contextlib.nullcontext()

    def prepare(self, keep: bool) -> None:
        if self.x is None:
            self.x = self.torch.empty(self.n, dtype=self.torch.uint8, device=self.device)

    def tensor(self):
        return self.x

    def finish(self) -> None:
        self.x = None
        gc.collect()
        if self.device == "cuda":
            self.torch.cuda.empty_cache()


class _StweaverSess(_Sess):
    def __init__(self, torch, n, device):
        super().__init__(torch, n, device)
        import stweaver

        self.st, self.tag = stweaver, f"share_bench_{n}"

    def ctx(self):
        return self.st.region(self.tag)

    def prepare(self, keep):
        with self.ctx():
            super().prepare(keep)

    def release(self, keep):
        self.info["pause"] = self.st.pause(self.tag, keep_contents=keep)

    def restore(self, keep):
        self.info["resume"] = self.st.resume(self.tag)


class _NativeSess(_Sess):
    def __init__(self, torch, n, device, host):
        super().__init__(torch, n, device)
        self.host = host

    def release(self, keep):
        if keep:
            self.host[: self.n].copy_(self.x)
        self.x = None
        if self.device == "cuda":
            self.torch.cuda.empty_cache()

    def restore(self, keep):
        self.x = self.torch.empty(self.n, dtype=self.torch.uint8, device=self.device)
        if keep:
            self.x.copy_(self.host[: self.n])


class _DriverRange:
    """`n` bytes of reserved address space mapped with handles of `chunk` bytes, through the
    driver API (vmm_probe.py's ctypes structs), and a uint8 tensor over it."""

    def __init__(self, torch, n: int, chunk: int, device: int):
        import ctypes

        import vmm_probe as vp  # loads libcuda.so.1 at import: only here, on the GPU machine

        self.c, self.vp, self.cu = ctypes, vp, vp.cu
        self.n, self.chunk = n, chunk
        prop = vp.AllocProp()
        prop.type = vp.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = vp.Location(vp.CU_MEM_LOCATION_TYPE_DEVICE, device)
        self.prop = prop
        gran = ctypes.c_size_t()
        vp.check(self.cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0),
                 "cuMemGetAllocationGranularity")
        if n % gran.value or chunk % gran.value or n % chunk:
            raise ValueError(f"{n} B in chunks of {chunk} B: not granule multiples ({gran.value} B)")
        ptr = ctypes.c_uint64()
        vp.check(self.cu.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(n), ctypes.c_size_t(0),
                                             ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        self.ptr = ptr.value
        self.desc = vp.AccessDesc(vp.Location(vp.CU_MEM_LOCATION_TYPE_DEVICE, device),
                                  vp.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        self.mapped = False
        self.map()
        ptr_v, shape = self.ptr, (n,)

        class Iface:
            __cuda_array_interface__ = {"shape": shape, "typestr": "|u1", "data": (ptr_v, False), "version": 3}

        self.t = torch.as_tensor(Iface(), device="cuda")

    def map(self) -> None:
        c, cu, check = self.c, self.cu, self.vp.check
        for off in range(0, self.n, self.chunk):
            h = c.c_ulonglong()
            check(cu.cuMemCreate(c.byref(h), c.c_size_t(self.chunk), c.byref(self.prop), c.c_ulonglong(0)),
                  "cuMemCreate")
            check(cu.cuMemMap(c.c_uint64(self.ptr + off), c.c_size_t(self.chunk), c.c_size_t(0), h,
                              c.c_ulonglong(0)), "cuMemMap")
            check(cu.cuMemRelease(h), "cuMemRelease")  # the mapping keeps the memory
        check(cu.cuMemSetAccess(c.c_uint64(self.ptr), c.c_size_t(self.n), c.byref(self.desc), c.c_size_t(1)),
              "cuMemSetAccess")
        self.mapped = True

    def unmap(self) -> None:
        c, cu, check = self.c, self.cu, self.vp.check
        for off in range(0, self.n, self.chunk):
            check(cu.cuMemUnmap(c.c_uint64(self.ptr + off), c.c_size_t(self.chunk)), "cuMemUnmap")
        self.mapped = False

    def free(self) -> None:
        if self.mapped:
            self.unmap()
        self.vp.check(self.cu.cuMemAddressFree(self.c.c_uint64(self.ptr), self.c.c_size_t(self.n)),
                      "cuMemAddressFree")


class _DriverSess(_Sess):
    def __init__(self, torch, n, device, host, chunk):
        super().__init__(torch, n, device)
        self.host, self.chunk, self.r = host, chunk, None

    def prepare(self, keep):
        if self.r is None:
            self.r = _DriverRange(self.torch, self.n, self.chunk, self.torch.cuda.current_device())

    def tensor(self):
        return self.r.t

    def release(self, keep):
        if keep:
            self.host[: self.n].copy_(self.r.t)
        self.r.unmap()

    def restore(self, keep):
        self.r.map()
        if keep:
            self.r.t.copy_(self.host[: self.n])

    def finish(self):
        if self.r is not None:
            self.torch.cuda.synchronize()
            self.r.t = None
            self.r.free()
            self.r = None


class _TmsSess(_Sess):
    def __init__(self, torch, n, device, tms):
        super().__init__(torch, n, device)
        self.tms, self.keep = tms, None

    def prepare(self, keep):
        if self.keep is not None and self.keep != keep:
            self.finish()  # another cpu-backup setting is another MemPool
        if self.x is None:
            self.keep, self.tag = keep, f"share_bench_{int(keep)}"
            with self.tms.region(tag=self.tag, enable_cpu_backup=keep):
                self.x = self.torch.empty(self.n, dtype=self.torch.uint8, device=self.device)

    def release(self, keep):
        self.tms.pause(self.tag)

    def restore(self, keep):
        self.tms.resume(self.tag)

    def finish(self):
        self.x = None
        gc.collect()
        # A live MemPool keeps its cached blocks through empty_cache: drop torch_memory_saver's
        # pools (as its own disable() does with its pool) so that the memory goes back. Its
        # torch-mode free (tms_torch_free) aborts the process ("only support interesting
        # region") when called outside a region on CUDA, and destroying a pool frees its
        # blocks: so the flag is set around the teardown (thread-local; only this pool's
        # pointers go through that free).
        cdll = None
        try:
            cdll = self.tms._impl._binary_wrapper.cdll
            was = bool(cdll.tms_get_interesting_region())
            cdll.tms_set_interesting_region(True)
        except Exception as e:  # private attributes: report, and leave the pools alone
            self.info["pool_clear_error"] = f"region flag: {type(e).__name__}: {e}"
            cdll = None
        if cdll is not None:
            try:
                self.tms._impl._mem_pools.clear()
                gc.collect()
                self.torch.cuda.synchronize()
                self.torch.cuda.empty_cache()
            except Exception as e:  # the next size may then not fit
                self.info["pool_clear_error"] = f"{type(e).__name__}: {e}"
            finally:
                cdll.tms_set_interesting_region(was)
        gc.collect()
        self.torch.cuda.empty_cache()
        self.keep = None


def _stats(n: int, xs: List[float]) -> dict:
    if not xs:
        return {"s": [], "min_s": None, "median_s": None, "GBps": None}
    med = statistics.median(xs)
    return {"s": xs, "min_s": min(xs), "median_s": med, "GBps": n / med / 1e9 if med > 0 else None}


def _measure(torch, sess: _Sess, keep: bool, reps: int, cuda: bool, gran: int, out_of_time, row: dict,
             save) -> None:
    """`reps` timed release + restore pairs of `sess` (contents checked when `keep`; no new
    pair after the first once `out_of_time()`), into `row`, saved after each pair."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = sess.n
    rows = max(1, n // gran)

    def fingerprint():
        with sess.ctx():
            v = sess.tensor().view(torch.int64).view(rows, -1)
            return v.sum(dim=1).cpu()

    rel, res, ok, given = [], [], [], None
    sess.prepare(keep)

    def put(cut=False):
        row.update({"keep": keep, "reps": len(rel), "release": _stats(n, rel), "restore": _stats(n, res),
                    "given_back": given, "contents_ok": (all(ok) if ok else None)})
        if cut:
            row["cut"] = "child time budget"
        if sess.info:
            row["info"] = dict(sess.info)
        save()

    for r in range(reps):
        if r and out_of_time():
            put(cut=True)
            return
        ref = None
        if keep:
            with sess.ctx():
                sess.tensor().view(torch.int64).random_(0, 1 << 20)
            ref = fingerprint()
        gc.collect()
        sync()
        free0 = torch.cuda.mem_get_info()[0] if cuda else 0
        t0 = time.perf_counter()
        sess.release(keep)
        sync()
        t1 = time.perf_counter()
        if r == 0 and cuda:
            given = torch.cuda.mem_get_info()[0] - free0
        sync()
        t2 = time.perf_counter()
        sess.restore(keep)
        sync()
        t3 = time.perf_counter()
        rel.append(t1 - t0)
        res.append(t3 - t2)
        if keep:
            ok.append(bool(torch.equal(fingerprint(), ref)))
        put()


def speed_child(spec: dict) -> dict:
    """One allocator kind, every size, in this fresh process; the result file is rewritten
    after each row (a child killed at its timeout still leaves what it measured)."""
    kind, dry = spec["kind"], spec["dry_run"]
    t_start = time.time()
    res: dict = {"kind": kind, "ok": False, "rows": []}

    def save():
        write_json(spec["result"], res, indent=None)

    tms = None
    if kind == "stweaver":
        import stweaver

        stweaver.install("online")
    if kind == "tms":
        from torch_memory_saver import torch_memory_saver as tms

        tms.hook_mode = "torch"  # a pluggable allocator in a MemPool: no LD_PRELOAD needed
        try:
            import importlib.metadata as md

            res["tms_version"] = md.version("torch_memory_saver")
        except Exception:
            res["tms_version"] = None
        import torch_memory_saver as tms_mod

        res["tms_path"] = os.path.dirname(tms_mod.__file__)
    import torch

    cuda = not dry
    device = "cuda" if cuda else "cpu"
    unit = MiB if dry else 1 << 30
    gran = (64 << 10) if dry else 2 * MiB
    if cuda:
        torch.cuda.init()
        res["device"] = torch.cuda.get_device_name(0)
        res["total"] = torch.cuda.get_device_properties(0).total_memory
        if kind == "stweaver":
            import stweaver

            res["mode"] = stweaver.mode()
    if kind == "native":
        try:
            import budget_bench as bb

            res["link"] = bb.link_probe(dry)
        except Exception as e:
            res["link"] = {"error": f"{type(e).__name__}: {e}"}
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()  # the probe's 1 GiB would count as given back by the first row
    sizes = spec["sizes"]
    biggest = max(sizes) * unit
    host = None
    if kind in ("native", "driver"):
        # One pinned buffer for every size (registered once, outside the timing).
        avail = _mem_available()
        want = biggest
        if avail is not None and want > 0.85 * avail:
            fit = [s for s in sizes if s * unit <= 0.85 * avail]
            want = max(fit) * unit if fit else 0
        if want:
            host = torch.empty(want, dtype=torch.uint8)
            if cuda:
                from torch.cuda._pin_memory_utils import pin_memory

                t0 = time.perf_counter()
                pin_memory(host.data_ptr(), want)
                res["pin_s"] = time.perf_counter() - t0
        res["host_bytes"] = want
    budget = spec["budget_s"]

    def out_of_time():  # no new repetition after the first of a row
        return time.time() - t_start > budget

    def hard_out():  # no new row
        return time.time() - t_start > 2 * budget

    variants = [kind] if kind != "driver" else ["driver_2m", "driver_1h"]
    save()
    for size in sorted(sizes):
        n = size * unit
        for var in variants:
            for keep in (False, True):
                row = {"kind": var, "size": size, "bytes": n, "contents": "kept" if keep else "dropped"}
                res["rows"].append(row)
                if hard_out():
                    row["skipped"] = f"child time budget spent ({2 * budget:.0f} s)"
                    continue
                if cuda:
                    free = torch.cuda.mem_get_info()[0]
                    if n + (1 << 30) > free:
                        row["skipped"] = f"does not fit: {free / GiB:.1f} GiB free on the device"
                        continue
                avail = _mem_available()
                if keep and kind == "stweaver" and avail is not None and n > 0.85 * avail:
                    row["skipped"] = f"host: {avail / GiB:.1f} GiB available"
                    continue
                if keep and kind in ("native", "driver") and (host is None or host.numel() < n):
                    row["skipped"] = "host: no pinned buffer that large"
                    continue
                if var == "tms" and keep and avail is not None and n > 0.85 * avail:
                    row["skipped"] = f"host: {avail / GiB:.1f} GiB available"
                    continue
                print(f"[{kind}] {var} {size} {'GiB' if cuda else 'MiB'} {row['contents']}", flush=True)
                sess = None
                try:
                    if var == "stweaver":
                        sess = _StweaverSess(torch, n, device)
                    elif var == "native":
                        sess = _NativeSess(torch, n, device, host)
                    elif var.startswith("driver"):
                        sess = _DriverSess(torch, n, device, host, 2 * MiB if var == "driver_2m" else n)
                    else:
                        sess = _TmsSess(torch, n, device, tms)
                    reps = spec["big_reps"] if size >= 20 and not dry else spec["reps"]
                    _measure(torch, sess, keep, reps, cuda, gran, out_of_time, row, save)
                except Exception as e:
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {e}"[:1000]
                finally:
                    save()  # before the teardown, which could take the process down
                    if sess is not None:
                        try:
                            sess.finish()
                        except Exception as e:
                            traceback.print_exc()
                            row["finish_error"] = f"{type(e).__name__}: {e}"[:500]
                print(f"[{kind}] {_row_line(row)}", flush=True)
                save()
    if host is not None and cuda:
        try:
            from torch.cuda._pin_memory_utils import unpin_memory

            unpin_memory(host.data_ptr())
        except Exception as e:
            res["unpin_error"] = str(e)
    res["ok"] = True
    res["wall_s"] = time.time() - t_start
    save()
    return res


# ------------------------------------------------------------------ trainer child


class Trainer:
    """One training process of part 2, driven by the parent over stdin (one JSON command a
    line) and answering on a private copy of stdout (one JSON line per command)."""

    def __init__(self, spec: dict):
        self.spec, self.dry = spec, spec["dry_run"]
        self.st = None
        if not self.dry:
            import stweaver

            # Online: a pause while a plan is served (plan, auto) is refused.
            stweaver.install("online")
            self.st = stweaver
            # Every allocation of this process carries the tag "train" (untagged memory is
            # never paused): weights, optimizer state, activations, cuBLAS workspaces.
            self._region = stweaver.region("train")
            self._region.__enter__()
        import torch
        import transformers  # noqa: F401  (imported now: the parent overlaps this with other runs)

        self.torch = torch
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        self.cuda = not self.dry
        self.device = "cuda" if self.cuda else "cpu"
        self.cfg = dict(spec["cfg"])
        self.model = self.opt = self.gen = None
        self.losses: List[str] = []
        self.step_s: List[float] = []

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def _build(self):
        torch = self.torch
        torch.manual_seed(self.spec["seed"])
        model, _ = gb._build_model(self.cfg, self.device, torch)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return model, opt

    def _step(self, model, opt, x) -> float:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach().float().item())

    def _batch(self, gen, batch):
        return self.torch.randint(0, self.cfg["vocab"], (batch, self.cfg["seq"]), generator=gen).to(self.device)

    def cmd_init(self, _):
        out = {"mode": self.st.mode() if self.st else "dry run (no stweaver)"}
        if self.cuda:
            torch = self.torch
            torch.cuda.init()
            out["device"] = torch.cuda.get_device_name(0)
            out["total"] = torch.cuda.get_device_properties(0).total_memory
            out["free"] = torch.cuda.mem_get_info()[0]
        return out

    def cmd_calibrate(self, c):
        """Peak reserved of one step at each batch of `c["batches"]` (after a warm step that
        makes the optimizer state), with the cache emptied before each; everything is freed
        after. Every trainer process runs it (identical histories in the alone and shared
        runs)."""
        torch = self.torch
        model, opt = self._build()
        gen = torch.Generator().manual_seed(4321)
        batches = c["batches"]
        self._step(model, opt, self._batch(gen, batches[0]))
        peaks = []
        for b in batches:
            x = self._batch(gen, b)
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            self._step(model, opt, x)
            del x
            self.sync()
            peaks.append({"batch": b,
                          "reserved": torch.cuda.max_memory_reserved() if self.cuda else None,
                          "allocated": torch.cuda.max_memory_allocated() if self.cuda else None})
        del model, opt
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        return {"peaks": peaks}

    def cmd_build(self, c):
        torch = self.torch
        self.cfg["batch"] = c["batch"]
        t0 = time.perf_counter()
        self.model, self.opt = self._build()
        self.gen = torch.Generator().manual_seed(1000 + self.spec["seed"])
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        return {"build_s": time.perf_counter() - t0,
                "n_params": sum(p.numel() for p in self.model.parameters())}

    def cmd_train(self, c):
        torch = self.torch
        losses, times = [], []
        for _ in range(c["steps"]):
            x = self._batch(self.gen, self.cfg["batch"])
            self.sync()
            t0 = time.perf_counter()
            loss = self._step(self.model, self.opt, x)
            self.sync()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss).hex())
            del x
        gc.collect()  # no tensor may die while paused: drop the step's garbage now
        self.sync()
        self.losses += losses
        self.step_s += times
        return {"losses": losses, "step_s": times,
                "reserved": torch.cuda.memory_reserved() if self.cuda else None,
                "peak_reserved": torch.cuda.max_memory_reserved() if self.cuda else None}

    def _mem(self) -> dict:
        torch = self.torch
        if not self.cuda:
            return {}
        return {"free": torch.cuda.mem_get_info()[0], "reserved": torch.cuda.memory_reserved(),
                "allocated": torch.cuda.memory_allocated()}

    def cmd_pause(self, c):
        gc.collect()
        self.sync()
        t0 = time.perf_counter()
        rep = self.st.pause(None, keep_contents=bool(c.get("keep", True))) if self.st else {}
        self.sync()
        dt = time.perf_counter() - t0
        return {"s": dt, "report": rep, "after": self._mem()}

    def cmd_resume(self, c):
        self.sync()
        t0 = time.perf_counter()
        rep = self.st.resume(None) if self.st else {}
        self.sync()
        dt = time.perf_counter() - t0
        return {"s": dt, "report": rep, "after": self._mem()}

    def cmd_finish(self, c):
        torch = self.torch
        out = {"losses": self.losses, "step_s": self.step_s}
        if self.cuda:
            out["max_reserved"] = torch.cuda.max_memory_reserved()
            out["max_allocated"] = torch.cuda.max_memory_allocated()
        if self.st is not None:
            try:
                s = self.st.stats()
                out["failed_frees"] = s.get("failed_frees")
                out["stweaver_mode"] = s.get("mode")
            except Exception as e:
                out["stats_error"] = str(e)
        return out


def trainer_main() -> int:
    # Replies go to a private copy of stdout; everything else printed goes to the log.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(d):
        proto.write(json.dumps(d) + "\n")
        proto.flush()

    try:
        spec = json.loads(sys.stdin.readline())
        tr = Trainer(spec)
    except Exception as e:
        traceback.print_exc()
        reply({"ok": False, "error": f"start: {type(e).__name__}: {e}"[:2000]})
        return 1
    reply({"ok": True, "ready": True})
    for line in sys.stdin:
        if not line.strip():
            continue
        c = json.loads(line)
        try:
            out = getattr(tr, "cmd_" + c["cmd"])(c)
            reply(dict(out, ok=True))
        except Exception as e:
            traceback.print_exc()
            reply({"ok": False, "error": f"{c['cmd']}: {type(e).__name__}: {e}"[:2000]})
        if c["cmd"] == "finish":
            break
    return 0


# ------------------------------------------------------------------ driver


class ChildError(RuntimeError):
    pass


class Proc:
    """A trainer child: commands on its stdin, replies read from its stdout with a timeout."""

    def __init__(self, name: str, spec: dict, tmp: str, env: dict):
        self.name = name
        self.log_path = os.path.join(tmp, f"trainer_{name}.log")
        self.log = open(self.log_path, "w")
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "trainer"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env)
        self.buf = b""
        self.ready = False
        self._send(spec)

    def _send(self, d: dict) -> None:
        try:
            self.p.stdin.write((json.dumps(d) + "\n").encode())
            self.p.stdin.flush()
        except OSError as e:
            raise ChildError(f"{self.name}: cannot write to the child ({e}){self.tail()}")

    def _readline(self, timeout: float) -> str:
        import select

        end = time.time() + max(1.0, timeout)
        fd = self.p.stdout.fileno()
        while b"\n" not in self.buf:
            left = end - time.time()
            if left <= 0:
                raise ChildError(f"{self.name}: no reply in {timeout:.0f} s{self.tail()}")
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise ChildError(f"{self.name}: the child exited (rc {self.p.poll()}){self.tail()}")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def wait_ready(self, timeout: float) -> None:
        if not self.ready:
            r = json.loads(self._readline(timeout))
            if not r.get("ok"):
                raise ChildError(f"{self.name}: {r.get('error')}{self.tail()}")
            self.ready = True

    def call(self, cmd: str, timeout: float, **kw) -> dict:
        self.wait_ready(timeout)
        self._send(dict(kw, cmd=cmd))
        r = json.loads(self._readline(timeout))
        if not r.get("ok"):
            raise ChildError(f"{self.name}: {r.get('error')}{self.tail()}")
        return r

    def tail(self, n: int = 1500) -> str:
        try:
            self.log.flush()
            with open(self.log_path) as f:
                t = f.read()[-n:]
            return f"\n--- {self.name} log tail ---\n{t}" if t.strip() else ""
        except OSError:
            return ""

    def close(self, timeout: float = 20.0) -> None:
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.log.close()


def _row_line(r: dict) -> str:
    head = f"{LABELS.get(r['kind'], r['kind'])} {r['size']} {r['contents']}"
    if r.get("skipped"):
        return f"{head}: skipped ({r['skipped']})"
    if r.get("error"):
        return f"{head}: error {r['error'][:300]}"
    rel, res = r.get("release") or {}, r.get("restore") or {}
    return (f"{head}: release {_s(rel.get('min_s'))}/{_s(rel.get('median_s'))} {_g(rel.get('GBps'))} GB/s, "
            f"restore {_s(res.get('min_s'))}/{_s(res.get('median_s'))} {_g(res.get('GBps'))} GB/s, "
            f"given back {_gib(r.get('given_back'))}, contents ok {r.get('contents_ok')}, reps {r.get('reps')}"
            + (f", {r['info']}" if r.get("info") else ""))


def _s(x) -> str:
    return "-" if x is None else (f"{x:.4f}" if x < 10 else f"{x:.2f}")


def _g(x) -> str:
    return "-" if not x else f"{x:.1f}"


def _gib(x) -> str:
    return "-" if x is None else f"{x / GiB:.2f}G"


def tms_setup() -> dict:
    """Whether torch_memory_saver imports in a child; if not, the wheel of third_party/ is
    installed (offline, --target a temporary folder) and put on the child's PYTHONPATH."""
    env = gb.child_env("native")
    probe = [sys.executable, "-c", "import torch_memory_saver, os; print(os.path.dirname(torch_memory_saver.__file__))"]
    cp = subprocess.run(probe, capture_output=True, text=True, env=env, timeout=120)
    if cp.returncode == 0:
        return {"available": True, "source": "installed", "path": cp.stdout.strip(), "pythonpath": None}
    wheels = sorted(f for f in os.listdir(TMS_DIR) if f.endswith(".whl")) if os.path.isdir(TMS_DIR) else []
    if not wheels:
        return {"available": False, "reason": "not importable and no wheel in third_party/torch_memory_saver"}
    whl = os.path.join(TMS_DIR, wheels[-1])
    target = tempfile.mkdtemp(prefix="stweaver-tms-site-")
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation",
           "--no-compile", "--target", target, whl]
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    how = "pip install --no-index --no-deps --target"
    if cp.returncode != 0:
        # No pip: a wheel is a zip of the files to put on the path.
        import zipfile

        try:
            with zipfile.ZipFile(whl) as z:
                z.extractall(target)
            how = f"unzipped (pip failed: {(cp.stderr or cp.stdout).strip()[-300:]})"
        except Exception as e:
            return {"available": False, "reason": f"pip install failed: {(cp.stderr or cp.stdout)[-500:]}; unzip: {e}"}
    env["PYTHONPATH"] = target + os.pathsep + env["PYTHONPATH"]
    cp = subprocess.run(probe, capture_output=True, text=True, env=env, timeout=120)
    if cp.returncode != 0:
        return {"available": False, "reason": f"installed from {wheels[-1]} but does not import: {cp.stderr[-800:]}"}
    return {"available": True, "source": f"{wheels[-1]} ({how})", "path": cp.stdout.strip(), "pythonpath": target}


def spawn_speed(kind: str, base: dict, tmp: str, timeout: float, pythonpath: Optional[str]) -> dict:
    spec = dict(base, kind=kind, result=os.path.join(tmp, f"speed_{kind}.json"))
    log_path = os.path.join(tmp, f"speed_{kind}.log")
    if os.path.exists(spec["result"]):
        os.remove(spec["result"])  # a reused --out: never read an earlier run's result
    env = gb.child_env("native")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env["PYTHONPATH"]
    t0 = time.time()
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "speed"], stdin=subprocess.PIPE,
                             stdout=log, stderr=subprocess.STDOUT, env=env, text=True)
        try:
            p.stdin.write(json.dumps(spec) + "\n")
            p.stdin.close()
        except OSError:
            pass
        try:
            rc = p.wait(timeout=max(5.0, timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = "timeout"
    try:
        with open(spec["result"]) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = {"kind": kind, "ok": False, "rows": []}
    res["rc"] = rc
    res["wall_s"] = time.time() - t0
    if rc != 0:
        res.setdefault("error", f"child rc={rc}")
    if res.get("error") or any(r.get("error") for r in res.get("rows", [])):
        with open(log_path) as f:
            res["log_tail"] = f.read()[-3000:]
    return res


def run_speed(args, tmp: str, doc: dict, deadline: float, save) -> None:
    base = {"dry_run": args.dry_run, "sizes": args.sizes_list, "reps": args.reps, "big_reps": args.big_reps,
            "budget_s": args.child_budget_s}
    if "tms" in args.kinds_list:
        try:
            tms = tms_setup()
        except Exception as e:
            tms = {"available": False, "reason": f"setup failed: {type(e).__name__}: {e}"[:800]}
        print(f"torch_memory_saver: {tms}", flush=True)
    else:
        tms = {"available": False, "reason": "not asked (--kinds)"}
    doc["tms"] = tms
    kinds = [k for k in args.kinds_list]
    speed = doc.setdefault("speed", {})
    for kind in kinds:
        if args.dry_run and kind != "native":
            speed[kind] = {"kind": kind, "ok": False, "skipped": "dry run (needs CUDA)", "rows": []}
            print(f"speed {kind}: skipped (dry run)", flush=True)
            continue
        if kind == "tms" and not tms.get("available"):
            speed[kind] = {"kind": kind, "ok": False, "skipped": f"torch_memory_saver: {tms.get('reason')}", "rows": []}
            print(f"speed {kind}: skipped ({tms.get('reason')})", flush=True)
            continue
        left = deadline - time.time() - args.share_reserve_s
        if left < 20:
            speed[kind] = {"kind": kind, "ok": False, "skipped": "deadline", "rows": []}
            print(f"speed {kind}: skipped (deadline)", flush=True)
            continue
        b = dict(base, budget_s=min(args.child_budget_s, (left - 15) / 2))
        print(f"== speed: {kind} (repetitions after the first of a row until {b['budget_s']:.0f} s, "
              f"rows until {2 * b['budget_s']:.0f} s)", flush=True)
        r = spawn_speed(kind, b, tmp, min(left, 2 * b["budget_s"] + 60),
                        tms.get("pythonpath") if kind == "tms" else None)
        speed[kind] = r
        if r.get("error"):
            print(f"speed {kind}: {r['error']}\n{r.get('log_tail', '')[-1500:]}", flush=True)
        print(f"speed {kind}: done in {r['wall_s']:.0f} s", flush=True)
        save()


def pick_batch(cal: dict, total: int, frac: float) -> dict:
    """The micro-batch whose predicted peak reserved is at most frac x total (peak linear in
    the batch: two calibration points)."""
    p = cal["peaks"]
    (b1, r1), (b2, r2) = (p[0]["batch"], p[0]["reserved"]), (p[1]["batch"], p[1]["reserved"])
    per = (r2 - r1) / (b2 - b1)
    base = r1 - per * b1
    if per <= 0:
        raise ValueError(f"calibration: the peak does not grow with the batch ({p})")
    batch = int((frac * total - base) // per)
    batch = max(1, min(batch, 4096))
    return {"batch": batch, "per_seq": per, "base": base, "predicted_peak": base + per * batch}


def run_share(args, tmp: str, doc: dict, deadline: float, save) -> None:
    share: dict = {"ok": False, "mode": "stweaver online (pause refused while a plan is served)",
                   "rounds": args.rounds, "steps": args.steps, "keep_contents": True}
    doc["share"] = share
    cfg = dict(TRAINER, seq=args.seq, vocab=32000)
    if args.dry_run:
        for k in ("hidden", "layers", "heads", "inter", "seq"):
            cfg[k] = gb.DRY[k]
        cfg["vocab"] = gb.DRY["vocab"]
        share["mode"] = "dry run: CPU, no stweaver (pause/resume do nothing)"
    share["cfg"] = cfg
    env = gb.child_env("stweaver")
    seeds = {"A": 0, "B": 0 if args.same_seed else 1}
    procs: Dict[str, Proc] = {}

    def start(name: str, who: str) -> Proc:
        p = Proc(name, {"dry_run": args.dry_run, "cfg": cfg, "seed": seeds[who]}, tmp, env)
        procs[name] = p
        return p

    def left() -> float:
        return deadline - time.time()

    n_steps = args.rounds * args.steps
    try:
        # 1. alone: A then B; the next children import while the current one trains.
        alone = share.setdefault("alone", {})
        a = start("alone_A", "A")
        b = start("alone_B", "B")
        info = a.call("init", left())
        share["device"], share["total"] = info.get("device"), info.get("total")
        share["child_mode"] = info.get("mode")
        print(f"share: {info}", flush=True)
        batches = args.cal_batches_list
        cal = a.call("calibrate", left(), batches=batches)
        share["calibration"] = cal
        if args.batch:
            share["batch"] = {"batch": args.batch, "source": "--batch"}
        elif args.dry_run:
            share["batch"] = {"batch": 2, "source": "dry run"}
        else:
            share["batch"] = dict(pick_batch(cal, share["total"], args.share_frac), source="calibration")
        batch = share["batch"]["batch"]
        print(f"share: calibration {cal['peaks']} -> batch {share['batch']}", flush=True)
        save()
        for who, p in (("A", a), ("B", b)):
            if who == "B":
                p.call("init", left())
                p.call("calibrate", left(), batches=batches)
            p.call("build", left(), batch=batch)
            rec = alone[who] = {"losses": [], "step_s": [], "wall_s": 0.0}
            for _ in range(args.rounds):
                t0 = time.time()
                tr = p.call("train", left(), steps=args.steps)
                rec["wall_s"] += time.time() - t0
                rec["losses"] += tr["losses"]
                rec["step_s"] += tr["step_s"]
            wall = rec["wall_s"]
            fin = p.call("finish", left())
            p.close()
            rec.update({k: v for k, v in fin.items() if k not in ("losses", "step_s", "ok")})
            print(f"share: alone {who}: {n_steps} steps in {wall:.1f} s, peak reserved "
                  f"{_gib(fin.get('max_reserved'))}, step median {_s(_median(fin['step_s']))} s", flush=True)
            if who == "A":
                # The shared pair imports while B trains alone.
                sa, sb = start("shared_A", "A"), start("shared_B", "B")
            save()
        # 2. shared: A and B take turns.
        sh = share.setdefault("shared", {"switches": [], "A": {"losses": [], "step_s": []},
                                         "B": {"losses": [], "step_s": []}})
        sa.call("init", left())
        sb.call("init", left())
        busy = 0.0  # seconds in train, pause and resume calls (not calibrate and build)

        def timed_call(p, cmd, **kw):
            nonlocal busy
            t0 = time.time()
            r = p.call(cmd, left(), **kw)
            busy += time.time() - t0
            return r

        sa.call("calibrate", left(), batches=batches)
        sa.call("build", left(), batch=batch)
        built_b = False
        after_resume = {"A": sh["A"].setdefault("first_after_resume_s", []),
                        "B": sh["B"].setdefault("first_after_resume_s", [])}
        turn_max = 0.0  # the longest turn so far (resume + train + pause calls)
        for r in range(args.rounds):
            for who, p in (("A", sa), ("B", sb)):
                # At a turn boundary after round 0 both trainers are paused: stop here when
                # this turn and the closing resumes would not fit before the deadline (the
                # table then says so, instead of a reply timing out mid-turn).
                if r > 0 and left() < 1.5 * turn_max + 20:
                    share["cut"] = (f"deadline: stopped before round {r} {who} "
                                    f"({left():.0f} s left, turns take up to {turn_max:.0f} s)")
                    print(f"share: {share['cut']}", flush=True)
                    break
                t_turn = time.time()
                rs = None
                if who == "A" and r > 0 or who == "B" and built_b:
                    rs = timed_call(p, "resume")
                    sh["switches"].append({"round": r, "who": who, "op": "resume", "s": rs["s"],
                                           "report": rs["report"], "after": rs["after"]})
                    resumed = True
                else:
                    resumed = False
                if who == "B" and not built_b:
                    p.call("calibrate", left(), batches=batches)
                    p.call("build", left(), batch=batch)
                    built_b = True
                    t_turn = time.time()  # a turn is resume + train + pause
                tr = timed_call(p, "train", steps=args.steps)
                sh[who]["losses"] += tr["losses"]
                sh[who]["step_s"] += tr["step_s"]
                if resumed and tr["step_s"]:
                    after_resume[who].append(tr["step_s"][0])
                ps = timed_call(p, "pause", keep=True)
                sh["switches"].append({"round": r, "who": who, "op": "pause", "s": ps["s"],
                                       "report": ps["report"], "after": ps["after"],
                                       "peak_reserved": tr.get("peak_reserved")})
                print(f"share: round {r} {who}: " + (f"resume {rs['s']:.3f} s, " if rs else "built, ")
                      + f"{args.steps} steps (median {_s(_median(tr['step_s']))} s, first {_s(tr['step_s'][0])} s), "
                      f"pause {ps['s']:.3f} s {ps['report']}, device free after {_gib(ps['after'].get('free'))}",
                      flush=True)
                turn_max = max(turn_max, time.time() - t_turn)
            save()
            if share.get("cut"):
                break
        phase_wall = busy
        for who, p in (("A", sa), ("B", sb)):
            rs = p.call("resume", left())
            sh["switches"].append({"round": args.rounds, "who": who, "op": "resume (to finish)", "s": rs["s"],
                                   "report": rs["report"]})
            fin = p.call("finish", left())
            sh[who].update({k: v for k, v in fin.items() if k not in ("losses", "step_s", "ok")})
            sh[who]["finish_losses_match"] = fin.get("losses") == sh[who]["losses"]
            p.close()
        sh["phase_wall_s"] = phase_wall  # train + pause + resume calls of the shared run
        share["ok"] = True
    except Exception as e:
        traceback.print_exc()
        share["error"] = f"{type(e).__name__}: {e}"[:4000]
        print(f"share: FAILED: {share['error']}", flush=True)
    finally:
        for p in procs.values():
            if p.p.poll() is None:
                p.p.kill()
                p.p.wait()
    derive_share(share)
    save()


def _median(xs) -> Optional[float]:
    return statistics.median(xs) if xs else None


def derive_share(share: dict) -> None:
    """Losses equal, times and peaks, from the raw records."""
    d: dict = {}
    alone, sh = share.get("alone") or {}, share.get("shared") or {}
    total = share.get("total")
    for who in ("A", "B"):
        a, s = alone.get(who) or {}, sh.get(who) or {}
        la, ls = a.get("losses") or [], s.get("losses") or []
        n = min(len(la), len(ls))
        first = list(s.get("first_after_resume_s") or [])
        steady = [t for i, t in enumerate(s.get("step_s") or []) if i % max(1, share["steps"]) != 0] \
            if s.get("step_s") else []
        pauses = [x for x in sh.get("switches", []) if x["who"] == who and x["op"] == "pause"]
        resumes = [x for x in sh.get("switches", []) if x["who"] == who and x["op"] == "resume"]
        d[who] = {
            "losses_compared": n, "losses_expected": len(la),
            "losses_equal": bool(n) and la[:n] == ls[:n] and n == len(la),
            "losses_prefix_equal": bool(n) and la[:n] == ls[:n],
            "first_mismatch": next((i for i in range(n) if la[i] != ls[i]), None),
            "alone_step_median_s": _median(a.get("step_s") or []),
            "shared_step_median_s": _median(steady),
            "first_after_resume_median_s": _median(first),
            "alone_peak_reserved": a.get("max_reserved"), "shared_peak_reserved": s.get("max_reserved"),
            "pause_s": [x["s"] for x in pauses], "resume_s": [x["s"] for x in resumes],
            "paused_bytes": _median([x["report"].get("bytes", 0) for x in pauses]) if pauses else None,
            "copied_bytes": _median([x["report"].get("copied", 0) for x in pauses]) if pauses else None,
            "free_after_pause": _median([x["after"].get("free", 0) for x in pauses]) if pauses and total else None,
            "failed_frees": s.get("failed_frees"),
            "alone_wall_s": a.get("wall_s"),
        }
    peaks = [d[w]["alone_peak_reserved"] for w in ("A", "B")]
    if total and all(peaks):
        d["sum_alone_peaks"] = sum(peaks)
        d["sum_over_total"] = sum(peaks) / total
    steps_total = sum(len((sh.get(w) or {}).get("step_s") or []) for w in ("A", "B"))
    if sh.get("phase_wall_s") and steps_total:
        d["shared_steps_per_s"] = steps_total / sh["phase_wall_s"]
    walls = [d[w]["alone_wall_s"] for w in ("A", "B")]
    steps_alone = sum(len((alone.get(w) or {}).get("step_s") or []) for w in ("A", "B"))
    if all(walls) and steps_alone:
        d["alone_steps_per_s"] = steps_alone / sum(walls)
    share["derived"] = d


def fmt_table(doc: dict) -> str:
    lines = []
    speed = doc.get("speed") or {}
    if speed:
        dev = next((r.get("device") for r in speed.values() if r.get("device")), None)
        lines.append(f"== release / restore speed ({dev or 'no device'}; seconds min/median over the reps; "
                     f"GB/s = bytes / median)")
        lines.append(f"{'size':>6} {'allocator':<19} {'contents':<8} {'release s':>17} {'GB/s':>7} "
                     f"{'restore s':>17} {'GB/s':>7} {'given back':>10} {'ok':<5} reps")
        rows = [r for k in SPEED_KINDS for r in (speed.get(k) or {}).get("rows", [])]
        unit = "M" if doc.get("dry_run") else "G"
        for size in sorted({r["size"] for r in rows}):
            for r in (x for x in rows if x["size"] == size):
                head = f"{str(size) + ' ' + unit + 'iB':>6} {LABELS.get(r['kind'], r['kind']):<19} {r['contents']:<8}"
                if r.get("skipped") or r.get("error"):
                    why = f"skipped: {r['skipped']}" if r.get("skipped") else f"ERROR: {r['error'][:120]}"
                    lines.append(f"{head} {why}")
                    continue
                rel, res = r.get("release") or {}, r.get("restore") or {}
                ok = r.get("contents_ok")
                lines.append(
                    f"{head} {_s(rel.get('min_s')):>8}/{_s(rel.get('median_s')):<8} {_g(rel.get('GBps')):>7} "
                    f"{_s(res.get('min_s')):>8}/{_s(res.get('median_s')):<8} {_g(res.get('GBps')):>7} "
                    f"{_gib(r.get('given_back')):>10} {('-' if ok is None else 'yes' if ok else 'NO'):<5} "
                    f"{r.get('reps')}{' (cut)' if r.get('cut') else ''}")
        for k in SPEED_KINDS:
            r = speed.get(k) or {}
            if r.get("skipped") or (r.get("error") and not r.get("rows")):
                lines.append(f"{LABELS.get(k, k)}: {r.get('skipped') or r.get('error')}")
        link = (speed.get("native") or {}).get("link") or {}
        if link.get("h2d_GBps"):
            lines.append(f"pinned link (1 GiB): H2D {_g(link.get('h2d_GBps'))} GB/s, "
                         f"D2H {_g(link.get('d2h_GBps'))} GB/s")
        mode = (speed.get("stweaver") or {}).get("mode")
        if mode:
            lines.append(f"stweaver mode: {mode}")
        tms = doc.get("tms") or {}
        if tms.get("available"):
            lines.append(f"torch_memory_saver: {tms.get('source')} (hook_mode torch)")
        lines.append("kept contents go through: stweaver, pinned host buffers made at the first pause and "
                     "reused by later ones (pageable only where pinning fails); "
                     "native and driver, one pinned buffer registered beforehand; torch_memory_saver, "
                     "its cpu backup (pinned by default)")
    share = doc.get("share")
    if share:
        d = share.get("derived") or {}
        cfg = share.get("cfg") or {}
        b = share.get("batch") or {}
        lines.append("")
        lines.append(f"== two trainers taking turns ({share.get('mode')}; mode in the child: "
                     f"{share.get('child_mode')}; pause(None, keep_contents=True); "
                     f"{share.get('rounds')} rounds x {share.get('steps')} steps; {share.get('device')})")
        lines.append(f"model {cfg.get('name')} hidden {cfg.get('hidden')} x {cfg.get('layers')} layers, batch "
                     f"{b.get('batch')} x {cfg.get('seq')} tokens ({b.get('source')}); GPU total "
                     f"{_gib(share.get('total'))}; sum of alone peaks {_gib(d.get('sum_alone_peaks'))}"
                     + (f" = {d['sum_over_total']:.2f} x total" if d.get("sum_over_total") else ""))
        lines.append(f"{'who':<4} {'losses = alone':<16} {'peak alone':>10} {'shared':>8} {'step alone':>10} "
                     f"{'shared':>8} {'1st after':>9} {'pause s med/max':>16} {'resume s med/max':>17} "
                     f"{'paused':>8} {'free after':>10}")
        for who in ("A", "B"):
            x = d.get(who) or {}
            eq = ("-" if not x.get("losses_compared") else "yes" if x.get("losses_equal")
                  else "partial" if x.get("losses_prefix_equal") else "NO") \
                + f" ({x.get('losses_compared')}/{x.get('losses_expected')})"
            ps, rs = x.get("pause_s") or [], x.get("resume_s") or []
            lines.append(
                f"{who:<4} {eq:<16} {_gib(x.get('alone_peak_reserved')):>10} {_gib(x.get('shared_peak_reserved')):>8} "
                f"{_s(x.get('alone_step_median_s')):>10} {_s(x.get('shared_step_median_s')):>8} "
                f"{_s(x.get('first_after_resume_median_s')):>9} "
                f"{_s(_median(ps)):>7}/{_s(max(ps) if ps else None):<8} "
                f"{_s(_median(rs)):>8}/{_s(max(rs) if rs else None):<8} "
                f"{_gib(x.get('paused_bytes')):>8} {_gib(x.get('free_after_pause')):>10}")
        lines.append(f"throughput: alone {_g2(d.get('alone_steps_per_s'))} steps/s, shared "
                     f"{_g2(d.get('shared_steps_per_s'))} steps/s (switches included); copied to the host "
                     f"per pause A {_gib((d.get('A') or {}).get('copied_bytes'))} B "
                     f"{_gib((d.get('B') or {}).get('copied_bytes'))}; failed frees "
                     f"A {(d.get('A') or {}).get('failed_frees')} B {(d.get('B') or {}).get('failed_frees')}")
        if share.get("cut"):
            lines.append(f"share cut short: {share['cut']}")
        if share.get("error"):
            lines.append(f"share ERROR: {share['error'][:600]}")
    return "\n".join(lines).strip("\n")


def _g2(x) -> str:
    return "-" if not x else f"{x:.2f}"


def main(argv=None) -> int:
    t_start = time.time()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: checks the plumbing")
    ap.add_argument("--parts", default="speed,share", help="speed, share or both")
    ap.add_argument("--sizes", default="1,10,40", help="GiB (MiB in --dry-run)")
    ap.add_argument("--kinds", default=",".join(SPEED_KINDS), help="speed rows: stweaver,native,driver,tms")
    ap.add_argument("--reps", type=int, default=3, help="release+restore pairs per row")
    ap.add_argument("--big-reps", type=int, default=2, help="the same from 20 GiB on")
    ap.add_argument("--child-budget-s", type=float, default=45.0,
                    help="a speed child runs no repetition after a row's first past this, and no "
                         "new row past twice this")
    ap.add_argument("--share-reserve-s", type=float, default=190.0,
                    help="seconds of --deadline-s the speed part leaves to the share part")
    ap.add_argument("--rounds", type=int, default=4, help="turns of each trainer")
    ap.add_argument("--steps", type=int, default=5, help="training steps per turn")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=0, help="micro-batch (0: calibrated to --share-frac)")
    ap.add_argument("--share-frac", type=float, default=0.58, help="each trainer's target peak / GPU total")
    ap.add_argument("--cal-batches", default="4,8",
                    help="calibration batches (two; large enough that activations, not the optimizer "
                         "step, make the peak)")
    ap.add_argument("--same-seed", action="store_true", help="A and B the same trainer (seed 0)")
    ap.add_argument("--deadline-s", type=float, default=460.0,
                    help="total seconds: what is left after it is skipped, the table still printed")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in ("speed", "share")]
    if bad:
        ap.error(f"unknown parts {bad}")
    try:
        args.sizes_list = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--sizes: integers, not {args.sizes!r}")
    if not args.sizes_list or min(args.sizes_list) <= 0:
        ap.error("--sizes: positive integers")
    args.kinds_list = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in args.kinds_list if k not in SPEED_KINDS]
    if bad:
        ap.error(f"unknown kinds {bad} (known: {', '.join(SPEED_KINDS)})")
    try:
        args.cal_batches_list = [int(b) for b in args.cal_batches.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--cal-batches: integers, not {args.cal_batches!r}")
    if len(args.cal_batches_list) != 2 or args.cal_batches_list[0] >= args.cal_batches_list[1] \
            or args.cal_batches_list[0] < 1:
        ap.error("--cal-batches: two increasing positive batches")
    if args.rounds < 1 or args.steps < 1 or args.reps < 1 or args.big_reps < 1:
        ap.error("--rounds, --steps, --reps and --big-reps must be >= 1")
    if args.dry_run:
        args.rounds, args.steps = min(args.rounds, 3), min(args.steps, 2)
        args.cal_batches_list = [1, 2]
    if "share" not in parts:
        args.share_reserve_s = 0.0
    deadline = t_start + args.deadline_s
    os.makedirs(args.out, exist_ok=True)
    tmp = os.path.join(args.out, "share_bench_logs")  # child logs and results: they come back
    os.makedirs(tmp, exist_ok=True)
    doc = {"schema": 1, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "dry_run": args.dry_run,
           "args": {k: v for k, v in vars(args).items()}, "logs": tmp}
    path = os.path.join(args.out, "share_bench.json")

    def save():
        write_json(path, doc)

    print(f"share_bench: parts {parts}, logs in {tmp}", flush=True)
    if "speed" in parts:
        try:
            run_speed(args, tmp, doc, deadline, save)
        except Exception as e:
            traceback.print_exc()
            doc["speed_error"] = f"{type(e).__name__}: {e}"
    if "share" in parts:
        if deadline - time.time() < 60:
            doc["share"] = {"ok": False, "error": "deadline: no time left for the share part"}
        else:
            run_share(args, tmp, doc, deadline, save)
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    doc["wall_s"] = time.time() - t_start
    save()
    table = fmt_table(doc)
    write_table(args.out, "share_bench", table)
    print(f"\nwritten: {path} ({doc['wall_s']:.0f} s)\n")
    print(table)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "speed":
        _spec = json.loads(sys.stdin.readline())
        try:
            speed_child(_spec)
        except Exception as _e:
            traceback.print_exc()
            try:  # keep the rows measured before the failure
                with open(_spec["result"]) as _f:
                    _res = json.load(_f)
            except (OSError, ValueError):
                _res = {"kind": _spec["kind"], "rows": []}
            _res.update(ok=False, error=f"{type(_e).__name__}: {_e}"[:2000])
            with open(_spec["result"], "w") as _f:
                json.dump(_res, _f)
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "trainer":
        sys.exit(trainer_main())
    sys.exit(main())
