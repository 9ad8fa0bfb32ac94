"""The extension without a GPU: builds against the installed torch, imports, installs as the
CUDA allocator without initialising CUDA, and reports bad input clearly.

Skipped (cleanly) when torch is not importable or the Rust staticlib is not built
(`cargo build --release -p stweaver-torch`). Each check runs in a fresh interpreter, since
installing an allocator is once per process.
"""

import os
import subprocess
import sys
import textwrap

import pytest

PY_DIR = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, PY_DIR)

torch = pytest.importorskip("torch")

from stweaver import _build  # noqa: E402

try:
    _build.native_parts()
except _build.BuildError as e:  # pragma: no cover - depends on the checkout
    pytest.skip(f"Rust side not built: {e}", allow_module_level=True)


def run_py(code: str, tmp_path, extra_env=None, args=()):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.abspath(PY_DIR) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("STWEAVER_BUILD_DIR", str(tmp_path / "ext"))
    env.pop("STWEAVER_MODE", None)
    env.update(extra_env or {})
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run(
        [sys.executable, *args, str(script)], env=env, capture_output=True, text=True, timeout=900
    )


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("stweaver-ext")


def test_build_install_and_errors(build_dir, tmp_path):
    r = run_py(
        """
        import torch, stweaver
        from stweaver._build import load_extension
        ext = load_extension()
        assert not torch.cuda.is_initialized(), "building initialised CUDA"
        try:
            ext.install("fast", "", "")
            raise SystemExit("bad mode accepted")
        except RuntimeError as e:
            assert "unknown mode" in str(e), e
        assert not stweaver.is_installed()
        s = stweaver.install("online", hook_optimizer=True)
        assert stweaver.install("online", hook_optimizer=True) == s
        try:
            stweaver.install("trace", trace="t.stwt")
            raise SystemExit("reinstall with other settings accepted")
        except RuntimeError as e:
            assert "already installed" in str(e), e
        assert torch.cuda.memory.get_allocator_backend() == "stweaver"
        assert not torch.cuda.is_initialized()
        stweaver.step()
        with stweaver.phase("eval"):
            pass
        st = stweaver.stats()
        assert st["mode"] == "online" and st["iterations"] == 1 and st["failed_frees"] == 0, st
        try:
            stweaver.flush_trace()
            raise SystemExit("flush_trace accepted in online mode")
        except RuntimeError as e:
            assert "not recording" in str(e), e
        print("OK")
        """,
        tmp_path,
        {"STWEAVER_BUILD_DIR": str(build_dir)},
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_run_module_installs_before_the_script(build_dir, tmp_path):
    r = run_py(
        """
        import sys, torch, stweaver
        assert stweaver.is_installed()
        assert torch.cuda.memory.get_allocator_backend() == "stweaver"
        print("ARGS", sys.argv[1:])
        """,
        tmp_path,
        {"STWEAVER_BUILD_DIR": str(build_dir)},
        args=("-m", "stweaver", "run"),
    )
    # `python -m stweaver run probe.py` (script path appended by run_py).
    assert r.returncode == 0 and "ARGS []" in r.stdout, r.stdout + r.stderr
    assert "serving" in r.stderr and "auto mode" in r.stderr, r.stderr


def test_a_bad_plan_is_served_online_with_a_warning(build_dir, tmp_path):
    r = run_py(
        """
        import warnings, torch, stweaver
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            stweaver.install("plan", plan=__file__)
        assert stweaver.mode().startswith("online (plan rejected:"), stweaver.mode()
        assert any("plan rejected" in str(x.message) for x in w), [str(x.message) for x in w]
        assert torch.cuda.memory.get_allocator_backend() == "stweaver"
        print("OK")
        """,
        tmp_path,
        {"STWEAVER_BUILD_DIR": str(build_dir)},
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_setup_py_prebuilt_layout(tmp_path):
    """setup.py's STWEAVER_PREBUILT (the GPU machines build the wheel from the carry, no
    cargo): a complete folder is taken as is, a missing file is named with its path."""
    setup_py = os.path.join(PY_DIR, "..", "setup.py")
    env = dict(os.environ, CARGO="/nonexistent/cargo", TORCH_CUDA_ARCH_LIST="9.0")
    parts = _build.native_parts()
    pre = tmp_path / "prebuilt"
    (pre / "cli").mkdir(parents=True)
    (pre / "libstweaver_torch.a").symlink_to(parts.staticlib)
    (pre / "cxxbridge").symlink_to(parts.cxxbridge, target_is_directory=True)
    (pre / "cli" / "stweaver").write_bytes(b"")

    def setup_name():
        return subprocess.run(
            [sys.executable, setup_py, "--name"],
            env=dict(env, STWEAVER_PREBUILT=str(pre)),
            cwd=os.path.dirname(setup_py),
            capture_output=True,
            text=True,
            timeout=300,
        )

    r = setup_name()
    assert r.returncode == 0 and "no cargo build" in r.stdout, r.stdout + r.stderr
    (pre / "cli" / "stweaver").unlink()
    (pre / "cxxbridge").unlink()
    r = setup_name()
    assert r.returncode != 0, r.stdout + r.stderr
    for missing in ("cxxbridge/rust/cxx.h", "cli/stweaver"):
        assert str(pre / missing) in r.stderr, r.stderr
    assert str(pre / "libstweaver_torch.a") not in r.stderr.split("lacks")[1].split(". It")[0]
