"""long_loops.py (issue #18's long GPU loops): the table's drift, the driver's plumbing and
budget (the children faked by a script that writes a result file), the report's targets (on
the measured H100 runs too), and the dry run end to end (real tiny CPU children: torch and
transformers)."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import long_loops as ll  # noqa: E402

GIB = 1 << 30


def test_table_reports_drift_from_iteration_20_to_the_end():
    r = {"loop": "len5", "alloc": "auto", "ok": True, "reserved": [GIB] * 19 + [2 * GIB] + [2 * GIB] * 179 + [3 * GIB],
         "max_reserved": 3 * GIB, "max_allocated": GIB, "modes": ["auto (plan)"]}
    t = ll.table([r])
    row = t.splitlines()[-1]
    assert "| len5 | auto | 2.000 | 3.000 | +50.00 % | 3.000 | 1.000 | auto (plan) |" == row


def test_table_names_a_failed_run_and_a_short_one():
    t = ll.table([{"loop": "moe", "alloc": "native", "ok": False, "error": "OOM: out of memory", "reserved": [GIB]}])
    assert "OOM: out of memory" in t and "| - |" in t


def test_every_loop_is_defined_and_unknown_names_are_refused(tmp_path):
    assert set(ll.LOOPS) == {"len5", "len50", "len5new", "eval10", "ckpt20", "moe"}
    assert len(set(ll.LOOPS["len50"]["lengths"])) == 50 and len(ll.LOOPS["len5"]["lengths"]) == 5
    # len5new: len5's lengths, then lengths never seen before from iteration 60 (#18 item 2).
    new = ll.LOOPS["len5new"]
    assert new["lengths"] == ll.LOOPS["len5"]["lengths"]
    assert not set(new["late_lengths"]) & set(new["lengths"]) and max(new["late_lengths"]) == new["max_seq"]
    try:
        ll.main(["--out", str(tmp_path), "--loops", "nope", "--allocs", "native"])
    except SystemExit as e:
        assert "unknown loop" in str(e)
    else:
        raise AssertionError("an unknown loop was accepted")


def test_driver_collects_children_and_gzips_traces(tmp_path, monkeypatch):
    # Each "child" writes the result file the driver reads, with a trace file for the trace run.
    fake = tmp_path / "fake_child.py"
    fake.write_text(
        "import json, os, sys\n"
        "a = sys.argv\n"
        "lp, al = a[a.index('--child') + 1], a[a.index('--child') + 2]\n"
        "out = a[a.index('--out') + 1]\n"
        "r = {'loop': lp, 'alloc': al, 'ok': True, 'reserved': [1 << 30] * 25, 'modes': []}\n"
        "if al == 'trace':\n"
        "    p = os.path.join(out, 'trace_' + lp + '.stwt'); open(p, 'wb').write(b'x' * 100)\n"
        "    r['trace_files'] = [p]\n"
        "json.dump(r, open(os.path.join(out, lp + '_' + al + '.json'), 'w'))\n")
    monkeypatch.setattr(ll.os.path, "abspath", lambda p, _real=os.path.abspath: str(fake) if p == ll.__file__ else _real(p))
    rc = ll.main(["--out", str(tmp_path / "o"), "--loops", "len5,eval10", "--allocs", "native,trace", "--parallel", "3"])
    assert rc == 0
    res = json.load(open(tmp_path / "o" / "long_loops.json"))["results"]
    assert [(r["loop"], r["alloc"]) for r in res] == [("len5", "native"), ("len5", "trace"),
                                                       ("eval10", "native"), ("eval10", "trace")]
    assert sorted(os.listdir(tmp_path / "o" / "traces")) == ["trace_eval10.stwt.gz", "trace_len5.stwt.gz"]


def _fake_child(tmp_path, body: str):
    """A script standing in for the child: `body` runs with lp, al, out set; then the result
    file is written (unless body returned)."""
    fake = tmp_path / "fake_child.py"
    fake.write_text(
        "import json, os, sys, time\n"
        "a = sys.argv\n"
        "lp, al = a[a.index('--child') + 1], a[a.index('--child') + 2]\n"
        "out = a[a.index('--out') + 1]\n" + body + "\n"
        "json.dump({'loop': lp, 'alloc': al, 'ok': True, 'reserved': [1 << 30] * 25},"
        " open(os.path.join(out, lp + '_' + al + '.json'), 'w'))\n")
    return fake


def _use_fake(monkeypatch, fake):
    monkeypatch.setattr(ll.os.path, "abspath", lambda p, _real=os.path.abspath: str(fake) if p == ll.__file__ else _real(p))


def test_budget_skips_runs_that_would_not_fit_and_stops_those_still_going(tmp_path, monkeypatch):
    # Each run takes ~1.5 s; with a 2.5 s budget and one at a time the second would end past it.
    _use_fake(monkeypatch, _fake_child(tmp_path, "time.sleep(1.5)"))
    out, work = tmp_path / "o", tmp_path / "w"
    rc = ll.main(["--out", str(out), "--work", str(work), "--loops", "moe", "--allocs", "native,expandable,auto",
                  "--parallel", "1", "--budget-s", "2.5"])
    assert rc == 1
    res = json.load(open(out / "long_loops.json"))["results"]
    assert [r["ok"] for r in res] == [True, False, False]
    assert all("skipped: the budget" in r["error"] for r in res[1:])
    assert "skipped: the budget" in (out / "table.txt").read_text()
    # --work keeps the per-run files out of --out.
    assert sorted(os.listdir(out)) == ["long_loops.json", "table.txt"]
    assert "moe_native.json" in os.listdir(work)

    # A run still going at the budget is stopped, and said so; the JSON is still written.
    _use_fake(monkeypatch, _fake_child(tmp_path, "print('still training', flush=True); time.sleep(60)"))
    rc = ll.main(["--out", str(out), "--work", str(work), "--loops", "moe", "--allocs", "native",
                  "--budget-s", "1"])
    assert rc == 1
    (r,) = json.load(open(out / "long_loops.json"))["results"]
    assert not r["ok"] and "stopped at the budget" in r["error"] and r["driver_wall_s"] < 30


def _run(loop, alloc, reserved, max_reserved, max_allocated, ok=True, modes=None):
    return {"loop": loop, "alloc": alloc, "ok": ok, "iters": len(reserved), "reserved": reserved,
            "max_reserved": max_reserved, "max_allocated": max_allocated, "modes": modes or []}


def test_targets_met_and_missed():
    exp = _run("eval10", "expandable", [2 * GIB] * 200, 2 * GIB, GIB)
    # At the lower bound, flat, never above expandable: all three met.
    t = ll.check_targets(_run("eval10", "auto", [GIB] * 200, GIB, GIB), exp, GIB)
    assert [t[k][0] for k in ("peak", "drift", "vs_expandable")] == [True, True, True]
    # 2 % over the bound, +1 % drift from iteration 20, above expandable after iteration 20 and 151..200.
    res = [GIB] * 150 + [int(2.04 * GIB)] * 50
    res[19] = int(2.02 * GIB)
    t = ll.check_targets(_run("eval10", "auto", res, int(2.04 * GIB), GIB), exp, 2 * GIB)
    assert t["peak"] == (False, "1.020 x")
    assert t["drift"][0] is False and t["drift"][1].startswith("+0.99 %")
    assert t["vs_expandable"] == (False, "above at 51 of 200 (first after iteration 20, worst +2.0 %)")
    # A failed run or a short one is not judged; nor is a run without its expandable run.
    t = ll.check_targets({"ok": False, "error": "OOM: out of memory"}, exp, GIB)
    assert t["peak"] == (None, "run failed: OOM: out of memory")
    t = ll.check_targets(_run("eval10", "auto", [GIB] * 10, GIB, GIB) | {"iters": 200}, None, GIB)
    assert t["drift"] == (None, "10 of 200 iterations recorded") and t["vs_expandable"][0] is None


def test_report_on_the_measured_h100_loops():
    # The last GPU numbers (session 14, with the cursor's restarts; len5 in session 15 with
    # plans per iteration class; len5new in session 16; auto zero-code and auto with phase
    # markers): len50's and len5new's lengths grow after iteration 20, every other target met.
    gt = os.path.join(os.path.dirname(__file__), "..", "..", "data", "traces", "long", "gpu_ground_truth.json")
    md = ll.report([gt], stweaver_bin=None)
    rows = {}
    for line in md.splitlines():
        if line.startswith("| ") and line.split(" | ")[1].startswith("auto") and "device calls" not in line:
            rows.setdefault(line.split(" | ")[0].strip("| "), []).append(line)
    assert set(rows) == {"len5", "len50", "len5new", "eval10", "ckpt20", "moe"}
    # Zero code and phases marked; len5new (session 16) zero code only.
    assert all(len(v) == 2 for k, v in rows.items() if k != "len5new") and len(rows["len5new"]) == 1
    for line in rows["len5"]:
        assert "met: 1.001 x" in line and "met: +0.04 %" in line
    for line in rows["len50"]:
        assert "met: 1.001 x" in line and "**missed**: +26.88 % (expandable +27.12 %)" in line
    for name in ("len5", "eval10", "ckpt20", "moe"):
        assert all("**missed**" not in line for line in rows[name]), rows[name]
    assert "met: 1.006 x" in rows["eval10"][0]
    # len5new: lengths first seen after the switch, learned (1.002 x); its lengths grow
    # from iteration 60 on by design, so its drift is missed as len50's.
    assert "met: 1.002 x" in rows["len5new"][0] and "**missed**: +23.27 %" in rows["len5new"][0]
    assert "Targets met: 30 of 33." in md
    # Its auto and online rows came from different device calls: no step-time ratio.
    assert "| len5new | auto and online ran in different device calls" in md
    assert "least peak allocated" in md  # no CLI given: the stand-in bound, marked


def test_report_merges_files_and_names_the_lower_bound_source(tmp_path):
    a = {"iters": 20, "results": [_run("moe", "expandable", [2 * GIB] * 20, 2 * GIB, GIB),
                                  _run("moe", "auto", [3 * GIB] * 20, 3 * GIB, GIB)]}
    b = {"iters": 20, "results": [_run("moe", "auto", [GIB] * 20, GIB, GIB, modes=["auto (plan)"])]}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    md = ll.report([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    row = [line for line in md.splitlines() if line.startswith("| moe")][0]
    assert row == ("| moe | auto (zero code) | 1.000* | - | 2.000 | 1.000 | met: 1.000 x | met: +0.00 % "
                   "(expandable +0.00 %) | met: 20 of 20 iterations | plan |")
    assert "Targets met: 3 of 3." in md and "DRY RUN" not in md


def test_dry_run_end_to_end(tmp_path):
    """The CPU path of `cargo xtask gpu-bench --long-loops --dry-run`: real children (tiny
    models), then the report over their JSON."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "o"
    script = os.path.join(os.path.dirname(__file__), "..", "bench", "long_loops.py")
    # Two children (each imports torch and transformers: ~10 s); `cargo xtask gpu-bench
    # --long-loops --dry-run` runs every loop.
    p = subprocess.run([sys.executable, script, "--dry-run", "--out", str(out), "--iters", "21", "--loops",
                        "eval10", "--allocs", "expandable,auto", "--parallel", "2"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.load(open(out / "long_loops.json"))
    assert doc["dry_run"] and [(r["loop"], r["alloc"], r["ok"]) for r in doc["results"]] == [
        ("eval10", "expandable", True), ("eval10", "auto", True)]
    ev = doc["results"][1]
    assert len(ev["reserved"]) == 21 and ev["events"] == [[9, "eval"], [19, "eval"]]
    assert (out / "table.txt").read_text().count("| eval10 |") == 2
    md = ll.report([str(out / "long_loops.json")])
    assert md.startswith("**DRY RUN**") and "Targets met: 3 of 3." in md


def test_planning_window_compares_the_iterations_that_began_while_planning():
    modes = ["auto (recording)"] * 3 + ["auto (planning)"] * 3 + ["plan"] * 4
    auto = {"loop": "eval10", "alloc": "auto", "ok": True, "modes": modes,
            "step_s": [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 1.1, 1.1, 1.1]}
    online = {"loop": "eval10", "alloc": "online", "ok": True, "step_s": [1.0] * 10}
    aa = {"loop": "eval10", "alloc": "online_aa", "ok": True, "step_s": [1.0] * 9 + [1.5]}
    runs = {("eval10", "auto"): auto, ("eval10", "online"): online, ("eval10", "online_aa"): aa}
    text = "\n".join(ll.planning_window(runs))
    # Iterations 5-7 (1-based) began while the plan was being made: 2.0 s against 1.0 s.
    assert "| eval10 | 5-7 (3) | 2000.0 vs 1000.0 | 2.000 / 2.000 | 1.000 / 1.000 | 1.100 / 1.100 |" in text
    # Without an online run there is nothing to compare against.
    assert ll.planning_window({("eval10", "auto"): auto}) == []
