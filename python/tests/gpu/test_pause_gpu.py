"""stweaver.pause / resume on a GPU (issue #17): contents over 100 cycles, a CUDA graph that
replays to the same output after a pause, and torch.cuda.memory_reserved() dropping by the
paused bytes. Skips without CUDA (conftest) and outside online mode (a served plan refuses
pauses).

Regions here hold whole 2 MiB multiples and start after an empty_cache, so that no region
shares a mapping unit with other tensors (a pause refuses mixed units).

Not run yet: written in a session without a GPU.
"""

import pytest
import torch

import stweaver

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _online():
    if not stweaver.mode().startswith("online"):
        pytest.skip(f"pause needs online mode (mode is {stweaver.mode()})")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    yield
    assert stweaver.paused().get(torch.cuda.current_device(), {}).get("bytes", 0) == 0


def test_contents_survive_100_cycles():
    with stweaver.region("pause_cycles"):
        x = torch.randn(8 * MIB // 4, device="cuda")  # 8 MiB
        y = torch.arange(16 * MIB // 4, device="cuda", dtype=torch.float32)  # 16 MiB
    host_y = y.cpu()
    for k in range(100):
        x.add_(1.0)
        expected = x.double().sum().item()
        host_x = x.cpu()
        r = stweaver.pause("pause_cycles")
        assert r["blocks"] >= 2 and r["copied"] >= 24 * MIB, r
        stweaver.resume("pause_cycles")
        assert x.double().sum().item() == expected, k
        if k % 10 == 0:
            assert torch.equal(x.cpu(), host_x), k
            assert torch.equal(y.cpu(), host_y), k
    assert torch.equal(y.cpu(), host_y)


def test_cuda_graph_replays_the_same_after_pause():
    with stweaver.region("pause_graph"):
        static_in = torch.randn(4 * MIB // 4, device="cuda")
        w = torch.randn(4 * MIB // 4, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                out = static_in * 2.0 + w
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = static_in * 2.0 + w
    g.replay()
    torch.cuda.synchronize()
    expected = out.clone()
    addr = (static_in.data_ptr(), w.data_ptr(), out.data_ptr())
    r = stweaver.pause("pause_graph")
    assert r["bytes"] > 0
    stweaver.resume("pause_graph")
    assert (static_in.data_ptr(), w.data_ptr(), out.data_ptr()) == addr
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    del g, out, expected


def test_memory_reserved_drops_by_the_paused_bytes():
    dev = torch.cuda.current_device()
    with stweaver.region("pause_reserved"):
        t = torch.full((64 * MIB // 4,), 3.0, device="cuda")
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    allocated = torch.cuda.memory_allocated()
    r = stweaver.pause("pause_reserved", keep_contents=True)
    assert r["bytes"] >= 64 * MIB
    assert torch.cuda.memory_reserved() == reserved - r["bytes"]
    assert torch.cuda.memory_allocated() == allocated  # the tensor still exists
    info = stweaver.paused()[dev]
    assert info == {"bytes": r["bytes"], "tags": ["pause_reserved"]}
    with pytest.raises(RuntimeError, match="already paused"):
        stweaver.pause("pause_reserved")
    stweaver.resume("pause_reserved")
    assert torch.cuda.memory_reserved() == reserved
    assert bool((t == 3.0).all())
    with pytest.raises(RuntimeError, match="not paused"):
        stweaver.resume("pause_reserved")
