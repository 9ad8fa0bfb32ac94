"""Install settings: arguments and environment variables, validated without importing torch.

Environment variables (for ``python -m stweaver run`` and code that calls ``install()``
with no arguments):

=========================  ==========================================================
``STWEAVER_MODE``          ``online`` | ``trace`` | ``plan`` | ``auto``
``STWEAVER_PLAN``          plan file to serve (implies ``plan`` when no mode is given)
``STWEAVER_TRACE``         trace file to write (implies ``trace`` when no mode is given;
                           with ``plan``: the served run, to replay against the plan)
``STWEAVER_HOOK_OPTIMIZER`` ``1``/``0``: mark an iteration after every optimizer step
                           (default: on in ``auto`` mode, which needs iteration
                           boundaries; off otherwise)
``STWEAVER_AUTO_ITERATIONS`` iterations ``auto`` records before planning (default 4)
``STWEAVER_RELEASE_AT_PEAK`` ``1``/``0``: before an online arena grows past the peak of
                           reserved memory, give its free holes back first (lower peak,
                           a device synchronisation each time; default on)
``STWEAVER_RELEASE_CHURN`` iterations (default 3; ``0``: never), online mode only: a loop whose
                           iterations repeat and each give holes back before a new peak
                           (to map them again in the next) stops giving them back after
                           this many in a row, until it needs more live memory
``STWEAVER_POOL_UNIT_MIB`` MiB (default 64; ``0``: whole ranges): the largest piece of a
                           first-touched range the plan pool maps as one physical
                           allocation (smaller pieces give back more of what an iteration
                           the plan did not foresee leaves free; larger ones copy faster)
``STWEAVER_PLAN_WAIT``     ``1``/``0``: a planned range held only by frees pending on
                           other streams makes the request's stream wait for them on the
                           device instead of a conflict (default on)
``STWEAVER_SHARE_STREAMS`` ``1``/``0``: ``auto`` plans all streams in one joint solve
                           (smallest pool; streams wait for each other's work on reuse;
                           default off)
``STWEAVER_PLAN_THREADS``  threads of ``auto``'s background planning (default 1; 0: every
                           core), so that planning beside training takes one core at most
``STWEAVER_PLAN_NICE``     niceness of those planning threads (default 10, 0..19; 0 leaves
                           it): the training's own threads come first
``STWEAVER_BUDGET``        device memory budget: ``16GiB``, ``512MiB``, bytes, or a
                           fraction of the device (``0.8``); every pool of the device
                           stays under it (with ``set_per_process_memory_fraction`` too,
                           the smaller limit holds)
``STWEAVER_OFFLOAD``       ``auto`` (default): trace mode records every saved tensor's
                           pack and unpack (for ``stweaver plan --budget``); auto and plan
                           modes under a budget follow the plan's offload schedule;
                           ``1``: the hooks in every mode (trace mode then offloads
                           every saved tensor of at least 1 MiB, so the trace says
                           when the program let go of each); ``0``: never
``STWEAVER_OFFLOAD_WATERMARK`` ``0`` (default): under a budget, before a plan is served,
                           every saved tensor of at least 1 MiB is offloaded; ``1``
                           (experimental): only when the device would otherwise come
                           near the budget (``_offload.py``, "Watermark"; it ran out of
                           memory on GPT-2 XL at 0.8 x LB, BENCHMARKS.md session 15)
=========================  ==========================================================

Under ``torchrun`` (``WORLD_SIZE`` > 1) file names are per rank: ``{rank}`` / ``{local_rank}``
in a path are replaced, otherwise ``.rank{R}`` goes before the extension of the files written;
plan mode reads ``NAME.rank{R}.EXT`` when it exists, else ``NAME.EXT`` as a plan shared by all
ranks (``crates/torch-bridge/src/dist.rs``).

Explicit arguments win over the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Union

MODES = ("online", "trace", "plan", "auto")
# The default when nothing says otherwise: record the first iterations, plan them in the
# background, serve the plan from an iteration boundary on (online for everything else).
DEFAULT_MODE = "auto"

PathLike = Union[str, "os.PathLike[str]"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class SettingsError(ValueError):
    """Invalid install arguments or environment variables."""


@dataclass(frozen=True)
class Settings:
    mode: str
    plan: Optional[str]
    trace: Optional[str]
    hook_optimizer: bool
    # The budget as given (``"16GiB"``, ``"0.8"``), validated; ``None``: no budget.
    budget: Optional[str] = None


_BINARY = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
           "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40,
           "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_budget(value: object, what: str = "budget") -> Union[int, float]:
    """Bytes (``int``) or a fraction of the device (``float`` in (0, 1]) from ``16GiB``,
    ``512MiB``, ``17179869184``, ``0.8`` or a number; the same rules as the Rust side
    (``crates/torch-bridge/src/budget.rs``)."""
    examples = "(examples: 16GiB, 512MiB, 17179869184, 0.8)"
    if isinstance(value, bool):
        raise SettingsError(f"{what} must be a size or a fraction, got a bool {examples}")
    if isinstance(value, int):
        if value <= 0:
            raise SettingsError(f"{what}={value!r}: it must be positive {examples}")
        return 1.0 if value == 1 else value
    if isinstance(value, float):
        if not (0.0 < value <= 1.0):
            raise SettingsError(f"{what}={value!r}: a fraction must be in (0, 1] {examples}")
        return value
    if not isinstance(value, str):
        raise SettingsError(f"{what} must be a str, int or float, got {type(value).__name__}")
    text = value.strip()
    i = 0
    while i < len(text) and (text[i].isdigit() or text[i] == "."):
        i += 1
    num, unit = text[:i].strip(), text[i:].strip().lower()
    try:
        x = float(num)
    except ValueError:
        raise SettingsError(f"{what}={value!r}: not a number {examples}") from None
    if x <= 0:
        raise SettingsError(f"{what}={value!r}: it must be positive {examples}")
    if unit not in _BINARY:
        raise SettingsError(f"{what}={value!r}: unknown unit {unit!r} {examples}")
    if unit == "":
        if x <= 1.0:
            return x
        if "." in num:
            raise SettingsError(f"{what}={value!r}: a fraction must be in (0, 1] {examples}")
    return int(x * _BINARY[unit])


def _path(value: object, what: str) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        s = os.fspath(value)
        if not isinstance(s, str):
            raise SettingsError(f"{what} must be a text path, got bytes {s!r}")
        if s == "":
            return None
        return s
    raise SettingsError(f"{what} must be a path (str or os.PathLike), got {type(value).__name__}")


def rank_of(env: Mapping[str, str]) -> Optional[tuple]:
    """``(rank, local_rank)`` under ``torchrun`` (``WORLD_SIZE`` > 1 and ``RANK`` set), else None.
    Mirrors ``crates/torch-bridge/src/dist.rs``, which decides the file names."""
    try:
        world = int(env.get("WORLD_SIZE") or 1)
        rank = env.get("RANK")
        if rank is None or rank.strip() == "" or world <= 1:
            return None
        r = int(rank)
        return r, int(env.get("LOCAL_RANK") or r)
    except ValueError:
        return None


def expand_rank(path: str, env: Mapping[str, str]) -> str:
    """``{rank}`` / ``{local_rank}`` replaced (0 outside torchrun)."""
    r, lr = rank_of(env) or (0, 0)
    return path.replace("{local_rank}", str(lr)).replace("{rank}", str(r))


def rank_plan_path(path: str, env: Mapping[str, str]) -> str:
    """The plan file this rank reads (the Rust side decides; this is for the existence check):
    a placeholder expanded, else ``NAME.rank{R}.EXT`` when it exists, else the file given
    (a plan shared by all ranks, or a plan named for a rank, which Rust may refuse)."""
    if "{rank}" in path or "{local_rank}" in path:
        return expand_rank(path, env)
    r = rank_of(env)
    if r is None:
        return path
    root, ext = os.path.splitext(path)
    mine = f"{root}.rank{r[0]}{ext}"
    return mine if os.path.isfile(mine) else path


def parse_bool(value: str, name: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise SettingsError(f"{name}={value!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def resolve(
    mode: Optional[str] = None,
    plan: Optional[PathLike] = None,
    trace: Optional[PathLike] = None,
    hook_optimizer: Optional[bool] = None,
    env: Optional[Mapping[str, str]] = None,
    check_files: bool = True,
    budget: Union[str, int, float, None] = None,
) -> Settings:
    """Combines arguments and environment into validated :class:`Settings`."""
    env = os.environ if env is None else env
    if mode is None:
        mode = env.get("STWEAVER_MODE") or None
        mode_src = "STWEAVER_MODE"
    else:
        mode_src = "mode"
    plan_s = _path(plan, "plan") if plan is not None else _path(env.get("STWEAVER_PLAN"), "STWEAVER_PLAN")
    trace_s = (
        _path(trace, "trace") if trace is not None else _path(env.get("STWEAVER_TRACE"), "STWEAVER_TRACE")
    )
    if mode is not None and not isinstance(mode, str):
        raise SettingsError(f"mode must be a string, got {type(mode).__name__}")
    if mode is None:
        if plan_s is not None and trace_s is not None:
            mode = "auto"
        elif plan_s is not None:
            mode = "plan"
        elif trace_s is not None:
            mode = "trace"
        else:
            mode = DEFAULT_MODE
    mode = mode.strip().lower()
    if mode not in MODES:
        raise SettingsError(f"{mode_src}={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "online" and (plan_s or trace_s):
        raise SettingsError(
            f"mode 'online' takes no plan or trace (got plan={plan_s!r}, trace={trace_s!r})"
        )
    if mode == "trace":
        if trace_s is None:
            raise SettingsError("mode 'trace' needs a trace path (trace=... or STWEAVER_TRACE)")
        if plan_s is not None:
            raise SettingsError("mode 'trace' takes no plan")
    if mode == "plan" and plan_s is None:
        raise SettingsError("mode 'plan' needs a plan file (plan=... or STWEAVER_PLAN)")
    raw_iters = env.get("STWEAVER_AUTO_ITERATIONS")
    if raw_iters is not None and not (raw_iters.strip().isdigit() and int(raw_iters) > 0):
        raise SettingsError(f"STWEAVER_AUTO_ITERATIONS={raw_iters!r} is not a positive integer")
    raw_off = env.get("STWEAVER_OFFLOAD")
    if raw_off is not None and raw_off.strip().lower() not in ("auto", "1", "true", "yes", "on", "0", "false", "no", "off"):
        raise SettingsError(f"STWEAVER_OFFLOAD={raw_off!r}: expected auto, 1 or 0")
    for var in ("STWEAVER_RELEASE_AT_PEAK", "STWEAVER_PLAN_WAIT", "STWEAVER_SHARE_STREAMS",
                "STWEAVER_OFFLOAD_WATERMARK"):
        raw = env.get(var)
        if raw is not None:
            parse_bool(raw, var)  # read by the Rust side (the watermark: by install())
    for var, hi in (("STWEAVER_PLAN_THREADS", 4096), ("STWEAVER_PLAN_NICE", 19),
                    ("STWEAVER_RELEASE_CHURN", 1_000_000), ("STWEAVER_POOL_UNIT_MIB", 1 << 20)):
        raw = env.get(var)  # read by the Rust side
        if raw is not None and raw.strip() and not (raw.strip().isdigit() and int(raw) <= hi):
            raise SettingsError(f"{var}={raw!r} is not an integer from 0 to {hi}")
    if check_files:
        # plan mode reads the plan; auto mode writes the plan it makes (and the trace).
        if mode == "plan" and not os.path.isfile(rank_plan_path(plan_s, env)):
            raise SettingsError(f"plan file {rank_plan_path(plan_s, env)!r} does not exist")
        outputs = [("trace", trace_s)] + ([("plan", plan_s)] if mode == "auto" else [])
        for what, path in outputs:
            if path is not None:
                parent = os.path.dirname(os.path.abspath(expand_rank(path, env)))
                if not os.path.isdir(parent):
                    raise SettingsError(f"{what} file {path!r}: folder {parent!r} does not exist")
    if hook_optimizer is None:
        raw = env.get("STWEAVER_HOOK_OPTIMIZER")
        if raw is not None:
            hook_optimizer = parse_bool(raw, "STWEAVER_HOOK_OPTIMIZER")
        else:
            hook_optimizer = mode == "auto"
    elif not isinstance(hook_optimizer, bool):
        raise SettingsError(f"hook_optimizer must be a bool, got {type(hook_optimizer).__name__}")
    if budget is None:
        raw = env.get("STWEAVER_BUDGET")
        if raw is not None and raw.strip():
            parse_budget(raw, "STWEAVER_BUDGET")
            budget_s: Optional[str] = raw.strip()
        else:
            budget_s = None
    else:
        parsed = parse_budget(budget)
        budget_s = budget.strip() if isinstance(budget, str) else repr(parsed)
    return Settings(
        mode=mode, plan=plan_s, trace=trace_s, hook_optimizer=hook_optimizer, budget=budget_s
    )
