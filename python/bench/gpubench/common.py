"""Paths and units shared by the benchmark's modules."""

from __future__ import annotations

import json
import os
from typing import Optional


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


def write_json(path: str, doc, indent: Optional[int] = 1) -> None:
    """Writes ``doc`` to ``path`` whole or not at all (a ``.tmp`` beside it, then renamed):
    a benchmark killed mid-write leaves its last complete results."""
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=indent)
    os.replace(path + ".tmp", path)


def write_table(out_dir: str, stem: str, table: str) -> str:
    """The benchmark's short table as ``<out_dir>/<stem>.txt``; its path."""
    path = os.path.join(out_dir, stem + ".txt")
    with open(path, "w") as f:
        f.write(table + "\n")
    return path
