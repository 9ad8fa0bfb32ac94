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
    decisions end in serving the plan), reserves at most the budget, and its losses are
    bitwise those of the unlimited run (recomputation and offload change no value)."""
    script = os.path.join(SCRIPTS, "auto_recompute_probe.py")
    ref = last_json(run([script, "unlimited"]))
    budget = int(0.7 * ref["max_allocated"])
    r = last_json(run([script, str(budget)]))
    assert r["error"] is None, r
    ar = r["auto_recompute"]
    assert ar and ar["decisions"], r
    assert ar["decisions"][-1]["action"] == "serve", ar
    assert r["mode"] == "auto (plan)", r
    assert r["max_reserved"] <= budget, (r["max_reserved"], budget)
    assert r["losses"] == ref["losses"], "losses differ from the unlimited run's"
    metric("auto_recompute_blocks", ar["recomputed"])
    metric("auto_recompute_rounds", ar["rounds"])
    metric("auto_recompute_reserved_GiB", r["max_reserved"] / GIB)
    metric("auto_recompute_unlimited_GiB", ref["max_allocated"] / GIB)
