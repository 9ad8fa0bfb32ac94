"""stweaver.pause / resume / region / paused without a GPU: the tag registry, nesting, and what
reaches the extension, through a fake extension that records calls (no torch needed)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import stweaver  # noqa: E402
from stweaver import _pause  # noqa: E402


class FakeExt:
    """Records calls; pauses are sets of keys per device, as the runtime keeps them."""

    def __init__(self):
        self.calls = []
        self.tag = 0
        self.paused = {}  # device -> [key]

    def set_tag(self, tag):
        self.calls.append(("set_tag", tag))
        self.tag = tag

    def pause(self, tag, keep, device):
        self.calls.append(("pause", tag, keep, device))
        d = 0 if device < 0 else device
        keys = self.paused.setdefault(d, [])
        if keys and (tag == 0 or 0 in keys or tag in keys):
            raise RuntimeError(f"stweaver.pause(): tag {tag} is already paused")
        keys.append(tag)
        return (1, 2, 4 << 20, (4 << 20) if keep else 0)

    def resume(self, tag, device):
        self.calls.append(("resume", tag, device))
        d = 0 if device < 0 else device
        keys = self.paused.get(d, [])
        hit = [k for k in keys if tag == 0 or k == tag]
        if not hit:
            raise RuntimeError(f"stweaver.resume(): tag {tag} is not paused")
        self.paused[d] = [k for k in keys if k not in hit]
        return (1, 2, 4 << 20, 4 << 20)

    def info_json(self):
        devices = [
            {"device": 0, "opened": True, "paused_bytes": (4 << 20) * len(self.paused.get(0, [])),
             "paused_tags": sorted(self.paused.get(0, []))},
            {"device": 1, "opened": False, "paused_bytes": 0, "paused_tags": []},
        ]
        return json.dumps({"devices": devices})


@pytest.fixture
def ext(monkeypatch):
    fake = FakeExt()
    monkeypatch.setattr(_pause, "_get_ext", lambda: fake)
    monkeypatch.setattr(_pause, "_ids", {})
    monkeypatch.setattr(_pause, "_names", {})
    monkeypatch.setattr(_pause, "_current", 0)
    return fake


def test_exported():
    for name in ("pause", "resume", "region", "paused"):
        assert name in stweaver.__all__
        assert getattr(stweaver, name) is getattr(_pause, name)


def test_names_map_to_ids_from_one(ext):
    assert _pause.tag_id("weights") == 1
    assert _pause.tag_id("kv") == 2
    assert _pause.tag_id("weights") == 1
    assert _pause.tag_name(2) == "kv"
    assert _pause.tag_name(0) is None
    with pytest.raises(ValueError):
        _pause.tag_id("")
    with pytest.raises(ValueError):
        _pause.tag_id(3)
    with pytest.raises(ValueError, match="no region"):
        _pause.tag_id("never", register=False)


def test_nested_regions_restore_the_outer_tag(ext):
    assert _pause.current_tag() is None
    with stweaver.region("weights") as w:
        assert ext.tag == w == 1
        with stweaver.region("kv") as k:
            assert ext.tag == k == 2
            assert _pause.current_tag() == "kv"
        assert ext.tag == 1
        assert _pause.current_tag() == "weights"
    assert ext.tag == 0
    assert [c[1] for c in ext.calls] == [1, 2, 1, 0]


def test_region_restores_the_tag_on_exceptions(ext):
    with pytest.raises(KeyError):
        with stweaver.region("weights"):
            raise KeyError("x")
    assert ext.tag == 0 and _pause.current_tag() is None


def test_pause_and_resume_pass_ids_and_report(ext):
    with stweaver.region("weights"):
        pass
    r = stweaver.pause("weights")
    assert r == {"blocks": 1, "units": 2, "bytes": 4 << 20, "copied": 4 << 20}
    assert ext.calls[-1] == ("pause", 1, True, -1)
    assert stweaver.paused() == {0: {"bytes": 4 << 20, "tags": ["weights"]}}
    with pytest.raises(RuntimeError, match="already paused"):
        stweaver.pause("weights")
    stweaver.resume("weights")
    assert ext.calls[-1] == ("resume", 1, -1)
    assert stweaver.paused() == {0: {"bytes": 0, "tags": []}}
    # Every region (tag 0), contents dropped, an explicit device.
    r = stweaver.pause(keep_contents=False, device=0)
    assert r["copied"] == 0 and ext.calls[-1] == ("pause", 0, False, 0)
    assert stweaver.paused()[0]["tags"] == [None]
    stweaver.resume(device=0)
    assert ext.calls[-1] == ("resume", 0, 0)


def test_unknown_region_is_refused_before_the_extension(ext):
    with pytest.raises(ValueError, match="no region"):
        stweaver.pause("nope")
    with pytest.raises(ValueError, match="no region"):
        stweaver.resume("nope")
    assert ext.calls == []


def test_not_installed_raises():
    if stweaver.is_installed():
        pytest.skip("stweaver is installed in this process")
    with pytest.raises(RuntimeError, match="not installed"):
        stweaver.pause()
