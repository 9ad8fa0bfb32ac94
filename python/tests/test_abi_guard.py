"""The torch ABI guard of an installed stweaver (python/stweaver/_abi.py), without a GPU or
torch: the comparison itself, and `import stweaver` of a package copy carrying a
`_build_info.py` under a stand-in torch distribution (only its metadata: the guard reads
the installed version without importing torch)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "stweaver"
sys.path.insert(0, str(PKG.parent))

from stweaver import _abi  # noqa: E402


@pytest.mark.parametrize(
    "built,running",
    [
        ("2.11.0", "2.11.0"),
        ("2.11.0+cu130", "2.11.0+cu130"),
        ("2.11.0+cu130", "2.11.0"),  # package metadata of PyPI's default wheel: no tag
        ("2.11.0", "2.11.0+cu130"),
        ("2.12.0.dev20260101+cu130", "2.12.0.dev20260101+cu130"),
    ],
)
def test_same_torch_accepts(built, running):
    assert _abi.same_torch(built, running)
    _abi.check(built, running)


@pytest.mark.parametrize(
    "built,running",
    [
        ("2.11.0", "2.12.0"),
        ("2.11.0+cu130", "2.11.1+cu130"),
        ("2.11.0+cu130", "2.11.0+cu126"),  # another CUDA build of the same release
        ("2.11.0+cu130", "2.11.0+cpu"),
        ("2.12.0.dev20260101", "2.12.0.dev20260102"),
    ],
)
def test_same_torch_refuses(built, running):
    assert not _abi.same_torch(built, running)
    with pytest.raises(_abi.TorchVersionMismatch) as e:
        _abi.check(built, running)
    msg = str(e.value)
    assert built in msg and running in msg
    assert _abi.REBUILD_COMMAND in msg
    assert isinstance(e.value, ImportError)


def test_no_torch_is_a_mismatch():
    with pytest.raises(_abi.TorchVersionMismatch, match="no torch is installed"):
        _abi.check("2.11.0", None)


def test_rebuild_command_is_the_install_command():
    assert _abi.REBUILD_COMMAND == "pip install --no-build-isolation --force-reinstall ."


def test_built_version_comes_from_build_info():
    # A source checkout has no _build_info.py (setup.py writes it into the build; only
    # `setup.py build_ext --inplace` puts one here): then nothing is guarded.
    info = PKG / "_build_info.py"
    if info.exists():
        ns: dict = {}
        exec(info.read_text(), ns)
        assert _abi.built_torch_version() == ns["TORCH_VERSION"]
    else:
        assert _abi.built_torch_version() is None
        _abi.check_installed()  # no error


def _installed_copy(tmp_path: pathlib.Path, built: str) -> pathlib.Path:
    site = tmp_path / "site"
    shutil.copytree(PKG, site / "stweaver", ignore=shutil.ignore_patterns("__pycache__", "_C*"))
    (site / "stweaver" / "_build_info.py").write_text(
        f'TORCH_VERSION = "{built}"\nTORCH_CUDA = "13.0"\nPYTHON = "3.11"\nCXX11_ABI = True\n'
    )
    return site


def _fake_torch(tmp_path: pathlib.Path, version: str) -> pathlib.Path:
    d = tmp_path / f"torch-{version}" / f"torch-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    return d.parent


def _import(paths) -> subprocess.CompletedProcess:
    # -S: no site-packages, so a real torch in this interpreter cannot answer instead.
    code = f"import sys; sys.path[:0] = {[str(p) for p in paths]!r}; import stweaver; print('ok')"
    return subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True)


def test_import_under_another_torch_names_both_versions_and_the_fix(tmp_path):
    site = _installed_copy(tmp_path, "2.11.0+cu130")
    r = _import([site, _fake_torch(tmp_path, "2.12.0")])
    assert r.returncode != 0
    assert "TorchVersionMismatch" in r.stderr
    assert "built against torch 2.11.0+cu130" in r.stderr
    assert "torch 2.12.0 is installed" in r.stderr
    assert "pip install --no-build-isolation --force-reinstall ." in r.stderr


def test_import_under_the_same_torch_works(tmp_path):
    site = _installed_copy(tmp_path, "2.11.0+cu130")
    r = _import([site, _fake_torch(tmp_path, "2.11.0")])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_import_without_torch_says_so(tmp_path):
    site = _installed_copy(tmp_path, "2.11.0+cu130")
    r = _import([site])
    assert r.returncode != 0
    assert "no torch is installed" in r.stderr
