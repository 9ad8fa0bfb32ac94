"""stweaver: a planning CUDA memory allocator for PyTorch training.

    import stweaver
    stweaver.install()            # before the first CUDA tensor
    ...
    for batch in data:
        loss = model(batch).sum(); loss.backward(); opt.step()
        stweaver.step()           # or install(hook_optimizer=True)
                                  # step(key): names the iteration that begins (see step)

or, with no code change, ``python -m stweaver run train.py``. Every ``torch.cuda`` memory API
keeps working: stweaver is a full ``CUDAAllocator`` (the logic is Rust behind a C++ shim).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import threading
import warnings
import weakref
from typing import Iterator, List, Optional

from ._abi import TorchVersionMismatch, check_installed
from ._pause import pause, paused, region, resume
from ._recompute import RecomputeError, find_blocks, recompute_blocks
from ._settings import DEFAULT_MODE, MODES, Settings, SettingsError, resolve

# An installed stweaver refuses to import under another torch than the one it was built
# against (a clear error now rather than an undefined symbol later); see _abi.py.
check_installed()

__all__ = [
    "DEFAULT_MODE",
    "MODES",
    "RecomputeError",
    "Settings",
    "SettingsError",
    "TorchVersionMismatch",
    "find_blocks",
    "flush_trace",
    "install",
    "is_installed",
    "iteration_key",
    "mark",
    "mode",
    "offload",
    "offload_stats",
    "pause",
    "paused",
    "phase",
    "recompute_blocks",
    "region",
    "resume",
    "stats",
    "step",
]

_lock = threading.Lock()
_ext = None
_settings: Optional[Settings] = None
_hook_handle = None


def _extension():
    global _ext
    if _ext is None:
        from ._build import load_extension

        _ext = load_extension()
    return _ext


def install(
    mode: Optional[str] = None,
    plan=None,
    trace=None,
    *,
    hook_optimizer: Optional[bool] = None,
    budget=None,
) -> Settings:
    """Makes stweaver the CUDA allocator of this process.

    Must run before CUDA is initialised (the first CUDA tensor, ``torch.cuda.init()``,
    ``torch.cuda.current_device()``...). Arguments default to ``STWEAVER_MODE``,
    ``STWEAVER_PLAN``, ``STWEAVER_TRACE`` and ``STWEAVER_HOOK_OPTIMIZER``. Calling it again
    with the same settings does nothing; with different ones it raises.

    ``budget`` (default ``STWEAVER_BUDGET``): the most device memory this process may
    use, over every pool: ``"16GiB"``, ``"512MiB"``, bytes, or a fraction of the device
    (``0.8``). ``torch.cuda.set_per_process_memory_fraction`` sets the same limit (the
    smaller holds). Near it stweaver gives back its cache, then its plan pool, then raises
    ``torch.OutOfMemoryError`` saying what was live, what was cached and the budget.
    """
    global _settings, _hook_handle
    settings = resolve(mode, plan, trace, hook_optimizer, budget=budget)
    with _lock:
        if _settings is not None:
            if settings != _settings:
                raise RuntimeError(
                    f"stweaver is already installed with {_settings}; cannot reinstall with {settings}"
                )
            return _settings
        import torch

        if torch.cuda.is_initialized():
            raise RuntimeError(
                "stweaver.install() must run before CUDA is initialised: this process already "
                "used CUDA with PyTorch's own allocator. Call it first thing (or use "
                "`python -m stweaver run script.py`)."
            )
        from torch.optim.optimizer import register_optimizer_step_post_hook

        ext = _extension()
        if settings.budget is not None:
            # The Rust side reads its settings from the environment (as for a zero-code
            # `python -m stweaver run`); the value was validated above.
            os.environ["STWEAVER_BUDGET"] = settings.budget
        ext.install(settings.mode, settings.plan or "", settings.trace or "")
        if settings.hook_optimizer:
            _hook_handle = register_optimizer_step_post_hook(_optimizer_hook())
        _start_offload(settings)
        if settings.mode == "trace":
            atexit.register(_flush_at_exit)
        _settings = settings
        now = ext.mode()
        if settings.mode == "plan" and now.startswith("online"):
            # A bad plan never stops training (it is served online); but say so.
            warnings.warn(f"stweaver: {now}", RuntimeWarning, stacklevel=2)
        return settings


def is_installed() -> bool:
    """Whether stweaver serves this process's CUDA allocations."""
    return _settings is not None


def _require():
    if _settings is None:
        raise RuntimeError("stweaver is not installed (call stweaver.install() first)")
    return _extension()


_KEY_MASK = (1 << 64) - 1


def _stable(key) -> bool:
    """Whether ``key``'s ``repr`` names its value the same in every process."""
    if isinstance(key, (str, bytes, int, float)) or key is None:
        return True
    return isinstance(key, tuple) and all(_stable(k) for k in key)


def _key_hash(key) -> int:
    """The 64-bit label the runtime keys an iteration by: an int as itself (mod 2**64);
    a str, bytes, float or a tuple of those by a digest of its type and ``repr`` (the same
    in every process); any other hashable by ``hash()`` (consistent with ``==`` in this
    process)."""
    try:
        hash(key)
    except TypeError:
        raise TypeError(
            f"an iteration key must be hashable (a str, an int, a tuple...), got {type(key).__name__}"
        ) from None
    if isinstance(key, int):
        return int(key) & _KEY_MASK
    if not _stable(key):
        return hash(key) & _KEY_MASK
    data = f"{type(key).__name__}:{key!r}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def step(key=None) -> None:
    """Marks an iteration boundary (call once per training step, e.g. after ``opt.step()``).

    ``key`` (optional, any hashable: ``"eval"``, a sequence-length bucket, an int) names the
    kind of the iteration that *begins* here. With a plan made per iteration class (a loop
    of a few sequence lengths, eval passes; issue #18) the runtime learns which class each
    key's iterations are (the class the plan served the key's last iteration as) and, at
    the next boundary with that key, guesses that class first instead of the class just
    served: iterations whose first requests are alike (an eval forward and a training
    forward of one batch shape) then take their own class's places from their first
    request. The key is only a hint: the iteration's requests still choose, and a wrong
    key costs a request or two served beside the plan, never an overlap. Without a plan,
    or with a plan of one class, the key is accepted and changes nothing. ``step()`` with
    no key is the plain boundary. When the boundaries come from the optimizer hook
    (``python -m stweaver run``, ``install(hook_optimizer=True)``, auto mode's default), do
    not call ``step`` as well (that would mark two boundaries per iteration): label the
    iteration with :func:`iteration_key` instead."""
    hashed = None if key is None else _key_hash(key)
    ext = _require()
    if hashed is None:
        ext.step()
    else:
        ext.step_key(hashed)
    from . import _offload

    # After the runtime's boundary: a plan switched to here brings its offload schedule.
    _offload.iteration_end()


def iteration_key(key) -> None:
    """Names the kind of the iteration in progress (the one the last boundary began)
    without marking a boundary: ``step(key)``'s key for loops whose boundaries come from
    the optimizer hook (``python -m stweaver run``, ``install(hook_optimizer=True)``)::

        for batch in data:
            stweaver.iteration_key(len(batch))   # first thing: before the batch goes to CUDA
            loss = model(batch.cuda()).sum(); loss.backward(); opt.step()   # the hook: step()

    Given before the iteration's first CUDA allocation, the plan's class guess for this
    iteration begins from the key's class; given later, the key is only learned from (at
    the iteration's end). ``None`` does nothing. See :func:`step`."""
    if key is None:
        return
    hashed = _key_hash(key)
    _require().iteration_key(hashed)


def _offload_setting(settings: Settings) -> Optional[str]:
    """What the saved-tensor hooks do for the whole run (``STWEAVER_OFFLOAD``, default
    ``auto``): ``"record"`` in trace mode (the trace carries every saved tensor's pack and
    unpack, for ``stweaver plan --budget``), ``"plan"`` in auto and plan modes under a budget
    (record while auto records, then follow the served plan's offload schedule), nothing
    otherwise; ``1`` turns them on in every mode, ``0`` off."""
    raw = os.environ.get("STWEAVER_OFFLOAD", "auto").strip().lower()
    if raw in ("0", "false", "no", "off"):
        return None
    forced = raw in ("1", "true", "yes", "on")
    if not forced and raw != "auto":
        raise SettingsError(f"STWEAVER_OFFLOAD={raw!r}: expected auto, 1 or 0")
    if settings.mode == "trace":
        return "record"
    if settings.mode in ("auto", "plan") and (forced or settings.budget is not None):
        return "plan"
    return "record" if forced else None


def _start_offload(settings: Settings) -> None:
    what = _offload_setting(settings)
    if what is None:
        return
    from . import _offload

    # Boundaries come from step() (which the optimizer hook calls), not a hook of its own.
    # The extension is passed explicitly: install() has not finished yet, so the offloader
    # could not find it through is_installed().
    # The first iteration is the plan's prologue, which carries no schedule: under a budget
    # (auto and plan modes) it offloads saved tensors of at least 1 MiB to fit -- every one,
    # or with STWEAVER_OFFLOAD_WATERMARK=1 those the watermark says would otherwise bring
    # the device near the budget (every one while the budget is not known) -- and so does auto
    # mode's recording; a trace run asked to (STWEAVER_OFFLOAD=1) offloads every one, so that
    # the recorded prologue is the one the budgeted run will have.
    forced = os.environ.get("STWEAVER_OFFLOAD", "auto").strip().lower() in ("1", "true", "yes", "on")
    if what == "record" and forced:
        # A trace run asked to offload does so in every iteration, as auto mode records
        # under a budget: each offloaded tensor's free then says when the program let go
        # of it (the next layer may still read it after its pack), which the planner needs
        # so as not to count on memory the program still holds (restore links, un_offload).
        _offload.enable(min_bytes=1 << 20, hook_optimizer=False, ext=_extension())
        return
    first = 1 << 20 if what == "plan" else None
    # The watermark is opt-in: on the H100 (BENCHMARKS.md, session 15) GPT-2 XL at 0.8 x LB
    # ran out of memory at its 6th recorded iteration with it (the learned level rose past
    # a transient its reads do not see), and passed without it.
    wm = os.environ.get("STWEAVER_OFFLOAD_WATERMARK", "0").strip().lower() in ("1", "true", "yes", "on")
    _offload.enable(
        schedule=[] if what == "record" else "plan",
        hook_optimizer=False,
        ext=_extension(),
        first_min_bytes=first,
        watermark="auto" if (first is not None and wm) else None,
    )


@contextlib.contextmanager
def offload(min_bytes: int = 2**20, schedule=None) -> Iterator[object]:
    """``with stweaver.offload(): loss = model(x)`` -- the autograd-saved tensors of the
    block (every one of at least ``min_bytes`` that is a whole CUDA storage) go to pinned
    host memory on a side stream as they are saved, and come back before backward needs
    them (the next one is prefetched as each is unpacked). ``schedule``: a list of
    ``(pack, unpack, prefetch_after_unpack, bytes)`` entries (``stweaver plan --budget``
    makes them) or ``"plan"`` (the served plan's) instead of the threshold. Losses and
    gradients are those of the run without offload. Under a budget in auto or plan mode the
    whole run already follows the plan's schedule; nesting raises."""
    from . import _offload

    with _offload.offload(min_bytes=min_bytes, schedule=schedule, hook_optimizer=False) as off:
        yield off


def offload_stats() -> dict:
    """The offloader's counters: tensors and bytes moved each way, stalls, schedule matches,
    achieved copy bandwidth (empty when offload never ran)."""
    from . import _offload

    return _offload.stats()


def mark(label: str, begin: bool = True) -> None:
    """Opens (``begin=True``) or closes a named phase, e.g. ``"eval"``."""
    if not isinstance(label, str) or not label:
        raise ValueError("a phase label must be a non-empty string")
    _require().mark(label, begin)


@contextlib.contextmanager
def phase(label: str) -> Iterator[None]:
    """``with stweaver.phase("eval"): ...`` marks the phase's begin and end."""
    mark(label, True)
    try:
        yield
    finally:
        mark(label, False)


def mode() -> str:
    """The serving mode now."""
    return _require().mode()


def stats() -> dict:
    """The runtime's state: mode, iterations, and per device allocated/reserved bytes and peaks."""
    ext = _require()
    info = json.loads(ext.info_json())
    info["failed_frees"] = int(ext.failed_frees())
    info["settings"] = {
        "mode": _settings.mode,
        "plan": _settings.plan,
        "trace": _settings.trace,
        "hook_optimizer": _settings.hook_optimizer,
        "budget": _settings.budget,
    }
    return info


def flush_trace() -> List[str]:
    """Trace mode (or plan mode given a trace path: the served run, for a CPU replay against
    the plan): stops recording and writes the trace file(s) now; returns their paths."""
    return list(_require().flush_trace())


def _flush_at_exit() -> None:
    try:
        served = _settings is not None and _settings.mode == "plan" and _settings.trace
        if _settings is not None and _ext is not None and (_ext.mode() == "trace" or served):
            for path in _ext.flush_trace():
                print(f"stweaver: trace written to {path}")
    except Exception as e:  # atexit: report, never raise
        print(f"stweaver: writing the trace at exit failed: {e}")


def _optimizer_hook():
    """A hook marking an iteration after each step of the first optimizer that steps (others
    are ignored, so several optimizers in one loop still give one boundary per iteration)."""
    first: List[weakref.ref] = []

    def hook(optimizer, args, kwargs):
        if not first:
            first.append(weakref.ref(optimizer))
        if first[0]() is optimizer:
            step()

    return hook
