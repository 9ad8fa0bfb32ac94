"""Hugging Face transformers training (scaled-down Llama) under native and every stweaver
mode, bitwise; torch.compile(mode="reduce-overhead") with default cudagraph trees and
without them. Each run is a fresh subprocess (the harness of test_subprocess.py).

The cudagraph-trees test (test_compile_reduce_overhead_cudagraph_trees) checks that, with
trees on (the default), a small MLP trains for several steps (compiled forward + backward,
eager AdamW) and a graph-break branch switches paths, all without error under stweaver;
that CUDA graphs really replayed and the trees really checkpointed the pool and restored a
checkpoint (getCheckpointState / setCheckpointPoolState, counted); that losses and branch
results equal native's bitwise and the eager run's within 1e-3; and that no free failed."""

import os

import pytest

from test_subprocess import SCRIPTS, last_json, run

LLAMA = os.path.join(SCRIPTS, "train_llama.py")
COMPILE = os.path.join(SCRIPTS, "compile_ro.py")
STEPS = {"STEPS": "16"}

_llama = {}


def llama_native():
    if "native" not in _llama:
        pytest.importorskip("transformers")
        _llama["native"] = last_json(run([LLAMA, "native"], STEPS))
    return _llama["native"]


def llama_auto(tmp_path_factory):
    if "auto" not in _llama:
        d = tmp_path_factory.mktemp("llama_auto")
        plan, trace = d / "llama.stwp", d / "llama_auto.stwt"
        r = run(["-m", "stweaver", "run", "--mode", "auto", "--plan", str(plan), "--trace", str(trace), LLAMA],
                {**STEPS, "STWEAVER_AUTO_ITERATIONS": "4"})
        _llama["auto"] = dict(result=last_json(r), plan=plan)
    return _llama["auto"]


def _check(native, ours, metric, tag):
    assert ours["backend"] == "stweaver", ours["backend"]
    assert len(ours["losses"]) == int(STEPS["STEPS"]) >= 10
    metric("transformers", native["transformers"])
    metric("native_max_reserved_MiB", native["max_reserved"] / 2**20)
    metric(f"{tag}_max_reserved_MiB", ours["max_reserved"] / 2**20)
    metric("native_step_ms", native["step_ms"])
    metric(f"{tag}_step_ms", ours["step_ms"])
    assert ours["losses"] == native["losses"], f"{tag}: losses differ from native"


def test_hf_llama_online_bitwise(metric):
    native = llama_native()
    _check(native, last_json(run([LLAMA, "stweaver"], STEPS)), metric, "online")


def test_hf_llama_trace_bitwise(tmp_path, metric):
    native = llama_native()
    trace = tmp_path / "llama.stwt"
    ours = last_json(run(["-m", "stweaver", "run", "--mode", "trace", "--trace", str(trace), LLAMA], STEPS))
    assert trace.is_file()
    metric("trace_bytes", trace.stat().st_size)
    _check(native, ours, metric, "trace")


def test_hf_llama_auto_bitwise(tmp_path_factory, metric):
    native = llama_native()
    a = llama_auto(tmp_path_factory)
    ours = a["result"]
    info = ours["stweaver"]
    metric("auto_mode", info["mode"])
    p = (info["devices"][0].get("plan") or {}) if info.get("devices") else {}
    metric("auto_hits", p.get("hits"))
    metric("auto_unplanned", p.get("unplanned"))
    _check(native, ours, metric, "auto")
    assert info["mode"] == "auto (plan)", info


def test_hf_llama_plan_bitwise(tmp_path_factory, metric):
    native = llama_native()
    plan = llama_auto(tmp_path_factory)["plan"]
    assert plan.is_file(), "auto mode wrote no plan"
    ours = last_json(run(["-m", "stweaver", "run", "--mode", "plan", "--plan", str(plan), LLAMA], STEPS))
    info = ours["stweaver"]
    p = info["devices"][0]["plan"]
    metric("plan_hits", p["hits"])
    metric("plan_unplanned", p["unplanned"])
    metric("plan_conflicts", p["conflicts"])
    _check(native, ours, metric, "plan")
    assert info["mode"] == "plan", info
    assert p["hits"] > 0, p


_compile = {}


def compile_run(mode, variant):
    if (mode, variant) not in _compile:
        _compile[(mode, variant)] = last_json(run([COMPILE, mode, variant]))
    return _compile[(mode, variant)]


def _close(got_hex, want_hex, rel=1e-3, abs_=1e-3):
    got, want = [float.fromhex(v) for v in got_hex], [float.fromhex(v) for v in want_hex]
    return len(got) == len(want) and all(abs(g - w) <= abs_ + rel * abs(w) for g, w in zip(got, want))


def test_compile_reduce_overhead_plain_cuda_graphs(metric):
    """cudagraph_trees = False: inductor's plain CUDA graphs over stweaver's private pools."""
    native = compile_run("native", "notrees")
    ours = compile_run("stweaver", "notrees")
    assert native["error"] is None, native["error"]
    assert ours["backend"] == "stweaver"
    assert ours["error"] is None, ours["error"]
    metric("steps", len(ours["losses"]))
    metric("inductor_counters", str(ours["inductor"]))
    metric("graph_replays", ours["graph_replays"])
    metric("graph_pool_segments", ours["graph_pool_segments"])
    metric("native_graph_replays", native["graph_replays"])
    # CUDA graphs really replayed, from stweaver private pools (not an eager fallback).
    assert ours["graph_replays"] > 0 and ours["graph_pool_segments"] > 0, ours
    metric("native_max_reserved_MiB", native["max_reserved"] / 2**20)
    metric("stweaver_max_reserved_MiB", ours["max_reserved"] / 2**20)
    assert ours["losses"] == native["losses"], "reduce-overhead losses differ from native"


def test_compile_reduce_overhead_cudagraph_trees(metric):
    """Default reduce-overhead: cudagraph trees over stweaver's private pool, with the
    pool checkpointed after every recording and restored when a new branch is warmed up
    and recorded after a replay."""
    native = compile_run("native", "trees")
    ours = compile_run("stweaver", "trees")
    eager = compile_run("stweaver", "eager")
    assert native["error"] is None, native["error"]
    assert eager["error"] is None, eager["error"]
    assert ours["backend"] == "stweaver"
    assert ours["error"] is None, ours["error"]
    api, native_api = ours["checkpoint_api"], native["checkpoint_api"]
    metric("steps", len(ours["losses"]))
    metric("inductor_counters", str(ours["inductor"]))
    metric("graph_replays", ours["graph_replays"])
    metric("checkpoints_taken", api["getCheckpointState"])
    metric("checkpoints_restored", api["setCheckpointPoolState"])
    metric("native_checkpoints_restored", native_api["setCheckpointPoolState"])
    metric("native_max_reserved_MiB", native["max_reserved"] / 2**20)
    metric("stweaver_max_reserved_MiB", ours["max_reserved"] / 2**20)
    # The scenario really exercises the trees (on native too, or it would prove nothing).
    assert native_api["setCheckpointPoolState"] > 0, f"native never restored a checkpoint: {native_api}"
    assert ours["graph_replays"] > 0, ours
    assert api["getCheckpointState"] > 0 and api["setCheckpointPoolState"] > 0, api
    assert ours["failed_frees"] == 0, ours["failed_frees"]
    assert len(ours["losses"]) == len(eager["losses"]) >= 10
    assert len(ours["branch"]) == len(eager["branch"]) > 0
    assert ours["losses"] == native["losses"], "reduce-overhead (trees) losses differ from native"
    assert ours["branch"] == native["branch"], "branch results differ from native"
    assert _close(ours["losses"], eager["losses"]), (ours["losses"], eager["losses"])
    assert _close(ours["branch"], eager["branch"]), (ours["branch"], eager["branch"])
