#!/usr/bin/env python3
"""The allocator's own CPU cost on a real request sequence, native vs stweaver, on a GPU.

    python python/bench/alloc_replay.py MODE [SNAPSHOT] [--reps N]     (MODE: native | online | auto)

Replays every allocation and free of a PyTorch memory snapshot (default: the bundled GPT-2 XL
training run, data/traces/snap_gpt2xl_rcp.pickle.gz: 21 504 allocations on one stream, up to 785 MiB)
as ``torch.empty(size, dtype=uint8)`` / ``del`` in a fresh process, with no kernel between
them, ``--reps`` times (what the trace left live is freed at the end of each repetition, so
every repetition asks for the same sequence). Each repetition's wall time is therefore the
allocator's CPU cost plus the same Python overhead under every allocator. ``auto`` calls
``stweaver.step()`` after each repetition (STWEAVER_AUTO_ITERATIONS=2 by default here), so the
later repetitions are served from the plan made of the first ones. Prints one JSON line: the
per-repetition seconds, the number of pairs and the backend.

Why: the training loops of the GPU benchmark that launch-bound (GPT-2 XL, 1F1B, MoE, variable
lengths) swing by 5–20 % per process on the H200 machine under every allocator, which hides a 1 %
step-time difference; the allocator's share of a step is what could move it, and this measures
that share directly (µs per pair × pairs per iteration vs the step time).
"""

import argparse
import gzip
import json
import os
import pickle
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def ops_of(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        snap = pickle.load(f)
    trace = next(t for t in snap["device_traces"] if t)
    ops, live, n = [], {}, 0
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = n
            ops.append((0, n, e["size"]))
            n += 1
        elif e["action"] == "free_requested" and e["addr"] in live:
            ops.append((1, live.pop(e["addr"]), 0))
    return ops, n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("native", "online", "auto"))
    ap.add_argument("snapshot", nargs="?", default=os.path.join(REPO, "data", "traces", "snap_gpt2xl_rcp.pickle.gz"))
    ap.add_argument("--reps", type=int, default=8)
    a = ap.parse_args()
    ops, n = ops_of(a.snapshot)
    st = None
    if a.mode != "native":
        os.environ.setdefault("STWEAVER_AUTO_ITERATIONS", "2")
        import stweaver

        stweaver.install(a.mode)
        st = stweaver
    import torch

    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    u8 = torch.uint8
    reps, modes = [], []
    for _ in range(a.reps):
        held = [None] * n
        t0 = time.perf_counter()
        for kind, i, size in ops:
            if kind == 0:
                held[i] = torch.empty(size, dtype=u8, device="cuda")
            else:
                held[i] = None
        held = None
        reps.append(time.perf_counter() - t0)
        if st is not None:
            st.step()
            modes.append(st.mode())
    torch.cuda.synchronize()
    out = {"mode": a.mode, "backend": torch.cuda.memory.get_allocator_backend(), "allocations": n,
           "rep_s": reps, "modes": modes, "max_reserved": torch.cuda.max_memory_reserved()}
    if st is not None:
        out["stweaver"] = st.stats()
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
