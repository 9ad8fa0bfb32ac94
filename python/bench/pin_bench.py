#!/usr/bin/env python3
"""How fast host memory can be pinned (issue #16: the first budgeted iteration pins its
offload pool, 20 GiB for GPT-2 XL at 0.8 x LB, and took 10-21 s on an H100 host).

    python python/bench/pin_bench.py [--sizes 4,16] [--threads 8,16] [--out DIR]
    python python/bench/pin_bench.py --dry-run      (CPU: the plumbing only, no pinning)

Each method runs in a fresh child process per size (nothing cached between them), timed
from the request to a usable pinned buffer, then checked: ``is_pinned()`` and the rate of
a 1 GiB device -> host copy into it (a pageable buffer copies at a fraction of the link).
Methods:

- ``torch``: ``torch.empty(n, dtype=torch.uint8, pin_memory=True)`` (PyTorch's caching host
  allocator: ``cudaHostAlloc``), what stweaver's offload pool used until now;
- ``torch_reg{T}``: the same with ``pinned_use_cuda_host_register:True,
  pinned_num_register_threads:T`` (``torch._C._accelerator_setAllocatorSettings``): torch
  ``malloc``s, touches the pages from T threads, then ``cudaHostRegister``s;
- ``mmap{T}`` / ``mmap{T}_thp``: an anonymous ``mmap`` (``madvise(MADV_HUGEPAGE)`` for
  ``_thp``: transparent huge pages), its pages touched from T Python threads (each a
  ``ctypes.memset`` over its share, which releases the GIL), then ``cudaHostRegister`` (through
  ``torch.cuda.cudart()``); touch and register timed apart.

``--overlap`` adds, per size, whether pinning on a second thread slows the main thread's
kernel launches: 3000 small matmuls timed alone, then again while another thread pins.

Prints a table last (seconds and GB/s = 10^9 bytes / second); ``--out`` writes pin_bench.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import threading
import time

GIB = 1 << 30


def _touch(addr: int, nbytes: int, threads: int) -> None:
    """Faults every page in: ``threads`` threads, each a ``memset`` of its contiguous share
    (the kernel zeroes each page at its first write; the memset's own writes cost little
    beside that)."""
    share = (nbytes // threads + 4095) & ~4095
    def work(i: int) -> None:
        lo = i * share
        hi = min(nbytes, lo + share)
        if hi > lo:
            ctypes.memset(addr + lo, 0, hi - lo)
    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def pin(method: str, nbytes: int):
    """Returns (tensor, seconds, detail dict). The tensor keeps the memory alive."""
    import torch

    detail = {}
    if method == "torch":
        t0 = time.perf_counter()
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return buf, time.perf_counter() - t0, detail
    if method.startswith("torch_reg"):
        threads = int(method[len("torch_reg"):])
        torch._C._accelerator_setAllocatorSettings(
            f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}")
        t0 = time.perf_counter()
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return buf, time.perf_counter() - t0, detail
    if method.startswith("mmap"):
        rest = method[len("mmap"):]
        thp = rest.endswith("_thp")
        threads = int(rest[:-4] if thp else rest)
        t0 = time.perf_counter()
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if thp:
            m.madvise(mmap.MADV_HUGEPAGE)
        buf = torch.frombuffer(m, dtype=torch.uint8)
        addr = buf.data_ptr()
        _touch(addr, nbytes, threads)
        t1 = time.perf_counter()
        err = torch.cuda.cudart().cudaHostRegister(addr, nbytes, 0)
        t2 = time.perf_counter()
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister returned {err}")
        detail.update(touch_s=t1 - t0, register_s=t2 - t1)
        buf._stweaver_mmap = m  # keeps the mapping alive with the tensor
        return buf, t2 - t0, detail
    raise ValueError(f"unknown method {method!r}")


def _launch_loop(n: int) -> float:
    import torch

    a = torch.randn(256, 256, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        a = a @ a
        a = a * 0.001
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def child(method: str, nbytes: int, overlap: bool) -> dict:
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")  # the context, outside the timing
    row = {"method": method, "gib": nbytes / GIB, "overlap": overlap}
    if overlap:
        _launch_loop(300)
        row["launch_alone_s"] = min(_launch_loop(3000) for _ in range(3))
        box = {}
        th = threading.Thread(target=lambda: box.update(r=pin(method, nbytes)))
        t0 = time.perf_counter()
        th.start()
        loops = []
        while th.is_alive():
            loops.append(_launch_loop(3000))
        th.join()
        row["launch_while_pinning_s"] = loops
        row["overlap_wall_s"] = time.perf_counter() - t0
        buf, secs, detail = box["r"]
    else:
        buf, secs, detail = pin(method, nbytes)
    row.update(seconds=secs, gbps=nbytes / secs / 1e9, **detail)
    row["is_pinned"] = bool(buf.is_pinned())
    n = min(GIB, nbytes)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = buf[:n]
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    row["d2h_gbps"] = 3 * n / (time.perf_counter() - t0) / 1e9
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4,16", help="GiB, comma separated")
    ap.add_argument("--threads", default="8,16", help="thread counts of the threaded methods")
    ap.add_argument("--methods", default=None,
                    help="comma separated (default: torch, torch_reg{T}, mmap{T}, mmap{T}_thp per T, mmap1_thp)")
    ap.add_argument("--overlap", action="store_true", help="also time kernel launches while a thread pins")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--child", nargs=3, metavar=("METHOD", "BYTES", "OVERLAP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        row = child(args.child[0], int(args.child[1]), args.child[2] == "1")
        print("ROW " + json.dumps(row), flush=True)
        return 0
    threads = [int(t) for t in args.threads.split(",") if t]
    methods = args.methods.split(",") if args.methods else (
        ["torch"] + [f"torch_reg{t}" for t in threads] + ["mmap1_thp"]
        + [m for t in threads for m in (f"mmap{t}", f"mmap{t}_thp")])
    sizes = [float(s) for s in args.sizes.split(",") if s]
    thp = "?"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        pass
    print(f"transparent huge pages: {thp}; cpus: {os.cpu_count()}", flush=True)
    runs = [(m, False) for m in methods]
    if args.overlap:
        runs += [("torch", True), (f"mmap{threads[-1]}_thp", True)]
    if args.dry_run:
        for s in sizes:
            for m, ov in runs:
                print(f"would run {m} at {s} GiB{' while timing launches' if ov else ''}")
        return 0
    rows = []
    for s in sizes:
        for m, ov in runs:
            cmd = [sys.executable, __file__, "--child", m, str(int(s * GIB)), "1" if ov else "0"]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
            if p.returncode != 0 or not line:
                print(f"{m} {s} GiB failed (rc {p.returncode}): {p.stderr.strip().splitlines()[-3:]}", flush=True)
                rows.append({"method": m, "gib": s, "error": p.stderr.strip()[-400:]})
                continue
            row = json.loads(line[0][4:])
            row["child_wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "pin_bench.json"), "w") as f:
            json.dump({"thp": thp, "rows": rows}, f, indent=1)
    print("\n| method | GiB | seconds | GB/s | touch s | register s | pinned | D2H GB/s | launches alone / while pinning (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['method']} | {r['gib']:g} | error | | | | | | |")
            continue
        ov = ""
        if r.get("overlap"):
            w = r["launch_while_pinning_s"]
            ov = f"{r['launch_alone_s']:.3f} / {min(w):.3f}-{max(w):.3f} ({len(w)})" if w else f"{r['launch_alone_s']:.3f} / -"
        print(f"| {r['method']} | {r['gib']:g} | {r['seconds']:.2f} | {r['gbps']:.2f} | "
              f"{r.get('touch_s', float('nan')):.2f} | {r.get('register_s', float('nan')):.2f} | "
              f"{r['is_pinned']} | {r['d2h_gbps']:.1f} | {ov} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
