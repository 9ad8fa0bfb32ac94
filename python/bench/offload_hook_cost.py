#!/usr/bin/env python3
"""The offloader's host cost per saved-tensor hook call (issue #16: on a host-bound forward
the pack / unpack hooks add to the step).

    python python/bench/offload_hook_cost.py [--packs 5488] [--reps 30]
    python python/bench/offload_hook_cost.py --device cuda --ext [--compare OLD_offload.py]

One "iteration" is N packs then N unpacks (GPT-2 XL 8 x 1024 saves 5 488 tensors per
iteration on the H100; BENCHMARKS.md session 11) of tensors of mixed sizes, none of them
offloaded: the cost every saved tensor pays whether or not the plan moves it. Rows:

- ``identity``: a pack and an unpack hook that return their argument (the floor of any
  Python ``saved_tensors_hooks``);
- ``offloader``: ``stweaver._offload.Offloader`` in schedule mode with an empty schedule.
  ``--device cpu`` (default): CPU tensors over budget_bench's ``--dry-run`` backend, whose
  CPU tensors count as device tensors and whose stream calls do nothing (so the tensors take
  the counted path, ordinals and all, as CUDA tensors do). ``--device cuda``: CUDA tensors
  over the real ``CudaBackend``; with ``--ext``, stweaver is installed first (online mode,
  ``STWEAVER_MODE`` overrides) and the offloader gets its extension, as ``enable()`` does (the
  ``record_saved`` marker calls included while the runtime may record);
- ``watermark``: the offloader before a plan (``first_min_bytes`` = 1 MiB) with a watermark
  whose limit is never reached, so nothing moves: what the watermark's reads of the device's
  allocated bytes cost (one per candidate pack, the 1 MiB tensors here, and one per unpack of
  one) on top of ``offloader``. ``--device cpu``: the dry backend reads a constant (the
  Python logic alone); ``--device cuda``: ``torch._C._cuda_memoryStats``, the real read;
- ``compare``: the same with the ``Offloader`` of another ``_offload.py`` (``--compare FILE``,
  e.g. an earlier commit's, ``git show REV:python/stweaver/_offload.py > old.py``), the two
  measured in alternation (ABBA), so that the machine's drift hits both alike.

It reports µs per call (pack or unpack) as min and median over ``--reps`` iterations, the
implied host time per iteration for N packs + N unpacks, and with ``--compare`` the ratio.
Hooks are called directly (not through autograd), so autograd's own cost of calling them is
not in the numbers.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # python/: the stweaver package
sys.path.insert(0, HERE)


def one(pack, unpack, tensors, end=None) -> float:
    """µs per hook call of one iteration (N packs, then N unpacks in reverse)."""
    t0 = time.perf_counter()
    handles = [pack(t) for t in tensors]
    for h in reversed(handles):
        unpack(h)
    dt = time.perf_counter() - t0
    if end is not None:
        end()
    return dt / (2 * len(tensors)) * 1e6


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("stweaver_offload_compared", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--compare: cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packs", type=int, default=5488)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--ext", action="store_true", help="cuda: install stweaver, pass its extension")
    ap.add_argument("--compare", default="", help="another _offload.py, measured in alternation")
    args = ap.parse_args(argv)
    if args.ext and args.device != "cuda":
        ap.error("--ext needs --device cuda")
    ext = None
    if args.ext:
        import stweaver

        stweaver.install(os.environ.get("STWEAVER_MODE", "online"))
        ext = stweaver._extension()
    import torch

    from stweaver import _offload

    sizes = [64, 4096, 1 << 16, 1 << 20]
    dev = "cuda" if args.device == "cuda" else "cpu"
    tensors = [torch.empty(sizes[i % len(sizes)] // 4, device=dev) for i in range(args.packs)]

    def make(mod):
        if args.device == "cuda":
            backend = mod.CudaBackend()
            pool = mod.PinnedPool()
        else:
            from budget_bench import _DryBackend  # the offloader's backend over CPU tensors

            backend = _DryBackend()
            pool = mod.PinnedPool(pin=lambda n: torch.empty(n, dtype=torch.uint8))
        return mod.Offloader(schedule=[], backend=backend, pool=pool, ext=ext)

    cands = {"identity": (lambda t: t, lambda t: t, None)}
    off = make(_offload)
    cands["offloader"] = (off.pack, off.unpack, off.iteration_end)
    wm = make(_offload)
    if args.device != "cuda":
        wm.backend.allocated_bytes = lambda device: 0  # the Python logic alone
    wm.first_min_bytes = 1 << 20
    wm.watermark = _offload.Watermark(1 << 62)  # never reached: every candidate stays
    wm._before_plan = True  # threshold rules at every iteration (as auto mode's recording)
    cands["watermark"] = (wm.pack, wm.unpack, wm.iteration_end)
    if args.compare:
        old = make(load_module(args.compare))
        cands["compare"] = (old.pack, old.unpack, old.iteration_end)
    times = {k: [] for k in cands}
    names = list(cands)
    for r in range(args.reps):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(one(cands[name][0], cands[name][1], tensors, cands[name][2]))
    where = f"{args.device}" + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
    print(f"{args.packs} packs + {args.packs} unpacks per iteration, {args.reps} iterations, {where}, "
          f"extension {'yes (' + str(ext.mode()) + ')' if ext is not None else 'no'}, "
          f"torch {torch.__version__}, Python {sys.version.split()[0]}")
    print(f"{'hooks':<10} {'us/call min':>12} {'median':>8} {'ms/iteration (median)':>22}")
    for name in names:
        v = times[name]
        med = statistics.median(v)
        print(f"{name:<10} {min(v):12.2f} {med:8.2f} {med * 2 * args.packs / 1e3:22.1f}")
    print(f"watermark reads per iteration: {wm.watermark.reads // max(1, wm.watermark.iterations)}; "
          f"candidates moved: {wm.stats()['tensors_out']}")
    if args.compare:
        a, b = times["offloader"], times["compare"]
        print(f"offloader / compare: {min(a) / min(b):.3f} (min), "
              f"{statistics.median(a) / statistics.median(b):.3f} (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
