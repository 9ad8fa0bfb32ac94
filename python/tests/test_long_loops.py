"""long_loops.py (issue #18's long GPU loops): the table's drift and the driver's plumbing,
without torch (the children are faked by a script that writes a result file)."""

import json
import os
import sys

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
    assert set(ll.LOOPS) == {"len5", "len50", "eval10", "ckpt20", "moe"}
    assert len(set(ll.LOOPS["len50"]["lengths"])) == 50 and len(ll.LOOPS["len5"]["lengths"]) == 5
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
