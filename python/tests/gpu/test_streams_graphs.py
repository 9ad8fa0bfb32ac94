"""Stream safety (record_stream), CUDA graphs and MemPools under stweaver."""

import gc

import pytest
import torch

MIB = 1 << 20
N = 16 * MIB  # floats: 64 MiB


def _scenario(record: bool):
    """x is read on a side stream after a long sleep; x is freed right away on the main
    stream and the main stream immediately allocates and fills z. If x's memory were handed
    to z before the side stream read it, y would see z's 2.0 instead of x's 1.0."""
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    x = torch.full((N,), 1.0, device="cuda")
    y = torch.empty_like(x)
    torch.cuda.synchronize()
    xp = x.data_ptr()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.cuda._sleep(400_000_000)  # ~0.2 s on an H200
        y.copy_(x)
    if record:
        x.record_stream(side)
    del x
    z = torch.full((N,), 2.0, device="cuda")
    zp = z.data_ptr()
    torch.cuda.synchronize()
    intact = bool((y == 1.0).all().item())
    del y, z
    return xp, zp, intact


def test_record_stream_delays_reuse(metric):
    # Negative control: without record_stream the hazard is real (same address, y corrupted)
    # — this is what the test would see if the allocator did not defer frees.
    xp, zp, intact = _scenario(record=False)
    metric("unrecorded_reused", xp == zp)
    metric("unrecorded_intact", intact)
    assert xp == zp, "best fit on the same stream should reuse the freed block"
    assert not intact, "the control scenario did not race; the test would prove nothing"
    # With record_stream the block is not reused until the side stream passes the free.
    xp, zp, intact = _scenario(record=True)
    metric("recorded_reused", xp == zp)
    metric("recorded_intact", intact)
    assert xp != zp, "memory still in use on another stream was handed out"
    assert intact, "data read on the side stream was overwritten"
    # Once the side stream is done, the next allocation completes the deferred free: nothing
    # stays active beyond what is allocated.
    torch.cuda.synchronize()
    w = torch.full((N,), 3.0, device="cuda")
    st = torch.cuda.memory_stats()
    assert st["active_bytes.all.current"] == st["allocated_bytes.all.current"]
    del w


def test_cuda_graph_capture_and_replay(metric):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)
    ).cuda()
    static_in = torch.randn(64, 512, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(static_in)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    # Capture on the warmed-up stream: its cuBLAS workspace already exists, so nothing but
    # the graph's own tensors lands in the private pool.
    with torch.cuda.graph(g, stream=side):
        static_out = model(static_in)
    pool = g.pool()
    segs = [s for s in torch.cuda.memory._snapshot()["segments"] if tuple(s["segment_pool_id"]) == tuple(pool)]
    assert segs, "graph allocations did not go to the graph's private pool"
    metric("graph_pool_segments", len(segs))
    for i in range(5):
        inp = torch.randn(64, 512, device="cuda")
        static_in.copy_(inp)
        g.replay()
        torch.cuda.synchronize()
        ref = model(inp)
        torch.testing.assert_close(static_out, ref, rtol=1e-5, atol=1e-5, msg=f"replay {i}")
    reserved_with_graph = torch.cuda.memory_reserved()
    del g, static_out
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    left = [s for s in torch.cuda.memory._snapshot()["segments"] if tuple(s["segment_pool_id"]) == tuple(pool)]
    assert not left, "the graph's pool outlived the graph"
    assert torch.cuda.memory_reserved() < reserved_with_graph


def test_mempool_use_count_and_snapshot():
    pool = torch.cuda.MemPool()
    assert pool.use_count() >= 1
    with torch.cuda.use_mem_pool(pool):
        t = torch.randn(1000, device="cuda")
    seg_pool = [s for s in pool.snapshot() if s["address"] <= t.data_ptr() < s["address"] + s["total_size"]]
    assert seg_pool, "tensor allocated under use_mem_pool is not in the pool's snapshot"
    u = torch.randn(1000, device="cuda")  # outside the context: default pool
    assert not any(s["address"] <= u.data_ptr() < s["address"] + s["total_size"] for s in pool.snapshot())
    del t, u
    del pool
    gc.collect()
    torch.cuda.empty_cache()


def test_unsupported_features_fail_clearly():
    with pytest.raises(RuntimeError, match="no_split"):
        torch.cuda.MemPool(no_split=True)
