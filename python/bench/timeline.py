"""Where a step's device time goes, from a ``torch.profiler`` trace (issue #16): is the
compute stream busy, waiting for an offload copy, or starved by the host?

``budget_bench.py --timeline N`` runs N steps after the measured ones under
``torch.profiler`` (CUDA activity only), marks their phases on the device (:func:`mark`), and
summarises the Chrome trace it exports with :func:`summarize`.

Model
=====
- **GPU work**: events of category ``kernel``, ``gpu_memcpy`` and ``gpu_memset``, each on a
  stream (``args.stream``, else the thread id). The **compute stream** is the one with the
  most kernel time. Copies between host and device on other streams are the offloader's
  (``Memcpy DtoH`` out, ``Memcpy HtoD`` back).
- **Phases**: the profiler records only CUDA activity (its CPU events would slow the
  host enough to starve the device, which is what is being looked for). The step marks its
  phases on the compute stream itself: after forward, after backward and after the
  optimizer, a device-to-device copy of a size no training tensor has (:data:`MARKERS`).
  Forward is from the first GPU event after the previous step's last mark to the forward
  mark, backward from there to the backward mark, the optimizer to the last mark.
- Per phase span: the compute stream's **busy** time (the union of its events, clipped to
  the span) and its **idle** time, split by what was in flight meanwhile on other streams:
  a device-to-host copy (``idle_during_d2h``: the compute stream likely waits for a copy
  out, as a planned reuse of an offloaded tensor's range does), a host-to-device copy
  (``idle_during_h2d``: an unpack waiting for its copy back), or nothing (``idle_other``: the
  host did not launch work fast enough, or a synchronisation). When both directions are
  in flight the time counts as d2h.
- Copies per direction within the span: count, bytes, the sum of their durations and the
  achieved rate (bytes over summed duration).

Cost: O(E log E) for E events (sorting per stream), one pass per phase span.
"""

from __future__ import annotations

import bisect
import gzip
import json
import statistics
from typing import Dict, Iterable, List, Optional, Tuple

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")

Interval = Tuple[float, float]


def _load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _stream(e: dict):
    a = e.get("args") or {}
    return a.get("stream", e.get("tid"))


def _direction(e: dict) -> Optional[str]:
    if e.get("cat") != "gpu_memcpy":
        return None
    n = e.get("name", "")
    if "DtoH" in n:
        return "d2h"
    if "HtoD" in n:
        return "h2d"
    return None


def _union(ivs: Iterable[Interval]) -> List[Interval]:
    out: List[Interval] = []
    for s, e in sorted(ivs):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _clip(ivs: List[Interval], lo: float, hi: float) -> List[Interval]:
    return [(max(s, lo), min(e, hi)) for s, e in ivs if e > lo and s < hi]


def _length(ivs: Iterable[Interval]) -> float:
    return sum(e - s for s, e in ivs)


def _overlap(a: List[Interval], b: List[Interval]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            tot += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def _subtract(a: List[Interval], b: List[Interval]) -> List[Interval]:
    """a minus b (both sorted, disjoint)."""
    out: List[Interval] = []
    j = 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


# The marks' sizes in bytes (uint8 tensors copied device to device), per phase end.
MARKERS = {"forward": 777_001, "backward": 777_002, "optimizer": 777_003}


class Marks:
    """The device-side phase marks of :data:`MARKERS`: ``mark("forward")`` after forward's
    launches enqueues a copy of 777 001 bytes on the current stream, and so on."""

    def __init__(self, torch_mod, device="cuda"):
        n = max(MARKERS.values())
        self._src = torch_mod.zeros(n, dtype=torch_mod.uint8, device=device)
        self._dst = torch_mod.empty(n, dtype=torch_mod.uint8, device=device)

    def mark(self, phase: str) -> None:
        k = MARKERS[phase]
        self._dst[:k].copy_(self._src[:k])


def phase_spans(events: List[dict], markers: Optional[Dict[str, int]] = None) -> List[Tuple[str, float, float]]:
    """(phase, start, end) on the device of every marked phase, in time order."""
    markers = markers or MARKERS
    by_size = {v: k for k, v in markers.items()}
    order = list(markers)  # the phases in step order
    marks = sorted(
        (float(e["ts"]) + float(e.get("dur", 0)), by_size[int((e.get("args") or {}).get("bytes", -1))])
        for e in events
        if e.get("cat") == "gpu_memcpy" and "DtoD" in e.get("name", "")
        and int((e.get("args") or {}).get("bytes", -1)) in by_size
    )
    starts = sorted(float(e["ts"]) for e in events if e.get("cat") in GPU_CATS)
    out = []
    prev_end: Optional[float] = None
    prev_phase: Optional[str] = None
    for end, phase in marks:
        first = order.index(phase) == 0
        if first:
            # The step's first GPU event after the previous step's last mark.
            lo = prev_end if prev_end is not None else float("-inf")
            i = bisect.bisect_right(starts, lo)
            start = starts[i] if i < len(starts) else end
        elif prev_phase is not None and order.index(prev_phase) == order.index(phase) - 1:
            start = prev_end
        else:
            start = None  # a mark without its predecessor: skipped
        if start is not None:
            out.append((phase, start, end))
        prev_end, prev_phase = end, phase
    return out


def summarize(trace: dict, markers: Optional[Dict[str, int]] = None) -> dict:
    """The per-phase summary of the module doc: for each phase name, the median over its
    spans of ``span_ms``, ``busy_ms``, ``idle_ms``, ``idle_during_d2h_ms``,
    ``idle_during_h2d_ms``, ``idle_other_ms``, and per direction ``{d}_copies``,
    ``{d}_bytes``, ``{d}_ms``, ``{d}_GBps``; plus ``spans`` (how many)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    kernel_time: Dict[object, float] = {}
    for e in gpu:
        if e.get("cat") == "kernel":
            kernel_time[_stream(e)] = kernel_time.get(_stream(e), 0.0) + float(e.get("dur", 0))
    if not kernel_time:
        return {"error": "no kernels in the trace"}
    compute = max(kernel_time, key=kernel_time.get)
    iv = lambda e: (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))  # noqa: E731
    busy_all = _union(iv(e) for e in gpu if _stream(e) == compute)
    copies = {d: [e for e in gpu if _stream(e) != compute and _direction(e) == d] for d in ("d2h", "h2d")}
    copy_ivs = {d: _union(iv(e) for e in es) for d, es in copies.items()}
    per: Dict[str, List[dict]] = {}
    for name, lo, hi in phase_spans(events, markers):
        busy = _clip(busy_all, lo, hi)
        idle = _subtract([(lo, hi)], busy)
        d2h = _clip(copy_ivs["d2h"], lo, hi)
        h2d_only = _subtract(_clip(copy_ivs["h2d"], lo, hi), d2h)
        during_d2h = _overlap(idle, d2h)
        during_h2d = _overlap(idle, h2d_only)
        row = {
            "span_ms": (hi - lo) / 1e3,
            "busy_ms": _length(busy) / 1e3,
            "idle_ms": _length(idle) / 1e3,
            "idle_during_d2h_ms": during_d2h / 1e3,
            "idle_during_h2d_ms": during_h2d / 1e3,
            "idle_other_ms": (_length(idle) - during_d2h - during_h2d) / 1e3,
        }
        for d, es in copies.items():
            inside = [e for e in es if lo <= float(e["ts"]) < hi]
            nbytes = sum(int((e.get("args") or {}).get("bytes", 0)) for e in inside)
            ms = sum(float(e.get("dur", 0)) for e in inside) / 1e3
            row[f"{d}_copies"] = len(inside)
            row[f"{d}_bytes"] = nbytes
            row[f"{d}_ms"] = ms
            row[f"{d}_GBps"] = nbytes / ms / 1e6 if ms > 0 else None
        per.setdefault(name, []).append(row)
    out: dict = {"compute_stream": compute}
    for name, rows in per.items():
        med = {}
        for k in rows[0]:
            vals = [r[k] for r in rows if r[k] is not None]
            med[k] = round(statistics.median(vals), 3) if vals else None
        med["spans"] = len(rows)
        out[name] = med
    return out


def summarize_file(path: str) -> dict:
    return summarize(_load(path))


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a Chrome trace from torch.profiler (.json or .json.gz)")
    a = ap.parse_args(argv)
    print(json.dumps(summarize_file(a.trace), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
