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
