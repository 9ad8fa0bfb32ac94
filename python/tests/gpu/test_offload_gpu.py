"""Activation offload (stweaver.offload) on a GPU, under stweaver (conftest installs it):
training under offload is bitwise the training without it, saved tensors survive pinned
round trips while the device memory they left is reused, and the peak of allocated memory
drops.

Run alone: python -m pytest python/tests/gpu/test_offload_gpu.py -v
(named apart from python/tests/test_offload.py: the test folders have no __init__.py, so
two test_offload.py would collide when pytest collects python/tests)
"""

import gc

import pytest
import torch

import stweaver
from stweaver import _offload as off

MIB = 1 << 20


# ------------------------------------------------------------------ models


class MLP(torch.nn.Module):
    """fp32, activations (2 x 256 MiB a layer) well above parameters (64 MiB a layer), so they
    make the peak; a layer's matmul (275 GFLOP, ~5 ms) about as long as copying its
    activations over PCIe, so copies keep up with forward and blocks are freed in time."""

    def __init__(self, width=4096, depth=8):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        for lin in self.layers:
            x = torch.nn.functional.gelu(lin(x))
        return self.head(x).square().mean()


class Block(torch.nn.Module):
    """A pre-norm transformer block in bf16, attention written out (matmul + softmax: no
    fused attention kernels, whose backward may use atomics)."""

    def __init__(self, d=1024, heads=16, ff=4096):
        super().__init__()
        self.h = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, ff)
        self.fc2 = torch.nn.Linear(ff, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, s, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        a = torch.softmax(q @ k.transpose(-1, -2) * (d // self.h) ** -0.5, dim=-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class Blocks(torch.nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x.float().square().mean()


def make(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        model = MLP().cuda()
        data = [torch.randn(8192, 4096, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    else:
        model = Blocks().cuda().to(torch.bfloat16)
        data = [torch.randn(8, 1024, 1024, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
                for i in range(3)]
    return model, data


def settle():
    gc.collect()
    torch.cuda.synchronize()


def train(kind, steps=3, hooks=None):
    """`steps` SGD steps; hooks: None, or a callable giving a context manager per forward.
    Returns losses (bits), the last step's grads and final params (host copies), the peak of
    allocated bytes over the steps, and the offloader's stats."""
    model, data = make(kind)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    settle()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    losses, grads, stats = [], None, None
    for i in range(steps):
        x = data[i % len(data)].cuda()
        opt.zero_grad(set_to_none=True)
        if hooks is None:
            loss = model(x)
            loss.backward()
        else:
            with hooks() as o:
                loss = model(x)
            loss.backward()
            stats = o.iteration_end() or stats
        grads = [p.grad.detach().to("cpu", copy=True) for p in model.parameters()]
        opt.step()
        losses.append(loss.detach().float().item())
    settle()
    peak = torch.cuda.max_memory_allocated() - base
    params = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    del model, opt, data
    settle()
    return {"losses": [v.hex() for v in losses], "grads": grads, "params": params, "peak": peak,
            "stats": stats}


def assert_bitwise(a, b):
    assert a["losses"] == b["losses"], (a["losses"], b["losses"])
    for x, y in zip(a["grads"], b["grads"]):
        assert torch.equal(x.view(torch.uint8) if x.dtype == torch.bool else x, y), "gradient differs"
        assert x.dtype == y.dtype
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y), "parameters differ"


_base = {}


def baseline(kind):
    if kind not in _base:
        _base[kind] = train(kind)
    return _base[kind]


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_min_bytes_offload_is_bitwise_and_lowers_the_peak(kind, metric):
    base = baseline(kind)
    got = train(kind, hooks=lambda: off.offload(min_bytes=0, hook_optimizer=False))
    assert_bitwise(got, base)
    st = got["stats"]
    assert st["tensors_out"] > 0 and st["tensors_in"] == st["tensors_out"], st
    assert st["not_unpacked"] == 0 and st["pin_failures"] == 0, st
    metric(f"{kind}_peak_MiB", base["peak"] / MIB)
    metric(f"{kind}_offload_peak_MiB", got["peak"] / MIB)
    metric(f"{kind}_offloaded_MiB", st["bytes_out"] / MIB)
    metric(f"{kind}_stalls", st["stalls"])
    if kind == "mlp":
        # At least a quarter of what went to the host is off the peak (copies may lag forward).
        # Not asserted for the block: its attention scores take ~0.1 ms to make and ~5 ms to
        # copy, so forward outruns the copies and the blocks are still held at its end.
        assert got["peak"] < base["peak"] - st["bytes_out"] // 4, (got["peak"], base["peak"], st["bytes_out"])


def record_schedule(kind, min_bytes=MIB):
    """One forward/backward with pass-through hooks that tag each save with its pack ordinal,
    so each unpack ordinal is paired with its pack exactly (what the planner gets from the
    trace's SavedPack/SavedUnpack markers). Every eligible tensor >= min_bytes is scheduled,
    its copy back started one unpack ahead (the first unpack's at -1)."""
    model, data = make(kind)
    checker = off.Offloader(schedule=[], ext=None)
    n_packs, n_unpacks, pairs, sizes = [0], [0], {}, {}

    def pack(t):
        k = n_packs[0]
        n_packs[0] += 1
        if checker.eligible(t) and not isinstance(t, torch.nn.Parameter) and t.nbytes >= min_bytes:
            sizes[k] = t.nbytes
        return (k, t)

    def unpack(kt):
        pairs.setdefault(kt[0], n_unpacks[0])
        n_unpacks[0] += 1
        return kt[1]

    x = data[0].cuda()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = model(x)
    loss.backward()
    del model, data, loss, x
    settle()
    assert len(pairs) == n_packs[0] == n_unpacks[0], "a saved tensor was not unpacked exactly once"
    return [(k, pairs[k], pairs[k] - 1, n) for k, n in sorted(sizes.items())]


@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_hand_made_schedule_is_followed_and_bitwise(kind, metric):
    sched = record_schedule(kind)
    assert len(sched) >= 8, sched
    base = baseline(kind)
    got = train(kind, hooks=lambda: off.offload(schedule=sched, hook_optimizer=False))
    assert_bitwise(got, base)
    st = got["stats"]
    # a tensor saved twice (softmax's output) is one host copy for both entries
    assert st["tensors_out"] + st["shared"] == len(sched), st
    assert st["schedule_mismatch"] == 0 and st["schedule_skipped"] == 0 and st["unpack_drift"] == 0, st
    assert st["stalls"] == 0 and st["prefetched"] == st["tensors_out"], st
    if kind == "mlp":
        assert got["peak"] < base["peak"], (got["peak"], base["peak"])
    metric(f"{kind}_schedule_entries", len(sched))
    metric(f"{kind}_schedule_peak_MiB", got["peak"] / MIB)


def test_checksums_survive_100_round_trips_with_delayed_copies(metric):
    """Packs tensors of several dtypes while the d2h stream is held back, drops them and
    refills the same sizes on the current stream (the allocator must not hand out the blocks
    before the copies read them: record_stream); then unpacks while the h2d stream is held
    back and checksums at once on the current stream (it must wait for the copies:
    wait_event). 100 rounds; the pinned pool is reused, not re-pinned."""
    o = off.Offloader(min_bytes=0, ext=None, prefetch=0)
    dev = torch.device("cuda", torch.cuda.current_device())
    d2h = o.backend.side_stream(dev, "d2h")
    h2d = o.backend.side_stream(dev, "h2d")
    specs = [(torch.float32, (1024, 1024)), (torch.bfloat16, (3, 777, 513)), (torch.int64, (300001,)),
             (torch.float16, (4096, 129)), (torch.uint8, (5 * MIB + 3,))]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def fresh(dtype, shape):
        if dtype.is_floating_point:
            return torch.randn(shape, device="cuda", generator=gen).to(dtype)
        return torch.randint(0, 1 << 7, shape, device="cuda", generator=gen, dtype=dtype)

    def checksum(t):
        return int(t.contiguous().view(torch.uint8).to(torch.int64).sum())

    pins = None
    for r in range(100):
        ts = [fresh(dt, sh) for dt, sh in specs]
        sums = [checksum(t) for t in ts]
        with torch.cuda.stream(d2h):
            torch.cuda._sleep(2_000_000 if r % 10 else 50_000_000)
        hs = [o.pack(t) for t in ts]
        assert all(isinstance(h, off._Handle) for h in hs)
        del ts
        junk = [torch.full(sh, 7, device="cuda").to(dt) for dt, sh in specs]  # reuses freed blocks
        with torch.cuda.stream(h2d):
            torch.cuda._sleep(2_000_000 if r % 10 else 50_000_000)
        back = [o.unpack(h) for h in reversed(hs)][::-1]
        got = [checksum(t) for t in back]
        assert got == sums, f"round {r}: checksums {got} != {sums}"
        for t, (dt, sh) in zip(back, specs):
            assert t.dtype == dt and tuple(t.shape) == tuple(sh)
        del hs, back, junk
        st = o.iteration_end()
        assert st["tensors_out"] == len(specs) == st["tensors_in"]
        if r == 0:
            pins = o.pool.pins
    settle()
    o.iteration_end()
    assert o.pool.pins == pins, "the pinned pool was grown after the first round"
    assert o.pool.used == 0
    s = o.stats()
    metric("round_trips", 100)
    metric("host_pins", s["host_pins"])
    metric("d2h_GBps", s["d2h_GBps"] or 0.0)
    metric("h2d_GBps", s["h2d_GBps"] or 0.0)


def test_pin_failure_leaves_training_untouched(metric):
    def refuse(n):
        raise RuntimeError("CUDA error: out of memory (simulated cudaHostAlloc failure)")

    base = baseline("mlp")
    pool = off.PinnedPool(pin=refuse)
    with pytest.warns(RuntimeWarning, match="could not pin"):
        got = train("mlp", hooks=lambda: off.offload(min_bytes=0, hook_optimizer=False, pool=pool))
    assert_bitwise(got, base)
    assert got["stats"]["tensors_out"] == 0 and got["stats"]["pin_failures"] >= 1


def test_plan_mode_without_a_served_plan_offloads_nothing():
    ext = stweaver._extension()
    if not hasattr(ext, "offload_schedule"):
        pytest.skip("the extension has no offload_schedule() yet")
    assert list(ext.offload_schedule()) == []  # online mode serves no plan
    with off.offload(schedule="plan", hook_optimizer=False) as o:
        x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
        y = (x * x).sum()
    y.backward()
    st = o.iteration_end()
    assert st["tensors_out"] == 0 and st["packs"] >= 1
    assert o.mode == "plan"


def test_extension_pins_fast_and_refuses_more_than_the_host_has(metric):
    # ext.pin_host: Rust's fast pin (huge-page mapping, faulted in by threads, registered);
    # the tensor is pinned, copies through it are exact, it frees with the tensor, and a
    # request over the host's available memory is a clean error (not the OOM killer).
    import time

    ext = stweaver._extension()
    if not hasattr(ext, "pin_host"):
        pytest.skip("the extension has no pin_host() yet")
    n = 1 << 30
    t0 = time.perf_counter()
    h = ext.pin_host(n, torch.cuda.current_device())
    secs = time.perf_counter() - t0
    assert h.is_pinned() and h.numel() == n and h.dtype == torch.uint8
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    h.copy_(src, non_blocking=True)
    back = torch.empty_like(src)
    back.copy_(h, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    metric("pin_1GiB_s", secs)
    del h
    with open("/proc/meminfo") as f:
        avail = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))
    with pytest.raises(RuntimeError, match="host memory"):
        ext.pin_host(avail + (8 << 30), torch.cuda.current_device())
    # The pool uses it; a refusal there is a PinnedMemoryError (offload off, training on).
    pool = off.PinnedPool(pin=off.ext_pin(ext))
    s = pool.alloc(64 << 20)
    assert pool._buffers[s.buffer].data.is_pinned()
    with pytest.raises(off.PinnedMemoryError, match="host memory"):
        pool.alloc(avail + (8 << 30))
