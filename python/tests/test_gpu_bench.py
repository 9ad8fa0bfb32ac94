"""The GPU benchmark's pure-Python parts (no torch, no GPU): the cap search's probe order,
the derived numbers (lower bound, utilization, step ratios over the same iterations, bitwise
loss match, auto's after-switch window) and the tables."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import gpu_bench as gb  # noqa: E402

G = 1 << 30


def run(alloc, reserved, allocated, steps, losses, **kw):
    r = {"ok": True, "alloc": alloc, "max_reserved": reserved, "max_allocated": allocated,
         "step_s": steps, "losses": losses, "iterations": len(steps), "param_digest": 7,
         "tokens_per_iter": [1000] * len(steps)}
    r.update(kw)
    return r


def entry():
    losses = [["0x1.0p+0"]] * 8
    steps = [0.5, 0.4] + [0.30] * 6
    return {
        "config": {"name": "llama1b_rcp", "batch": 8, "micro": 2},
        "planner": {"ok": True, "summary": {"lower_bound": 10 * G}},
        "runs": {
            "native": run("native", 12 * G, 10.2 * G, steps, losses),
            "expandable": run("expandable", 11 * G, 10.1 * G, steps, losses),
            "trace": run("trace", 10.6 * G, 10.05 * G, [0.5, 0.4] + [0.303] * 6, losses),
            "plan": run("plan", 10.01 * G, 10.0 * G, [0.5, 0.4] + [0.301] * 6, losses),
            # switched after iteration 3, cache released after 4, window from 5 on; ran longer
            "auto": run("auto", 11.5 * G, 10.1 * G, [0.5, 0.4] + [0.302] * 8,
                        losses + [["0x1.8p+0"]] * 2, steady_from=5, switched_at=3,
                        steady_max_reserved=10.02 * G, steady_max_allocated=10.0 * G,
                        modes=["auto (recording)"] * 3 + ["auto (plan)"] * 7,
                        stweaver={"mode": "auto (plan)", "devices": [{"plan": {"hits": 5}}]}),
        },
    }


def test_derived_numbers():
    e = entry()
    gb.finalize_workload(e)
    rows = {r["key"]: r for r in e["rows"]}
    assert e["lower_bound"] == 10 * G
    assert set(rows) == {"native", "expandable", "trace", "plan", "auto", "auto_steady"}
    assert abs(rows["native"]["utilization"] - 0.85) < 1e-9
    assert rows["plan"]["waste"] == int(0.01 * G) or abs(rows["plan"]["waste"] - 0.01 * G) < 1
    assert abs(rows["plan"]["step_ratio"] - 0.301 / 0.30) < 1e-9
    assert rows["plan"]["losses_match"] and rows["plan"]["params_match"]
    # auto's window: iterations 5..9, compared with native's 5..7 (native ran 8)
    st = rows["auto_steady"]
    assert st["reserved"] == 10.02 * G and st["steady_iters"] == [5, 9]
    assert st["step_ratio_basis"] == "same iterations 5..7"
    assert st["losses_compared"] == 8 and st["losses_match"]
    assert st["plan_stats"] == {"hits": 5}


def test_losses_that_differ_are_reported():
    e = entry()
    e["runs"]["expandable"]["losses"] = [["0x1.0p+0"]] * 7 + [["0x1.0000000000001p+0"]]
    gb.finalize_workload(e)
    rows = {r["key"]: r for r in e["rows"]}
    assert rows["expandable"]["losses_match"] is False
    assert "NO" in gb.render_table({"workloads": [e]}, markdown=False)


def test_auto_without_a_switch_has_no_window():
    e = entry()
    a = e["runs"]["auto"]
    for k in ("steady_from", "switched_at", "steady_max_reserved", "steady_max_allocated"):
        a.pop(k)
    a["modes"] = ["auto (planning)"] * 10
    gb.finalize_workload(e)
    rows = {r["key"]: r for r in e["rows"]}
    assert not rows["auto_steady"]["ok"] and "no plan served" in rows["auto_steady"]["error"]
    assert rows["auto"]["ok"]


def test_lower_bound_falls_back_to_max_allocated():
    e = entry()
    e["planner"] = None
    gb.finalize_workload(e)
    assert e["lower_bound"] == 10.0 * G  # the plan run's max_allocated, the smallest
    assert "max_memory_allocated" in e["lower_bound_basis"]


def test_failed_runs_render():
    e = entry()
    e["runs"]["plan"] = {"ok": False, "alloc": "plan", "error": "no trace to plan"}
    gb.finalize_workload(e)
    doc = {"workloads": [e], "cap_search": None, "skipped": ["x: skipped"]}
    text = gb.render_table(doc, markdown=False)
    assert "failed: no trace to plan" in text and "skipped: x: skipped" in text
    md = gb.render_table(doc, markdown=True)
    assert md.splitlines()[0].startswith("| workload |")
    assert any("llama1b_rcp" in t and "auto_steady" in t for t in gb.targets(doc))


def test_next_probe_gallops_to_the_edge():
    # fits at 7, 8; not at 9 -> stop at 8
    assert gb.next_probe(7, True, {7: True}) == 8
    assert gb.next_probe(8, True, {7: True, 8: True}) == 9
    assert gb.next_probe(9, False, {7: True, 8: True, 9: False}) is None
    # does not fit at 7: go down until one fits
    assert gb.next_probe(7, False, {7: False}) == 6
    assert gb.next_probe(6, True, {7: False, 6: True}) is None
    assert gb.next_probe(1, False, {1: False}) is None


def test_cap_summary():
    ok = run("native", 15 * G, 14 * G, [0.5, 0.4, 0.3, 0.3, 0.3, 0.3], [["0x1p+0"]] * 6)
    ok["tokens_per_iter"] = [2048 * 7] * 6
    s = gb.cap_summary({7: ok, 8: {"ok": False, "oom": True, "oom_iter": 1}})
    assert s["largest"] == 7 and s["edge_proven"]
    assert abs(s["tokens_per_s"] - 2048 * 7 / 0.3) < 1e-6
    assert [p["fits"] for p in s["probes"]] == [True, False]
    assert gb.cap_summary({5: {"ok": False, "oom": True}})["largest"] is None


def test_cap_summary_of_auto_without_a_plan_counts_native_s_iterations_only():
    # Variable lengths: auto stays online and runs to max_iters (here 12); native ran 8. The
    # extra iterations are short (few tokens): counting them would make auto look slower.
    toks = [8000, 16000, 6000, 17000, 15000, 12000, 5000, 12000, 3000, 3000, 3000, 3000]
    steps = [0.9, 0.4, 0.2, 0.4, 0.3, 0.25, 0.2, 0.25, 0.15, 0.15, 0.15, 0.15]
    auto = run("auto", 14 * G, 13 * G, steps, [["0x1p+0"]] * 12, tokens_per_iter=toks)
    native = run("native", 14 * G, 13 * G, steps[:8], [["0x1p+0"]] * 8, tokens_per_iter=toks[:8])
    sa = gb.cap_summary({10: auto}, base_iters=8)
    sn = gb.cap_summary({10: native}, base_iters=8)
    assert sa["tokens_basis"].startswith("iterations 3-7")
    assert sa["tokens_per_s"] == sn["tokens_per_s"]
    # Without the window every iteration after warm-up counted, the short ones too.
    assert gb.cap_summary({10: auto})["tokens_per_s"] < sn["tokens_per_s"]


def test_step_rounds_are_ratios_to_the_same_rounds_native_and_their_median():
    e = entry()
    e["step_rounds"] = {"native": [0.30, 0.40, 0.20], "plan": [0.303, 0.38, 0.21],
                        "auto": [0.33, None, 0.20]}
    doc = {"workloads": [e]}
    lines = gb.render_step_rounds(doc)
    assert lines[0].startswith("step time / native per round")
    plan = next(x for x in lines[1:] if "plan" in x)
    assert "1.010 0.950 1.050" in plan and plan.endswith("median 1.010")
    auto = next(x for x in lines[1:] if "auto" in x)
    # The failed round is left out; two rounds: the median is their mean.
    assert "1.100 1.000" in auto and auto.endswith("median 1.050")
    assert gb.render_step_rounds({"workloads": [entry()]}) == []


def test_paired_ratios_pair_the_same_iteration_of_the_same_round():
    nat = [{"step_s": [9.0, 1.0, 2.0, 4.0], "steady": [1, 2, 3]},
           {"step_s": [9.0, 2.0, 2.0], "steady": [1, 2]}]
    # auto's steady window starts later in round 0; round 1 failed (None).
    auto = [{"step_s": [9.0, 9.0, 2.2, 4.4], "steady": [2, 3]}, None]
    assert [round(x, 6) for x in gb.paired_ratios(nat, auto)] == [1.1, 1.1]
    plan = [{"step_s": [1.0, 1.0, 2.0, 4.0], "steady": [1, 2, 3]},
            {"step_s": [1.0, 3.0, 2.0], "steady": [1, 2]}]
    assert gb.paired_ratios(nat, plan) == [1.0, 1.0, 1.0, 1.5, 1.0]
    e = entry()
    e["step_rounds"] = {"native": [0.3, 0.4], "plan": [0.3, 0.4]}
    e["step_rounds_iters"] = {"native": nat, "plan": plan}
    line = next(x for x in gb.render_step_rounds({"workloads": [e]}) if "plan" in x)
    assert "paired iterations: median 1.000" in line and "n=5" in line


def test_steady_median_uses_the_steady_window():
    r = run("auto", G, G, [0.5, 0.4, 0.3, 0.2, 0.1, 0.1, 0.1], [], steady_from=4)
    assert gb.steady_median(r) == 0.1
    assert gb.steady_median({"ok": False}) is None
    # auto that never switched (stays online by design): its iterations after warm-up.
    never = run("auto", G, G, [0.5, 0.4, 0.3, 0.2, 0.2, 0.2], [])
    assert gb.steady_indices(never) == [] and gb.round_indices(never) == [3, 4, 5]
    assert gb.steady_median(never) == 0.2


def test_bootstrap_ci_and_verdict():
    # Two rounds of paired ratios, both tight around 1.000: the CI lies inside [0.99, 1.01].
    tight = [[1.000, 1.002, 0.998, 1.001, 0.999, 1.003, 0.997] * 2,
             [1.001, 0.999, 1.000, 1.002, 0.998, 1.000, 1.001] * 2]
    ci = gb.bootstrap_median_ci(tight)
    assert ci["rounds"] == 2 and ci["n"] == 28
    assert 0.99 <= ci["lo"] <= ci["median"] <= ci["hi"] <= 1.01
    assert gb.step_verdict(ci) == "within 1 %"
    # Deterministic (seeded).
    assert gb.bootstrap_median_ci(tight) == ci
    # Iterations swinging by +-10 %: the median may sit at 1.00, but the CI is wide.
    wide = [[0.90, 1.10, 0.95, 1.05, 1.00, 0.92, 1.08]]
    ci = gb.bootstrap_median_ci(wide)
    assert ci["median"] == 1.00 and ci["lo"] < 0.99 and ci["hi"] > 1.01
    assert gb.step_verdict(ci) == "not resolved"
    # Tight rounds whose medians differ by 4 %: resampling rounds keeps the CI that wide,
    # where pooling the iterations alone would call it resolved.
    apart = [[0.98, 0.981, 0.979, 0.98] * 3, [1.02, 1.021, 1.019, 1.02] * 3]
    ci = gb.bootstrap_median_ci(apart)
    assert ci["lo"] <= 0.981 and ci["hi"] >= 1.019
    assert gb.step_verdict(ci) == "not resolved"
    slow = gb.bootstrap_median_ci([[1.05, 1.06, 1.04, 1.05, 1.055]])
    assert gb.step_verdict(slow).startswith("slower")
    fast = gb.bootstrap_median_ci([[0.95, 0.96, 0.94, 0.95, 0.955]])
    assert gb.step_verdict(fast).startswith("faster")
    assert gb.bootstrap_median_ci([[], []]) is None and gb.step_verdict(None) == "no data"


def test_step_estimates_pair_rounds_and_reach_the_rows_and_targets():
    e = entry()
    gb.finalize_workload(e)
    rows = {r["key"]: r for r in e["rows"]}
    # Main runs only: plan is 0.301 / 0.300 on every counted iteration.
    assert abs(rows["plan"]["step_paired"]["median"] - 0.301 / 0.30) < 1e-9
    assert rows["plan"]["step_paired"]["rounds"] == 1
    assert rows["plan"]["step_paired"]["verdict"] == "within 1 %"
    assert "step_paired" not in rows["auto"]  # the whole-run row mixes recording and plan
    assert rows["auto_steady"]["step_paired"]["n"] == 3  # native ran 8, auto's window 5..9
    t = next(x for x in gb.targets({"workloads": [e]}) if x.startswith("llama1b_rcp plan"))
    assert "met, within 1 %" in t and "1 rounds, n=5" in t
    text = gb.render_table({"workloads": [e]}, markdown=True)
    assert "1.003 [1.003, 1.003]" in text


def test_parse_rounds_and_cpus():
    assert gb.parse_rounds("0") == (0, {})
    assert gb.parse_rounds(2) == (2, {})
    assert gb.parse_rounds("2,gpt2xl_rcp=4") == (2, {"gpt2xl_rcp": 4})
    assert gb.parse_rounds("llama1b_1f1b=3") == (0, {"llama1b_1f1b": 3})
    assert gb.parse_cpus("8-11,2,3") == [2, 3, 8, 9, 10, 11]
    assert gb.cpu_split(list(range(16))) == (list(range(8, 16)), list(range(8)))
    assert gb.cpu_split([0, 1]) == ([0, 1], [0, 1])


def test_run_noise_reads_the_diagnostics_of_counted_iterations():
    steps = [1.0, 0.5, 0.5, 0.2, 0.3, 0.2, 0.3]
    r = run("native", G, G, steps, [], diag={
        "launch_s": [0.9, 0.4, 0.4, 0.19, 0.29, 0.19, 0.29],
        "cpu_s": [0.9, 0.4, 0.4, 0.2, 0.3, 0.2, 0.3],
        "proc_cpu_s": [1.0, 0.5, 0.5, 0.2, 0.3, 0.2, 0.3],
        "host_busy_s": [1.0, 0.5, 0.5, 0.4, 0.3, 0.4, 0.3],
        "runq_s": [0, 0, 0, 0.001, 0.002, 0.001, 0.002]})
    n = gb.run_noise(r)
    assert n["n"] == 4 and n["median_s"] == 0.25
    assert abs(n["cv"] - 0.2) < 1e-9
    assert abs(n["runq_s"] - 0.0015) < 1e-12
    assert abs(n["others_cpus"] - 0.5) < 1e-9  # (0.4 - 0.2) / 0.2 = 1 twice, 0 twice
    assert "cv=20.0%" in gb.noise_note(r)
    e = {"config": {"name": "x"}, "runs": {"native": r}}
    lines = gb.render_noise({"workloads": [e]})
    assert lines and "procs=1" in lines[1] and "CV per process 20.0 %" in lines[1]


def test_floor_ratios_compare_low_quantiles_of_the_same_iterations():
    nat = [{"step_s": [9.0, 1.0, 1.2, 1.0, 1.3, 1.0], "steady": [1, 2, 3, 4, 5]}]
    # The same floor, more iterations disturbed: the low quantile sees no difference.
    alloc = [{"step_s": [9.0, 1.3, 1.0, 1.3, 1.0, 1.3], "steady": [1, 2, 3, 4, 5]}]
    assert gb.floor_ratios(nat, alloc) == [1.0]
    assert gb.floor_ratios(nat, [None]) == []
    assert gb.low_quantile([5, 1, 4, 2, 3], 0.2) == 1 and gb.low_quantile([]) is None


# ------------------------------------------------------------------ lockstep


def test_round_order_balances_positions_and_neighbours():
    import lockstep

    keys = ["native", "expandable", "plan", "auto", "native_aa"]
    orders = [lockstep.round_order(keys, r) for r in range(2 * len(keys))]
    assert all(sorted(o) == sorted(keys) for o in orders)
    # every participant takes every position equally often
    for k in keys:
        pos = [o.index(k) for o in orders]
        assert sorted(pos) == sorted(list(range(len(keys))) * 2)
    # and follows each other participant as often as it precedes it
    for a in keys:
        for b in keys:
            if a == b:
                continue
            after = sum(1 for o in orders for i in range(1, len(o)) if o[i - 1] == b and o[i] == a)
            before = sum(1 for o in orders for i in range(1, len(o)) if o[i - 1] == a and o[i] == b)
            assert after == before


def lockstep_entry():
    """Native, plan and the A/A control in lockstep from iteration 5 (warm-ups side by side,
    slow), and a trace run alone."""
    losses = [["0x1.0p+0"]] * 10
    warm = [1.2] * 5  # contended warm-up iterations: must not count anywhere
    li = list(range(5, 10))
    nat = [0.300, 0.330, 0.300, 0.360, 0.300]  # slow phases common to the round
    return {
        "config": {"name": "gpt2xl_rcp", "batch": 8, "micro": 2},
        "planner": {"ok": True, "summary": {"lower_bound": 10 * G}},
        "runs": {
            "native": run("native", 12 * G, 10.2 * G, warm + nat, losses, lockstep_iters=li),
            "trace": run("trace", 10.6 * G, 10.05 * G, [0.3] * 10, losses),
            "plan": run("plan", 10.01 * G, 10.0 * G, warm + [1.01 * x for x in nat], losses,
                        lockstep_iters=li),
            "native_aa": run("native", 12 * G, 10.2 * G, warm + nat, losses, lockstep_iters=li,
                             control_of="native"),
        },
    }


def test_lockstep_rows_pair_the_rounds_and_skip_the_warm_up():
    e = lockstep_entry()
    gb.finalize_workload(e)
    rows = {r["key"]: r for r in e["rows"]}
    assert set(rows) == {"native", "trace", "plan", "native_aa"}
    # the slow phases cancel in the paired ratio; the warm-up (1.2 s) is not counted
    sp = rows["plan"]["step_paired"]
    assert abs(sp["median"] - 1.01) < 1e-9 and sp["lockstep"] and sp["n"] == 5
    assert abs(rows["plan"]["step_s"] - 0.303) < 1e-9
    assert abs(rows["native_aa"]["step_paired"]["median"] - 1.0) < 1e-12
    assert rows["native_aa"]["label"].endswith("(A/A)")
    # the trace run trained alone: not paired with lockstep iterations
    assert rows["trace"].get("step_ratio") is None and "step_paired" not in rows["trace"]
    assert "not comparable" in rows["trace"]["step_ratio_basis"]
    lines = gb.targets({"workloads": [e]})
    assert any("lockstep, 5 rounds" in line for line in lines)


def test_lockstep_warm_rule():
    assert not gb.lockstep_warm("native", 2, None, None, 16)
    assert gb.lockstep_warm("native", 3, None, None, 16)
    # auto: after the plan served an iteration past the switch, settled online, or out of iterations
    assert not gb.lockstep_warm("auto", 6, "auto (recording)", None, 32)
    assert not gb.lockstep_warm("auto", 6, "auto (plan)", 6, 32)
    assert gb.lockstep_warm("auto", 7, "auto (plan)", 6, 32)
    assert gb.lockstep_warm("auto", 5, "auto (online: no steady state)", None, 32)
    assert gb.lockstep_warm("auto", 32, "auto (planning)", None, 32)
