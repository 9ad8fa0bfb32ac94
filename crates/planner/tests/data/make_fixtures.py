"""Writes the small snapshot fixtures of stweaver-planner's tests (plain `pickle`, no torch).

Run from anywhere: `python3 crates/planner/tests/data/make_fixtures.py`. The output is
deterministic (pickle protocol 4, gzip mtime 0), so re-running it leaves the committed
files unchanged. The layout follows `torch.cuda.memory._snapshot()` in torch 2.11
(`shared/research/pytorch-allocator-2.11.md` §4).
"""
import gzip
import os
import pickle

HERE = os.path.dirname(os.path.abspath(__file__))
T0 = 1_795_000_000_000_000  # µs since the epoch

# Frames are shared objects, as torch's `py_symbolize` builds them: one dict per
# frame, the same list for repeated tracebacks. pickle memoises them (BINGET).
FRAME_A = {"filename": "train.py", "line": 10, "name": "forward"}
FRAME_B = {"filename": "train.py", "line": 20, "name": "backward"}
STACK_1 = [FRAME_A, FRAME_B]
STACK_2 = [FRAME_B]

ROUNDUP = {str(1 << i): 0 for i in range(16)}


def settings(conf="", expandable=False, roundup=None):
    return {
        "PYTORCH_CUDA_ALLOC_CONF": conf,
        "max_split_size": -1,
        "garbage_collection_threshold": 0.0,
        "expandable_segments": expandable,
        "pinned_num_register_threads": 1,
        "release_lock_on_cudamalloc": False,
        "pinned_use_cuda_host_register": False,
        "graph_capture_record_stream_reuse": False,
        "roundup_power2_divisions": roundup or dict(ROUNDUP),
    }


class Device:
    """Builds one device's trace entries with a clock."""

    def __init__(self):
        self.entries = []
        self.t = T0

    def add(self, action, addr, size, stream=0, frames=None, **extra):
        self.t += 10
        e = {"action": action, "addr": addr, "size": size, "stream": stream,
             "time_us": self.t, "compile_context": "N/A", "user_metadata": ""}
        e.update(extra)
        if frames is not None:
            e["frames"] = frames
        self.entries.append(e)
        return e

    def alloc(self, addr, size, stream=0, frames=None):
        self.add("alloc", addr, size, stream, frames)

    def free(self, addr, size, stream=0, frames=None):
        self.add("free_requested", addr, size, stream, frames)
        self.add("free_completed", addr, size, stream, frames)


def segment(device, address, total, stream=0, expandable=False, blocks=None, pool=(0, 0)):
    blocks = blocks or [{"address": address, "size": total, "requested_size": 0,
                         "state": "inactive", "frames": []}]
    active = sum(b["size"] for b in blocks if b["state"] != "inactive")
    return {"device": device, "address": address, "total_size": total,
            "allocated_size": active, "active_size": active,
            "requested_size": sum(b["requested_size"] for b in blocks if b["state"] != "inactive"),
            "stream": stream, "segment_type": "large" if total >= 1 << 20 else "small",
            "segment_pool_id": pool, "is_expandable": expandable, "frames": [], "blocks": blocks}


def write(name, obj, gz=False):
    data = pickle.dumps(obj, protocol=4)
    if gz:
        data = gzip.compress(data, mtime=0)
    with open(os.path.join(HERE, name), "wb") as f:
        f.write(data)
    return data


def multi_device():
    """Two devices with history (one of them on two streams), one without; frees of
    blocks allocated before recording; never-freed blocks; shared frames; segment,
    snapshot and oom entries; annotations for one device and for all."""
    d0 = Device()
    d0.add("segment_alloc", 0x7F00_0000_0000, 20 << 20, frames=STACK_1)
    d0.alloc(0x7F00_0000_0000, 1000, frames=STACK_1)           # a0: freed below
    d0.alloc(0x7F00_0000_0400, 3 << 20, frames=STACK_1)        # a1: never freed
    d0.free(0x7F00_DEAD_0000, 4096, frames=STACK_2)            # preexisting (both frees)
    d0.add("free_completed", 0x7F00_BEEF_0000, 512)            # preexisting (completed only)
    d0.alloc(0x7F00_0040_0400, 8 << 20, frames=STACK_2)        # a4: never freed; the peak
    d0.free(0x7F00_0000_0000, 1000, frames=STACK_1)
    d0.add("snapshot", 0, 11 << 20)
    d0.add("oom", 0, 64 << 30)
    del d0.entries[-1]["addr"]                                  # oom has device_free
    d0.entries[-1]["device_free"] = 1 << 30
    d0.alloc(0x7F00_0000_0000, 500)                             # a5: never freed
    d0.add("segment_free", 0x7F10_0000_0000, 2 << 20)

    d1 = Device()
    d1.add("segment_map", 0x7E00_0000_0000, 20 << 20, stream=0)
    d1.alloc(0x7E00_0000_0000, 512, stream=0)
    d1.alloc(0x7E00_0000_0200, 1 << 20, stream=0xC0FFEE)
    d1.add("free_requested", 0x7E00_0000_0200, 1 << 20, stream=0xC0FFEE)
    d1.alloc(0x7E00_0010_0200, 256, stream=0)                  # while the stream block is pending
    d1.add("free_completed", 0x7E00_0000_0200, 1 << 20, stream=0xC0FFEE)
    d1.add("segment_unmap", 0x7E00_0100_0000, 2 << 20)
    d1.add("mystery_action", 0x1, 1)                            # unknown: counted, skipped

    annotations = [
        {"stage": "START", "name": "phase#forward", "device": 0, "time_us": T0 + 15},
        {"stage": "END", "name": "phase#forward", "device": 0, "time_us": T0 + 65},
        {"stage": "START", "name": "global#mark", "device": -1, "time_us": T0 + 1},
        {"stage": "END", "name": "global#mark", "device": -1, "time_us": T0 + 1_000},
        {"stage": "START", "name": "phase#forward", "device": 1, "time_us": T0 + 25},
    ]
    snap = {
        "segments": [
            segment(0, 0x7F00_0000_0000, 20 << 20, blocks=[
                {"address": 0x7F00_0000_0000, "size": 2048, "requested_size": 500,
                 "state": "active_allocated", "frames": STACK_1},
                {"address": 0x7F00_0000_0800, "size": (20 << 20) - 2048, "requested_size": 7,
                 "state": "inactive", "frames": []}]),
            segment(1, 0x7E00_0000_0000, 20 << 20, expandable=True),
            segment(1, 0x7E00_0200_0000, 2 << 20, stream=0xC0FFEE, pool=(1, 0)),
        ],
        "device_traces": [d0.entries, d1.entries, []],
        "allocator_settings": settings("expandable_segments:True,roundup_power2_divisions:[256:4]",
                                       expandable=True, roundup=dict(ROUNDUP, **{"256": 4})),
        "external_annotations": annotations,
    }
    write("multi_device.pickle", snap)
    # gzip'd, under a name that does not say so: detection is by content.
    write("multi_device_gzipped.pickle", snap, gz=True)
    return snap


def periodic():
    """Parameters, a longer first iteration (optimizer state), then 4 identical
    iterations, each ending with an Optimizer.step annotation; the snapshot is gzip'd."""
    d = Device()
    annotations = []
    addr = 0x7000_0000_0000
    params = []
    for i, size in enumerate([4096, 8192, 4096]):
        d.alloc(addr + i * 0x10000, size)
        params.append(addr + i * 0x10000)
    act = 0x7100_0000_0000
    for it in range(5):
        sizes = [1 << 20, 2 << 20, 512, 1 << 20]
        for k, s in enumerate(sizes):
            d.alloc(act + k * 0x400000, s)
        for k, s in reversed(list(enumerate(sizes))):
            d.free(act + k * 0x400000, s)
        annotations.append({"stage": "START", "name": "Optimizer.step#AdamW.step",
                            "device": 0, "time_us": d.t + 1})
        if it == 0:  # optimizer state, created once
            for i, size in enumerate([4096, 8192, 4096]):
                d.alloc(0x7200_0000_0000 + i * 0x10000, size)
        d.alloc(0x7300_0000_0000, 256)
        d.free(0x7300_0000_0000, 256)
        annotations.append({"stage": "END", "name": "Optimizer.step#AdamW.step",
                            "device": 0, "time_us": d.t + 1})
    snap = {"segments": [segment(0, 0x7000_0000_0000, 20 << 20)],
            "device_traces": [d.entries], "allocator_settings": settings(),
            "external_annotations": annotations}
    data = write("periodic.pickle.gz", snap, gz=True)
    # The same, cut in the middle of the deflate stream.
    with open(os.path.join(HERE, "truncated.pickle.gz"), "wb") as f:
        f.write(data[: len(data) // 2])


def bad_inputs():
    with open(os.path.join(HERE, "not_a_pickle.pickle"), "wb") as f:
        f.write(b"id,lower,upper,size\n0,0,10,4096\n")
    d = Device()
    d.alloc(0x1000, 64)
    d.free(0x1000, 64)
    del d.entries[1]["addr"]  # device_traces[0][1]: missing key 'addr'
    write("wrong_shape.pickle", {"segments": [], "device_traces": [d.entries],
                                 "allocator_settings": settings()})
    # Recording was on but nothing was allocated: segment events only.
    e = Device()
    e.add("segment_alloc", 0x2000, 2 << 20)
    write("empty_trace.pickle", {"segments": [], "device_traces": [e.entries, []],
                                 "allocator_settings": settings(),
                                 "external_annotations": []})


if __name__ == "__main__":
    multi_device()
    periodic()
    bad_inputs()
