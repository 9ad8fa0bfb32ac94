"""Does how device memory is mapped change kernel speed? (GPU probe, one process.)

stweaver (like PyTorch's expandable segments) maps physical memory one 2 MiB granule per
allocation handle (``cuMemCreate`` + ``cuMemMap``); PyTorch's native allocator takes
``cudaMalloc`` segments. This probe runs the same kernels on buffers of the three kinds:

- ``native``: ``torch.empty`` under PyTorch's own allocator (``cudaMalloc``);
- ``vmm_2m``: a reserved range mapped with one handle per 2 MiB granule;
- ``vmm_big``: the same range mapped with one handle for the whole buffer;
- with ``--chunks-mib 4,32,...``: the same range mapped with one handle per that many MiB;

and prints the median time of each kernel per kind, and the ratio to native. Kernels:
streaming copy, fp16 GEMM, row gather and scatter-add over a large table (TLB-sensitive
random rows), exp and row sums over a GPT-2-sized logits tensor.

    python python/bench/vmm_probe.py [--gib 4] [--reps 30] [--chunks-mib 4,8,32,128]

Uses the driver API through ctypes; the tensors over VMM memory are made with
``__cuda_array_interface__`` (no copy). Needs nothing but torch and a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics

import torch

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class AllocProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


cu = ctypes.CDLL("libcuda.so.1")


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUresult {rc}")


class VmmBuffer:
    """`nbytes` of device memory in a reserved range, mapped in handles of `chunk` bytes."""

    def __init__(self, nbytes: int, chunk: int, device: int):
        self.nbytes = nbytes
        prop = AllocProp()
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = Location(CU_MEM_LOCATION_TYPE_DEVICE, device)
        gran = ctypes.c_size_t()
        check(cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0),
              "cuMemGetAllocationGranularity")
        assert nbytes % gran.value == 0 and chunk % gran.value == 0 and nbytes % chunk == 0
        ptr = ctypes.c_uint64()
        check(cu.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(nbytes),
                                     ctypes.c_size_t(0), ctypes.c_uint64(0),
                                     ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        self.ptr = ptr.value
        for off in range(0, nbytes, chunk):
            h = ctypes.c_ulonglong()
            check(cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(chunk), ctypes.byref(prop),
                                 ctypes.c_ulonglong(0)), "cuMemCreate")
            check(cu.cuMemMap(ctypes.c_uint64(self.ptr + off), ctypes.c_size_t(chunk),
                              ctypes.c_size_t(0), h, ctypes.c_ulonglong(0)), "cuMemMap")
            check(cu.cuMemRelease(h), "cuMemRelease")
        desc = AccessDesc(Location(CU_MEM_LOCATION_TYPE_DEVICE, device),
                          CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        check(cu.cuMemSetAccess(ctypes.c_uint64(self.ptr), ctypes.c_size_t(nbytes),
                                ctypes.byref(desc), ctypes.c_size_t(1)), "cuMemSetAccess")
        self.cursor = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor over the next bytes of the buffer (512-B aligned)."""
        elem = torch.empty((), dtype=dtype).element_size()
        n = 1
        for s in shape:
            n *= s
        size = (n * elem + 511) // 512 * 512
        assert self.cursor + size <= self.nbytes, "buffer too small"
        typestr = {torch.float16: "<f2", torch.float32: "<f4", torch.int64: "<i8"}[dtype]

        class Iface:
            __cuda_array_interface__ = {
                "shape": shape, "typestr": typestr,
                "data": (self.ptr + self.cursor, False), "version": 3,
            }

        self.cursor += size
        return torch.as_tensor(Iface(), device="cuda")


def timed(fn, reps: int) -> float:
    """Median milliseconds of `fn` over `reps` runs (CUDA events), after 3 warm-ups."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def kernels(make, reps: int) -> dict[str, float]:
    g = torch.Generator(device="cuda").manual_seed(0)
    res = {}
    # Streaming copy, 1 GiB -> 1 GiB.
    n = (1 << 30) // 4
    x, y = make((n,), torch.float32), make((n,), torch.float32)
    x.uniform_(generator=g)
    res["copy_1GiB"] = timed(lambda: y.copy_(x), reps)
    # GEMM, fp16 8192^3.
    a, b, c = (make((8192, 8192), torch.float16) for _ in range(3))
    a.normal_(generator=g), b.normal_(generator=g)
    res["gemm_8k_fp16"] = timed(lambda: torch.mm(a, b, out=c), reps)
    # Random rows of a 1 GiB table (rows of 6400 B, like GPT-2 XL's embedding rows).
    rows = (1 << 30) // 6400
    table = make((rows, 1600), torch.float32)
    table.zero_()
    idx = make((65536,), torch.int64)
    idx.copy_(torch.randint(0, rows, (65536,), device="cuda", generator=g))
    out = make((65536, 1600), torch.float32)
    res["gather_rows"] = timed(lambda: torch.index_select(table, 0, idx, out=out), reps)
    res["scatter_add_rows"] = timed(lambda: table.index_add_(0, idx, out), reps)
    # exp and row sums over GPT-2-sized logits: 8192 x 50257 fp16.
    logits = make((8192, 50257), torch.float16)
    logits.normal_(generator=g)
    probs = make((8192, 50257), torch.float16)
    sums = make((8192,), torch.float16)

    def exp_sum():
        torch.exp(logits, out=probs)
        torch.sum(probs, -1, out=sums)

    res["exp_sum_logits"] = timed(exp_sum, reps)
    torch.cuda.synchronize()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=6, help="VMM buffer size")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--chunks-mib", default="",
                    help="comma-separated extra handle sizes in MiB (e.g. 4,8,32,128): one VMM "
                         "run per size, between vmm_2m and vmm_big")
    args = ap.parse_args()
    torch.zeros(1, device="cuda")
    dev = torch.cuda.current_device()
    nbytes = args.gib << 30
    results = {}
    extra = [int(c) for c in args.chunks_mib.split(",") if c.strip()]
    for c in extra:
        if c <= 0 or c % 2 or nbytes % (c << 20):
            ap.error(f"--chunks-mib: {c} MiB must be a positive multiple of 2 that divides {args.gib} GiB")
    order = ["native", "vmm_2m"] + [f"vmm_{c}m" for c in extra] + ["vmm_big", "native_again"]
    for kind in order:
        if kind.startswith("native"):
            results[kind] = kernels(lambda s, d: torch.empty(s, dtype=d, device="cuda"), args.reps)
        else:
            chunk = nbytes if kind == "vmm_big" else int(kind[4:-1]) << 20
            buf = VmmBuffer(nbytes, chunk, dev)
            results[kind] = kernels(buf.take, args.reps)
        torch.cuda.empty_cache()
    names = list(results["native"])
    print(f"{'kernel':<18}" + "".join(f"{k:>14}" for k in order) + "   (median ms; ratio to native)")
    for name in names:
        base = results["native"][name]
        cells = "".join(f"{results[k][name]:>8.3f} {results[k][name] / base:>5.3f}" for k in order)
        print(f"{name:<18}{cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
