#!/usr/bin/env python3
"""The offloader's host cost per saved-tensor hook call, on the CPU (issue #16: on a
host-bound forward the pack / unpack hooks add to the step).

    python python/bench/offload_hook_cost.py [--packs 5488] [--reps 30]

One "iteration" is N packs then N unpacks (GPT-2 XL 8 x 1024 saves 5 488 tensors per
iteration on the H100; BENCHMARKS.md session 11) of CPU tensors of mixed sizes, none of
them offloaded: the cost every saved tensor pays whether or not the plan moves it. Rows:

- ``identity``: a pack and an unpack hook that return their argument (the floor of any
  Python ``saved_tensors_hooks``);
- ``offloader``: ``stweaver._offload.Offloader`` in schedule mode with an empty schedule,
  over budget_bench's ``--dry-run`` backend, whose CPU tensors count as device tensors and
  whose stream calls do nothing (so the tensors take the counted path, ordinals and all, as
  CUDA tensors do; CudaBackend's ``is_device`` is ``t.is_cuda``, the same kind of read).

It reports µs per call (pack or unpack) as min and median over ``--reps`` iterations, and
the implied host time per iteration for N packs + N unpacks. Hooks are called directly (not
through autograd), so autograd's own cost of calling them is not in the numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # python/: the stweaver package
sys.path.insert(0, HERE)

from budget_bench import _DryBackend  # noqa: E402 (the offloader's backend over CPU tensors)


def run(pack, unpack, tensors, reps: int, end=None):
    per_call = []
    for _ in range(reps):
        t0 = time.perf_counter()
        handles = [pack(t) for t in tensors]
        for h in reversed(handles):
            unpack(h)
        dt = time.perf_counter() - t0
        if end is not None:
            end()
        per_call.append(dt / (2 * len(tensors)) * 1e6)
    return min(per_call), statistics.median(per_call)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packs", type=int, default=5488)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    import torch

    from stweaver._offload import Offloader, PinnedPool

    sizes = [64, 4096, 1 << 16, 1 << 20]
    tensors = [torch.empty(sizes[i % len(sizes)] // 4) for i in range(args.packs)]
    rows = [("identity", *run(lambda t: t, lambda t: t, tensors, args.reps))]
    off = Offloader(schedule=[], backend=_DryBackend(),
                    pool=PinnedPool(pin=lambda n: torch.empty(n, dtype=torch.uint8)))
    rows.append(("offloader", *run(off.pack, off.unpack, tensors, args.reps, off.iteration_end)))
    print(f"{args.packs} packs + {args.packs} unpacks per iteration, {args.reps} iterations, "
          f"torch {torch.__version__}, Python {sys.version.split()[0]}")
    print(f"{'hooks':<10} {'us/call min':>12} {'median':>8} {'ms/iteration (median)':>22}")
    for name, lo, med in rows:
        print(f"{name:<10} {lo:12.2f} {med:8.2f} {med * 2 * args.packs / 1e3:22.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
