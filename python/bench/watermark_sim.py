#!/usr/bin/env python3
"""The watermark (``stweaver._offload.Watermark``) on a CPU simulation of a GPT-2 XL-shaped
training step, no GPU: 48 layers, each saving six activations (26, 78, 26, 26, 105, 105 MB)
and four weights (61 MB), forward's end (823 MB of logits, their 1.65 GB fp32 copy and the
saved 1.65 GB log-softmax), backward's gradients, AdamW's state (2 x the weights) made at the
first step. Sizes in MB, simulated as KiB of CPU memory through the offloader's test fakes
(``python/tests/test_offload.py``: every "device" tensor counted while it lives, the peak
taken at every allocation, copies run at once).

    python python/bench/watermark_sim.py

Prints, per iteration, the peak (GB), the bytes offloaded (GB) and the pinned pool (GB):
without offload, offloading every candidate, and with the watermark at 0.9, 0.8 and 0.7 x
the steady peak without offload. A model of the step, not a measurement.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

import test_offload as T  # noqa: E402
from stweaver import _offload as off  # noqa: E402
U = 1024  # bytes per simulated MB
L_ = 48
SAVES = [26, 78, 26, 26, 105, 105]  # per layer, MB
PARAMS_PER_LAYER = [15, 15, 15, 16]  # MB, weights saved by their matmuls (61 MB)
EMB = 160

def params_make(mem):
    ps = [[mem.track(torch.nn.Parameter(torch.zeros(n * U // 4))) for n in PARAMS_PER_LAYER] for _ in range(L_)]
    emb = mem.track(torch.nn.Parameter(torch.zeros(EMB * U // 4)))
    return ps, emb

def step(o, mem, ps, emb, state):
    pack = o.pack if o else (lambda t: t); unpack = o.unpack if o else (lambda t: t)
    for layer in ps:
        for p in layer: p.grad = None
    emb.grad = None
    saved = []
    h = mem.new(26 * U)
    for li in range(L_):
        layer_saved = []
        for wi, n in enumerate(SAVES):
            t = mem.new(n * U)
            layer_saved.append(pack(t))
            if wi < len(PARAMS_PER_LAYER):
                layer_saved.append(pack(ps[li][wi]))
            del t
        h2 = mem.new(26 * U); del h; h = h2
        saved.append(layer_saved)
    hs = pack(h)
    logits = mem.new(823 * U)
    wsave = pack(emb)
    f32 = mem.new(1650 * U)
    ls = mem.new(1650 * U)
    lss = pack(ls)
    del ls, f32, logits, h
    # backward
    g = mem.new(1650 * U)
    x = unpack(lss); del lss, x
    g2 = mem.new(823 * U); del g
    unpack(wsave); unpack(hs); del wsave, hs
    emb.grad = mem.track(torch.zeros_like(emb))
    gh = mem.new(26 * U); del g2
    for li in reversed(range(L_)):
        items = saved[li]
        for wi in reversed(range(len(PARAMS_PER_LAYER))):
            ps[li][wi].grad = mem.track(torch.zeros_like(ps[li][wi]))
        tmp = mem.new(105 * U)
        for hh in reversed(items):
            unpack(hh)
        saved[li] = None; del items, hh
        del tmp
    del gh
    if state is not None and not state:
        state.extend(mem.new(2 * 61 * U) for _ in range(L_))
    return o.iteration_end() if o else None

def run(wm_limit, iters=6, adam=True, peak=True):
    mem = T.SimMem(); ps, emb = params_make(mem); st = [] if adam else None
    o = None
    if wm_limit != "none":
        be = T.SimBackend(mem, peak=peak)
        ext = T.FakeExt(recording=False, schedule=[]); ext.mode = lambda: "auto (recording)"
        pool = off.PinnedPool(pin=T.cpu_pin(), pow2=True, min_grow=64 * U)
        wm = None if wm_limit is None else off.Watermark(wm_limit)  # default margin: max(256 MiB, L/32) scaled
        if wm is not None:
            wm.min_margin = 256 * U
        o = off.Offloader(schedule="plan", ext=ext, backend=be, pool=pool, first_min_bytes=1 * U, watermark=wm)
        o._before_plan = True
    out = []
    for i in range(iters):
        mem.peak = mem.live
        it = step(o, mem, ps, emb, st)
        out.append((round(mem.peak / U / 1000, 2), round((it or {}).get("bytes_out", 0) / U / 1000, 2),
                    round(o.pool.capacity / U / 1000, 2) if o else 0))
    return out

none = run("none"); print("no offload (peak GB):", none)
lb = none[-1][0]
allr = run(None); print("threshold all (peak GB, moved GB, pool GB):", allr)
for f in (0.9, 0.8, 0.7):
    L = int(f * lb * 1000 * U)
    r = run(L)
    print(f"{f} x LB = {L / U / 1000:.2f} GB:", r, "fits" if all(p <= L / U / 1000 for p, _, _ in r) else "OVER")
