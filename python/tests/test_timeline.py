"""timeline.summarize: the compute stream's busy and idle time per phase, and what was in
flight while it idled (python/bench/timeline.py)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import timeline  # noqa: E402


def k(ts, dur, stream=7, corr=None):
    return {"ph": "X", "cat": "kernel", "name": "gemm", "ts": ts, "dur": dur, "tid": stream,
            "args": {"stream": stream, "correlation": corr}}


def cp(ts, dur, d, nbytes, stream=20, corr=None):
    name = "Memcpy DtoH (Device -> Pinned)" if d == "d2h" else "Memcpy HtoD (Pinned -> Device)"
    return {"ph": "X", "cat": "gpu_memcpy", "name": name, "ts": ts, "dur": dur, "tid": stream,
            "args": {"stream": stream, "bytes": nbytes, "correlation": corr}}


def mark(phase, ts):
    n = timeline.MARKERS[phase]
    return {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": ts, "dur": 0,
            "tid": 7, "args": {"stream": 7, "bytes": n}}


def test_idle_time_is_split_by_the_copies_in_flight():
    ev = [
        k(0, 30), k(50, 50),              # forward 0..100: idle 30..50 while a copy out runs (25..55)
        cp(25, 30, "d2h", 30_000_000),
        mark("forward", 100),
        k(100, 40), k(160, 20),           # backward 100..200: idle 140..160: copy back 130..150
        cp(130, 20, "h2d", 10_000_000, stream=21),
        mark("backward", 200),            # (idle 180..200: nothing in flight)
        k(200, 10), mark("optimizer", 210),
        k(1000, 10), mark("forward", 1010),  # the next step starts at its first event
    ]
    s = timeline.summarize({"traceEvents": ev})
    f, b, o = s["forward"], s["backward"], s["optimizer"]
    assert s["compute_stream"] == 7
    assert f["spans"] == 2 and b["spans"] == 1 and o["spans"] == 1
    assert (b["span_ms"], b["busy_ms"], b["idle_ms"]) == (0.1, 0.06, 0.04)
    assert b["idle_during_h2d_ms"] == 0.01 and b["idle_during_d2h_ms"] == 0.0
    assert abs(b["idle_other_ms"] - 0.03) < 1e-9
    assert o["span_ms"] == 0.01 and o["idle_ms"] == 0.0
    spans = timeline.phase_spans(ev)
    assert spans[0] == ("forward", 0.0, 100.0) and spans[-1] == ("forward", 1000.0, 1010.0)
    one = timeline.summarize({"traceEvents": ev[:3] + [mark("forward", 100)]})["forward"]
    assert (one["span_ms"], one["busy_ms"], one["idle_ms"]) == (0.1, 0.08, 0.02)
    assert one["idle_during_d2h_ms"] == 0.02 and one["idle_other_ms"] == 0.0
    assert one["d2h_copies"] == 1 and one["d2h_bytes"] == 30_000_000
    assert one["d2h_GBps"] == 1000.0  # 30 MB in 30 us


def test_a_mark_without_its_predecessor_is_skipped():
    ev = [k(0, 10), mark("backward", 10), k(10, 10), mark("optimizer", 20)]
    assert timeline.phase_spans(ev) == [("optimizer", 10.0, 20.0)]


def test_interval_helpers():
    assert timeline._union([(5, 6), (0, 2), (1, 3)]) == [(0, 3), (5, 6)]
    assert timeline._subtract([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]
    assert timeline._overlap([(0, 4), (6, 8)], [(3, 7)]) == 2
    assert timeline.summarize({"traceEvents": []}) == {"error": "no kernels in the trace"}
