"""budget_bench.py's pure parts (no torch, no GPU): the hybrid row's candidates, its
prediction and when its sweep stops, and what the planner's report yields."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import budget_bench as bb  # noqa: E402


def test_hybrid_candidates_start_at_zero_and_grow():
    assert bb.hybrid_candidates(16) == [0, 2, 4, 6, 8, 12]
    assert bb.hybrid_candidates(24) == [0, 3, 6, 9, 12, 18]
    assert bb.hybrid_candidates(2) == [0, 1, 2]
    assert bb.hybrid_candidates(1) == [0, 1]


def test_planned_wait_is_copy_out_waits_plus_stalls_and_none_when_refused():
    assert bb.planned_wait_ms({"offload": {"copy_out_wait_us": 1500, "stall_us": 500}}) == 2.0
    assert bb.planned_wait_ms({"offload": {}}) == 0.0
    assert bb.planned_wait_ms({"error": "no plan within the budget", "rc": 1}) is None


def test_prediction_charges_k_over_n_of_forward():
    assert bb.predicted_ms(4, 16, 90.0, 10.0) == 32.5
    assert bb.predicted_ms(0, 16, 90.0, 80.0) == 80.0
    assert bb.predicted_ms(2, 16, 90.0, None) is None


def s(k, wait, pred):
    return {"k": k, "wait_ms": wait, "predicted_ms": pred}


def test_sweep_goes_on_while_refused_or_improving():
    step = 300.0
    assert not bb.sweep_done([s(0, None, None)], step)
    assert not bb.sweep_done([s(0, 90.0, 90.0)], step)
    assert not bb.sweep_done([s(0, 90.0, 90.0), s(2, 40.0, 51.0)], step)


def test_sweep_stops_when_waits_are_small_or_a_candidate_is_worse():
    step = 300.0
    assert bb.sweep_done([s(0, 90.0, 90.0), s(2, 5.0, 16.0)], step)  # 5 ms <= 2 % of 300
    assert bb.sweep_done([s(0, 90.0, 90.0), s(2, 40.0, 51.0), s(4, 30.0, 52.5)], step)
    assert not bb.sweep_done([s(0, 90.0, 90.0), s(2, 40.0, 51.0), s(4, None, None)], step)
