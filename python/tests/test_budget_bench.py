"""budget_bench.py's pure parts (no torch, no GPU): the hybrid row's candidates, its
prediction and when its sweep stops, and what the planner's report yields."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import budget_bench as bb  # noqa: E402


def test_hybrid_candidates_start_at_zero_and_grow():
    assert bb.hybrid_candidates(16) == [0, 2, 4, 6, 8, 12]
    assert bb.hybrid_candidates(24) == [0, 3, 6, 9, 12, 18]
    assert bb.hybrid_candidates(2) == [0, 1, 2]
    assert bb.hybrid_candidates(1) == [0, 1]


def test_hybrid_choices_try_each_placement_at_each_k():
    assert bb.hybrid_choices(8, ["last", "first"]) == [
        ("last", 0), ("last", 1), ("first", 1), ("last", 2), ("first", 2), ("last", 3), ("first", 3),
        ("last", 4), ("first", 4), ("last", 6), ("first", 6)]
    assert bb.hybrid_choices(16, ["last"]) == [("last", k) for k in (0, 2, 4, 6, 8, 12)]


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


def test_sweep_stops_when_waits_are_small_or_three_larger_k_did_no_better():
    step = 300.0
    assert bb.sweep_done([s(0, 90.0, 90.0), s(2, 5.0, 16.0)], step)  # 5 ms <= 2 % of 300
    worse = [s(0, 90.0, 90.0), s(2, 40.0, 51.0), s(4, 30.0, 52.5), s(6, 30.0, 64.0)]
    assert not bb.sweep_done(worse, step)
    assert bb.sweep_done(worse + [s(8, 20.0, 65.0)], step)
    # GPT-2 XL at 0.8 x LB on the H100: 3 refused, 6 barely better than nothing: go on
    gpt2 = [s(0, 113.7, 113.7), s(3, None, None), s(6, 102.6, 118.0)]
    assert not bb.sweep_done(gpt2, step)
    assert not bb.sweep_done(gpt2 + [s(9, 40.0, 63.1)], step)
    assert bb.sweep_done(gpt2 + [s(9, 40.0, 63.1), s(12, 0.0, 30.8)], step)


def faked_children(spawned, slower_each_unlimited=False):
    """budget_bench's spawn, faked: the link, the unlimited reference (each later one
    0.2 s slower with ``slower_each_unlimited``, for the A/A ratio), trace runs that write
    their file, and rows that train; every spec is appended to ``spawned``."""

    def fake_spawn(spec, tmp, timeout):
        spawned.append(spec)
        row = spec["row"]
        if row == "link":
            return {"ok": True, "h2d_GBps": 55.0, "d2h_GBps": 55.0}
        if row == "unlimited":
            n = sum(1 for s in spawned if s["row"] == "unlimited") if slower_each_unlimited else 1
            return {"ok": True, "row": row, "max_allocated": 10 << 30, "step_median_s": 0.2 * n,
                    "step_min_s": 0.2, "losses": ["0x1p+0"],
                    "phases_ms": {"device_forward": 60.0, "device_backward": 120.0, "device_optimizer": 10.0}}
        if row == "stweaver_trace":
            with open(spec["trace"], "w") as f:
                f.write("trace")
            return {"ok": True, "trace_files": [spec["trace"]]}
        return {"ok": True, "row": row, "step_median_s": 0.22, "step_min_s": 0.22, "losses": ["0x1p+0"]}

    return fake_spawn


def test_the_hybrid_row_sweeps_traces_and_runs_the_best_choice(tmp_path, monkeypatch):
    """The driver with its children and the planner faked: a trace per (placement, k) made
    once and kept, the plan with the least predicted step run with its blocks recomputed."""
    spawned = []
    fake_spawn = faked_children(spawned)

    # planned waits by trace: "first" placements plan better here, 6 blocks is best
    waits = {"gpt2xl_norcp.stwt": 110.0, "last3": None, "first3": 60.0, "last6": 100.0, "first6": 3.0}

    def fake_planner(cmd):
        src = os.path.basename(cmd[2])
        key = next((k for k in waits if k in src), None)
        wait = waits[key]
        if wait is None:
            return {"error": "no plan within the budget", "rc": 1}
        with open(cmd[cmd.index("-o") + 1], "w") as f:
            f.write("plan")
        return {"offload": {"copy_out_wait_us": wait * 1e3, "stall_us": 0, "bytes_per_iteration": 1}}

    monkeypatch.setattr(bb, "spawn", fake_spawn)
    monkeypatch.setattr(bb, "run_planner", fake_planner)
    assert bb.main(["--out", str(tmp_path), "--stweaver-bin", "/bin/true", "--rows", "stweaver_hybrid",
                    "--workloads", "gpt2xl_norcp", "--fractions", "0.8"]) == 0
    traces = [(s.get("recompute_where"), s.get("recompute")) for s in spawned if s["row"] == "stweaver_trace"]
    assert traces == [(None, None), ("last", 3), ("first", 3), ("last", 6), ("first", 6)]
    run = [s for s in spawned if s["row"] == "stweaver_hybrid"]
    assert len(run) == 1 and run[0]["recompute"] == 6 and run[0]["recompute_where"] == "first"
    assert run[0]["planner"]["sweep"][-1] == {"k": 6, "where": "first", "wait_ms": 3.0,
                                             "predicted_ms": 6 / 24 * 60.0 + 3.0,
                                             "bytes_per_iteration": 1, "refused": None}
    kept = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".stwt")
    assert kept == ["gpt2xl_norcp.stwt", "gpt2xl_norcp_first3.stwt", "gpt2xl_norcp_first6.stwt",
                    "gpt2xl_norcp_last3.stwt", "gpt2xl_norcp_last6.stwt"]


def test_hybrid_k_runs_only_the_given_choices_and_the_aa_row_reruns_the_reference(tmp_path, monkeypatch):
    """--hybrid-k 6: no plain trace, no sweep from 0, only the 6-block traces; unlimited_aa: the
    uncapped reference again, with its ratio to the first run."""
    spawned = []
    fake_spawn = faked_children(spawned, slower_each_unlimited=True)

    def fake_planner(cmd):
        with open(cmd[cmd.index("-o") + 1], "w") as f:
            f.write("plan")
        return {"offload": {"copy_out_wait_us": 0, "stall_us": 0, "bytes_per_iteration": 1}}

    monkeypatch.setattr(bb, "spawn", fake_spawn)
    monkeypatch.setattr(bb, "run_planner", fake_planner)
    assert bb.main(["--out", str(tmp_path), "--stweaver-bin", "/bin/true", "--rows",
                    "stweaver_hybrid,unlimited_aa", "--workloads", "gpt2xl_norcp", "--fractions", "0.8",
                    "--hybrid-k", "6", "--hybrid-where", "last"]) == 0
    traces = [(s.get("recompute_where"), s.get("recompute")) for s in spawned if s["row"] == "stweaver_trace"]
    assert traces == [("last", 6)]
    run = [s for s in spawned if s["row"] == "stweaver_hybrid"]
    assert len(run) == 1 and run[0]["recompute"] == 6
    refs = [s for s in spawned if s["row"] == "unlimited"]
    assert len(refs) == 2 and "budget" not in refs[1], "the A/A run is uncapped"
    import json

    doc = json.load(open(tmp_path / "budget_bench.json"))
    aa = [r for r in doc["workloads"][0]["rows"] if r["row"] == "unlimited_aa"]
    assert len(aa) == 1 and abs(aa[0]["derived"]["step_median_ratio"] - 2.0) < 1e-9


def test_the_table_and_details_show_the_first_iteration_and_pinned_memory():
    GiB = 1 << 30
    row = {"row": "stweaver_auto", "fraction": 0.8, "ok": True, "max_reserved": 20 * GiB,
           "step_median_s": 0.2, "first_step_s": 3.25, "pinned_max": 6 * GiB,
           "step_s": [3.25, 0.9, 0.8, 0.21], "pinned_after": [6 * GiB, 6 * GiB, GiB, GiB],
           "host_capacity_after": [4 * GiB, 4 * GiB, GiB // 2, GiB // 2], "switched_at": 2,
           "offload": {"watermark_kept": 120, "watermark": {"level": 123}}, "derived": {}}
    ref = {"ok": True, "max_reserved": 28 * GiB, "step_median_s": 0.18, "first_step_s": 1.5}
    table = bb.fmt_table({"workloads": [{"name": "gpt2xl_norcp", "unlimited": ref, "rows": [row]}]})
    head, unl, line = table.splitlines()[:3]
    assert "1st it" in head and "pinned" in head
    assert "1.500s" in unl and "3.250s" in line and "6.00G" in line
    details = "\n".join(bb.row_details(row))
    assert "step s 3.25, 0.90, 0.80, 0.21" in details
    assert "[6.00, 6.00, 1.00, 1.00]" in details and "[4.00, 4.00, 0.50, 0.50]" in details
    assert "plan served from iteration 3" in details
    assert "watermark: kept 120 candidates" in details and '"level": 123' in details


def test_child_env_items_parse_and_a_malformed_one_is_refused():
    assert bb.parse_child_env("") == {}
    assert bb.parse_child_env("STWEAVER_PIN_THREADS=8, STWEAVER_AUTO_TRIAL=1") == {
        "STWEAVER_PIN_THREADS": "8", "STWEAVER_AUTO_TRIAL": "1"}
    assert bb.parse_child_env("A=") == {"A": ""}
    for bad in ("NOEQUALS", "=1", "BAD KEY=1"):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            bb.parse_child_env(bad)


def test_phase_marks_time_python_collections_per_phase():
    import gc

    clock = bb._GcClock().install()
    try:
        marks = bb._PhaseMarks(None, bb._probes(None, clock.read))
        marks.mark("forward")  # nothing collected
        gc.collect()  # a full collection
        marks.mark("backward")
        out = marks.done()
    finally:
        gc.callbacks.remove(clock._cb)
    assert out["gc_calls_forward"] == 0 and out["gc_ms_forward"] == 0
    assert out["gc_calls_backward"] >= 1 and out["gc2_calls_backward"] >= 1
    assert out["gc_ms_backward"] > 0
    assert bb._probes(None, None) is None


def test_host_clock_medians_are_ms_beside_the_step_and_shown_under_the_row():
    clocks = [{"cpu_s": 0.10, "proc_cpu_s": 0.12, "runq_s": 0.001, "steal_s": 0.0, "nivcsw": 3, "nvcsw": 40},
              {"cpu_s": 0.20, "proc_cpu_s": 0.22, "runq_s": 0.030, "steal_s": 0.0, "nivcsw": 9, "nvcsw": 44},
              {"cpu_s": 0.12, "proc_cpu_s": 0.14, "runq_s": 0.002, "steal_s": 0.0, "nivcsw": 4, "nvcsw": 42}]
    m = bb.host_clock_median(clocks, [0.2, 0.3, 0.25])
    assert m == {"step_ms": 250.0, "cpu_ms": 120.0, "proc_cpu_ms": 140.0, "runq_ms": 2.0, "steal_ms": 0.0,
                 "nivcsw": 4, "nvcsw": 42}
    # A clock that could not read a counter leaves it out; no iterations, no medians.
    assert bb.host_clock_median([{"cpu_s": 0.1}], []) == {"cpu_ms": 100.0}
    row = {"row": "stweaver_auto", "ok": True, "host_clock_median": m, "cpus": [8, 9, 10, 11]}
    details = "\n".join(bb.row_details(row))
    assert '"runq_ms": 2.0' in details and "on CPUs 8-11" in details


def test_train_cpus_pins_children_to_the_given_cpus_and_moves_the_driver_off_them():
    avail = sorted(os.sched_getaffinity(0))
    try:
        assert bb.train_cpus("") is None
        assert bb.train_cpus(str(avail[-1])) == [avail[-1]]
        if len(avail) > 1:
            assert avail[-1] not in os.sched_getaffinity(0)  # the driver left it
        with pytest.raises(SystemExit, match="none of these CPUs"):
            bb.train_cpus("100000")
    finally:
        os.sched_setaffinity(0, avail)
    assert bb._cpus([0, 2, 3]) == "0,2,3" and bb._cpus([4, 5, 6]) == "4-6"
