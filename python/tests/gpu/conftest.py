"""GPU suite: installs stweaver in this pytest process before anything touches CUDA, collects
per-test metrics, and writes a summary table (printed last by scripts/gpu_test.sh).

Environment: STWEAVER_TEST_MODE (default "online"), STWEAVER_SUMMARY (table path, default
$OUT/summary.txt or ./gpu_summary.txt), STWEAVER_TEST_INSTALLED=1 (test the installed
stweaver, as scripts/gpu_test.sh does with the wheel it builds: the checkout's python/ is not
put on sys.path, here nor in the subprocesses of test_subprocess.py, and a stweaver imported
from it is an error). Skips everything cleanly without a GPU.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

PY_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
INSTALLED = os.environ.get("STWEAVER_TEST_INSTALLED") == "1"
if not INSTALLED and PY_DIR not in sys.path:
    sys.path.insert(0, PY_DIR)


def _stweaver_origin() -> str:
    """Where `import stweaver` resolves (without importing it), for the summary."""
    import importlib.util

    spec = importlib.util.find_spec("stweaver")
    if spec is None or spec.origin is None:
        return "stweaver not importable"
    where = os.path.dirname(os.path.realpath(spec.origin))
    if where.startswith(os.path.realpath(PY_DIR) + os.sep):
        return f"stweaver from the checkout ({where})"
    return f"stweaver installed ({where})"


STWEAVER_ORIGIN = _stweaver_origin()
if INSTALLED and not STWEAVER_ORIGIN.startswith("stweaver installed"):
    raise RuntimeError(f"STWEAVER_TEST_INSTALLED=1, but {STWEAVER_ORIGIN}")

torch = pytest.importorskip("torch")

# Device count only: does not run torch's lazy CUDA init (the allocator can still be swapped).
HAVE_GPU = torch.cuda.is_available()
INSTALL_ERROR = None
if HAVE_GPU:
    import stweaver

    try:
        stweaver.install(os.environ.get("STWEAVER_TEST_MODE", "online"))
    except Exception as e:  # reported by every test, not a collection crash
        INSTALL_ERROR = e

_results: dict = {}
_metrics: dict = {}
_started = time.time()


HERE = os.path.dirname(os.path.abspath(__file__))


def _is_gpu_test(nodeid_or_path: str) -> bool:
    return "tests/gpu/" in nodeid_or_path.replace(os.sep, "/")


def pytest_collection_modifyitems(config, items):
    if not HAVE_GPU:
        skip = pytest.mark.skip(reason="no CUDA GPU")
        for it in items:
            if str(it.fspath).startswith(HERE):
                it.add_marker(skip)


@pytest.fixture(autouse=True)
def _installed(request):
    if INSTALL_ERROR is not None and str(request.node.fspath).startswith(HERE):
        pytest.fail(f"stweaver.install() failed: {INSTALL_ERROR}")
    yield


@pytest.fixture
def metric(request):
    """metric(name, value): a number to show in the summary table for this test."""

    def record(name, value):
        _metrics.setdefault(request.node.name, {})[name] = value

    return record


def pytest_runtest_logreport(report):
    if not _is_gpu_test(report.nodeid):
        return
    name = report.nodeid.split("::")[-1]
    if report.when == "call" or report.outcome != "passed":
        prev = _results.get(name)
        if prev is None or prev[0] == "passed":
            _results[name] = (report.outcome, report.duration)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def summary_table() -> str:
    lines = []
    w = max([len(n) for n in _results] + [10])
    lines.append(f"{'test'.ljust(w)}  result   time(s)  metrics")
    lines.append("-" * (w + 40))
    for name, (outcome, dur) in _results.items():
        m = ", ".join(f"{k}={_fmt(v)}" for k, v in _metrics.get(name, {}).items())
        lines.append(f"{name.ljust(w)}  {outcome:<7}  {dur:7.2f}  {m}")
    n_pass = sum(1 for o, _ in _results.values() if o == "passed")
    n_fail = sum(1 for o, _ in _results.values() if o == "failed")
    n_skip = sum(1 for o, _ in _results.values() if o == "skipped")
    lines.append("-" * (w + 40))
    dev = torch.cuda.get_device_name(0) if HAVE_GPU else "no GPU"
    lines.append(
        f"{n_pass} passed, {n_fail} failed, {n_skip} skipped in {time.time() - _started:.1f} s "
        f"on {dev}, torch {torch.__version__}"
    )
    lines.append(STWEAVER_ORIGIN)
    return "\n".join(lines) + "\n"


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("OUT")
    path = os.environ.get("STWEAVER_SUMMARY") or (
        os.path.join(out, "summary.txt") if out else "gpu_summary.txt"
    )
    table = summary_table()
    try:
        with open(path, "w") as f:
            f.write(table)
        with open(os.path.splitext(path)[0] + ".json", "w") as f:
            json.dump({"results": _results, "metrics": _metrics}, f, indent=1)
    except OSError as e:
        print(f"could not write the summary to {path}: {e}")


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_sep("=", "stweaver GPU summary")
    terminalreporter.write(summary_table())
