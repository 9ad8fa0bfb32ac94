"""Recomputation of a few repeated blocks, beside planned offload (issue #16: budgets below
what the link can offload in time).

    import stweaver
    names = stweaver.recompute_blocks(model, 4)            # the last 4 transformer blocks
    names = stweaver.recompute_blocks(model, 4, where="first")
    stweaver.recompute_blocks(model, 0)                    # undo: every block stores again

Why
===
Offload alone is bound by the host link: everything that must be off the device at the peak
(the start of backward) has to cross the link during forward. On an H100 (55 GB/s each way)
Llama 1B, 8 x 2048 tokens, must move 7.5 GB out at 0.8 x its peak in a forward of 91 ms: 136
ms of copies, so no offload schedule runs faster than ~1.2x there (BENCHMARKS.md, session 10).
Recomputing k of the N repeated blocks (activation checkpointing of those blocks only) takes
their saved activations off the peak for about k/N of a forward's compute, and leaves the rest
of the cut to offload, inside the time the link has. Which k is best is measured, not guessed:
``python/bench/budget_bench.py``'s ``stweaver_hybrid`` row records a trace per candidate k,
asks ``stweaver plan --budget`` for each plan's planned copy waits, and keeps the k whose
predicted step (k/N of forward + the planned waits) is least.

What it does
============
:func:`find_blocks` takes the model's repeated blocks: the ``nn.ModuleList`` with the most
children of one class (at least two), e.g. a Llama's ``model.layers`` or a GPT-2's
``transformer.h``. :func:`recompute_blocks` replaces the ``forward`` of k of them (the last k by
default: their activations live shortest and are the worst offload candidates, while the
first blocks' activations have the whole forward to cross the link) by one that runs the
original under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: the block keeps its
inputs only, and backward runs its forward again (RNG state preserved, so dropout draws the
same masks: the gradients are those of the run without recomputation, bit for bit where the
kernels are deterministic). Non-reentrant checkpointing saves through its own
``saved_tensors_hooks`` inside the block, so the offloader's pack hook (outer) sees only the
saves outside recomputed blocks, and the pack ordinals of a trace and of the run that serves
its plan agree as long as both recompute the same blocks.

The model's ``config.use_cache`` is turned off (a KV cache written inside a recomputed block
would be written twice), as Hugging Face's own ``gradient_checkpointing_enable`` does.

Cost: O(number of modules) to find the blocks; nothing per step beyond checkpointing itself.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

_ORIG = "_stweaver_orig_forward"


class RecomputeError(ValueError):
    """The model has no repeated blocks, or k is out of range."""


def find_blocks(model) -> Tuple[str, list]:
    """The model's repeated blocks: ``(qualified name, [module, ...])`` of the ``nn.ModuleList``
    with the most children of one class (at least two; the first such list on a tie).

    Raises :class:`RecomputeError` when no ``ModuleList`` holds two children of one class."""
    import torch

    best: Optional[Tuple[str, list]] = None
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList):
            continue
        kids = list(mod)
        if len(kids) < 2:
            continue
        counts: dict = {}
        for k in kids:
            counts[type(k)] = counts.get(type(k), 0) + 1
        cls, n = max(counts.items(), key=lambda kv: kv[1])
        if n < 2:
            continue
        blocks = [k for k in kids if type(k) is cls]
        if best is None or len(blocks) > len(best[1]):
            best = (name, blocks)
    if best is None:
        raise RecomputeError(
            f"{type(model).__name__} has no nn.ModuleList with two children of one class: "
            "no repeated blocks to recompute")
    return best


def recomputed(model) -> List[str]:
    """Qualified names of the blocks whose forward is recomputed now."""
    return [n for n, m in model.named_modules() if _ORIG in m.__dict__]


def recompute_blocks(model, k, *, where: str = "last") -> List[str]:
    """Recompute k of the model's repeated blocks in backward instead of storing their
    activations (``where``: ``"last"`` or ``"first"`` k in the list's order); k = 0 undoes it.
    Blocks recomputed before and not chosen now store again. Returns the chosen blocks'
    qualified names.

    ``k="auto"``: under a budget in auto mode, stweaver decides k itself when its plan is
    ready (recording again with more blocks recomputed while the plan would wait for the
    host link; ``stweaver._auto_recompute``). Call it right after ``install`` and before
    training; returns the blocks recomputed now (none yet)."""
    import functools

    import torch.utils.checkpoint as cp

    if k == "auto":
        from . import _auto_recompute

        _auto_recompute.start(model, where=where)
        return recomputed(model)
    if where not in ("last", "first"):
        raise RecomputeError(f"where must be 'last' or 'first', not {where!r}")
    list_name, blocks = find_blocks(model)
    n = len(blocks)
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= n:
        raise RecomputeError(f"k must be an integer in 0..{n} (the blocks of {list_name or 'the model'}), not {k!r}")
    chosen = blocks[n - k:] if where == "last" else blocks[:k]
    chosen_ids = {id(b) for b in chosen}
    for b in blocks:
        saved = b.__dict__.get(_ORIG)
        if saved is not None and id(b) not in chosen_ids:
            # Restore the instance's own forward if it had one, else the class's shows again.
            fwd, own = saved
            del b.__dict__[_ORIG]
            if own:
                b.__dict__["forward"] = fwd
            else:
                del b.__dict__["forward"]
        elif saved is None and id(b) in chosen_ids:
            own = "forward" in b.__dict__
            fwd = b.forward  # the bound method (the class's, or one a user set)

            @functools.wraps(fwd)
            def checkpointed(*args, _fwd=fwd, **kwargs):
                return cp.checkpoint(_fwd, *args, use_reentrant=False, **kwargs)

            b.__dict__[_ORIG] = (fwd, own)
            b.__dict__["forward"] = checkpointed
    cfg = getattr(model, "config", None)
    if k and cfg is not None and getattr(cfg, "use_cache", False):
        cfg.use_cache = False
    names = {id(m): nm for nm, m in model.named_modules()}
    return [names[id(b)] for b in chosen]
