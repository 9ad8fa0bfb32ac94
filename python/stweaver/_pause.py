"""Pause / resume: give a process's GPU memory back to the driver and take it again, with
every address kept (issue #17) -- for sharing one GPU between, e.g., an RL rollout engine
and a trainer, as ``torch_memory_saver`` does.

    import stweaver
    stweaver.install()
    with stweaver.region("kv_cache"):
        cache = torch.empty(n, device="cuda")   # allocations of the region carry its tag
    stweaver.pause("kv_cache")                   # physical memory goes back to the driver
    ...                                          # another model uses it
    stweaver.resume("kv_cache")                  # same addresses, same contents

What happens to the tensors
===========================
A paused tensor keeps its address (its storage, and any CUDA graph that captured it, stay
valid) and keeps counting as allocated (``torch.cuda.memory_allocated()``), but the memory
behind it is unmapped: ``torch.cuda.memory_reserved()`` drops by the paused bytes.
**Do not touch a paused tensor's memory on the GPU** (no kernel, copy or graph replay that
reads or writes it) until it is resumed: the access is an illegal-address fault the CUDA
driver reports, which poisons the CUDA context. Keep paused tensors alive until resumed:
stweaver refuses to free a paused block, so a tensor dropped while paused fails its free
(reported on stderr, counted in ``stweaver.stats()["failed_frees"]``) and its memory stays
allocated for the rest of the process. With ``keep_contents=True`` (the default) the bytes are
copied to host memory at pause and back at resume; with ``False`` the contents after
resume are undefined (cheaper, for caches rebuilt anyway).

Host memory for kept contents
=============================
The copies go through page-locked (pinned) host memory, at the PCIe link's speed: one
buffer per paused run of mapping units, as large as the live bytes in it. A resume keeps
the buffers (still pinned) for the next pause of the same tag, which reuses them instead
of pinning new memory, so a tag paused and resumed over and over pays for pinning once.
So after a kept-contents pause of a tag, about as much host memory as its live bytes
stays pinned until the process ends (``torch.cuda.empty_cache()`` does not free it);
a later pause of the tag with fewer bytes frees what it no longer needs. Pausing every
tag at once (``pause()``) keeps buffers of its own. If the host cannot pin more memory,
the pause copies to ordinary memory instead (slower, never an error).
``stweaver.stats()["devices"][i]["host_backup"]`` tells the bytes held (``in_use_bytes``
by paused tensors, ``cached_bytes`` kept for the next pause, ``pinned_bytes`` of both),
the buffers allocated and the fallbacks to ordinary memory.

Tags
====
Every allocation carries the tag current when it is made: 0 (untagged, never paused) outside
any region, the region's id inside ``with stweaver.region(name)``. Names map to ids >= 1
through a process-wide registry (the first region of a name registers it). The tag is
process-wide (every thread, every device and pool), like ``torch_memory_saver``'s region;
nested regions restore the outer tag when they end. Blocks of different tags that share a
2 MiB mapping unit cannot be paused apart (the pause is refused, nothing changes): keep a
region's small tensors together.

Pause and resume act on one device (the current one unless ``device`` is given), all its
pools (the default pool, CUDA graph pools, ``MemPool``s) together, all or nothing. A pause
synchronises the device. A pause while a plan is served (plan and auto modes) is refused.
"""

from __future__ import annotations

import contextlib
import json
import threading
from typing import Dict, Iterator, List, Optional

_U32_MAX = 2**32 - 1

_lock = threading.Lock()
_ids: Dict[str, int] = {}
_names: Dict[int, str] = {}
# The tag set in the extension now (0: untagged).
_current = 0


def _get_ext():
    """The installed extension (tests replace this)."""
    from . import _require

    return _require()


def tag_id(name: str, *, register: bool = True) -> int:
    """The id (>= 1) of the region ``name``, registered at its first use when ``register``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a region tag must be a non-empty string, not {name!r}")
    with _lock:
        got = _ids.get(name)
        if got is not None:
            return got
        if not register:
            raise ValueError(f"no region is named {name!r} (use stweaver.region({name!r}) first)")
        new = len(_ids) + 1
        if new > _U32_MAX:
            raise ValueError("too many region tags")
        _ids[name] = new
        _names[new] = name
        return new


def tag_name(tag: int) -> Optional[str]:
    """The name of region id ``tag``; ``None`` for 0 (every tag, in :func:`paused`)."""
    if tag == 0:
        return None
    with _lock:
        return _names.get(tag, str(tag))


def current_tag() -> Optional[str]:
    """The name of the region allocations are tagged with now (``None``: untagged)."""
    return tag_name(_current) if _current else None


def _set(tag: int) -> None:
    global _current
    _get_ext().set_tag(tag)
    _current = tag


@contextlib.contextmanager
def region(tag: str) -> Iterator[int]:
    """``with stweaver.region("weights"): ...`` -- CUDA allocations made inside carry the tag
    ``"weights"``, so :func:`pause` can give their memory back later. Yields the tag's id.
    Nested regions restore the outer region's tag when they end; a region is process-wide
    (allocations of other threads meanwhile are tagged too)."""
    new = tag_id(tag)
    outer = _current
    _set(new)
    try:
        yield new
    finally:
        _set(outer)


def _report(t) -> Dict[str, int]:
    blocks, units, nbytes, copied = (int(x) for x in t)
    return {"blocks": blocks, "units": units, "bytes": nbytes, "copied": copied}


def _key(tag: Optional[str]) -> int:
    return 0 if tag is None else tag_id(tag, register=False)


def pause(tag: Optional[str] = None, *, keep_contents: bool = True, device: Optional[int] = None) -> Dict[str, int]:
    """Gives the physical memory of the tensors of region ``tag`` (``None``: every region) on
    ``device`` (default: the current device) back to the driver. Addresses are kept: the
    tensors and any CUDA graph that uses them stay valid, but **their memory must not be
    touched on the GPU until** :func:`resume` (the driver reports the access as an illegal
    address). ``keep_contents``: copy the bytes to host memory, restored at resume.
    Synchronises the device. Raises (and pauses nothing) when the region is already paused,
    a plan is served, or a region shares a 2 MiB unit with other tensors. Returns what moved:
    ``{"blocks", "units", "bytes", "copied"}``."""
    key = _key(tag)
    return _report(_get_ext().pause(key, bool(keep_contents), -1 if device is None else int(device)))


def resume(tag: Optional[str] = None, *, device: Optional[int] = None) -> Dict[str, int]:
    """Maps fresh memory at the paused addresses of region ``tag`` (``None``: every pause in
    force) on ``device`` and restores the contents kept at pause. Raises when it is not
    paused, or when the memory is no longer there (everything stays paused then). Returns
    ``{"blocks", "units", "bytes", "copied"}``."""
    key = _key(tag)
    return _report(_get_ext().resume(key, -1 if device is None else int(device)))


def paused() -> Dict[int, Dict[str, object]]:
    """What is paused now, per opened device: ``{device: {"bytes": n, "tags": [...]}}``, where
    ``tags`` names the paused regions (``None``: a pause of every region)."""
    info = json.loads(_get_ext().info_json())
    out: Dict[int, Dict[str, object]] = {}
    for d in info.get("devices", []):
        if not d.get("opened"):
            continue
        tags: List[Optional[str]] = [tag_name(int(t)) for t in d.get("paused_tags", [])]
        out[int(d["device"])] = {"bytes": int(d.get("paused_bytes", 0)), "tags": tags}
    return out
