"""Argument and environment validation: pure Python, no torch, no GPU."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from stweaver._settings import DEFAULT_MODE, SettingsError, parse_bool, resolve  # noqa: E402


def test_defaults_to_auto_with_the_optimizer_hook():
    s = resolve(env={})
    assert DEFAULT_MODE == "auto"
    assert (s.mode, s.plan, s.trace, s.hook_optimizer) == ("auto", None, None, True)
    assert resolve("online", env={}).hook_optimizer is False
    assert resolve(hook_optimizer=False, env={}).hook_optimizer is False


def test_environment_is_read(tmp_path):
    plan = tmp_path / "p.stwp"
    plan.write_bytes(b"x")
    s = resolve(env={"STWEAVER_MODE": "Plan", "STWEAVER_PLAN": str(plan), "STWEAVER_HOOK_OPTIMIZER": "yes"})
    assert (s.mode, s.plan, s.hook_optimizer) == ("plan", str(plan), True)
    s = resolve(env={"STWEAVER_TRACE": str(tmp_path / "t.stwt")})
    assert s.mode == "trace", "a trace path alone implies trace mode"
    s = resolve(env={"STWEAVER_PLAN": str(plan)})
    assert s.mode == "plan", "a plan path alone implies plan mode"


def test_arguments_win_over_environment(tmp_path):
    env = {"STWEAVER_MODE": "trace", "STWEAVER_TRACE": str(tmp_path / "t.stwt")}
    s = resolve("online", trace="", env=env)
    assert s.mode == "online" and s.trace is None
    s = resolve(hook_optimizer=False, env={**env, "STWEAVER_HOOK_OPTIMIZER": "1"})
    assert s.hook_optimizer is False


def test_auto_writes_its_plan_and_trace(tmp_path):
    s = resolve("auto", plan=tmp_path / "new.stwp", trace=tmp_path / "new.stwt", env={})
    assert (s.mode, s.plan, s.trace) == ("auto", str(tmp_path / "new.stwp"), str(tmp_path / "new.stwt"))
    with pytest.raises(SettingsError, match="folder"):
        resolve("auto", plan=tmp_path / "missing" / "p.stwp", env={})


def test_path_like_arguments(tmp_path):
    s = resolve(trace=tmp_path / "t.stwt", env={})
    assert s.trace == str(tmp_path / "t.stwt")


@pytest.mark.parametrize(
    "kwargs, env, message",
    [
        ({"mode": "fast"}, {}, "expected one of"),
        ({}, {"STWEAVER_MODE": "fast"}, "STWEAVER_MODE"),
        ({"mode": 3}, {}, "must be a string"),
        ({"mode": "trace"}, {}, "needs a trace path"),
        ({"mode": "plan"}, {}, "needs a plan file"),
        ({"mode": "online", "trace": "t.stwt"}, {}, "takes no plan or trace"),
        ({"plan": 5}, {}, "must be a path"),
        ({"hook_optimizer": "yes"}, {}, "must be a bool"),
        ({}, {"STWEAVER_HOOK_OPTIMIZER": "maybe"}, "not a boolean"),
        ({"mode": "plan", "plan": "/nonexistent/p.stwp"}, {}, "does not exist"),
        ({}, {"STWEAVER_AUTO_ITERATIONS": "0"}, "positive integer"),
        ({}, {"STWEAVER_AUTO_ITERATIONS": "many"}, "positive integer"),
        ({}, {"STWEAVER_RELEASE_AT_PEAK": "sometimes"}, "STWEAVER_RELEASE_AT_PEAK"),
        ({}, {"STWEAVER_PLAN_WAIT": "later"}, "STWEAVER_PLAN_WAIT"),
        ({}, {"STWEAVER_SHARE_STREAMS": "2"}, "STWEAVER_SHARE_STREAMS"),
        ({}, {"STWEAVER_PLAN_THREADS": "-1"}, "STWEAVER_PLAN_THREADS"),
        ({}, {"STWEAVER_PLAN_THREADS": "all"}, "STWEAVER_PLAN_THREADS"),
        ({}, {"STWEAVER_PLAN_NICE": "20"}, "STWEAVER_PLAN_NICE"),
        ({}, {"STWEAVER_RELEASE_CHURN": "-3"}, "STWEAVER_RELEASE_CHURN"),
        ({}, {"STWEAVER_RELEASE_CHURN": "often"}, "STWEAVER_RELEASE_CHURN"),
        ({}, {"STWEAVER_POOL_UNIT_MIB": "-64"}, "STWEAVER_POOL_UNIT_MIB"),
        ({}, {"STWEAVER_POOL_UNIT_MIB": "big"}, "STWEAVER_POOL_UNIT_MIB"),
        ({"mode": "trace", "trace": "/nonexistent/dir/t.stwt"}, {}, "does not exist"),
    ],
)
def test_bad_settings_are_clear_errors(kwargs, env, message):
    with pytest.raises(SettingsError, match=message):
        resolve(env=env, **kwargs)


def test_parse_bool():
    assert parse_bool(" ON ", "X") is True
    assert parse_bool("0", "X") is False
    with pytest.raises(SettingsError):
        parse_bool("2", "X")


def test_budget_parses_sizes_fractions_and_bytes():
    from stweaver._settings import parse_budget

    assert parse_budget("16GiB") == 16 << 30
    assert parse_budget(" 16 G ") == 16 << 30
    assert parse_budget("512MiB") == 512 << 20
    assert parse_budget("1.5GB") == 1_500_000_000
    assert parse_budget("17179869184") == 16 << 30
    assert parse_budget("0.8") == 0.8
    assert parse_budget(0.5) == 0.5
    assert parse_budget(1 << 30) == 1 << 30
    for bad, why in [("lots", "not a number"), ("0", "positive"), ("16 parsecs", "unknown unit"),
                     ("1.5", "(0, 1]"), (2.0, "(0, 1]"), (True, "bool"), ([1], "str, int or float")]:
        with pytest.raises(SettingsError, match=None) as e:
            parse_budget(bad)
        assert why in str(e.value), (bad, str(e.value))


def test_budget_from_argument_or_environment():
    assert resolve(env={}).budget is None
    assert resolve(env={"STWEAVER_BUDGET": "16GiB"}).budget == "16GiB"
    assert resolve(env={"STWEAVER_BUDGET": "16GiB"}, budget="0.7").budget == "0.7"
    assert resolve(env={}, budget=0.7).budget == "0.7"
    with pytest.raises(SettingsError, match="STWEAVER_BUDGET"):
        resolve(env={"STWEAVER_BUDGET": "much"})


def test_offload_setting_is_validated():
    assert resolve(env={"STWEAVER_OFFLOAD": "auto"}).mode == "auto"
    assert resolve(env={"STWEAVER_OFFLOAD": "0"}).mode == "auto"
    with pytest.raises(SettingsError, match="STWEAVER_OFFLOAD"):
        resolve(env={"STWEAVER_OFFLOAD": "sometimes"})


def test_offload_hooks_follow_mode_and_budget(monkeypatch, tmp_path):
    import stweaver

    monkeypatch.delenv("STWEAVER_OFFLOAD", raising=False)
    s = lambda **kw: resolve(env={}, **kw)  # noqa: E731
    assert stweaver._offload_setting(s()) is None
    assert stweaver._offload_setting(s(budget="16GiB")) == "plan"
    assert stweaver._offload_setting(s(mode="trace", trace=str(tmp_path / "t.stwt"))) == "record"
    assert stweaver._offload_setting(s(mode="online", budget="16GiB")) is None
    monkeypatch.setenv("STWEAVER_OFFLOAD", "1")
    assert stweaver._offload_setting(s()) == "plan"
    assert stweaver._offload_setting(s(mode="online")) == "record"
    monkeypatch.setenv("STWEAVER_OFFLOAD", "0")
    assert stweaver._offload_setting(s(budget="16GiB")) is None


def test_a_trace_run_asked_to_offload_offloads_every_iteration(monkeypatch, tmp_path):
    # STWEAVER_OFFLOAD=1 in trace mode: threshold offload throughout (as auto records under a
    # budget), so every iteration's trace says when the program let go of each tensor;
    # auto under a budget: the plan's schedule, threshold only before it. (The offloader
    # needs torch; the rest of this file does not.)
    pytest.importorskip("torch")
    import stweaver
    from stweaver import _offload

    monkeypatch.setattr(stweaver, "_extension", lambda: None)
    monkeypatch.setenv("STWEAVER_OFFLOAD", "1")
    stweaver._start_offload(resolve(env={}, mode="trace", trace=str(tmp_path / "t.stwt")))
    try:
        o = _offload.current()
        assert o.mode == "threshold" and o.min_bytes == 1 << 20
    finally:
        _offload.disable()
    monkeypatch.setenv("STWEAVER_OFFLOAD", "auto")
    stweaver._start_offload(resolve(env={}, mode="trace", trace=str(tmp_path / "t.stwt")))
    try:
        o = _offload.current()
        assert o.mode == "schedule" and o.first_min_bytes is None
    finally:
        _offload.disable()


def test_auto_mode_under_a_budget_offloads_under_the_watermark(monkeypatch):
    # install()'s offloader under a budget: threshold rules with the watermark before the
    # plan (the limit read from the extension) with STWEAVER_OFFLOAD_WATERMARK=1; without
    # by default (opt-in) and with 0.
    pytest.importorskip("torch")
    import json

    import stweaver
    from stweaver import _offload

    class Ext:
        def mode(self):
            return "auto (recording)"

        def offload_schedule(self):
            return []

        def info_json(self):
            return json.dumps({"devices": [{"device": 0, "limit_bytes": 16 << 30, "budget": "16GiB",
                                            "memory_fraction": 1.0}]})

    monkeypatch.setattr(stweaver, "_extension", lambda: Ext())
    monkeypatch.delenv("STWEAVER_OFFLOAD", raising=False)
    for env, on in ((None, False), ("1", True), ("0", False)):
        if env is None:
            monkeypatch.delenv("STWEAVER_OFFLOAD_WATERMARK", raising=False)
        else:
            monkeypatch.setenv("STWEAVER_OFFLOAD_WATERMARK", env)
        stweaver._start_offload(resolve(env={}, budget="16GiB"))
        try:
            o = _offload.current()
            assert o.mode == "plan" and o.first_min_bytes == 1 << 20
            assert (o.watermark is not None) == on, env
            if on:
                assert o.watermark.begin(torch_device0()) and o.watermark.limit == 16 << 30
        finally:
            _offload.disable()
    with pytest.raises(SettingsError, match="STWEAVER_OFFLOAD_WATERMARK"):
        resolve(env={"STWEAVER_OFFLOAD_WATERMARK": "maybe"})


def torch_device0():
    import torch

    return torch.device("cuda", 0)
