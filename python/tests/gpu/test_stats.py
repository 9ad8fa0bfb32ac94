"""torch.cuda memory statistics under stweaver: exact, complete, resettable."""

import gc

import pytest
import torch

MIB = 1 << 20


def ceil512(n: int) -> int:
    return (n + 511) // 512 * 512


def settle():
    gc.collect()
    torch.cuda.synchronize()


def test_backend_is_stweaver_everywhere():
    assert torch.cuda.memory.get_allocator_backend() == "stweaver"
    x = torch.ones(10, device="cuda")
    assert torch.cuda.is_initialized()
    # c10::SetAllocator too: torch.accelerator sees the same allocator.
    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "memory_allocated"):
        assert torch.accelerator.memory_allocated() == torch.cuda.memory_allocated()
    del x


def test_memory_allocated_is_the_sum_of_live_tensors(metric):
    settle()
    base = torch.cuda.memory_allocated()
    base_req = torch.cuda.memory_stats()["requested_bytes.all.current"]
    sizes = [1, 511, 512, 513, 4096, MIB, MIB + 1, 3 * MIB + 7, 50 * MIB, 300 * MIB + 3]
    ts = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    expected = sum(ceil512(n) for n in sizes)
    got = torch.cuda.memory_allocated() - base
    metric("live_bytes", expected)
    assert got == expected, f"memory_allocated grew by {got}, live tensors take {expected}"
    st = torch.cuda.memory_stats()
    assert st["requested_bytes.all.current"] - base_req == sum(sizes)
    assert st["allocation.all.current"] >= len(sizes)
    assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()
    assert torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated()
    # small pool (<= 1 MiB rounded) and large pool add up
    assert (
        st["allocated_bytes.small_pool.current"] + st["allocated_bytes.large_pool.current"]
        == st["allocated_bytes.all.current"]
    )
    del ts
    settle()
    assert torch.cuda.memory_allocated() == base
    assert torch.cuda.memory_stats()["requested_bytes.all.current"] == base_req


def test_memory_stats_has_every_key_and_summary_renders():
    x = torch.empty(10 * MIB, dtype=torch.uint8, device="cuda")
    st = torch.cuda.memory_stats()
    for group in (
        "allocation", "segment", "active", "inactive_split", "allocated_bytes",
        "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes",
    ):
        for pool in ("all", "small_pool", "large_pool"):
            for field in ("current", "peak", "allocated", "freed"):
                assert f"{group}.{pool}.{field}" in st
    for k in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
              "num_device_free", "max_split_size", "oversize_allocations.current"):
        assert k in st, k
    summary = torch.cuda.memory_summary()
    assert "Allocated memory" in summary and "GPU reserved memory" in summary
    nested = torch.cuda.memory_stats_as_nested_dict()
    assert nested["allocated_bytes"]["all"]["current"] == st["allocated_bytes.all.current"]
    del x


def test_peaks_reset_and_max_reserved(metric):
    settle()
    x = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    peak_with_x = torch.cuda.max_memory_allocated()
    del x
    settle()
    assert torch.cuda.max_memory_allocated() == peak_with_x
    assert torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated() + 256 * MIB
    assert torch.cuda.max_memory_reserved() >= torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
    assert torch.cuda.max_memory_reserved() == torch.cuda.memory_reserved()
    torch.cuda.reset_accumulated_memory_stats()
    st = torch.cuda.memory_stats()
    assert st["allocated_bytes.all.allocated"] == 0 and st["num_device_alloc"] == 0
    metric("peak_MiB", peak_with_x / MIB)


def test_empty_cache_returns_memory_to_the_device(metric):
    settle()
    torch.cuda.empty_cache()
    free0, _ = torch.cuda.mem_get_info()
    res0 = torch.cuda.memory_reserved()
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    del x
    settle()
    res1 = torch.cuda.memory_reserved()
    free1, _ = torch.cuda.mem_get_info()
    assert res1 - res0 >= 4 << 30, "the freed 4 GiB stays cached until empty_cache"
    torch.cuda.empty_cache()
    res2 = torch.cuda.memory_reserved()
    free2, _ = torch.cuda.mem_get_info()
    metric("cached_GiB", (res1 - res0) / (1 << 30))
    metric("returned_GiB", (free2 - free1) / (1 << 30))
    assert res2 <= res0, f"reserved {res2} after empty_cache, {res0} before the test"
    assert free2 - free1 >= (4 << 30) * 0.95, "the driver got the memory back"
    assert abs(free2 - free0) < 256 * MIB


def test_memory_fraction_round_trip():
    assert torch.cuda.get_per_process_memory_fraction() == 1.0
    torch.cuda.set_per_process_memory_fraction(0.5)
    try:
        assert torch.cuda.get_per_process_memory_fraction() == 0.5
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    with pytest.raises((RuntimeError, ValueError)):
        torch.cuda.set_per_process_memory_fraction(1.5)


def test_raw_alloc_and_bad_pointers():
    p = torch.cuda.caching_allocator_alloc(12345)
    assert p != 0 and p % 512 == 0
    torch.cuda.caching_allocator_delete(p)
    with pytest.raises(RuntimeError, match="invalid device pointer"):
        torch.cuda.caching_allocator_delete(p)  # double free is an error, not a crash
    with pytest.raises(RuntimeError, match="invalid device pointer"):
        torch.cuda.caching_allocator_delete(0xDEAD000)
    assert torch.cuda.caching_allocator_alloc(0) == 0  # size 0: no memory, no error


def test_cudnn_benchmark_conv_uses_cache_info():
    torch.backends.cudnn.benchmark = True
    try:
        conv = torch.nn.Conv2d(32, 64, 3, padding=1).cuda()
        x = torch.randn(16, 32, 64, 64, device="cuda")
        y = conv(x)
        y.sum().backward()
        torch.cuda.synchronize()
        assert torch.isfinite(y).all()
    finally:
        torch.backends.cudnn.benchmark = False


def test_many_threads_allocate_and_free(metric):
    import random
    import threading

    import stweaver

    settle()
    base = torch.cuda.memory_allocated()
    errors = []

    def work(seed):
        rng = random.Random(seed)
        live = []
        try:
            for _ in range(1500):
                if live and rng.random() < 0.5:
                    live.pop(rng.randrange(len(live)))
                else:
                    live.append(torch.empty(rng.randint(1, 4 * MIB), dtype=torch.uint8, device="cuda"))
            live.clear()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    settle()
    assert not errors, errors
    assert torch.cuda.memory_allocated() == base
    assert stweaver.stats()["failed_frees"] == 0
    metric("threads", len(threads))
