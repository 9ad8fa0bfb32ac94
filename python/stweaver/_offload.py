"""Activation offload: autograd-saved tensors go to pinned host memory between forward and
backward, and come back before backward needs them (issue #16, part 2: run time).

    import stweaver, stweaver._offload as off
    stweaver.install(budget="60GiB")        # auto mode: the plan may carry an offload schedule
    off.enable()                            # follow the served plan's schedule
    ...                                     # or: with off.offload(min_bytes=2**20): ...
    off.stats()

Modes
=====
* **plan** (``enable()`` with no arguments, ``schedule="plan"``): the schedule is the one of the
  plan stweaver serves now (``ext.offload_schedule()``), read again at every iteration
  boundary; an empty schedule offloads nothing.
* **schedule** (``schedule=[(pack, unpack, prefetch_after_unpack, bytes), ...]``): a fixed
  schedule (tests, hand-made plans).
* **threshold** (``min_bytes=N``, no schedule): every eligible saved tensor of at least N bytes
  is offloaded (as torchtune's ``OffloadActivations``); the copy back of the next offloaded
  tensor (the next lower pack ordinal, backward's usual order) is started when one is unpacked.

Ordinals
========
A schedule entry names a saved tensor by its **pack ordinal** k: the 0-based count of the
*counted* pack-hook calls since the iteration boundary (``stweaver.step()`` or the
optimizer-step hook; here :func:`iteration_end`). A call is counted when its tensor is a CUDA
tensor that covers its whole storage (``data_ptr() == untyped_storage().data_ptr()`` and
``nbytes == untyped_storage().nbytes()``, storage not empty): exactly the calls for which the
trace carries a marker, since a storage is one allocation. A view of part of a storage (the q
of a fused qkv projection, which starts the storage) is not counted: offloading it would free
nothing while the other views hold the storage, and the planner, which sees only the counted
calls, must not count on its allocation going away (on the H100, GPT-2 XL's 75 MiB qkv
outputs were scheduled, skipped at run time, and their plan conflicted at the peak). Its unpack is the **unpack ordinal** j among the iteration's counted unpack-hook
calls (a tensor returned as is by pack is the same object at unpack, so it is counted the same
way; a handle always is), and ``prefetch_after_unpack`` p the unpack ordinal right after which
its copy back starts (-1: at the iteration's first unpack). While stweaver records a trace,
every counted call also calls ``ext.record_saved(ptr, pack)``, so the trace carries a
SavedPack / SavedUnpack event at the allocation, in call order, and the planner's ordinals
(the events of one iteration, in order) are the hook's. ``record_saved`` returns the
allocation's trace id (-1: nothing recorded); the handle of a tensor offloaded while recording
keeps the id of its pack, and when its copy back is allocated the offloader calls
``ext.record_restore(copy_back.data_ptr(), id)``: a *restore link* in the trace, saying that
the copy back is the offloaded allocation again. A trace recorded with offload on (threshold
mode, so that recording fits a budget) is thereby the run without offload to the planner,
which chooses afresh what to offload (``stweaver_planner::unoffload``). Once stweaver can no longer record
(its mode, read at each boundary, says it serves a plan or online, or its trace is written),
the hooks stop calling ``record_saved`` (a call into the extension per counted hook call,
for nothing). A counted call that recorded nothing
while others did (an allocation of a CUDA graph's private pool, say) is counted in
``stats()["marker_misses"]``: the ordinals after it no longer match the plan's, which makes
schedule entries mismatch (``schedule_mismatch``) rather than anything unsafe.

A tensor saved several times (softmax's output, by softmax and by the next matmul) is
offloaded once: a later pack of the same tensor object in the iteration returns the first
handle (``shared``), which every save unpacks; so does a later pack of another whole view of
the same storage with the same dtype (a layer norm's output and its ``view(-1, n)``), as a
``_View`` of the first handle with its own shape and strides (the same storage object, which
PyTorch preserves while the storage lives, not merely the same address). The planner sees two
packs of one allocation and does not schedule it; a recording offloads it once, so its copy
back is linked (restore link) and the recorded run stays steady.

Eligible tensors: a plain CUDA ``torch.Tensor`` (no subclass, no ``nn.Parameter`` nor a view of
one: offloading a parameter frees nothing), strided, not conjugated/negated, contiguous or a permutation of a
contiguous tensor (non-overlapping and dense, e.g. attention's transposed q/k/v), covering its whole
storage (``data_ptr == storage ptr`` and ``nbytes == storage nbytes``), not empty. Dropping such a
tensor after the copy frees its device block; a view would free nothing. In schedule modes an
entry whose tensor is not eligible, or whose size differs from ``bytes`` (the ordinals no longer
match the plan's), is left on the device and counted (``schedule_skipped``,
``schedule_mismatch``).

Algorithm and stream rules
==========================
Two side streams per device, ``d2h`` and ``h2d``; copies are asynchronous, and the host never
blocks on the device (no ``synchronize``, no ``Event.synchronize``; only ``Event.query``).

Pack (forward), tensor t, ordinal k, scheduled or over the threshold:

1. take a host slice of ``t.nbytes`` from the :class:`PinnedPool` (one pinned buffer,
   sub-allocated; no ``cudaHostAlloc`` per tensor);
2. ``d2h.wait_stream(current)``: t's producer was queued on the current stream; the copy must
   not read t before it is written;
3. copy t into the slice on ``d2h`` (``non_blocking=True``), with an event ``ev_out`` after it;
4. ``t.record_stream(d2h)``: autograd drops its last reference to t when the hook returns; the
   allocator (stweaver) then frees t's block only once the work queued on ``d2h`` so far (the
   copy) is done, so no later allocation on the current stream overwrites t mid-copy;
5. return a handle that holds the slice and t's metadata, **not** t.

Unpack (backward), ordinal j, handle h (a tensor returned by pack is returned as is):

0. start the copies back due before j (prefetch point p < j, p = -1 at the first unpack) that
   have not started (their tensor was packed after their point: 1F1B-like orders);
1. if h's copy back has not started (its prefetch point p >= j, or threshold mode), start it
   now and count a stall;
2. start the copy back of every scheduled tensor with p <= j that was packed and not started
   yet (threshold mode: of the next offloaded tensor below h's pack ordinal). To start one: allocate the device
   tensor on the **current** stream (``torch.empty_strided``: it then belongs to the stream
   that will use it, as if backward had made it), ``h2d.wait_stream(current)`` (the block may
   have been freed by work queued on the current stream that has not run yet: the copy must
   not overwrite it before that work ran), ``h2d.wait_event(ev_out)`` (the host slice must be
   filled), copy on ``h2d``, event ``ev_in`` after it, ``dev.record_stream(h2d)`` (if the
   tensor dies before the current stream waited for ``ev_in`` (e.g. the graph is freed
   unused), its block must not be reused while the copy writes it);
3. ``current.wait_event(ev_in)``: the consumer sees the data; a device-side wait, not a host
   one. The handle keeps the device tensor (a second unpack under ``retain_graph`` returns it);
   it dies with the saved variable, i.e. when its autograd node has run;
4. h's host slice is free once ``ev_in`` has passed: slices are released when their event's
   ``query()`` says so, at every later hook call and at the iteration boundary, never
   waiting. A slice is reused by a later d2h copy only after that; a slice whose handle died
   unpacked (graph freed) is released once its ``ev_out`` has passed.

Iteration boundary (:func:`iteration_end`): ordinals go back to 0, finished copies give their
slices back, handles packed in the iteration but not unpacked are counted (``not_unpacked``;
they stay valid), copy times are read from the events that have completed, and in plan mode
the schedule is read again.

Host memory: pinned by the extension (:func:`ext_pin`: a huge-page mapping faulted in by up
to 16 threads, then registered with the driver, 7-9x faster than ``pin_memory=True``'s
``cudaHostAlloc`` on an H100 host and without holding up kernel launches meanwhile;
``STWEAVER_PIN_THREADS=0`` uses the driver's ``cuMemHostAlloc`` instead; more than the host
can give (``MemAvailable``, the cgroup limit, checked before a page is touched) is a
:class:`PinnedMemoryError`), or by torch
without the extension. The pool grows by adding a buffer (live slices cannot move while copies may be
in flight): up front to the schedule's bytes (an upper bound of what is offloaded at once;
exact when every pack precedes the first unpack; one buffer per power of two of the missing
bytes), else, when a slice does not fit, by a buffer of the largest of the slice, 64 MiB and a
quarter of the pool (:meth:`PinnedPool.grow_size`): at most about 1.25 x what it ever held
at once, in O(log) buffers (doubling pinned up to 2 x: GPT-2 XL at 0.8 x LB offloaded ~18 GB
by threshold and could pin ~32 GiB). Buffers are powers of two (PyTorch's pinned allocator
rounds to one anyway: a slice's size rounded up, a quarter rounded down). Once schedule rules
apply (a plan served, with or without a schedule, or a fixed schedule after the first
iteration), the pool keeps buffers covering ``schedule_host_bytes`` and drops the other empty
ones (:meth:`PinnedPool.release_beyond`; again at the next boundaries while busy buffers kept
it larger), then empties torch's pinned host cache (``torch._C._host_emptyCache``, torch 2.11),
which would otherwise keep the dropped blocks pinned for its next pinned allocation (it gives
back every free cached pinned block of the process, e.g. a DataLoader's, which torch pins
again when needed). ``stats()``: ``host_capacity`` (pinned now), ``host_pins``,
``host_pinned_total`` (ever pinned), ``host_released``, ``host_peak`` (most used at once). If
pinning fails (host memory exhausted), :class:`PinnedMemoryError` says how many bytes could
not be pinned; the offloader turns offload off (a warning; ``stats()["off_reason"]``) and the
tensor simply stays on the device: training goes on, results unchanged.

Watermark
=========
Before a plan is served (auto mode recording or planning, the first iteration in plan mode:
``first_min_bytes``), threshold rules keep the run within its budget. Offloading every
candidate (every eligible saved tensor of at least ``first_min_bytes``) does, at a price:
GPT-2 XL at 0.8 x LB on an H100 moved ~18 GB per recorded iteration and its first one took
18.8 s, while the served plan moves ~0.6 GB. With a :class:`Watermark` (opt-in, experimental:
``install()`` under a budget with ``STWEAVER_OFFLOAD_WATERMARK=1``; on the H100 GPT-2 XL at
0.8 x LB ran out of memory at its 6th recorded iteration with it, the learned level having
risen past a transient these reads do not see, BENCHMARKS.md session 15) a candidate is offloaded only when
the device would otherwise come near the budget; the rest stay on the device, as without
offload. Per candidate, at its pack, it reads the device's allocated bytes (the allocator's
stats, ``torch._C._cuda_memoryStats``: one call, only in these iterations; also at the
unpack of every offloaded tensor and of every counted one of at least ``first_min_bytes``,
to measure the iteration's peak) and the iteration's first check reads the
limit (``info_json``'s ``limit_bytes``: ``STWEAVER_BUDGET`` and
``set_per_process_memory_fraction``, the smaller; neither set: no watermark, every
candidate offloaded). The first iteration (nothing learned yet) still offloads every
candidate, and is measured: no guess of what comes later is safe there, since forward's end
can allocate more than every activation before it (a large vocabulary's logits, their fp32
copy and the saved log-softmax: ~21 GB for Llama 1B at 8 x 2048 tokens), which the first
iteration cannot know (``Watermark(guess_first=True)`` guesses a headroom instead; the tests
show it going over on a GPT-2-shaped run). The allocated bytes stand for what the budget
counts (mapped bytes): the margin (``max(256 MiB, limit / 32)``) covers what the online
arenas map beyond them (session 14 measured 125-184 MB of non-releasable free bytes on
GPT-2 XL) and what the hooks do not see. Each iteration measures its peak (the most
allocated at the hooks, and the allocator's peak when it set a new record, which the
offloader reads but never resets) and moves a *level* of allocated bytes under which later
iterations keep a candidate: up by offloaded candidates whose bytes fit ``limit - margin -
peak``, down below kept ones when the peak went over it (details: :class:`Watermark`); so
the recorded iterations after the first approach the budget from below
(``python/bench/watermark_sim.py``, a CPU simulation of a GPT-2 XL-shaped step, 48 layers,
the optimizer's state made at the first step: every iteration within 0.7, 0.8 and 0.9 x the
steady peak, the third and later ones moving 11.5, 8.6 and 5.6 "GB" instead of 19.2; not a
GPU measurement). The first iteration thus moves as much as before; what it pins shrinks
with the pool's growth (about 1.25 x instead of up to 2 x what it holds). When auto
recompute recomputes more blocks, the level is learned again
(:meth:`Offloader.program_changed`). A storage kept at its first save stays at its later
saves in the iteration (offloading those would copy it and free nothing), as an offloaded
one is shared. ``stats()["watermark_kept"]`` counts candidates left on the device;
``stats()["watermark"]`` and each iteration's ``watermark`` the limit, level, headroom and
peak. The recording is still the run without offload to the planner (restore
links only for what moved): fewer offloads change nothing there.

Threads: the hooks are thread-local in PyTorch; :func:`enable` pushes them for the calling
thread (the one that runs forward). Unpacks run on autograd's device threads; the offloader's
state is guarded by a lock.

The CUDA pieces (streams, events, copies, pinning, ``record_stream``) are behind a small
backend object (:class:`CudaBackend`) so the logic runs on CPU in tests with a fake one.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

__all__ = [
    "ALIGN",
    "CudaBackend",
    "Offloader",
    "PinnedMemoryError",
    "PinnedPool",
    "current",
    "disable",
    "enable",
    "iteration_end",
    "normalize_schedule",
    "offload",
    "schedule_host_bytes",
    "stats",
]

ALIGN = 512
_NEVER = float("inf")  # a prefetch point no unpack ordinal reaches


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class PinnedMemoryError(RuntimeError):
    """Pinned host memory could not be had; offload is off, training state untouched."""

    def __init__(self, nbytes: int, cause: Optional[BaseException] = None):
        self.nbytes = nbytes
        why = f": {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}" if cause else ""
        super().__init__(
            f"stweaver offload: could not pin {nbytes} bytes ({nbytes / 2**30:.2f} GiB) of host "
            f"memory{why}. Offload is off from here on; the training state is untouched (saved "
            f"tensors stay on the device)."
        )


def _pin_torch(nbytes: int):
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def ext_pin(ext) -> Optional[Callable[[int], Any]]:
    """The extension's pinning (``ext.pin_host``, cpp/offload_copy.cpp over
    ``stweaver_cuda``'s fast pin: a huge-page mapping faulted in by several threads, then
    registered; 16 GiB in 0.9 s on an H100 host where ``pin_memory=True`` took 6.7-8.2 s
    and held up kernel launches from other threads), as a pin function for
    :class:`PinnedPool`, in the current device's context; None without it (torch's
    pinning then)."""
    fn = getattr(ext, "pin_host", None) if ext is not None else None
    if fn is None:
        return None

    def pin(nbytes: int):
        import torch

        return fn(nbytes, torch.cuda.current_device())

    return pin


def _torch_host_empty_cache() -> None:
    """Gives torch's cached free pinned blocks back (``torch._C._host_emptyCache``, torch
    2.11; what ``torch.cuda.graphs`` calls). A torch without it: nothing (the blocks stay
    cached, pinned, for torch's next pinned allocations)."""
    import torch

    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is not None:
        fn()


class HostSlice:
    """A range of a pool buffer: ``tensor`` is a uint8 view of ``nbytes`` bytes at ``offset``."""

    __slots__ = ("buffer", "offset", "nbytes", "size", "tensor")

    def __init__(self, buffer: int, offset: int, nbytes: int, size: int, tensor):
        self.buffer, self.offset, self.nbytes, self.size, self.tensor = buffer, offset, nbytes, size, tensor

    def __repr__(self) -> str:
        return f"HostSlice(buffer={self.buffer}, offset={self.offset}, nbytes={self.nbytes})"


class _Buffer:
    __slots__ = ("data", "capacity", "free", "used")

    def __init__(self, data, capacity: int):
        self.data, self.capacity = data, capacity
        self.free: List[List[int]] = [[0, capacity]]  # sorted [offset, size], coalesced
        self.used = 0


class PinnedPool:
    """Pinned host memory for offloaded tensors: a few large pinned buffers (normally one),
    sub-allocated first-fit with offsets aligned to ``align`` bytes.

    ``pin(nbytes)`` makes a buffer (a 1-D uint8 tensor of ``nbytes``); it defaults to
    ``torch.empty(n, dtype=torch.uint8, pin_memory=True)`` (the :class:`Offloader` passes
    the extension's faster one, :func:`ext_pin`, when there is one). A failure raises
    :class:`PinnedMemoryError` and leaves the pool as it was.

    ``pow2`` (default: on with torch's pinning): buffer sizes are powers of two. PyTorch's
    caching host allocator rounds every pinned allocation up to one, so a buffer of another
    size would pin memory it never uses; ``reserve`` therefore adds one buffer per power of
    two of the missing bytes (16 GiB + 4 GiB for 20 GiB), not one rounded-up buffer."""

    def __init__(self, pin: Optional[Callable[[int], Any]] = None, align: int = ALIGN,
                 min_grow: int = 64 << 20, pow2: Optional[bool] = None,
                 empty_host_cache: Any = "auto"):
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        self._pin = pin or _pin_torch
        self.pow2 = (pin is None) if pow2 is None else pow2
        self.align = align
        self.min_grow = max(align, min_grow)
        # Called after buffers were dropped: torch's caching host allocator keeps a freed
        # pinned block cached (still pinned) for its next pin_memory=True allocation;
        # ``torch._C._host_emptyCache`` (torch 2.11) gives its free blocks back. "auto": that
        # with torch's pinning, nothing with another pin function; None: nothing.
        if empty_host_cache == "auto":
            empty_host_cache = _torch_host_empty_cache if pin is None else None
        self._empty_host_cache = empty_host_cache
        self._buffers: List[Optional[_Buffer]] = []
        self.pins = 0  # buffers pinned so far (each one cudaHostAlloc)
        self.pinned_total = 0  # bytes pinned so far, released ones included
        self.released = 0  # bytes of buffers given back so far
        self.peak_used = 0

    # -- sizes
    @property
    def capacity(self) -> int:
        return sum(b.capacity for b in self._buffers if b is not None)

    @property
    def used(self) -> int:
        return sum(b.used for b in self._buffers if b is not None)

    @property
    def buffers(self) -> int:
        return sum(1 for b in self._buffers if b is not None)

    def _new_buffer(self, nbytes: int) -> int:
        nbytes = _pow2(nbytes) if self.pow2 else _align(nbytes, self.align)
        try:
            data = self._pin(nbytes)
        except PinnedMemoryError:
            raise
        except (RuntimeError, MemoryError, OSError) as e:  # cudaErrorMemoryAllocation & co
            raise PinnedMemoryError(nbytes, e) from e
        if data is None or int(data.numel()) < nbytes:
            raise PinnedMemoryError(nbytes, RuntimeError("the pin function returned too little"))
        self.pins += 1
        self.pinned_total += nbytes
        self._buffers.append(_Buffer(data, nbytes))
        return len(self._buffers) - 1

    def reserve(self, nbytes: int) -> None:
        """Makes the capacity at least ``nbytes``: one new buffer for the difference (with
        ``pow2``: one per power of two of it, the last at least ``min_grow``). On a pinning
        failure the buffers pinned by this call are kept (they are usable)."""
        short = _align(nbytes, self.align) - self.capacity
        while short > 0:
            if not self.pow2:
                self._new_buffer(short)
                return
            chunk = 1 << (short.bit_length() - 1)
            if chunk < self.min_grow:
                chunk = _pow2(max(short, self.min_grow))
            self._new_buffer(chunk)
            short -= chunk

    def alloc(self, nbytes: int) -> HostSlice:
        """A slice of ``nbytes`` (first fit over the buffers in order); grows the pool by one
        buffer (:meth:`grow_size`) when nothing fits."""
        if nbytes <= 0:
            raise ValueError(f"a host slice needs a positive size, got {nbytes}")
        need = _align(nbytes, self.align)
        for bi, buf in enumerate(self._buffers):
            if buf is None:
                continue
            for fi, (off, size) in enumerate(buf.free):
                if size >= need:
                    if size == need:
                        del buf.free[fi]
                    else:
                        buf.free[fi] = [off + need, size - need]
                    return self._take(bi, buf, off, need, nbytes)
        bi = self._new_buffer(self.grow_size(need))
        buf = self._buffers[bi]
        off, size = buf.free[0]
        if size == need:
            buf.free.pop(0)
        else:
            buf.free[0] = [off + need, size - need]
        return self._take(bi, buf, off, need, nbytes)

    def grow_size(self, need: int) -> int:
        """The size of the buffer added when a slice of ``need`` (aligned) bytes fits nowhere:
        the largest of ``need``, ``min_grow`` and a quarter of the capacity (with ``pow2``:
        ``need`` and ``min_grow`` rounded up to a power of two, the quarter rounded down to
        one, since PyTorch pins a power of two anyway). The pool then pins at most about
        1.25 x what it ever held at once, plus the rounding of the slice that grew it
        (doubling pinned up to 2 x: 32 GiB for 18 GB offloaded), in O(log) buffers."""
        quarter = self.capacity // 4
        if self.pow2:
            floor_quarter = 1 << (quarter.bit_length() - 1) if quarter > 0 else 0
            return max(_pow2(need), _pow2(self.min_grow), floor_quarter)
        return max(need, self.min_grow, _align(quarter, self.align) if quarter >= self.align else 0)

    def release_beyond(self, keep: int) -> int:
        """Drops empty buffers while the capacity stays at least ``keep`` bytes (or as close
        above it as the buffers allow): the empty buffers kept are chosen to cover what the
        busy ones lack (the smallest that covers the rest, else the largest, in turn); the
        rest are dropped and, when any was, the host cache emptied. Returns the bytes
        dropped. Slices in use are never touched (a busy buffer stays)."""
        busy = [b for b in self._buffers if b is not None and b.used]
        cap = sum(b.capacity for b in busy)
        empty = [(i, b) for i, b in enumerate(self._buffers) if b is not None and not b.used]
        kept = set()
        while cap < keep and len(kept) < len(empty):
            short = keep - cap
            rest = [(i, b) for i, b in empty if i not in kept]
            cover = [ib for ib in rest if ib[1].capacity >= short]
            i, b = min(cover, key=lambda ib: ib[1].capacity) if cover else max(rest, key=lambda ib: ib[1].capacity)
            kept.add(i)
            cap += b.capacity
        dropped = 0
        for i, b in empty:
            if i not in kept:
                dropped += b.capacity
                b.data = None
                self._buffers[i] = None  # slices keep buffer indices: the slot stays
        if dropped:
            self.released += dropped
            if self._empty_host_cache is not None:
                try:
                    self._empty_host_cache()
                except Exception as e:  # report; the buffers are dropped either way
                    warnings.warn(f"stweaver offload: emptying the pinned host cache failed: {e!r}",
                                  RuntimeWarning)
        return dropped

    def _take(self, bi: int, buf: _Buffer, off: int, need: int, nbytes: int) -> HostSlice:
        buf.used += need
        self.peak_used = max(self.peak_used, self.used)
        return HostSlice(bi, off, need, nbytes, buf.data[off: off + nbytes])

    def free(self, s: HostSlice) -> None:
        buf = self._buffers[s.buffer] if 0 <= s.buffer < len(self._buffers) else None
        if buf is None:
            raise ValueError(f"{s!r}: no such buffer in this pool")
        if s.offset % self.align or s.offset + s.nbytes > buf.capacity:
            raise ValueError(f"{s!r}: not a slice of this pool")
        fl = buf.free
        i = bisect.bisect_left(fl, [s.offset, 0])
        # overlap with a free neighbour = a double free
        if (i < len(fl) and fl[i][0] < s.offset + s.nbytes) or (i > 0 and fl[i - 1][0] + fl[i - 1][1] > s.offset):
            raise ValueError(f"{s!r}: freed twice")
        fl.insert(i, [s.offset, s.nbytes])
        if i + 1 < len(fl) and fl[i][0] + fl[i][1] == fl[i + 1][0]:
            fl[i][1] += fl[i + 1][1]
            del fl[i + 1]
        if i > 0 and fl[i - 1][0] + fl[i - 1][1] == fl[i][0]:
            fl[i - 1][1] += fl[i][1]
            del fl[i]
        buf.used -= s.nbytes
        s.tensor = None

    def release_all(self) -> None:
        """Drops every buffer (all slices must be free)."""
        if any(b is not None and b.used for b in self._buffers):
            raise RuntimeError("PinnedPool.release_all with slices in use")
        self.release_beyond(0)
        self._buffers = []


# ---------------------------------------------------------------- backend


def copy_out(b, t, host: HostSlice, host_view, nbytes: int):
    """The copy out of t into its host slice on backend b's ``d2h`` side stream, after
    the current stream's work so far, with t's block recorded on that stream; (start
    event or None, done event). A backend may do it in one call (``b.copy_out``, the
    extension's); else its primitive operations, in this order."""
    fast = getattr(b, "copy_out", None)
    if fast is not None:
        r = fast(t, host, nbytes)
        if r is not None:
            return r
    cur = b.current_stream(t.device)
    d2h = b.side_stream(t.device, "d2h")
    b.wait_stream(d2h, cur)                      # t is written (current stream) before read
    ev0 = b.event(d2h) if b.timing else None
    b.copy(host_view(), t, d2h)
    b.record_stream(t, d2h)                      # t's block is not reused mid-copy
    return ev0, b.event(d2h)


def copy_in(b, dev, host: HostSlice, host_view, nbytes: int, after):
    """The copy back of a host slice into dev on the ``h2d`` side stream, after the
    current stream's work so far (dev's block's earlier users) and after the event
    ``after`` (the copy out); dev recorded on that stream; (start or None, done)."""
    fast = getattr(b, "copy_in", None)
    if fast is not None:
        r = fast(dev, host, nbytes, after)
        if r is not None:
            return r
    cur = b.current_stream(dev.device)
    h2d = b.side_stream(dev.device, "h2d")
    b.wait_stream(h2d, cur)      # the block's earlier users (current stream) are done
    b.wait_event(h2d, after)     # the host slice holds the data
    ev0 = b.event(h2d) if b.timing else None
    b.copy(dev, host_view(), h2d)
    b.record_stream(dev, h2d)    # dev dying early does not free it under the copy
    return ev0, b.event(h2d)


def wait_current(b, device, event) -> None:
    """The device's current stream waits (on the device) for event."""
    fast = getattr(b, "wait_current", None)
    if fast is not None and fast(device, event):
        return
    b.wait_event(b.current_stream(device), event)


class CudaBackend:
    """The CUDA operations of the offloader (the test suite swaps in a CPU fake).

    ``ext``: stweaver's extension; when it has ``offload_copy_out`` (cpp/offload_copy.cpp),
    each copy is one call into it with pooled events (``copy_out`` / ``copy_in`` /
    ``wait_current``) instead of ~10 calls of torch's Python API: the hooks run once per
    offloaded tensor each way while forward is host-bound. ``STWEAVER_OFFLOAD_FAST=0``
    turns that path off (an A/B control)."""

    def __init__(self, timing: bool = True, ext=None):
        import torch

        self.torch = torch
        self.timing = timing
        self._streams: Dict[Tuple[str, int], Any] = {}
        self._fast = ext if ext is not None and hasattr(ext, "offload_copy_out") else None
        if os.environ.get("STWEAVER_OFFLOAD_FAST", "1") == "0":  # the A/B control
            self._fast = None
        self._pooled = getattr(self._fast, "PooledEvent", None)
        self._mem_stats = getattr(torch._C, "_cuda_memoryStats", None) or (
            lambda idx: {"allocated_bytes": {"all": {"current": torch.cuda.memory_allocated(idx),
                                                     "peak": torch.cuda.max_memory_allocated(idx)}}})

    def _side(self, device, kind: str):
        s = self.side_stream(device, kind)
        return s.stream_id, s.device_index, s.device_type

    def copy_out(self, t, host: HostSlice, nbytes: int):
        if self._fast is None:
            return None
        return self._fast.offload_copy_out(t, host.tensor, nbytes, *self._side(t.device, "d2h"), self.timing)

    def copy_in(self, dev, host: HostSlice, nbytes: int, after):
        if self._fast is None or not isinstance(after, self._pooled):
            return None
        return self._fast.offload_copy_in(dev, host.tensor, nbytes, *self._side(dev.device, "h2d"), after,
                                          self.timing)

    def wait_current(self, device, event) -> bool:
        if self._fast is None or not isinstance(event, self._pooled):
            return False
        idx = device.index if device.index is not None else self.torch.cuda.current_device()
        self._fast.offload_wait(event, idx)
        return True

    def is_device(self, t) -> bool:
        return t.is_cuda

    def allocated_bytes(self, device) -> int:
        """The device's allocated bytes now (the watermark's read, once per candidate pack
        and counted unpack before a plan): ``torch._C._cuda_memoryStats``'s nested dict
        read directly, without ``torch.cuda.memory_allocated``'s flattening of every stat
        into strings; the allocator's (stweaver's) own stats."""
        idx = device.index if device.index is not None else self.torch.cuda.current_device()
        return self._mem_stats(idx)["allocated_bytes"]["all"]["current"]

    def peak_allocated_bytes(self, device) -> int:
        """The allocator's peak allocated bytes (read, never reset: resetting would change
        what ``torch.cuda.max_memory_allocated`` tells the user); the watermark reads it at
        an iteration's first check and at its boundary."""
        idx = device.index if device.index is not None else self.torch.cuda.current_device()
        return self._mem_stats(idx)["allocated_bytes"]["all"]["peak"]

    def current_stream(self, device):
        return self.torch.cuda.current_stream(device)

    def side_stream(self, device, kind: str):
        idx = device.index if device.index is not None else self.torch.cuda.current_device()
        key = (kind, idx)
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = self.torch.cuda.Stream(device=idx)
        return s

    def wait_stream(self, waiter, waitee) -> None:
        waiter.wait_stream(waitee)

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def event(self, stream):
        ev = self.torch.cuda.Event(enable_timing=self.timing)
        ev.record(stream)
        return ev

    def query(self, event) -> bool:
        return event.query()

    def elapsed_ms(self, a, b) -> Optional[float]:
        if not self.timing:
            return None
        return a.elapsed_time(b)

    def copy(self, dst, src, stream) -> None:
        with self.torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record_stream(self, t, stream) -> None:
        t.record_stream(stream)

    def empty_device(self, size, stride, dtype, device):
        return self.torch.empty_strided(size, stride, dtype=dtype, device=device)


# ---------------------------------------------------------------- schedule

Entry = Tuple[int, int, int, int]


def normalize_schedule(schedule: Iterable) -> List[Entry]:
    """Validated ``(pack, unpack, prefetch_after_unpack, bytes)`` entries (None -> -1), sorted by
    pack ordinal."""
    out: List[Entry] = []
    seen = set()
    for i, e in enumerate(schedule):
        try:
            pack, unpack, pre, nbytes = e
        except (TypeError, ValueError):
            raise ValueError(f"offload schedule entry {i}: expected (pack, unpack, prefetch_after_unpack, bytes), got {e!r}") from None
        pre = -1 if pre is None else pre
        for name, v in (("pack", pack), ("unpack", unpack), ("prefetch_after_unpack", pre), ("bytes", nbytes)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"offload schedule entry {i}: {name}={v!r} is not an int")
        if pack < 0 or unpack < 0 or nbytes <= 0:
            raise ValueError(f"offload schedule entry {i}: {e!r}: pack and unpack must be >= 0, bytes > 0")
        if not (-1 <= pre <= unpack):
            raise ValueError(
                f"offload schedule entry {i}: {e!r}: prefetch_after_unpack must be in [-1, unpack] "
                f"(a copy back cannot start after its tensor is needed)")
        if pack in seen:
            raise ValueError(f"offload schedule entry {i}: pack ordinal {pack} appears twice")
        seen.add(pack)
        out.append((int(pack), int(unpack), int(pre), int(nbytes)))
    out.sort()
    return out


def schedule_host_bytes(schedule: Sequence[Entry], align: int = ALIGN) -> int:
    """Pinned bytes that hold every scheduled tensor at once (slices aligned): an upper bound of
    the peak of concurrently offloaded bytes, exact when all packs precede the first unpack."""
    return sum(_align(e[3], align) for e in schedule)


# ---------------------------------------------------------------- watermark


class Watermark:
    """Before a plan is served, under a budget: offload a saved tensor only when the device
    would otherwise come near the budget (module doc, "Watermark").

    ``limit``: the device limit in bytes, or a callable ``limit(device) -> bytes or None``
    (None: not known, and the iteration offloads as plain threshold rules do), read once per
    iteration. ``margin``: bytes kept free below the limit (default ``max(min_margin,
    limit / 32)``: the online arenas' fragmentation, transients the hooks do not see).

    Each candidate is *checked* at its pack with ``allocated``, the device's allocated bytes
    then (it included):

    * before anything was learned (the first iteration, and the first after :meth:`forget`)
      every candidate moves, as without a watermark, and the iteration is measured: no
      guess of what comes later is safe there. Forward's end can allocate more than all
      the activations before it (a large vocabulary's logits, their fp32 copy and the saved
      log-softmax: Llama 1B at 8 x 2048 tokens, ~21 GB) and the first iteration cannot
      know it. ``guess_first=True`` guesses instead: a candidate stays when ``allocated +
      headroom <= limit``, ``headroom = max(first, grads) + (prefetch + 2) x largest +
      max(margin, limit / 8)`` -- ``first`` the allocated bytes at the first check
      (parameters and batch before any optimizer state: at least the gradients backward
      allocates when they start as None), ``grads`` the bytes of the trainable parameters
      without ``.grad`` saved so far in the iteration, ``largest`` the largest candidate so
      far, ``limit / 8`` for forward's end (too little for such losses: the tests show a
      GPT-2-shaped run going over with it);
    * once an iteration was measured it stays when ``allocated <= level``, the learned
      watermark level.

    At a boundary the iteration's peak ``P`` (the most allocated at any check or sampled
    unpack, and the allocator's own peak when it set a new record during the iteration) is
    set against ``T = limit - margin``, and ``level`` moves from the level in force (the
    learned one, else the most allocated at which a candidate stayed):

    * ``P <= T``: up over the offloaded candidates in order of their allocated bytes, to
      the allocated bytes the last of them would have at its check with those before it
      kept (their bytes added), while both the sum of their bytes (keeping more raises the
      peak by at most the extra bytes kept) and the rise of the level (the peak follows the
      level when the static part grew meanwhile -- the optimizer's state after the first
      step -- and the kept candidates fill what the level allows) stay within ``T - P``;
    * ``P > T``: down below the kept candidates of most allocated bytes until theirs cover
      ``P - T``.

    So the level approaches the limit from below, one measured iteration at a time, and
    :meth:`forget` (the program changed: more blocks recomputed) goes back to measuring an
    iteration that moves every candidate."""

    def __init__(self, limit, margin: Optional[int] = None, min_margin: int = 256 << 20,
                 guess_first: bool = False):
        if isinstance(limit, bool) or not (callable(limit) or (isinstance(limit, int) and limit > 0)):
            raise ValueError(f"watermark limit must be bytes > 0 or a callable, got {limit!r}")
        self._limit = limit
        self.guess_first = guess_first
        self.margin_fixed = margin
        self.min_margin = min_margin
        self.first: Optional[int] = None
        self.level: Optional[int] = None
        self.iterations = 0  # iterations measured
        self.reads = 0  # allocated-bytes reads by the hooks (pack checks and unpack samples)
        self.last: Optional[dict] = None
        self._begin_iteration(None)

    def _begin_iteration(self, limit: Optional[int]) -> None:
        self.limit = limit
        self.margin = (self.margin_fixed if self.margin_fixed is not None
                       else max(self.min_margin, (limit or 0) // 32))
        self.largest = 0
        self.grads = 0
        self._grad_ids: set = set()
        self.checks: List[Tuple[int, int, bool]] = []  # (allocated, bytes, stayed) per check
        self.peak_seen = 0
        self.peak_start: Optional[int] = None
        self.kept = 0

    def begin(self, device, peak: Optional[int] = None) -> bool:
        """Reads the limit for an iteration; whether the watermark applies to it. ``peak``:
        the allocator's peak allocated bytes now (None: not known)."""
        limit = self._limit(device) if callable(self._limit) else self._limit
        if limit is None or limit <= 0:
            self._begin_iteration(None)
            return False
        self._begin_iteration(int(limit))
        self.peak_start = peak
        return True

    def note_param(self, p) -> None:
        """A trainable parameter saved without a ``.grad`` yet: backward will allocate one."""
        if id(p) not in self._grad_ids:
            self._grad_ids.add(id(p))
            self.grads += p.numel() * p.element_size()

    def headroom(self, prefetch: int) -> Optional[int]:
        """What the check keeps free below the limit now (None: nothing learned, no guess:
        every candidate moves)."""
        if self.level is not None:
            return (self.limit or 0) - self.level
        if not self.guess_first:
            return None
        return (max(self.first or 0, self.grads) + (max(0, prefetch) + 2) * self.largest
                + max(self.margin, (self.limit or 0) // 8))

    def keep(self, allocated: int, nbytes: int, prefetch: int) -> bool:
        """Whether a candidate of ``nbytes`` saved with ``allocated`` bytes on the device stays."""
        self.reads += 1
        if self.first is None:
            self.first = allocated
        self.largest = max(self.largest, nbytes)
        self.peak_seen = max(self.peak_seen, allocated)
        h = self.headroom(prefetch)
        stay = h is not None and allocated + h <= self.limit
        self.checks.append((allocated, nbytes, stay))
        if stay:
            self.kept += 1
        return stay

    def note_unpack(self, allocated: int) -> None:
        self.reads += 1
        self.peak_seen = max(self.peak_seen, allocated)

    def end_iteration(self, prefetch: int, peak: Optional[int] = None) -> None:
        """Moves the level (see the class doc). ``peak``: the allocator's peak allocated bytes
        now (None: not known)."""
        if self.limit is None or not self.checks:
            return
        p = self.peak_seen
        if peak is not None and self.peak_start is not None and peak > self.peak_start:
            p = max(p, peak)  # a new record: the iteration's own peak, transients included
        target = self.limit - self.margin
        kept = sorted((a, n) for a, n, stay in self.checks if stay)
        offloaded = sorted((a, n) for a, n, stay in self.checks if not stay)
        low = min(a for a, _, _ in self.checks) - 1
        top = kept[-1][0] if kept else low  # the most allocated at a kept candidate
        ref = self.level if self.level is not None else top
        if p <= target:
            slack = target - p
            # Nothing flips at first: below the offloaded candidate of fewest bytes allocated.
            level = min(ref, offloaded[0][0] - 1) if offloaded else ref
            total = 0
            for a, n in offloaded:
                # Kept, the candidates flipped before it are still allocated at its check.
                at = a + total
                if total + n > slack or at - top > slack:
                    break
                level = max(level, at)
                total += n
        else:
            over = p - target
            level, dropped = low, 0
            for a, n in reversed(kept):
                if dropped >= over:
                    level = a
                    break
                dropped += n
            level = min(level, ref - over)
        h_used = self.headroom(prefetch)
        self.level = level
        self.iterations += 1
        self.last = {"limit": self.limit, "margin": self.margin, "headroom": h_used, "checks": len(self.checks),
                     "kept": self.kept, "grads": self.grads, "largest": self.largest, "peak": p,
                     "level": level, "level_before": ref}
        self._begin_iteration(self.limit)

    def forget(self) -> None:
        """The program changed (e.g. more blocks recomputed): back to the unlearned headroom
        until an iteration of the new program is measured."""
        self.level = None

    def stats(self) -> dict:
        return {"first": self.first, "level": self.level, "iterations": self.iterations, "reads": self.reads,
                "last_iteration": dict(self.last) if self.last else None}


def _ext_limit(ext) -> Optional[Callable[[Any], Optional[int]]]:
    """The device limit stweaver enforces (``info_json``'s ``limit_bytes``: the budget and
    ``set_per_process_memory_fraction``, the smaller), as the watermark's ``limit``; None
    (no watermark) for an extension without ``info_json``. The limit reads as None while
    neither a budget nor a fraction below 1 is set: the budget is not known."""
    if ext is None or not hasattr(ext, "info_json"):
        return None
    import json

    def limit(device) -> Optional[int]:
        idx = getattr(device, "index", None)
        if idx is None:
            import torch

            idx = torch.cuda.current_device()
        try:
            info = json.loads(ext.info_json())
        except Exception:
            return None
        for d in info.get("devices") or []:
            if d.get("device") != idx:
                continue
            lim = d.get("limit_bytes")
            frac = d.get("memory_fraction")
            if lim is None or (d.get("budget") is None and (frac is None or frac >= 1.0)):
                return None
            return int(lim)
        return None

    return limit


# ---------------------------------------------------------------- offloader


class _Handle:
    """What autograd keeps for an offloaded tensor: host slice and metadata, not the tensor."""

    __slots__ = ("k", "j_expected", "host", "size", "stride", "dtype", "device", "nbytes",
                 "ev_out", "ev_out0", "dev", "ev_in", "unpacked", "stalled", "owner", "iteration", "src",
                 "storage", "rec_id", "__weakref__")

    def __del__(self):
        # Dropped unpacked (graph freed) or after: give the slice back once copies are done.
        owner = self.owner
        if owner is not None and self.host is not None:
            owner._zombies.append((self.host, self.ev_in if self.ev_in is not None else self.ev_out))
            self.host = None


class _View:
    """What autograd keeps for another whole view of an offloaded storage (same storage, same
    dtype, its own shape and strides): the storage's handle, which this keeps alive."""

    __slots__ = ("main", "size", "stride")

    def __init__(self, main: _Handle, size: tuple, stride: tuple):
        self.main, self.size, self.stride = main, size, stride


class Offloader:
    """Pack/unpack hooks for ``torch.autograd.graph.saved_tensors_hooks``; see the module doc.

    ``schedule``: a list of entries, ``"plan"`` (the served plan's, read at each boundary) or
    None (threshold mode with ``min_bytes``). ``ext``: stweaver's extension object (for
    ``record_saved`` / ``offload_schedule``); None: none. ``backend``: :class:`CudaBackend` by
    default. ``pool``: a :class:`PinnedPool`."""

    def __init__(self, schedule=None, min_bytes: Optional[int] = None, ext=None, backend=None,
                 pool: Optional[PinnedPool] = None, prefetch: int = 1,
                 first_min_bytes: Optional[int] = None, watermark: Any = None):
        if schedule is None and min_bytes is None:
            raise ValueError("Offloader needs a schedule (entries or 'plan') or min_bytes")
        if min_bytes is not None and (isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0):
            raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
        if schedule == "plan":
            if ext is None or not hasattr(ext, "offload_schedule"):
                raise RuntimeError(
                    "offload schedule='plan' needs stweaver installed with an extension that has "
                    "offload_schedule() (install stweaver first, or pass a schedule / min_bytes)")
            self.mode = "plan"
        elif schedule is not None:
            self.mode = "schedule"
        else:
            self.mode = "threshold"
        self.min_bytes = min_bytes
        # Schedule / plan modes: until the first boundary, offload as threshold mode does with
        # this size (the first iteration is the plan's prologue, which carries no schedule:
        # under a budget below the run's peak it must offload to fit too). None: no.
        if first_min_bytes is not None and (isinstance(first_min_bytes, bool) or first_min_bytes < 0):
            raise ValueError(f"first_min_bytes must be an int >= 0, got {first_min_bytes!r}")
        self.first_min_bytes = first_min_bytes
        # Plan mode: auto mode still records or plans (no plan served yet), read from
        # ext.mode() at each boundary; first_min_bytes applies meanwhile.
        self._before_plan = False
        self.ext = ext
        self._record = getattr(ext, "record_saved", None) if ext is not None else None
        self._restore = getattr(ext, "record_restore", None) if ext is not None else None
        # record_saved while stweaver may record a trace, None once it no longer can (read
        # at each boundary): a call into the extension per counted hook call is the hooks'
        # largest host cost when nothing is recorded.
        self._rec = self._record if self._may_record() else None
        self.backend = backend if backend is not None else CudaBackend(ext=ext)
        self._is_device = self.backend.is_device  # bound once: the hooks call it per tensor
        self.pool = pool if pool is not None else PinnedPool(pin=ext_pin(ext))
        self.prefetch = prefetch
        # The watermark of the threshold rules before a plan (first_min_bytes): a
        # Watermark, a limit (bytes or callable), "auto" (stweaver's limit, from the
        # extension), or None (off: every candidate is offloaded).
        if watermark == "auto":
            lim = _ext_limit(ext)
            watermark = Watermark(lim) if lim is not None else None
        elif watermark is not None and not isinstance(watermark, Watermark):
            watermark = Watermark(watermark)
        if watermark is not None and not hasattr(self.backend, "allocated_bytes"):
            watermark = None  # no way to read the bytes in use
        self.watermark: Optional[Watermark] = watermark
        self._wm_it: Optional[bool] = None  # this iteration: watermark on / off / not decided yet
        self._wm_device = None
        self._fitted: Optional[int] = None  # the pinned bytes the pool was last fitted to
        self._lock = threading.RLock()
        self._zombies: List[tuple] = []  # (slice, event) of dead handles, appended from __del__
        self._pending: List[tuple] = []  # (slice, event) waiting for the event to pass
        self._timings: List[tuple] = []  # (kind, start event, end event, bytes)
        self.off_reason: Optional[str] = None
        self._raw_plan: Optional[list] = None
        self._schedule: List[Entry] = []
        self._by_pack: Dict[int, Entry] = {}
        self._by_prefetch: List[Tuple[int, int]] = []  # (prefetch_after_unpack, pack), sorted
        self._totals = self._zero()
        self._it = self._zero()
        self.iterations = 0
        self.last_iteration: Optional[dict] = None
        # Counted pack bytes since construction (what recompute_blocks(model, "auto")
        # measures per block), and callables run at each boundary before the plan is read,
        # with the offloader (its AutoRecompute's).
        self.packed_bytes = 0
        self.boundary_hooks: List[Callable[["Offloader"], None]] = []
        self.auto_recompute = None
        # STWEAVER_TIME_CALLS (enable() pushes the timed hooks): pack ns, packs, unpack ns, unpacks.
        self.hook_times: Optional[List[int]] = None
        self._copy_ms = {"d2h": 0.0, "h2d": 0.0}
        self._copy_bytes_timed = {"d2h": 0, "h2d": 0}
        self._reset_ordinals()
        if self.mode == "schedule":
            self.set_schedule(schedule)
        elif self.mode == "plan":
            self._read_plan()

    # -- state
    @staticmethod
    def _zero() -> dict:
        return {"packs": 0, "unpacks": 0, "packs_device": 0, "markers": 0, "marker_misses": 0,
                "tensors_out": 0, "bytes_out": 0, "tensors_in": 0, "bytes_in": 0, "stalls": 0,
                "prefetched": 0, "shared": 0, "restore_links": 0, "schedule_skipped": 0, "schedule_mismatch": 0,
                "schedule_unreached": 0, "unpack_drift": 0, "not_unpacked": 0, "pin_failures": 0,
                "watermark_kept": 0}

    def _threshold_now(self) -> bool:
        """Threshold rules apply now: threshold mode, or the first iteration with
        ``first_min_bytes``."""
        return self.mode == "threshold" or (
            self.first_min_bytes is not None and (self.iterations == 0 or self._before_plan)
        )

    def _reset_ordinals(self) -> None:
        self._misses = 0  # record_saved calls with a device pointer that recorded nothing
        self.k = 0  # next pack ordinal
        self.j = 0  # next unpack ordinal
        self._live: Dict[int, weakref.ref] = {}  # pack ordinal -> handle (this iteration)
        self._by_ptr: Dict[int, weakref.ref] = {}  # device pointer -> handle (this iteration)
        self._started: set = set()
        self._prefetch_pos = 0
        # The prefetch point of _by_prefetch[_prefetch_pos] (_NEVER past the end): an unpack
        # before it with nothing due has no copy back to start (the hot path's test).
        self._next_prefetch = self._by_prefetch[0][0] if self._by_prefetch else _NEVER
        self._due: List[int] = []  # pack ordinals due for copy back, not packed yet
        self._order: List[int] = []  # threshold mode: offloaded pack ordinals, in order
        self._wm_kept: Dict[int, weakref.ref] = {}  # device pointer -> storage the watermark kept

    def set_schedule(self, schedule: Iterable) -> None:
        """Replaces the schedule (takes effect now; normally called at a boundary)."""
        entries = normalize_schedule(schedule)
        with self._lock:
            self._schedule = entries
            self._by_pack = {e[0]: e for e in entries}
            self._by_prefetch = sorted((e[2], e[0]) for e in entries)
            self._next_prefetch = (self._by_prefetch[self._prefetch_pos][0]
                                   if self._prefetch_pos < len(self._by_prefetch) else _NEVER)
            need = schedule_host_bytes(entries, self.pool.align)
            if need and self.off_reason is None:
                try:
                    self.pool.reserve(need)
                except PinnedMemoryError as e:
                    self._turn_off(e)

    def _read_plan(self) -> None:
        try:
            sched = list(self.ext.offload_schedule())
        except Exception as e:  # report; never stop training
            warnings.warn(f"stweaver offload: reading the plan's offload schedule failed: {e}", RuntimeWarning)
            sched = []
        if sched != self._raw_plan:
            self._raw_plan = sched
            self.set_schedule(sched)

    def _runtime_before_plan(self) -> bool:
        """Whether stweaver's auto mode is still recording or planning (no plan served or
        refused yet): until then the run has no schedule and, with ``first_min_bytes``,
        offloads by threshold to fit its budget."""
        try:
            m = str(self.ext.mode())
        except Exception:  # an extension without mode(): no auto stage to wait for
            return False
        return m.startswith("auto (recording") or m.startswith("auto (planning") or m.startswith("auto (plan held")

    def _may_record(self) -> bool:
        """Whether stweaver may record saved-tensor markers from now on: not once its mode
        says it serves online or a plan, or has written its trace (states a run does not
        leave). An extension without ``mode()``: yes."""
        if self._record is None:
            return False
        try:
            m = str(self.ext.mode())
        except Exception:
            return True
        return not (m in ("online", "plan", "auto (plan)", "trace (written)")
                    or m.startswith("online (") or m.startswith("auto (online"))

    def _turn_off(self, err: PinnedMemoryError) -> None:
        self._it["pin_failures"] += 1
        if self.off_reason is None:
            self.off_reason = str(err)
            warnings.warn(str(err), RuntimeWarning, stacklevel=3)

    # -- helpers
    def _mark(self, t, dev: bool, pack: bool) -> Optional[int]:
        """Records the saved-tensor event; the allocation's trace id, None when nothing was
        recorded (or the extension gives no id)."""
        if self._rec is None:
            return None
        ptr = 0
        if dev:
            try:
                ptr = t.data_ptr()
            except RuntimeError:  # a tensor without storage (fake / functional): no marker
                ptr = 0
        r = self._rec(ptr, pack)
        if isinstance(r, bool):  # an extension that only says whether it recorded
            ok, rid = r, None
        else:
            ok = r is not None and r >= 0
            rid = int(r) if ok else None
        if ok:
            self._it["markers"] += 1
        elif ptr:
            self._misses += 1
        return rid

    def _reap(self, full: bool = False) -> None:
        """Frees host slices whose last copy has passed (never waits). The hooks' calls
        stop at the first slice whose copy is still running (``full``, at a boundary:
        every slice is asked): the copies back run in order on one stream and are
        reaped in about that order, so one event query per call instead of one per
        pending slice (quadratic over backward's unpacks)."""
        while self._zombies:  # list.pop is atomic: __del__ may append meanwhile
            self._pending.append(self._zombies.pop())
        if not self._pending:
            return
        keep = []
        query = self.backend.query
        pending = self._pending
        for i, (sl, ev) in enumerate(pending):
            if ev is None or query(ev):
                self.pool.free(sl)
            elif full:
                keep.append((sl, ev))
            else:
                keep.extend(pending[i:])
                break
        self._pending = keep

    def eligible(self, t) -> bool:
        """Whether t can be offloaded (see the module doc)."""
        import torch

        if type(t) is not torch.Tensor or not self.backend.is_device(t):
            return False
        if isinstance(getattr(t, "_base", None), torch.nn.Parameter):
            return False  # a view of a parameter (a weight's transpose): the parameter holds it
        if t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg():
            return False
        n = t.numel() * t.element_size()
        if n == 0 or not (t.is_contiguous() or _dense(t)):
            return False
        st = t.untyped_storage()
        return t.data_ptr() == st.data_ptr() and n == st.nbytes()

    def counted(self, t) -> bool:
        """Whether a hook call on t counts as an ordinal (see the module doc): a device tensor
        that covers its whole (non-empty) storage."""
        return self.backend.is_device(t) and _whole_storage_bytes(t) > 0

    # -- hooks
    def pack(self, t):
        # The hot path (every saved tensor of the iteration, a few thousand per step, most
        # of them left alone): attribute reads hoisted into locals, the counted test
        # inlined (``_whole_storage_bytes``), and the slice reaping skipped when nothing waits.
        lock = self._lock  # acquire / release: half the cost of `with` here
        lock.acquire()
        try:
            it = self._it
            it["packs"] += 1
            dev = self._is_device(t)
            if not dev:
                if self._zombies or self._pending:
                    self._reap()
                return t
            it["packs_device"] += 1
            nbytes = _whole_storage_bytes(t)
            if not nbytes:  # not counted: a view of part of a storage, empty, no storage
                if self._zombies or self._pending:
                    self._reap()
                return t
            k = self.k
            self.k = k + 1
            self.packed_bytes += nbytes
            rid = self._mark(t, True, True) if self._rec is not None else None
            if self._zombies or self._pending:
                self._reap()
            if self.off_reason is not None:
                return t
            if self._by_ptr:
                shared = self._shared(t, k)  # scheduled or not: the device copy is gone already
                if shared is not None:
                    return shared
            if self._threshold_now():
                if self.mode == "threshold":
                    if not (nbytes >= self.min_bytes and self.eligible(t)):
                        return t
                else:
                    wm = self.watermark is not None and self._wm_it is not False
                    if not (nbytes >= self.first_min_bytes and self.eligible(t)):
                        if wm:
                            self._wm_param(t)
                        return t
                    if wm and (self._wm_kept_before(t) or self._wm_keep(t, nbytes)):
                        it["watermark_kept"] += 1
                        return t
                j_expected = -1
            else:
                e = self._by_pack.get(k)
                if e is None:
                    return t
                if not self.eligible(t):
                    it["schedule_skipped"] += 1
                    return t
                if nbytes != e[3]:
                    it["schedule_mismatch"] += 1
                    return t
                j_expected = e[1]
            try:
                return self._offload(t, k, j_expected, nbytes, rid)
            except PinnedMemoryError as err:
                self._turn_off(err)
                return t
        finally:
            lock.release()

    def _wm_device_bytes(self, device) -> Optional[int]:
        try:
            return int(self.backend.allocated_bytes(device))
        except Exception as e:  # report once; the iteration offloads as plain threshold
            warnings.warn(f"stweaver offload: reading the device's allocated bytes failed ({e!r}); "
                          f"no watermark this iteration", RuntimeWarning)
            return None

    def _wm_start(self, device) -> bool:
        """Whether the watermark applies to this iteration (the limit read at its first
        counted pack)."""
        if self._wm_it is None:
            try:
                self._wm_device = device
                self._wm_it = self.watermark.begin(device, self._wm_peak(device))
            except Exception as e:
                warnings.warn(f"stweaver offload: reading the device limit failed ({e!r}); "
                              f"no watermark this iteration", RuntimeWarning)
                self._wm_it = False
        return self._wm_it

    def _wm_peak(self, device) -> Optional[int]:
        """The allocator's peak allocated bytes (None: the backend does not say)."""
        fn = getattr(self.backend, "peak_allocated_bytes", None)
        if fn is None or device is None:
            return None
        try:
            return int(fn(device))
        except Exception:
            return None

    def _wm_keep(self, t, nbytes: int) -> bool:
        """The watermark's decision for a candidate (module doc, "Watermark"): True when it
        stays on the device."""
        if not self._wm_start(t.device):
            return False
        a = self._wm_device_bytes(t.device)
        if a is None:
            self._wm_it = False
            return False
        if not self.watermark.keep(a, nbytes, self.prefetch):
            return False
        try:
            self._wm_kept[t.data_ptr()] = weakref.ref(t.untyped_storage())
        except (RuntimeError, NotImplementedError, TypeError):
            pass
        return True

    def _wm_kept_before(self, t) -> bool:
        """Whether the watermark kept this storage at an earlier pack of the iteration (a
        tensor saved twice, or another whole view of it): it stays, since offloading a
        later save would copy it and free nothing (module doc: tensors saved several
        times). The storage object's identity, not its address, as :meth:`_shared`."""
        ref = self._wm_kept.get(t.data_ptr())
        if ref is None:
            return False
        try:
            return ref() is t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return False

    def _wm_param(self, t) -> None:
        """A saved trainable parameter (or a whole view of one) without ``.grad``: its
        gradient is still to come (the watermark's headroom)."""
        param = _parameter_type()
        p = t if isinstance(t, param) else getattr(t, "_base", None)
        if isinstance(p, param) and p.requires_grad and p.grad is None and self._wm_start(t.device):
            self.watermark.note_param(p)

    def _wm_sample(self, device) -> None:
        a = self._wm_device_bytes(device)
        if a is None:
            self._wm_it = False
        else:
            self.watermark.note_unpack(a)

    def program_changed(self) -> None:
        """The model's program changed (more blocks recomputed, say): the watermark forgets
        the level it learned (module doc, "Watermark")."""
        with self._lock:
            if self.watermark is not None:
                self.watermark.forget()

    def _shared(self, t, k: int):
        """The handle of this very tensor, or of another whole view of the same storage, if it
        was offloaded earlier in the iteration (a tensor saved twice, e.g. softmax's output by
        softmax and by the next matmul; a layer norm's output and its ``view(-1, n)`` saved by
        the next projection): one host copy, one copy back. Offloading only one of the saves
        would free nothing (the other keeps the device storage), and offloading both would
        copy the storage twice. The same Python object is what autograd passes for the same
        TensorImpl, and the same storage object (``untyped_storage()``, preserved while the
        storage lives) for the same storage: a pointer alone could be a new tensor in a freed
        block. Another view gets a :class:`_View` of the handle (its own shape and strides)."""
        ref = self._by_ptr.get(t.data_ptr())
        h = ref() if ref is not None else None
        if h is None or h.unpacked:
            return None
        src = h.src() if h.src is not None else None
        if src is t:
            out = h
        else:
            st = h.storage() if h.storage is not None else None
            try:
                same = st is not None and st is t.untyped_storage() and t.dtype == h.dtype
            except (RuntimeError, NotImplementedError):
                same = False
            if not same:
                return None
            out = _View(h, tuple(t.size()), tuple(t.stride()))
        self._live[k] = ref
        h.j_expected = -1  # unpacked once per save: either may come first
        self._it["shared"] += 1
        return out

    def _offload(self, t, k: int, j_expected: int, nbytes: int, rid: Optional[int] = None):
        b = self.backend
        sl = self.pool.alloc(nbytes)  # raises before anything is queued
        h = _Handle()
        h.k, h.j_expected, h.host, h.nbytes = k, j_expected, sl, nbytes
        h.rec_id = rid  # t's trace id when its pack was recorded
        h.size, h.stride, h.dtype, h.device = tuple(t.size()), tuple(t.stride()), t.dtype, t.device
        h.dev = h.ev_in = None
        h.unpacked = h.stalled = False
        h.iteration = self.iterations
        h.ev_out0, h.ev_out = copy_out(b, t, sl, lambda: self._host_view(h), nbytes)
        if h.ev_out0 is not None:
            self._timings.append(("d2h", h.ev_out0, h.ev_out, nbytes))
        h.owner = self
        h.src = weakref.ref(t)
        try:
            h.storage = weakref.ref(t.untyped_storage())
        except (RuntimeError, NotImplementedError, TypeError):
            h.storage = None
        self._live[k] = self._by_ptr[t.data_ptr()] = weakref.ref(h)
        if self._threshold_now():
            self._order.append(k)
        self._it["tensors_out"] += 1
        self._it["bytes_out"] += nbytes
        return h

    def _host_view(self, h: _Handle):
        # Offsets are 512-aligned: a view as any dtype is aligned.
        return h.host.tensor.view(h.dtype).as_strided(h.size, h.stride)

    def _copy_back(self, h: _Handle) -> None:
        """Starts h's copy back (see the module doc, unpack step 2)."""
        b = self.backend
        dev = b.empty_device(h.size, h.stride, h.dtype, h.device)  # on the current stream
        if h.rec_id is not None and self._restore is not None:
            # The copy back is the packed allocation again (a restore link in the trace).
            if self._restore(dev.data_ptr(), h.rec_id):
                self._it["restore_links"] += 1
        ev0, h.ev_in = copy_in(b, dev, h.host, lambda: self._host_view(h), h.nbytes, h.ev_out)
        if ev0 is not None:
            self._timings.append(("h2d", ev0, h.ev_in, h.nbytes))
        h.dev = dev
        self._started.add(h.k)
        self._it["tensors_in"] += 1
        self._it["bytes_in"] += h.nbytes

    def _start_if_live(self, k: int) -> bool:
        """Copy back of pack ordinal k if it is an offloaded handle not started; whether k is
        settled (started now or before, or never offloaded and never will be)."""
        if k in self._started:
            return True
        ref = self._live.get(k)
        h = ref() if ref is not None else None
        if h is not None:
            if h.ev_in is None and not h.unpacked:
                self._copy_back(h)
                self._it["prefetched"] += 1
            return True
        return k < self.k  # packed (and not offloaded, or dead) vs not packed yet

    def unpack(self, x):
        # The hot path, as pack's: most unpacks get back the tensor pack returned.
        lock = self._lock  # acquire / release: half the cost of `with` here
        lock.acquire()
        try:
            self._it["unpacks"] += 1
            view = None
            if isinstance(x, _View):
                view, x = x, x.main
            handle = isinstance(x, _Handle)
            nb = 0
            if not handle and not (self._is_device(x) and (nb := _whole_storage_bytes(x))):
                if self._zombies or self._pending:
                    self._reap()
                return x
            j = self.j
            self.j = j + 1
            plan = not self._threshold_now()
            if plan and (self._due or self._next_prefetch <= j - 1):
                self._trigger(j - 1)  # due before this unpack (p = -1 at the first one)
            if not handle:
                if self._rec is not None:
                    self._mark(x, True, False)
                if self._zombies or self._pending:
                    self._reap()
                if plan and (self._due or self._next_prefetch <= j):
                    self._trigger(j)
                if self._wm_it and nb >= self.first_min_bytes:  # a candidate's size: worth a read
                    self._wm_sample(x.device)
                return x
            h = x
            if h.ev_in is None:
                if h.host is None:
                    raise RuntimeError("stweaver offload: a saved tensor was unpacked after its host copy was released")
                self._copy_back(h)
                h.stalled = True
                self._it["stalls"] += 1
            wait_current(self.backend, h.device, h.ev_in)  # device-side wait only
            if not h.unpacked:
                if h.j_expected >= 0 and h.j_expected != j:
                    self._it["unpack_drift"] += 1  # the plan expected it at another unpack
                h.unpacked = True
                if h.host is not None:
                    self._pending.append((h.host, h.ev_in))
                    h.host = None
                for kk in [kk for kk, r in self._live.items() if r() is h] if self._it["shared"] else [h.k]:
                    self._live.pop(kk, None)
            self._mark(h.dev, True, False)
            self._reap()
            self._prefetch_after(j, h)
            if self._wm_it:
                self._wm_sample(h.device)
            return h.dev if view is None else h.dev.as_strided(view.size, view.stride)
        finally:
            lock.release()

    def _prefetch_after(self, j: int, h: Optional[_Handle]) -> None:
        if self.off_reason is not None and not self._live:
            return
        if self._threshold_now():
            if h is None or self.prefetch <= 0 or h.iteration != self.iterations:
                return
            # The next offloaded tensors below h's pack ordinal (backward's usual order).
            i = bisect.bisect_left(self._order, h.k)
            n = 0
            while i > 0 and n < self.prefetch:
                i -= 1
                ref = self._live.get(self._order[i])
                g = ref() if ref is not None else None
                if g is not None and g.ev_in is None:
                    self._copy_back(g)
                    self._it["prefetched"] += 1
                    n += 1
            return
        self._trigger(j)

    def _trigger(self, j: int) -> None:
        """Starts the copies back due at unpack ordinal j (prefetch point <= j), if packed."""
        bp = self._by_prefetch
        while self._prefetch_pos < len(bp) and bp[self._prefetch_pos][0] <= j:
            self._due.append(bp[self._prefetch_pos][1])
            self._prefetch_pos += 1
        self._next_prefetch = bp[self._prefetch_pos][0] if self._prefetch_pos < len(bp) else _NEVER
        if self._due:
            self._due = [k for k in self._due if not self._start_if_live(k)]

    # -- boundary
    def iteration_end(self) -> Optional[dict]:
        """Marks an iteration boundary (see the module doc). Returns the iteration's stats, or
        None when no hook ran since the last boundary (a repeated boundary is a no-op)."""
        with self._lock:
            it = self._it
            # Misses matter only while recording (some call recorded a marker).
            it["marker_misses"] = self._misses if it["markers"] else 0
            live = [r() for r in self._live.values()]
            it["not_unpacked"] = len({id(h) for h in live if h is not None and not h.unpacked})
            if self._schedule and self.mode != "threshold":
                it["schedule_unreached"] = sum(1 for e in self._schedule if e[0] >= self.k)
            self._reap(full=True)
            self._read_timings()
            wm_last = None
            if self._wm_it:
                self.watermark.end_iteration(self.prefetch, self._wm_peak(self._wm_device))
                wm_last = self.watermark.last
            self._wm_it = None
            busy = it["packs"] or it["unpacks"] or it["pin_failures"]
            if busy:
                self.iterations += 1
                for key, v in it.items():
                    self._totals[key] += v
                it = dict(it)
                it["iteration"] = self.iterations - 1
                if wm_last is not None:
                    it["watermark"] = dict(wm_last)  # limit, headroom, peak, level, ...
                self.last_iteration = it
            self._it = self._zero()
            self._reset_ordinals()
            for hook in list(self.boundary_hooks):
                try:
                    hook(self)
                except Exception as e:  # report; never stop training
                    warnings.warn(f"stweaver offload: a boundary hook failed: {e!r}", RuntimeWarning)
            if self.mode == "plan":
                self._read_plan()
                self._before_plan = self._runtime_before_plan()
            self._rec = self._record if self._may_record() else None
            if self._threshold_now():
                self._fitted = None  # threshold rules may grow the pool: fit it again after
            else:
                self._fit_pool()
            if it.get("not_unpacked"):
                warnings.warn(
                    f"stweaver offload: {it['not_unpacked']} offloaded tensor(s) of the iteration "
                    f"were not unpacked before its end (kept in host memory until they are or "
                    f"their graph is freed)", RuntimeWarning, stacklevel=2)
            return it if busy else None

    def _fit_pool(self) -> None:
        """Schedule rules (a plan served, or a fixed schedule): the pinned pool keeps what
        the schedule needs (``schedule_host_bytes``) and gives the rest back, host cache
        included (module doc, "Host memory"); once per schedule and stretch of schedule rules,
        again at later boundaries while busy buffers kept it above that (a pool that grew
        since, a slice fitting no buffer's free range, stays: no pinning at every boundary)."""
        need = schedule_host_bytes(self._schedule, self.pool.align)
        if self._fitted == need:
            return
        self.pool.release_beyond(need)
        if self.pool.capacity <= need or all(b is None or not b.used for b in self.pool._buffers):
            self._fitted = need

    def link_rates(self) -> Tuple[Optional[float], Optional[float]]:
        """The copies' achieved GB/s so far, (device to host, host to device); None for a
        direction not timed yet."""
        with self._lock:
            return (_rate(self._copy_bytes_timed["d2h"], self._copy_ms["d2h"]),
                    _rate(self._copy_bytes_timed["h2d"], self._copy_ms["h2d"]))

    def _read_timings(self) -> None:
        """Adds the time of the copies finished so far. A copy's start event is recorded on its
        side stream after the stream's waits, and the stream runs one thing at a time, so
        start -> end is the copy alone (not the wait, not the copies before it)."""
        if not self._timings:
            return
        b = self.backend
        keep = []
        for rec in self._timings:
            kind, e0, e1, n = rec
            if not b.query(e1):
                keep.append(rec)
                continue
            try:
                ms = b.elapsed_ms(e0, e1)
            except RuntimeError:
                continue
            if ms is not None:
                self._copy_ms[kind] += max(0.0, ms)
                self._copy_bytes_timed[kind] += n
        self._timings = keep

    def stats(self) -> dict:
        with self._lock:
            out = dict(self._totals)
            out.update(
                mode=self.mode,
                iterations=self.iterations,
                schedule_entries=len(self._schedule),
                schedule_bytes=sum(e[3] for e in self._schedule),
                off_reason=self.off_reason,
                host_capacity=self.pool.capacity,
                host_buffers=self.pool.buffers,
                host_pins=self.pool.pins,
                host_pinned_total=self.pool.pinned_total,
                host_released=self.pool.released,
                watermark=self.watermark.stats() if self.watermark is not None else None,
                host_used=self.pool.used,
                host_peak=self.pool.peak_used,
                d2h_ms=self._copy_ms["d2h"],
                h2d_ms=self._copy_ms["h2d"],
                d2h_GBps=_rate(self._copy_bytes_timed["d2h"], self._copy_ms["d2h"]),
                h2d_GBps=_rate(self._copy_bytes_timed["h2d"], self._copy_ms["h2d"]),
                last_iteration=dict(self.last_iteration) if self.last_iteration else None,
                current_iteration=dict(self._it),
            )
            if self.auto_recompute is not None:
                out["auto_recompute"] = self.auto_recompute.stats()
            if self.hook_times is not None:
                out["hook_times"] = dict(zip(("pack_ns", "packs", "unpack_ns", "unpacks"), self.hook_times))
            return out

    # -- timed hooks (STWEAVER_TIME_CALLS=1: the host time of the hooks themselves)
    def timed_hooks(self) -> Tuple[Callable[[Any], Any], Callable[[Any], Any]]:
        """pack and unpack, each adding its host ns and a call to ``hook_times``."""
        self.hook_times = h = [0, 0, 0, 0]  # pack ns, packs, unpack ns, unpacks

        def timed(fn, at: int):
            def hook(x):
                t0 = time.perf_counter_ns()
                try:
                    return fn(x)
                finally:
                    h[at] += time.perf_counter_ns() - t0
                    h[at + 1] += 1
            return hook

        return timed(self.pack, 0), timed(self.unpack, 2)


_PARAMETER = None


def _parameter_type():
    """``torch.nn.Parameter``, looked up once (the watermark asks per saved tensor)."""
    global _PARAMETER
    if _PARAMETER is None:
        import torch

        _PARAMETER = torch.nn.Parameter
    return _PARAMETER


def _whole_storage_bytes(t) -> int:
    """t's bytes when t covers its whole storage (starts it and spans all of it), else 0
    (a view of part of a storage, an empty tensor, a tensor without storage: fake or
    functional tensors). The counted test of the module doc, without the device part."""
    try:
        st = t.untyped_storage()
        n = st.nbytes()
        return n if n > 0 and t.nbytes == n and t.data_ptr() == st.data_ptr() else 0
    except (RuntimeError, NotImplementedError):
        return 0


def _dense(t) -> bool:
    """Whether t's elements fill a block of memory exactly once in some order of its dims
    (non-overlapping and dense: a permuted contiguous tensor, e.g. attention's
    ``q.transpose(1, 2)``). Such a tensor round-trips through a host buffer of its bytes with
    its own strides (``as_strided`` there, ``empty_strided`` back), byte for byte."""
    # PyTorch's test (TensorImpl::compute_non_overlapping_and_dense): dims by stride, each
    # stride the product of the sizes below it (dims of size 1 do not matter).
    dims = sorted((st, sz) for sz, st in zip(t.size(), t.stride()) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _rate(nbytes: int, ms: float) -> Optional[float]:
    return nbytes / (ms * 1e6) if ms > 0 else None


# ---------------------------------------------------------------- process-wide use

_state_lock = threading.Lock()
_active: Optional[Offloader] = None
_pushed_by: Optional[int] = None
_opt_handle = None


def _installed_ext():
    """stweaver's extension when stweaver serves this process, else None."""
    import stweaver

    if not stweaver.is_installed():
        return None
    return stweaver._extension()


def _time_calls() -> bool:
    """``STWEAVER_TIME_CALLS``: the hooks' own host time is counted (``stats()["hook_times"]``),
    as the allocator counts its calls' (``ext.call_times()``)."""
    from ._settings import parse_bool

    v = os.environ.get("STWEAVER_TIME_CALLS", "")
    return bool(v.strip()) and parse_bool(v, "STWEAVER_TIME_CALLS")


def current() -> Optional[Offloader]:
    """The offloader :func:`enable` made, or None."""
    return _active


def enable(schedule=None, min_bytes: Optional[int] = None, *, hook_optimizer: bool = True,
           backend=None, pool: Optional[PinnedPool] = None, ext: Any = "auto",
           first_min_bytes: Optional[int] = None, watermark: Any = None) -> Offloader:
    """Pushes offload's pack/unpack hooks for the calling thread (the one that runs forward).

    ``schedule``: entries, or ``"plan"``; with neither a schedule nor ``min_bytes``: ``"plan"``
    (stweaver must be installed). ``min_bytes`` without a schedule: threshold mode.
    ``hook_optimizer``: mark an iteration boundary after every step of the first optimizer
    that steps (registered after stweaver's own hook, so the plan switch at that boundary is
    seen); else call :func:`iteration_end` at each boundary yourself."""
    global _active, _pushed_by, _opt_handle
    import torch

    with _state_lock:
        if _active is not None:
            raise RuntimeError("stweaver offload is already enabled (call disable() first)")
        if ext == "auto":
            ext = _installed_ext()
        if schedule is None and min_bytes is None:
            schedule = "plan"
        off = Offloader(schedule=schedule, min_bytes=min_bytes, ext=ext, backend=backend, pool=pool,
                        first_min_bytes=first_min_bytes, watermark=watermark)
        hooks = off.timed_hooks() if _time_calls() else (off.pack, off.unpack)
        torch._C._autograd._push_saved_tensors_default_hooks(*hooks)
        _active, _pushed_by = off, threading.get_ident()
        if hook_optimizer:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            _opt_handle = register_optimizer_step_post_hook(_optimizer_hook())
        return off


def disable() -> Optional[dict]:
    """Pops the hooks :func:`enable` pushed (same thread); returns the offloader's stats.
    Tensors already offloaded stay valid (their graph still unpacks them)."""
    global _active, _pushed_by, _opt_handle
    import torch

    with _state_lock:
        if _active is None:
            return None
        if _pushed_by != threading.get_ident():
            raise RuntimeError("stweaver offload: disable() must run on the thread that called enable()")
        torch._C._autograd._pop_saved_tensors_default_hooks()
        if _opt_handle is not None:
            _opt_handle.remove()
            _opt_handle = None
        off, _active, _pushed_by = _active, None, None
        return off.stats()


def iteration_end() -> Optional[dict]:
    """An iteration boundary for the enabled offloader (no-op when none)."""
    off = _active
    return off.iteration_end() if off is not None else None


def stats() -> dict:
    """The enabled offloader's stats (``{"enabled": False}`` when none)."""
    off = _active
    if off is None:
        return {"enabled": False}
    s = off.stats()
    s["enabled"] = True
    return s


def _optimizer_hook():
    first: List[weakref.ref] = []

    def hook(optimizer, args, kwargs):
        if not first:
            first.append(weakref.ref(optimizer))
        if first[0]() is optimizer:
            iteration_end()

    return hook


@contextlib.contextmanager
def offload(min_bytes: Optional[int] = 2**20, schedule=None, **kw) -> Iterator[Offloader]:
    """``with offload(): ...`` -- offload saved tensors inside the block (threshold mode with
    ``min_bytes``; a schedule, or ``"plan"``, instead when given). Yields the offloader. The
    hooks are popped on exit; tensors saved inside stay valid for backward after it."""
    off = enable(schedule=schedule, min_bytes=None if schedule is not None else min_bytes, **kw)
    try:
        yield off
    finally:
        disable()
