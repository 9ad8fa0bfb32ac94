#!/usr/bin/env python3
"""Stream safety under NCCL: a buffer freed while a collective on another stream still uses it.

    torchrun --standalone --nproc-per-node 2 python/tests/gpu_dist/nccl_stream_safety.py --out DIR

``--alloc stweaver`` installs stweaver first (``stweaver.install()``, mode from STWEAVER_MODE).
Each case, per rank, ``ROUNDS`` times:

- ``collective_input``: on a side stream, a long ``torch.cuda._sleep`` then
  ``all_gather_into_tensor(out, inp)``; ``inp.record_stream(side)`` and ``del inp`` while the
  collective is still queued; right away, on the main stream, new tensors of the same size are
  allocated and filled with -7. After the side stream finishes, ``out`` must hold every rank's
  input (rank r's chunk all ``r + 1``).
- ``side_read`` (record_stream): the same, but the side stream first reads ``inp`` with a copy
  kernel (``tmp = inp * 1``) and gathers ``tmp``: only our ``record_stream`` protects ``inp``.
- ``side_read_unprotected`` (control, expected to detect): as ``side_read`` without
  ``record_stream``: the allocator may hand ``inp``'s memory to the main stream at once, the -7
  fill lands before the delayed read, and the check sees it. It shows the check can fail.

Writes DIR/rank{R}.json with, per case, the number of rounds whose result was clobbered.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

N = 8 << 20  # floats per buffer (32 MiB)
ROUNDS = 4
SLEEP_CYCLES = 200_000_000  # ~0.1 s at ~2 GHz: the collective is still queued when we refill


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--alloc", choices=("native", "stweaver"), default="stweaver")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    os.makedirs(a.out, exist_ok=True)
    res = {"rank": rank, "alloc": a.alloc, "ok": False, "cases": {}}
    if a.alloc == "stweaver":
        import stweaver

        stweaver.install()
    import torch
    import torch.distributed as dist

    try:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=dev)
        res["backend"] = torch.cuda.memory.get_allocator_backend()
        side = torch.cuda.Stream()
        main_s = torch.cuda.current_stream()
        expected = torch.cat([torch.full((N,), float(r + 1), device=dev) for r in range(world)])
        dist.barrier()
        torch.cuda.synchronize()

        def one(case: str) -> bool:
            inp = torch.full((N,), float(rank + 1), device=dev)
            out = torch.empty(world * N, device=dev)
            side.wait_stream(main_s)
            with torch.cuda.stream(side):
                torch.cuda._sleep(SLEEP_CYCLES)
                src = inp if case == "collective_input" else inp * 1
                dist.all_gather_into_tensor(out, src)
            if case != "side_read_unprotected":
                inp.record_stream(side)
            out.record_stream(side)
            del inp, src
            junk = [torch.full((N,), -7.0, device=dev) for _ in range(4)]
            main_s.wait_stream(side)
            ok = bool(torch.equal(out, expected))
            del junk
            return ok

        for case in ("collective_input", "side_read", "side_read_unprotected"):
            bad = 0
            for _ in range(ROUNDS):
                if not one(case):
                    bad += 1
            torch.cuda.synchronize()
            dist.barrier()
            res["cases"][case] = {"rounds": ROUNDS, "clobbered": bad}
        res["ok"] = True
        if a.alloc == "stweaver":
            res["stweaver_mode"] = stweaver.mode()
            res["failed_frees"] = stweaver.stats()["failed_frees"]
    except Exception as e:
        import traceback

        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["traceback"] = traceback.format_exc()[-4000:]
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
