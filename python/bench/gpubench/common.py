"""Paths and units shared by the benchmark's modules."""

from __future__ import annotations

import os


# python/bench (this package's parent), the repository, its python/ folder.
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


REPO = os.path.dirname(os.path.dirname(HERE))


PY_DIR = os.path.join(REPO, "python")
# The script every child process runs (`gpu_bench.py child READY`).
ENTRY = os.path.join(HERE, "gpu_bench.py")


GiB = float(1 << 30)


MiB = float(1 << 20)


def stweaver_stats(st) -> dict:
    """``st.stats()`` (stweaver's counters), or the error that stopped it: a run's report
    never loses its other numbers to it."""
    try:
        return st.stats()
    except Exception as e:  # report, do not lose the run
        return {"error": str(e)}
