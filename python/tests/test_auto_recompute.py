"""recompute_blocks(model, "auto") without a GPU: the decision loop of
stweaver._auto_recompute over the real Offloader (fake streams, CPU tensors) and a fake
extension that plays auto mode's plan gate: per-block bytes measured in forward, the held
plan served when it waits little, more blocks recomputed and a new recording asked for when
it waits, the number of blocks from the planned wait and the link, the rounds bounded, and
clear errors outside auto mode."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

torch = pytest.importorskip("torch")

from stweaver import _auto_recompute as ar_mod  # noqa: E402
from stweaver._recompute import recompute_blocks, recomputed  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_offload import FakeExt, offloader  # noqa: E402
from test_recompute import Net, step  # noqa: E402


class GateExt(FakeExt):
    """FakeExt with auto mode's stage, the plan gate and a held plan's outcome."""

    def __init__(self):
        super().__init__(recording=True, schedule=[])
        self.stage = "auto (recording)"
        self.gate = None
        self.link = None
        self.outcome = None
        self.releases = []

    def mode(self):
        return self.stage

    def set_plan_gate(self, on):
        self.gate = on

    def set_offload_timing(self, link_gbps, iteration_us):
        self.link = link_gbps
        self.iteration_us = iteration_us

    def info_json(self):
        return json.dumps({"devices": [{"device": 0, "offload": self.outcome}]})

    def release_held_plan(self, accept):
        if self.stage != "auto (plan held)":
            raise RuntimeError("no plan is held")
        self.releases.append(accept)
        self.stage = "auto (plan)" if accept else "auto (recording)"


class TrialExt(GateExt):
    """GateExt with record_again / serve_kept_plan: the measured trial's two calls."""

    def __init__(self):
        super().__init__()
        self.kept = False
        self.trial_calls = []

    def record_again(self):
        assert self.stage == "auto (plan)" or "given up" in self.stage, self.stage
        self.trial_calls.append("record_again")
        self.kept, self.stage = True, "auto (recording)"

    def serve_kept_plan(self):
        assert self.kept
        self.trial_calls.append("serve_kept_plan")
        self.kept, self.stage = False, "auto (plan)"


def setup(depth=8, ext_class=None, **kw):
    ext = (ext_class or GateExt)()
    off, _ = offloader(schedule="plan", ext=ext, first_min_bytes=1 << 30)
    torch.manual_seed(0)
    model = Net(width=32, depth=depth, p=0.0)
    logs = []
    ar = ar_mod.AutoRecompute(model, off, ext, log=logs.append, **kw)
    off.auto_recompute = ar
    return ext, off, model, ar, logs


def iteration(model, off, x):
    step(model, x, hooks=off)
    off.iteration_end()


def test_a_plan_that_waits_little_is_served_with_nothing_recomputed():
    ext, off, model, ar, logs = setup()
    assert ext.gate is True, "the gate is on from the start"
    x = torch.randn(16, 32)
    for _ in range(3):
        iteration(model, off, x)
    assert ar._per_block and ar._per_block[-1] > 0, "each block's saved bytes measured in forward"
    ext.stage = "auto (plan held)"
    ext.outcome = {"planned": True, "copy_out_wait_us": 0.0, "stall_us": 0.0, "link_gbps": 20.0,
                   "bytes_per_iteration": 1000}
    iteration(model, off, x)
    assert ext.releases == [True] and ext.stage == "auto (plan)"
    assert recomputed(model) == [] and ar.done
    assert off.stats()["auto_recompute"]["decisions"][0]["action"] == "serve"
    assert "serving the plan" in logs[-1]


def test_a_plan_that_waits_recomputes_blocks_for_the_bytes_the_link_missed_and_records_again():
    ext, off, model, ar, logs = setup()
    x = torch.randn(16, 32)
    for _ in range(2):
        iteration(model, off, x)
    block = ar._per_block[-1]
    # The link missed 2.5 blocks' bytes: 3 more blocks recomputed.
    link = 10.0
    wait_us = 2.5 * block / (link * 1e9) * 1e6
    ext.stage = "auto (plan held)"
    ext.outcome = {"planned": True, "copy_out_wait_us": wait_us, "stall_us": 0.0, "link_gbps": link}
    ar.wait_share = 0.0  # any wait is too much here (the CPU's iterations are short)
    from stweaver._offload import Watermark

    off.watermark = Watermark(lambda device: None)  # its limit unknown: only its level matters here
    off.watermark.level = 1 << 30  # as learned from the recording so far
    iteration(model, off, x)
    assert ext.releases == [False] and ext.stage == "auto (recording)"
    assert recomputed(model) == [f"layers.{i}" for i in range(5, 8)]
    assert off.watermark.level is None, "the program changed: the watermark learns again"
    d = off.stats()["auto_recompute"]["decisions"][0]
    assert d["action"] == "recompute" and d["k"] == 0 and d["k_new"] == 3
    assert "recomputing the last 3 of 8 blocks" in logs[-1]
    # The next recording measures only the blocks still stored; a plan without waits is served.
    for _ in range(2):
        iteration(model, off, x)
    assert ar._per_block and abs(ar._per_block[-1] - block) <= 0.01 * block
    ext.stage = "auto (plan held)"
    ext.outcome = dict(ext.outcome, copy_out_wait_us=0.0)
    iteration(model, off, x)
    assert ext.releases == [False, True] and len(recomputed(model)) == 3
    # Once served, nothing more is decided.
    iteration(model, off, x)
    assert len(off.stats()["auto_recompute"]["decisions"]) == 2


def test_rounds_are_bounded_and_a_refused_plan_recomputes_an_eighth():
    ext, off, model, ar, logs = setup(depth=16, max_rounds=2, where="first")
    ar.wait_share = 0.0
    x = torch.randn(16, 32)
    ext.stage = "auto (plan held)"
    ext.outcome = {"planned": False, "reason": "the budget is below the minimum"}
    iteration(model, off, x)
    assert recomputed(model) == ["layers.0", "layers.1"], "a refusal: ceil(16 / 8) more blocks"
    for expected in (4, 4):  # a second refusal grows it once more, then the rounds are spent
        ext.stage = "auto (plan held)"
        iteration(model, off, x)
        assert len(recomputed(model)) == expected
    assert ext.releases == [False, False, True]
    assert "2 re-recordings made" in logs[-1]


class FakeEvent:
    """A device event whose elapsed time is set by the test (ms per block, by block)."""

    clock = {"t": 0.0, "ms": 2.0, "done": True}

    def record(self):
        FakeEvent.clock["t"] += FakeEvent.clock["ms"] / 2  # pre-hook and hook: half each
        self.t = FakeEvent.clock["t"]

    def query(self):
        return FakeEvent.clock["done"]

    def elapsed_time(self, later):
        return later.t - self.t


def test_the_link_and_the_block_times_the_recording_measured_time_the_plan():
    ext, off, model, ar, logs = setup()
    off.link_rates = lambda: (30.0, 20.0)
    iteration(model, off, torch.randn(4, 32))
    assert ext.link == pytest.approx(0.9 * 20.0) and ext.iteration_us == 0.0, "no device timing on a CPU"
    FakeEvent.clock.update(ms=2.0, done=False)
    ext2, off2, model2, ar2, _ = setup(event=FakeEvent)
    x = torch.randn(4, 32)
    iteration(model2, off2, x)
    assert ar2.forward_ms() is None, "events not passed yet: never waited for"
    FakeEvent.clock.update(done=True)
    FakeEvent.clock["ms"] = 3.0
    iteration(model2, off2, x)  # reads both iterations: 1 ms blocks, then 1.5 ms
    iteration(model2, off2, x)
    # The first read iteration aside, the fastest: 8 blocks x 1.5 ms, a third of the iteration.
    assert ar2.forward_ms() == pytest.approx(8 * 1.5)
    assert ext2.iteration_us == pytest.approx(8 * 1.5e3 * 3)
    # The decision compares the wait with that device time (2 % of 36 ms: 0.72 ms), not
    # with the host's iteration (a few ms on this CPU, where 0.5 ms would be too much).
    ar2.wait_share = 0.02
    ext2.stage = "auto (plan held)"
    ext2.outcome = {"planned": True, "copy_out_wait_us": 0.5e3, "stall_us": 0.0, "link_gbps": 18.0}
    iteration(model2, off2, x)
    d = off2.stats()["auto_recompute"]["decisions"][0]
    assert d["iteration_ms"] == pytest.approx(36.0) and d["action"] == "serve", d


def test_a_wait_with_every_block_recomputed_serves_the_plan():
    ext, off, model, ar, logs = setup(depth=4)
    recompute_blocks(model, 4)
    ar.k = 4
    ar.wait_share = 0.0
    ext.stage = "auto (plan held)"
    ext.outcome = {"planned": True, "copy_out_wait_us": 5e3, "stall_us": 0.0, "link_gbps": 10.0}
    iteration(model, off, torch.randn(4, 32))
    assert ext.releases == [True] and "no more blocks" in logs[-1]


def test_auto_outside_auto_mode_is_a_clear_error():
    torch.manual_seed(0)
    with pytest.raises(ar_mod.AutoRecomputeError, match="auto mode under a budget"):
        recompute_blocks(Net(), "auto")


def test_the_offloader_keeps_offloading_by_threshold_while_a_plan_is_held():
    ext, off, model, ar, logs = setup()
    off.first_min_bytes = 1
    x = torch.randn(16, 32)
    iteration(model, off, x)
    ext.stage = "auto (plan held)"
    ext.outcome = {"planned": True, "copy_out_wait_us": 1e6, "stall_us": 0.0, "link_gbps": 10.0}
    ar.done = True  # no decision: the plan stays held
    iteration(model, off, x)
    assert off._runtime_before_plan(), "held counts as before the plan"
    step(model, x, hooks=off)
    assert off.iteration_end()["tensors_out"] > 0


def test_a_failing_decision_or_removal_never_leaves_the_plan_held():
    ext, off, model, ar, logs = setup()
    ext.stage = "auto (plan held)"
    ext.outcome = {"planned": True, "copy_out_wait_us": 5e3, "stall_us": 0.0, "link_gbps": 10.0}
    ar.wait_share = 0.0

    def broken(*a, **k):
        raise RuntimeError("boom")

    import stweaver._recompute as rc

    real = rc.recompute_blocks
    rc.recompute_blocks = broken
    try:
        iteration(model, off, torch.randn(4, 32))
    finally:
        rc.recompute_blocks = real
    assert ext.releases == [True] and ext.gate is False and ar.done
    assert any("deciding failed" in m for m in logs), logs
    # Removing the decider while a plan is held serves it.
    ext2, off2, model2, ar2, _ = setup()
    ext2.stage = "auto (plan held)"
    ar2.remove()
    assert ext2.releases == [True] and ext2.gate is False
    assert ar2.boundary not in off2.boundary_hooks


class Clock:
    """perf_counter for AutoRecompute's iteration times: moved by the test only."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def trial_setup(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(ar_mod.time, "perf_counter", clock)
    ext, off, model, ar, logs = setup(ext_class=TrialExt)
    x = torch.randn(16, 32)

    def run(n, ms):
        for _ in range(n):
            step(model, x, hooks=off)
            clock.t += ms / 1e3
            off.iteration_end()

    run(2, 500.0)  # recorded iterations (slow: threshold offload)
    block = ar._per_block[-1]
    ext.stage = "auto (plan held)"
    # No wait, but 2.5 blocks' bytes moved per iteration: the trial tries 3 blocks more.
    ext.outcome = {"planned": True, "copy_out_wait_us": 0.0, "stall_us": 0.0, "link_gbps": 20.0,
                   "bytes_per_iteration": int(2.5 * block)}
    run(1, 500.0)
    assert ext.releases == [True] and ext.stage == "auto (plan)", "plan A served"
    assert ext.gate is True and not ar.done, "the gate stays on for B's plan"
    assert recomputed(model) == []
    return ext, off, model, ar, logs, run


def measure(run, ms):
    run(ar_mod.TRIAL_SKIP + ar_mod.TRIAL_STEPS, ms)


def to_plan_b(ext, off, model, ar, run):
    assert ext.trial_calls == ["record_again"] and ext.stage == "auto (recording)"
    assert recomputed(model) == [f"layers.{i}" for i in range(5, 8)], "k_B = 0 + ceil(2.5)"
    run(2, 400.0)
    ext.stage = "auto (plan held)"
    ext.outcome = dict(ext.outcome, bytes_per_iteration=0)
    run(1, 400.0)
    assert ext.releases == [True, True] and ext.stage == "auto (plan)", "plan B served whatever it waits"


def test_a_plan_that_moves_bytes_is_measured_against_more_blocks_recomputed_and_b_wins(monkeypatch):
    ext, off, model, ar, logs, run = trial_setup(monkeypatch)
    measure(run, 120.0)
    to_plan_b(ext, off, model, ar, run)
    measure(run, 110.0)
    assert ar.done and ext.gate is False and ext.trial_calls == ["record_again"]
    assert len(recomputed(model)) == 3
    st = off.stats()["auto_recompute"]
    assert [d["action"] for d in st["decisions"]] == ["trial_a", "trial_measured_a", "trial_b", "trial_keep_b"]
    assert st["trial"]["step_ms_a"] == pytest.approx(120.0) and st["trial"]["step_ms_b"] == pytest.approx(110.0)
    assert "keeping 3 blocks" in logs[-1]


def test_the_trial_goes_back_to_plan_a_without_recording_when_b_is_slower(monkeypatch):
    ext, off, model, ar, logs, run = trial_setup(monkeypatch)
    measure(run, 100.0)
    to_plan_b(ext, off, model, ar, run)
    measure(run, 104.0)
    assert ext.trial_calls == ["record_again", "serve_kept_plan"] and ext.stage == "auto (plan)"
    assert recomputed(model) == [] and ar.done and ext.gate is False
    assert off.stats()["auto_recompute"]["decisions"][-1]["action"] == "trial_back_to_a"
    assert "going back to 0 blocks" in logs[-1]
    # Nothing more is decided afterwards.
    run(3, 100.0)
    assert ext.trial_calls == ["record_again", "serve_kept_plan"]


def test_b_without_a_plan_goes_back_to_a_and_a_given_up_plan_ends_the_trial(monkeypatch):
    ext, off, model, ar, logs, run = trial_setup(monkeypatch)
    measure(run, 100.0)
    ext.stage = "auto (online: no plan)"
    run(1, 100.0)
    assert ext.trial_calls == ["record_again", "serve_kept_plan"] and recomputed(model) == [] and ar.done
    # Plan A given up while measured: B at once, kept (no comparison with a given-up plan).
    ext2, off2, model2, ar2, logs2, run2 = trial_setup(monkeypatch)
    ext2.stage = "auto (online: plan given up)"
    run2(1, 100.0)
    assert ext2.trial_calls == ["record_again"] and len(recomputed(model2)) == 3 and not ar2.done
    ext2.stage = "auto (plan held)"
    run2(1, 100.0)
    assert ext2.stage == "auto (plan)"
    measure(run2, 300.0)
    assert ar2.done and len(recomputed(model2)) == 3 and ext2.trial_calls == ["record_again"]
    assert off2.stats()["auto_recompute"]["decisions"][-1]["action"] == "trial_keep_b"
    # Plan B given up while measured: back to A.
    ext3, off3, model3, ar3, logs3, run3 = trial_setup(monkeypatch)
    measure(run3, 100.0)
    to_plan_b(ext3, off3, model3, ar3, run3)
    ext3.stage = "auto (online: plan given up)"
    run3(1, 100.0)
    assert ext3.trial_calls == ["record_again", "serve_kept_plan"] and recomputed(model3) == [] and ar3.done
    # Both given up: what runs stays.
    ext4, off4, model4, ar4, logs4, run4 = trial_setup(monkeypatch)
    ext4.stage = "auto (online: plan given up)"
    run4(1, 100.0)
    ext4.stage = "auto (plan held)"
    run4(1, 100.0)
    ext4.stage = "auto (online: plan given up)"
    run4(1, 100.0)
    assert ar4.done and ext4.trial_calls == ["record_again"]
    assert off4.stats()["auto_recompute"]["decisions"][-1]["action"] == "trial_ended"


def test_no_trial_when_the_plan_moves_nothing_or_when_turned_off(monkeypatch):
    for outcome_bytes, trial in ((0, True), (10**6, False)):
        ext, off, model, ar, logs = setup(ext_class=TrialExt, trial=trial)
        x = torch.randn(16, 32)
        iteration(model, off, x)
        ext.stage = "auto (plan held)"
        ext.outcome = {"planned": True, "copy_out_wait_us": 0.0, "stall_us": 0.0, "link_gbps": 20.0,
                       "bytes_per_iteration": outcome_bytes}
        iteration(model, off, x)
        assert ar.done and ext.gate is False and ext.releases == [True] and ext.trial_calls == []


def recorded_with_block_times():
    """Three recorded iterations of an 8-block model whose blocks take 1.5 ms each on the
    (fake) device: (ext, off, model, ar, logs, x, one block's saved bytes)."""
    FakeEvent.clock.update(ms=3.0, done=True)
    ext, off, model, ar, logs = setup(event=FakeEvent)
    x = torch.randn(16, 32)
    for _ in range(3):
        iteration(model, off, x)
    assert ar.forward_ms() == pytest.approx(8 * 1.5)
    return ext, off, model, ar, logs, x, ar._per_block[-1]


def test_a_plan_whose_tensors_cost_more_than_recomputing_their_blocks_recomputes_them():
    """Step 3b: a plan without waits that moves 1.5 blocks' bytes in 30 tensors (TENSOR_MS each:
    4.5 ms) against 2 more blocks recomputed (1.5 ms each: 3 ms) recomputes the 2 blocks and
    records again; the next plan moving nothing is served. With one tensor (0.15 ms) the plan
    is served as it is."""
    assert 30 * ar_mod.TENSOR_MS > 2 * 1.5 > ar_mod.TENSOR_MS  # the two cases below
    for tensors, expect_k in ((30, 2), (1, 0)):
        ext, off, model, ar, logs, x, block = recorded_with_block_times()
        ext.stage = "auto (plan held)"
        ext.outcome = {"planned": True, "copy_out_wait_us": 0.0, "stall_us": 0.0, "link_gbps": 20.0,
                       "bytes_per_iteration": int(1.5 * block), "tensors": tensors}
        iteration(model, off, x)
        d = off.stats()["auto_recompute"]["decisions"][0]
        assert d["offload_cost_ms"] == pytest.approx(tensors * ar_mod.TENSOR_MS)
        assert d["recompute_cost_ms"] == pytest.approx(2 * 1.5)
        assert len(recomputed(model)) == expect_k, (tensors, d)
        if expect_k:
            assert d["action"] == "recompute" and ext.releases == [False]
            assert "30 tensors costs" in logs[-1]
            for _ in range(2):
                iteration(model, off, x)
            ext.stage = "auto (plan held)"
            ext.outcome = {"planned": True, "copy_out_wait_us": 0.0, "stall_us": 0.0, "link_gbps": 20.0,
                           "bytes_per_iteration": 0, "tensors": 0}
            iteration(model, off, x)
            assert ext.releases == [False, True] and ar.done and len(recomputed(model)) == 2
        else:
            assert d["action"] == "serve" and ext.releases == [True] and ar.done


def test_a_plan_that_waits_and_moves_costly_tensors_recomputes_all_their_blocks_at_once():
    """A plan that waits (the link missed half a block) and moves 2.5 blocks' bytes in 60
    tensors (9 ms, against 3 blocks' 4.5 ms): the round recomputes the 3 blocks of every byte
    moved (3b), not the 1 block the wait alone asks for, so that the rounds are not spent a
    block at a time."""
    ext, off, model, ar, logs, x, block = recorded_with_block_times()
    link = 10.0
    ar.wait_share = 0.0
    ext.stage = "auto (plan held)"
    ext.outcome = {"planned": True, "copy_out_wait_us": 0.5 * block / (link * 1e9) * 1e6, "stall_us": 0.0,
                   "link_gbps": link, "bytes_per_iteration": int(2.5 * block), "tensors": 60}
    iteration(model, off, x)
    d = off.stats()["auto_recompute"]["decisions"][0]
    assert d["action"] == "recompute" and d["k_new"] == 3, d
    assert len(recomputed(model)) == 3


def test_a_link_bound_plan_recomputes_no_more_blocks_than_its_bytes_are():
    """A plan whose waits stand for 10 blocks' bytes on the link but which moves 1.5 blocks'
    bytes (a link-bound schedule's waits count each late byte on the way out and back)
    recomputes the 2 blocks its bytes are, not 10."""
    ext, off, model, ar, logs, x, block = recorded_with_block_times()
    link = 10.0
    ar.wait_share = 0.0
    ext.stage = "auto (plan held)"
    ext.outcome = {"planned": True, "copy_out_wait_us": 10 * block / (link * 1e9) * 1e6, "stall_us": 0.0,
                   "link_gbps": link, "bytes_per_iteration": int(1.5 * block), "tensors": 1}
    iteration(model, off, x)
    d = off.stats()["auto_recompute"]["decisions"][0]
    assert d["action"] == "recompute" and d["k_new"] == 2, d
    assert len(recomputed(model)) == 2


def test_a_plan_waiting_longer_than_its_iteration_steps_by_an_eighth():
    """Waits longer than the iteration itself (a link-bound plan: 100 ms against the 36 ms
    the measured blocks give) say little about how many blocks to recompute: an eighth of
    the blocks, as for a refused plan, then measured again."""
    ext, off, model, ar, logs, x, block = recorded_with_block_times()
    ar.wait_share = 0.0
    ext.stage = "auto (plan held)"
    ext.outcome = {"planned": True, "copy_out_wait_us": 100_000.0, "stall_us": 0.0,
                   "link_gbps": 10.0, "bytes_per_iteration": int(5 * block), "tensors": 1}
    iteration(model, off, x)
    d = off.stats()["auto_recompute"]["decisions"][0]
    assert d["iteration_ms"] == pytest.approx(36.0)
    assert d["action"] == "recompute" and d["k_new"] == 1, d
