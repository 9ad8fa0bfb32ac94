"""The memory budget (`stweaver.install(budget=...)`, `STWEAVER_BUDGET`) on a GPU, in fresh
processes: every pool of the device stays under it, out-of-memory errors name it, and a
training loop under it trains."""

import os

from test_subprocess import SCRIPTS, last_json, run

GIB = 1 << 30


def probe(budget, mode="auto"):
    return last_json(run([os.path.join(SCRIPTS, "budget_probe.py"), budget, mode]))


def test_budget_holds_over_pools_and_oom_names_it(metric):
    r = probe("3GiB")
    limit = r["budget_bytes"]
    assert limit == 3 * GIB
    # 256 MiB tensors: 12 fit exactly under 3 GiB, the 13th is refused.
    assert r["fill_tensors"] == 12, r
    assert r["fill_max_reserved"] <= limit, r
    msg = r["fill_message"]
    assert "STWEAVER_BUDGET=3.00 GiB" in msg and "live" in msg and "cached" in msg, msg
    assert r["graph_ok"], r
    assert r["graph_max_reserved"] <= limit, r
    assert r["capture_oom"] == "OutOfMemoryError", r
    assert r["after_capture_oom_ok"], r
    assert r["train_losses_finite"], r
    assert r["train_max_reserved"] <= limit, r
    metric("budget_fill_tensors", r["fill_tensors"])
    metric("budget_graph_max_reserved_GiB", r["graph_max_reserved"] / GIB)
    metric("budget_train_max_reserved_GiB", r["train_max_reserved"] / GIB)
    metric("budget_train_mode", r["train_mode"])


def test_budget_as_a_fraction_of_the_device(metric):
    r = probe("0.05", "online")
    assert r["fill_max_reserved"] <= r["budget_bytes"], r
    assert r["fill_tensors"] == r["budget_bytes"] // (256 << 20), r
    metric("budget_fraction_bytes_GiB", r["budget_bytes"] / GIB)


def test_processes_sharing_a_gpu_each_get_their_budget_at_once(metric, tmp_path):
    """Three processes, each under 0.3 of the device (issue #17 item 2): all three fill
    their own share at the same time (each as many 256 MiB tensors as its budget holds, not
    fewer because another took more), none reserves past its budget, and each then trains
    under it."""
    from concurrent.futures import ThreadPoolExecutor

    n = 3
    sync = tmp_path / "sync"
    sync.mkdir()
    script = os.path.join(SCRIPTS, "shared_budget_probe.py")
    with ThreadPoolExecutor(n) as ex:
        rs = [last_json(r) for r in ex.map(lambda _: run([script, "0.3", str(sync), str(n)]), range(n))]
    limit = rs[0]["budget_bytes"]
    for r in rs:
        assert r["all_holding"], r
        assert r["fill_tensors"] == limit // (256 << 20), r
        assert r["fill_reserved"] <= limit, r
        assert "STWEAVER_BUDGET" in r["fill_message"], r
        assert r["train_losses_finite"] and r["train_max_reserved"] <= limit, r
    held = sum(r["fill_tensors"] for r in rs) * (256 << 20)
    assert max(r["device_used_while_all_hold"] for r in rs) >= held, rs
    metric("shared_budget_processes", n)
    metric("shared_budget_fill_tensors_each", rs[0]["fill_tensors"])
    metric("shared_budget_device_used_GiB", max(r["device_used_while_all_hold"] for r in rs) / GIB)


def test_auto_recompute_keeps_the_budget_and_the_losses(metric):
    """recompute_blocks(model, "auto") under 0.7 x the unlimited peak: the run decides (its
    decisions end in serving a plan, after a measured trial when the plan moves bytes),
    reserves at most the budget, and its losses are
    bitwise those of the unlimited run (recomputation and offload change no value)."""
    script = os.path.join(SCRIPTS, "auto_recompute_probe.py")
    # 70 iterations: the recordings, and the measured trial when the plan moves bytes.
    ref = last_json(run([script, "unlimited", "70"]))
    budget = int(0.7 * ref["max_allocated"])
    r = last_json(run([script, str(budget), "70"]))
    assert r["error"] is None, r
    ar = r["auto_recompute"]
    assert ar and ar["decisions"] and ar["done"], r
    assert ar["decisions"][-1]["action"] in ("serve", "trial_keep_b", "trial_back_to_a"), ar
    assert r["mode"] == "auto (plan)", r
    assert r["max_reserved"] <= budget, (r["max_reserved"], budget)
    assert r["losses"] == ref["losses"], "losses differ from the unlimited run's"
    metric("auto_recompute_blocks", ar["recomputed"])
    metric("auto_recompute_rounds", ar["rounds"])
    metric("auto_recompute_reserved_GiB", r["max_reserved"] / GIB)
    metric("auto_recompute_unlimited_GiB", ref["max_allocated"] / GIB)


def test_watermark_moves_less_before_the_plan_and_the_pool_shrinks_after_it(metric):
    """Auto mode under 0.7 x the unlimited peak, nothing recomputed, with and without the
    watermark (STWEAVER_OFFLOAD_WATERMARK=0): both reserve at most the budget over the whole
    run (the first iterations included) with the unlimited run's losses bitwise; before
    the plan the watermark (its first iteration moves everything and is measured) keeps
    candidates on the device in later ones and moves fewer bytes; once the
    plan is served the offloader's pinned pool keeps about what the schedule needs (a power
    of two per buffer) and torch's pinned host bytes come down to it (host cache emptied)."""
    script = os.path.join(SCRIPTS, "watermark_probe.py")
    ref = last_json(run([script, "unlimited"]))
    budget = int(0.7 * ref["max_allocated"])
    runs = {}
    for name, env in (("watermark", {"STWEAVER_OFFLOAD_WATERMARK": "1"}), ("every", {})):
        r = last_json(run([script, str(budget)], extra_env=env))
        assert r["error"] is None, (name, r)
        assert r["max_reserved"] <= budget, (name, r["max_reserved"], budget)
        assert r["losses"] == ref["losses"], f"{name}: losses differ from the unlimited run's"
        assert r["mode"] == "auto (plan)", (name, r["mode"])
        runs[name] = r
    pre = {n: [it for it in r["iterations"] if it["mode"] != "auto (plan)"] for n, r in runs.items()}
    assert pre["watermark"] and pre["every"], pre
    moved = {n: sum(it["bytes_out"] or 0 for it in its) / len(its) for n, its in pre.items()}
    assert moved["watermark"] < moved["every"], moved
    assert pre["watermark"][0]["watermark_kept"] == 0, "the first iteration moves every candidate"
    assert sum(it["watermark_kept"] or 0 for it in pre["watermark"]) > 0, pre["watermark"]
    assert runs["watermark"]["offload"]["watermark"]["level"] is not None, runs["watermark"]["offload"]
    assert runs["every"]["offload"]["watermark"] is None
    for name, r in runs.items():
        end = r["iterations"][-1]
        need = end["schedule_bytes"] or 0
        before = max(it["host_capacity"] or 0 for it in pre[name])
        assert end["host_capacity"] <= 2 * need + (64 << 20), (name, end)
        if before > max(2 * need, 64 << 20):
            assert r["offload"]["host_released"] > 0, (name, r["offload"])
        assert end["pinned"] <= end["host_capacity"] + (64 << 20), (name, end)
    w, e = runs["watermark"], runs["every"]
    metric("watermark_budget_GiB", budget / GIB)
    metric("watermark_moved_pre_plan_GiB", moved["watermark"] / GIB)
    metric("every_moved_pre_plan_GiB", moved["every"] / GIB)
    metric("watermark_first_step_s", w["iterations"][0]["step_s"])
    metric("every_first_step_s", e["iterations"][0]["step_s"])
    metric("watermark_pinned_max_GiB", max(it["pinned"] for it in w["iterations"]) / GIB)
    metric("every_pinned_max_GiB", max(it["pinned"] for it in e["iterations"]) / GIB)
    metric("watermark_pinned_end_GiB", w["iterations"][-1]["pinned"] / GIB)
