"""gpu_dist_bench.py --lockstep without torch or a GPU: the analysis (a job's step per round,
the paired ratio to native, its bootstrap CI and verdict, the rows and tables), the worker's
warm-up rule and seat names (dist_worker.py), and the driver's per-rank go / done orchestration
(`drive_lockstep`) against fake jobs: threads that take the participant's side with
lockstep.Turn, as every rank of a real torchrun job does."""

import os
import random
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
sys.path.insert(0, os.path.join(HERE, "gpu_dist"))

if not hasattr(os, "mkfifo"):
    pytest.skip("named pipes (POSIX) needed", allow_module_level=True)

import dist_worker as dw  # noqa: E402
import gpu_dist_bench as gb  # noqa: E402
from lockstep import Seat, Turn, round_order  # noqa: E402

# ------------------------------------------------------------------ analysis


def test_job_step_is_the_slowest_rank():
    assert gb.job_step([0.5, 0.7]) == 0.7
    assert gb.job_step([0.5]) == 0.5
    assert gb.job_step([0.5, None]) is None, "a rank that did not report: no job step"
    assert gb.job_step([]) is None


def test_ratio_per_round_cancels_a_slow_phase():
    # Rounds 20..39 run 15 % slower for every job (a slow phase of the machine); expandable
    # costs 0.5 % more than native in every round, the A/A job the same as native.
    rng = random.Random(1)
    times = {"native": {}, "expandable": {}, "native_aa": {}}
    for it in range(10, 70):
        phase = 1.15 if 20 <= it - 10 < 40 else 1.0
        for key, cost in (("native", 1.0), ("expandable", 1.005), ("native_aa", 1.0)):
            times[key][it] = 0.4 * phase * cost * (1 + rng.uniform(-0.001, 0.001))
    est = gb.lockstep_estimates(times)
    assert set(est) == {"expandable", "native_aa"}, "no ratio of native to itself"
    e = est["expandable"]
    assert e["rounds"] == e["n"] == 60 and len(e["ratios"]) == 60
    assert e["median"] == pytest.approx(1.005, abs=0.001)
    assert e["lo"] <= e["median"] <= e["hi"]
    assert e["verdict"] == "within 1 %"
    assert est["native_aa"]["verdict"] == "within 1 %"
    assert est["native_aa"]["median"] == pytest.approx(1.0, abs=0.001)
    # Unpaired (median of one over median of the other) the phase would not cancel here; the
    # paired ratio of each round does.
    assert max(e["ratios"]) < 1.01


def test_ratios_pair_the_same_round_only():
    times = {"native": {5: 1.0, 6: 2.0, 7: 1.0}, "plan": {6: 2.2, 7: 1.1, 8: 9.0}}
    est = gb.lockstep_estimates(times)
    assert est["plan"]["ratios"] == pytest.approx([1.1, 1.1]), "rounds 6 and 7: both jobs ran them"
    assert gb.lockstep_estimates({"native": {}, "plan": {1: 1.0}}) == {}, "no common round: no estimate"
    assert est["plan"]["verdict"] == "too few rounds (2 < 8)"


def test_verdicts():
    v = gb.step_verdict
    assert v(None) == "no data"
    assert v({"lo": 0.991, "hi": 1.009}) == "within 1 %"
    assert v({"lo": 0.989, "hi": 1.005}) == "not resolved", "the CI must lie inside [0.99, 1.01]"
    assert v({"lo": 1.02, "hi": 1.04}) == "slower than native by more than 1 %"
    assert v({"lo": 0.95, "hi": 0.98}) == "faster than native by more than 1 %"
    assert v({"lo": 1.005, "hi": 1.03}) == "not resolved"


def test_bootstrap_ci_over_rounds():
    rs = [1.0 + 0.02 * ((i * 7) % 11 - 5) / 5 for i in range(40)]  # 0.98 .. 1.02
    ci = gb.bootstrap_median_ci([[x] for x in rs])
    assert ci == gb.bootstrap_median_ci([[x] for x in rs]), "seeded: the same CI every time"
    assert ci["lo"] <= ci["median"] <= ci["hi"]
    assert 0.98 <= ci["lo"] and ci["hi"] <= 1.02 and ci["rounds"] == 40
    wide = gb.bootstrap_median_ci([[x] for x in (0.9, 1.1, 0.95, 1.05)])
    assert gb.step_verdict(wide) == "not resolved"
    assert gb.bootstrap_median_ci([]) is None


def _rank(losses, reserved, step):
    return {"ok": True, "losses": losses, "max_reserved": reserved, "max_allocated": reserved // 2,
            "modes": [], "lockstep_step_median_s": step}


def _job(alloc, ranks, iters, rank_steps):
    return {"alloc": alloc, "rc": 0, "timed_out": False, "ranks": ranks,
            "lockstep": {"iters": iters, "rank_step_s": rank_steps,
                         "job_step_s": [gb.job_step(s) for s in rank_steps]}}


def test_rows_and_table_of_a_lockstep_doc():
    L = ["0x1p+0", "0x1.8p+0", "0x1p-1", "0x1p-2"]
    iters = [3, 4]
    doc = {"gpus": 2, "config": "llama1b", "iters": 30, "warmup": 5, "wall_s": 60.0, "skipped": [],
           "lockstep_rounds": 2, "runs": {"ddp": {
               "native": _job("native", [_rank(L, 100, 1.0), _rank(L, 100, 1.0)], iters,
                              [[1.0, 1.1], [1.0, 1.1]]),
               # The trace job ran alone (3 iterations): losses compared over those.
               "trace": {"alloc": "trace", "rc": 0, "timed_out": False,
                         "ranks": [_rank(L[:3], 120, None), _rank(L[:3], 120, None)]},
               "expandable": _job("expandable", [_rank(L, 90, 1.02), _rank(L[:3] + ["0x1p-3"], 90, 1.0)],
                                  iters, [[1.02, 1.0], [1.02, 1.0]]),
               "native_aa": _job("native", [_rank(L, 100, 1.0), _rank(L, 100, 1.0)], iters,
                                 [[1.0, 1.1], [1.0, 1.1]]),
           }}}
    times = {k: dict(zip(iters, r["lockstep"]["job_step_s"]))
             for k, r in doc["runs"]["ddp"].items() if r.get("lockstep")}
    doc["lockstep"] = {"ddp": {"keys": ["native", "expandable", "native_aa"], "rounds_run": 2,
                               "start_iter": 3, "round_s": [3.0, 3.2], "failed": {},
                               "estimates": gb.lockstep_estimates(times)}}
    rows = {(r["alloc"], r["rank"]): r for r in gb.rows_of(doc)}
    assert rows[("trace", 0)]["losses_equal"] is True and rows[("trace", 0)]["losses_compared"] == 3
    assert "step_ratio" not in rows[("trace", 0)], "a job alone is not paired with the rounds"
    assert rows[("expandable", 0)]["step_ratio"] == pytest.approx(1.02)
    assert rows[("expandable", 1)]["step_ratio"] == pytest.approx(1.0 / 1.1)
    assert rows[("expandable", 1)]["losses_equal"] is False, "a different loss on rank 1"
    assert rows[("expandable", 0)]["reserved_vs_native"] == pytest.approx(0.9)
    assert rows[("native_aa", 0)]["step_ratio"] == pytest.approx(1.0)
    assert doc["lockstep"]["ddp"]["estimates"]["expandable"]["median"] == pytest.approx(1.02 / 1.1)
    doc["rows"] = gb.rows_of(doc)
    table = gb.render(doc)
    assert "native, 2nd job (A/A)" in table and "(base)" in table
    assert "0.927 [0.927, 0.927]" in table  # expandable: 1.02 / 1.1 in both rounds


# ------------------------------------------------------------------ worker side


def test_worker_warm_rule():
    w = dw.lockstep_warm
    assert not w(4, 5, 30, False, None, None) and w(5, 5, 30, False, None, None)
    assert not w(5, 5, 30, True, "auto (recording)", None), "auto: not before its switch"
    assert not w(8, 5, 30, True, "auto (plan)", 8), "the switch's next iteration is not yet the plan's"
    assert w(9, 5, 30, True, "auto (plan)", 8)
    assert w(6, 5, 30, True, "auto (online: moe)", None), "settled online: no switch to wait for"
    assert w(30, 5, 30, True, "auto (planning)", None), "ran out of --iters"


def test_worker_seat_matches_the_driver_seat(tmp_path):
    assert dw.lockstep_turn(1, env={}) is None
    seat = Seat("plan.r1", str(tmp_path))
    turn = dw.lockstep_turn(1, env={dw.LOCKSTEP_DIR_VAR: str(tmp_path), dw.LOCKSTEP_KEY_VAR: "plan"})
    try:
        turn.ready(7, "auto (plan)")
        assert seat.read_line(5.0) == "ready 7 auto_(plan)"
        seat.send("go")
        assert turn.command() == "go"
    finally:
        turn.close()
        seat.close()
    assert dw.LOCKSTEP_DIR_VAR == gb.dl.LOCKSTEP_DIR_VAR and dw.LOCKSTEP_KEY_VAR == gb.dl.LOCKSTEP_KEY_VAR


def test_concurrent_env_drops_shared_rendezvous_settings():
    env = gb.dl.concurrent_env({"PET_MASTER_PORT": "29500", "MASTER_PORT": "29500", "PATH": "/bin",
                                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "NCCL_NVLS_ENABLE": "0"})
    assert env == {"PATH": "/bin", "NCCL_NVLS_ENABLE": "0"}


# ------------------------------------------------------------------ orchestration


class FakeJob:
    """A job of `ranks` threads, each taking a rank's side with lockstep.Turn: `ready_at`
    free warm-up iterations, then one iteration per "go" (a sleep of `step_s`), recorded in
    `log` as (job, rank, iteration, start, end). `die_at`: rank `die_rank` leaves without a
    reply at that iteration (a crash; the job counts as exited, as torchrun does)."""

    def __init__(self, key, pipes, ranks, ready_at, step_s, log, die_at=None, die_rank=1):
        self.key, self.log = key, log
        self.seats = [Seat(f"{key}.r{r}", pipes) for r in range(ranks)]
        self.threads = [threading.Thread(target=self._rank, daemon=True,
                                         args=(r, os.path.join(pipes, f"{key}.r{r}"), ready_at,
                                               step_s * (1 + 0.2 * r), die_at if r == die_rank else None))
                        for r in range(ranks)]
        for t in self.threads:
            t.start()

    def _rank(self, rank, seat, i, step_s, die_at):
        turn = Turn(seat + ".cmd", seat + ".reply")
        turn.ready(i, "-")
        while turn.command() == "go":
            if die_at is not None and i >= die_at:
                break
            t0 = time.monotonic()
            time.sleep(step_s)
            t1 = time.monotonic()
            self.log.append((self.key, rank, i, t0, t1))
            # The nominal step time, not the measured one: on a loaded machine a sleep
            # overshoots by more than the 20 % that sets the ranks apart, and the tests
            # check the protocol's bookkeeping, not the clock.
            turn.done(i, step_s, "-")
            i += 1
        turn.close()

    def alive(self):
        return all(t.is_alive() for t in self.threads)

    def join(self, timeout=10.0):
        for t in self.threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self.threads)

    def close(self):
        for s in self.seats:
            s.close()


def _drive(tmp_path, specs, rounds, time_left=lambda: 1e9, **kw):
    log, msgs = [], []
    jobs = {key: FakeJob(key, str(tmp_path), 2, ready_at, step_s, log, **extra)
            for key, ready_at, step_s, extra in specs}
    try:
        out = gb.drive_lockstep({k: j.seats for k, j in jobs.items()}, {k: j.alive for k, j in jobs.items()},
                                rounds, time_left=time_left, ready_timeout=10.0, turn_timeout=5.0,
                                log=msgs.append, **kw)
        for j in jobs.values():
            assert j.join(), f"{j.key} did not leave on 'stop'"
    finally:
        for j in jobs.values():
            j.close()
    return out, log, msgs


def test_drive_rounds_one_job_at_a_time(tmp_path):
    specs = [("native", 5, 0.01, {}), ("expandable", 7, 0.015, {}), ("native_aa", 5, 0.01, {})]
    out, log, msgs = _drive(tmp_path, specs, rounds=6, progress_every=3)
    keys = ["native", "expandable", "native_aa"]
    assert out["failed"] == {} and out["stopped_early"] is None
    assert out["start_iter"] == 7, "the laggards caught up to the latest ready iteration"
    assert out["rounds_run"] == 6
    assert out["orders"] == [round_order(keys, r) for r in range(6)]
    for k in keys:
        assert sorted(out["times"][k]) == list(range(7, 13)), k
        for it, steps in out["rank_times"][k].items():
            assert len(steps) == 2 and out["times"][k][it] == max(steps)
            assert steps[1] > steps[0], "per-rank times kept apart (rank 1's fake is slower)"
    # The catch-up iterations (5, 6 of the native jobs) ran, untimed.
    assert {(k, r, i) for k, r, i, _, _ in log if i < 7} == {
        (k, r, i) for k in ("native", "native_aa") for r in (0, 1) for i in (5, 6)}
    # In the rounds, one job at a time: no two jobs' timed iterations overlap, both ranks of
    # a job ran each, and within a round the jobs ran in the round's order.
    timed = [x for x in log if x[2] >= 7]
    spans = {}
    for k, r, i, t0, t1 in timed:
        a, b = spans.get((k, i), (t0, t1))
        spans[(k, i)] = (min(a, t0), max(b, t1))
    assert len(spans) == 3 * 6 and len(timed) == 2 * 3 * 6
    ordered = sorted(spans.items(), key=lambda kv: kv[1][0])
    for (_, (_, end)), (_, (start, _)) in zip(ordered, ordered[1:]):
        assert start >= end, "a job started before the previous one's turn was over"
    for r, order in enumerate(out["orders"]):
        assert [k for (k, i), _ in ordered if i == 7 + r] == order
    assert any("round 3/6" in m for m in msgs) and any("round 6/6" in m for m in msgs)


def test_drive_goes_on_without_a_failed_job(tmp_path):
    specs = [("native", 5, 0.005, {}), ("plan", 5, 0.005, {"die_at": 7}), ("auto", 5, 0.005, {})]
    out, log, msgs = _drive(tmp_path, specs, rounds=5)
    assert set(out["failed"]) == {"plan"} and "round 2" in out["failed"]["plan"]
    assert sorted(out["times"]["plan"]) == [5, 6]
    assert sorted(out["times"]["native"]) == sorted(out["times"]["auto"]) == list(range(5, 10))
    assert all("plan" not in o for o in out["orders"][3:])
    assert set(gb.lockstep_estimates(out["times"])) == {"plan", "auto"}


def test_drive_stops_when_the_budget_runs_out(tmp_path):
    specs = [("native", 3, 0.005, {}), ("expandable", 3, 0.005, {})]
    # 30 s left and 30 s kept back: the first round runs, the next would not fit.
    out, log, msgs = _drive(tmp_path, specs, rounds=50, time_left=lambda: 30.0, reserve_s=30.0)
    assert out["rounds_run"] == 1 and out["stopped_early"].startswith("stopped after 1 of 50")
    assert out["failed"] == {}


def test_drive_when_a_job_never_gets_ready(tmp_path):
    log, msgs = [], []
    ok = FakeJob("native", str(tmp_path), 2, 4, 0.005, log)
    dead = [Seat(f"expandable.r{r}", str(tmp_path)) for r in range(2)]  # never started
    try:
        out = gb.drive_lockstep({"native": ok.seats, "expandable": dead},
                                {"native": ok.alive, "expandable": lambda: False}, 3,
                                time_left=lambda: 1e9, ready_timeout=5.0, turn_timeout=5.0,
                                log=msgs.append)
        assert ok.join()
    finally:
        ok.close()
        for s in dead:
            s.close()
    assert out["failed"]["expandable"].startswith("not ready: rank 0 exited")
    assert sorted(out["times"]["native"]) == [4, 5, 6] and out["rounds_run"] == 3
