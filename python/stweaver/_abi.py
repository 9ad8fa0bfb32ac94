"""The torch ABI guard of an installed stweaver (``pip install --no-build-isolation .``).

The C++ extension is compiled against one torch's headers and linked against its
libraries; under another torch it would fail to load with an undefined symbol at best and
corrupt memory at worst. The build records that torch in ``stweaver/_build_info.py``
(written by setup.py, absent from a source checkout); importing ``stweaver`` compares it
with the torch installed now (from its package metadata, without importing torch), and
loading the extension compares it again with the imported ``torch.__version__`` (which
carries the CUDA tag, e.g. ``2.11.0+cu130``). A mismatch raises
:class:`TorchVersionMismatch` naming both versions and the rebuild command.

A source checkout (no ``_build_info``) builds its extension itself and is not guarded
here (``_build.py`` rebuilds when the torch changes).
"""

from __future__ import annotations

import importlib.metadata
from typing import Optional

REBUILD_COMMAND = "pip install --no-build-isolation --force-reinstall ."


class TorchVersionMismatch(ImportError):
    """The installed stweaver was built against another torch than the one present."""


def _split(version: str) -> tuple[str, Optional[str]]:
    public, _, local = version.strip().partition("+")
    return public, (local or None)


def same_torch(built: str, running: str) -> bool:
    """Whether an extension built against torch `built` may load under torch `running`.

    The public versions must be equal (the C++ ABI changes between releases, even between
    nightlies); the local tags (``+cu130``, ``+cpu``: which CUDA) must be equal when both
    are known. Package metadata has no local tag for PyPI's default wheels while
    ``torch.__version__`` has one, so a missing tag matches any.
    """
    b_pub, b_local = _split(built)
    r_pub, r_local = _split(running)
    if b_pub != r_pub:
        return False
    return b_local is None or r_local is None or b_local == r_local


def mismatch_message(built: str, running: Optional[str]) -> str:
    now = f"torch {running} is installed" if running else "no torch is installed"
    return (
        f"stweaver was built against torch {built}, but {now}: its C++ extension cannot be "
        f"loaded under another torch. Rebuild it against this torch, from the stweaver "
        f"source directory: `{REBUILD_COMMAND}`"
    )


def check(built: str, running: Optional[str]) -> None:
    """Raises :class:`TorchVersionMismatch` unless torch `running` matches `built`."""
    if running is None or not same_torch(built, running):
        raise TorchVersionMismatch(mismatch_message(built, running))


def installed_torch_version() -> Optional[str]:
    """The version of the installed torch distribution (no import of torch), or None."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def built_torch_version() -> Optional[str]:
    """The torch this installed stweaver was built against; None in a source checkout."""
    try:
        from . import _build_info  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _build_info.TORCH_VERSION


def check_installed() -> None:
    """The import-time guard: an installed stweaver under the torch it was built for."""
    built = built_torch_version()
    if built is not None:
        check(built, installed_torch_version())
