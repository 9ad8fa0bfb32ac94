"""Memory history, snapshots and PyTorch's memory visualizer under stweaver."""

import gc
import os
import pickle

import torch
from torch.cuda import _memory_viz

MIB = 1 << 20


def _my_frames(block_or_entry):
    return [f for f in block_or_entry.get("frames", []) if "test_snapshot" in f.get("filename", "")]


def test_history_snapshot_and_visualizer(tmp_path, metric):
    torch.cuda.synchronize()
    # Nothing cached from earlier tests: the allocations below map memory (segment_map).
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python")
    try:
        keep = torch.empty(3 * MIB + 5, dtype=torch.uint8, device="cuda")
        tmp = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1000, 70000, 5 * MIB)]
        del tmp
        snap = torch.cuda.memory._snapshot()
        path = tmp_path / "snap.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)

    # Segments: blocks tile each segment; our live tensor is there with its Python stack.
    segs = snap["segments"]
    assert segs, "no segments in the snapshot"
    found = None
    for s in segs:
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
        assert s["segment_type"] in ("small", "large")
        assert s["device"] == 0
        for b in s["blocks"]:
            assert b["state"] in ("active_allocated", "active_pending_free", "inactive")
            if b["address"] == keep.data_ptr():
                found = b
    assert found is not None, "live tensor missing from the snapshot"
    assert found["state"] == "active_allocated"
    assert found["requested_size"] == 3 * MIB + 5
    assert found["size"] == (3 * MIB + 5 + 511) // 512 * 512
    assert _my_frames(found), f"no Python frames recorded for the block: {found.get('frames')}"

    # Trace: alloc / free_requested / free_completed with requested sizes, plus mappings.
    trace = snap["device_traces"][0]
    actions = [e["action"] for e in trace]
    for a in ("alloc", "free_requested", "free_completed", "segment_map"):
        assert a in actions, f"{a} missing from {sorted(set(actions))}"
    allocs = [e for e in trace if e["action"] == "alloc"]
    sizes = {e["size"] for e in allocs}
    assert {3 * MIB + 5, 1000, 70000, 5 * MIB} <= sizes, sizes
    keep_alloc = [e for e in allocs if e["addr"] == keep.data_ptr()]
    assert keep_alloc and _my_frames(keep_alloc[-1]), "alloc entry without its stack"
    assert all(e["time_us"] > 1_600_000_000_000_000 for e in trace), "times are not µs since epoch"
    metric("trace_entries", len(trace))
    metric("segments", len(segs))

    # The file round-trips and every visualizer entry point accepts it.
    with open(path, "rb") as f:
        loaded = pickle.load(f)
    assert loaded["segments"] and loaded["device_traces"]
    assert "stweaver" in str(loaded.get("allocator_settings", {}))
    html = _memory_viz.trace_plot(loaded)
    assert "MemoryViz" in html or "<html" in html
    assert _memory_viz.segment_plot(loaded)
    text = _memory_viz.segsum(loaded)
    assert "total_reserved" in text
    assert "Device 0" in _memory_viz.trace(loaded)
    with open(tmp_path / "trace.html", "w") as f:
        f.write(html)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "snapshot.pickle"), "wb") as f:
            pickle.dump(loaded, f)
    del keep
    gc.collect()


def test_memory_snapshot_lists_segments():
    x = torch.empty(2 * MIB, dtype=torch.uint8, device="cuda")
    segs = torch.cuda.memory_snapshot()
    total = sum(s["total_size"] for s in segs)
    assert total == torch.cuda.memory_reserved()
    assert sum(s["allocated_size"] for s in segs) == torch.cuda.memory_allocated()
    del x


def test_history_off_records_nothing():
    torch.cuda.memory._record_memory_history(max_entries=1000, stacks="python")
    torch.cuda.memory._record_memory_history(enabled=None)
    y = torch.empty(MIB, device="cuda")
    snap = torch.cuda.memory._snapshot()
    assert all(len(t) == 0 for t in snap["device_traces"])
    del y
