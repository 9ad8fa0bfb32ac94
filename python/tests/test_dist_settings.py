"""Per-rank file names under torchrun, as the Python settings check them (no torch, no GPU).
The Rust side (crates/torch-bridge/src/dist.rs and tests/dist.rs) decides the names served."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from stweaver._settings import SettingsError, expand_rank, rank_of, rank_plan_path, resolve  # noqa: E402

R1 = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}


def test_rank_comes_from_torchrun_variables():
    assert rank_of({}) is None
    assert rank_of({"RANK": "0", "WORLD_SIZE": "1"}) is None
    assert rank_of(R1) == (1, 1)
    assert rank_of({"RANK": "5", "WORLD_SIZE": "8"}) == (5, 5)
    assert expand_rank("t.{rank}.{local_rank}.stwt", {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}) == "t.3.1.stwt"
    assert expand_rank("t.{rank}.stwt", {}) == "t.0.stwt"


def test_plan_placeholder_is_checked_per_rank(tmp_path):
    (tmp_path / "p.1.stwp").write_bytes(b"x")
    s = resolve("plan", plan=str(tmp_path / "p.{rank}.stwp"), env=R1)
    assert s.plan == str(tmp_path / "p.{rank}.stwp"), "the template is passed on; Rust expands it"
    with pytest.raises(SettingsError, match=r"p\.0\.stwp"):
        resolve("plan", plan=str(tmp_path / "p.{rank}.stwp"), env={**R1, "RANK": "0", "LOCAL_RANK": "0"})


def test_plan_per_rank_sibling_or_shared(tmp_path):
    shared = tmp_path / "p.stwp"
    mine = tmp_path / "p.rank1.stwp"
    mine.write_bytes(b"x")
    assert rank_plan_path(str(shared), R1) == str(mine)
    assert resolve("plan", plan=str(shared), env=R1).mode == "plan"
    mine.unlink()
    shared.write_bytes(b"x")
    assert rank_plan_path(str(shared), R1) == str(shared), "no per-rank file: shared"
    assert rank_plan_path(str(shared), {}) == str(shared)


def test_outputs_with_placeholders_check_their_folder(tmp_path):
    (tmp_path / "r1").mkdir()
    resolve("trace", trace=str(tmp_path / "r{rank}" / "t.stwt"), env=R1)
    with pytest.raises(SettingsError, match="folder"):
        resolve("trace", trace=str(tmp_path / "r{rank}" / "t.stwt"), env={})
