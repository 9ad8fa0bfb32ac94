"""stweaver.step(key) and stweaver.iteration_key(key) without a GPU: what reaches the extension
(a fake that records calls; no torch needed), the keys' 64-bit labels, and the optimizer hook's
boundaries composing with a key given at the top of the loop body."""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import stweaver  # noqa: E402


class FakeExt:
    def __init__(self):
        self.calls = []

    def step(self):
        self.calls.append(("step",))

    def step_key(self, key):
        assert isinstance(key, int) and 0 <= key < 1 << 64
        self.calls.append(("step_key", key))

    def iteration_key(self, key):
        assert isinstance(key, int) and 0 <= key < 1 << 64
        self.calls.append(("iteration_key", key))


@pytest.fixture
def ext(monkeypatch):
    fake = FakeExt()
    monkeypatch.setattr(stweaver, "_ext", fake)
    monkeypatch.setattr(stweaver, "_settings", object())
    return fake


def test_step_without_a_key_is_the_plain_boundary(ext):
    stweaver.step()
    stweaver.step(None)
    assert ext.calls == [("step",), ("step",)]


def test_step_with_a_key_marks_one_boundary_with_its_label(ext):
    stweaver.step("eval")
    stweaver.step(128)
    stweaver.step(("len", 512))
    assert [c[0] for c in ext.calls] == ["step_key"] * 3
    assert ext.calls[1] == ("step_key", 128)
    # Equal keys, equal labels; different keys, different labels.
    stweaver.step("eval")
    assert ext.calls[3] == ext.calls[0]
    assert len({c[1] for c in ext.calls}) == 3


def test_iteration_key_labels_without_a_boundary(ext):
    stweaver.iteration_key("eval")
    stweaver.iteration_key(None)  # nothing
    assert ext.calls == [("iteration_key", stweaver._key_hash("eval"))]


def test_labels_are_stable_across_processes_for_plain_values():
    # str / bytes / int / float / tuples of them: the same label in another process (whose
    # str hashes are salted differently).
    keys = ["eval", b"x", 7, -1, 2.5, ("len", 512, None), True]
    here = [stweaver._key_hash(k) for k in keys]
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import stweaver; "
        f"print([stweaver._key_hash(k) for k in {keys!r}])"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code, os.path.join(os.path.dirname(__file__), "..")],
        capture_output=True, text=True, env=env, check=True,
    ).stdout
    assert eval(out) == here
    assert stweaver._key_hash(7) == 7 and stweaver._key_hash(-1) == (1 << 64) - 1
    assert all(0 <= h < 1 << 64 for h in here)
    # Another hashable: Python's hash, consistent with ==.
    assert stweaver._key_hash(frozenset({1, 2})) == stweaver._key_hash(frozenset({2, 1}))


def test_an_unhashable_key_is_refused_before_the_boundary(ext):
    with pytest.raises(TypeError, match="hashable"):
        stweaver.step(["eval"])
    with pytest.raises(TypeError, match="hashable"):
        stweaver.iteration_key({"len": 5})
    assert ext.calls == []


def test_keys_need_stweaver_installed(monkeypatch):
    monkeypatch.setattr(stweaver, "_settings", None)
    with pytest.raises(RuntimeError, match="not installed"):
        stweaver.step("eval")
    with pytest.raises(RuntimeError, match="not installed"):
        stweaver.iteration_key("eval")


def test_the_optimizer_hook_and_a_key_at_the_top_of_the_loop_compose(ext):
    # The hook marks the boundary after each optimizer step; the key given first thing in
    # the loop body labels the iteration that boundary began: one boundary per iteration.
    class Optimizer:
        pass

    hook = stweaver._optimizer_hook()
    opt = Optimizer()
    for bucket in (128, 256, 128):
        stweaver.iteration_key(("len", bucket))
        hook(opt, (), {})
    names = [c[0] for c in ext.calls]
    assert names == ["iteration_key", "step"] * 3
    assert ext.calls[0] == ext.calls[4] != ext.calls[2]
