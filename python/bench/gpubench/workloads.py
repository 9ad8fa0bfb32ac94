"""The benchmark's workloads: the training configs (make_traces.py's), the cap-search loops,
the tiny dry-run variants, the allocators and their labels."""

from __future__ import annotations

from typing import List


# The configs of make_traces.py (same names, sizes and loops); iterations scaled to fit one call.
WORKLOADS = [
    dict(name="llama1b_rcp", family="llama", hidden=2048, layers=16, heads=16, inter=5632,
         batch=8, seq=2048, ckpt=True, micro=2, iters=16, est_s=12,
         note="Llama 1B, 8 x 2048 tokens in 2 micro-batches, activation checkpointing"),
    dict(name="gpt2xl_rcp", family="gpt2", hidden=1600, layers=24, heads=25, inter=6400,
         batch=8, seq=1024, ckpt=True, micro=2, iters=16, est_s=10,
         note="GPT-2 XL, 8 x 1024 in 2 micro-batches, checkpointing"),
    dict(name="qwenmoe_eager_rcp", family="qwen2moe", hidden=1024, layers=12, heads=16, inter=2816,
         batch=8, seq=1024, ckpt=True, micro=2, experts=16, topk=4, moe_inter=1408,
         experts_impl="eager", iters=10, max_iters=24, est_s=16,
         note="Qwen2-MoE 16 experts top-4, eager experts (token-dependent shapes), checkpointing"),
    # make_traces' llama1b_1f1b is batch 16 (8 micro-batches of 2); halved here to fit the call.
    dict(name="llama1b_1f1b", family="llama", hidden=2048, layers=16, heads=16, inter=5632,
         batch=8, seq=2048, ckpt=True, micro=8, inflight=4, iters=12, est_s=12,
         note="Llama 1B, 1F1B-style: 8 micro-batches of 1 x 2048, 4 in flight (batch 16 -> 8)"),
    # Added: every micro-batch has its own sequence length (uniform in [256, 2048]), so the
    # request sizes change every iteration and never repeat with a short period.
    dict(name="llama1b_varlen", family="llama", hidden=2048, layers=16, heads=16, inter=5632,
         batch=8, seq=2048, seq_min=256, ckpt=True, micro=2, iters=16, est_s=10,
         note="Llama 1B, 2 micro-batches of 4 x L, L uniform in [256, 2048] per micro-batch"),
]


# The loops of the "memory you can spend" search: the largest micro-batch B that trains
# under a fixed cap (torch.cuda.set_per_process_memory_fraction), one micro-batch per
# iteration, checkpointing. Llama 1B (dense, B x 2048), GPT-2 XL (B x 1024) and Llama 1B
# with a sequence length drawn per iteration (B x L, L uniform in [256, 2048]: shapes that
# never repeat). `guess`: the first B tried when nothing better is known.
CAP_WORKLOAD = dict(name="llama1b_cap", family="llama", hidden=2048, layers=16, heads=16, inter=5632,
                    batch=1, seq=2048, ckpt=True, micro=1, iters=6, max_iters=18, est_s=10,
                    cap_bytes=16 * (1 << 30), guess=10)


CAP_WORKLOADS = [
    CAP_WORKLOAD,
    dict(name="gpt2xl_cap", family="gpt2", hidden=1600, layers=24, heads=25, inter=6400,
         batch=1, seq=1024, ckpt=True, micro=1, iters=6, max_iters=18, est_s=10,
         cap_bytes=12 * (1 << 30), guess=8),
    dict(name="llama1b_varlen_cap", family="llama", hidden=2048, layers=16, heads=16, inter=5632,
         batch=1, seq=2048, seq_min=256, ckpt=True, micro=1, iters=8, max_iters=18, est_s=10,
         cap_bytes=14 * (1 << 30), guess=7),
]


CAP_BYTES = CAP_WORKLOAD["cap_bytes"]


CAP_ALLOCATORS = ("native", "expandable", "auto")


# Tiny shapes for --dry-run (CPU).
DRY = dict(hidden=64, layers=2, heads=4, inter=128, moe_inter=32, experts=4, topk=2, vocab=1000,
           seq=32, seq_min=8, batch=4, iters=5, max_iters=10)


ALLOCATORS = ("native", "expandable", "trace", "plan", "auto")


LABELS = {
    "native": "PyTorch native",
    "expandable": "expandable segments",
    "trace": "stweaver online (trace run)",
    "auto": "stweaver auto (whole run)",
    "auto_steady": "stweaver auto (after switch)",
    "plan": "stweaver plan (trace -> plan)",
    "native_aa": "PyTorch native, 2nd process (A/A)",
}


# Lockstep's control: a second native process, compared with the first like any allocator.
CONTROL = "native_aa"


WARMUP = 3  # iterations left out of step-time medians


def dry_workloads() -> List[dict]:
    out = []
    for w in WORKLOADS:
        d = dict(w)
        for k in ("hidden", "layers", "heads", "inter", "moe_inter", "experts", "topk", "seq", "batch"):
            if k in d:
                d[k] = DRY[k]
        if "seq_min" in d:
            d["seq_min"] = DRY["seq_min"]
        d["vocab"] = DRY["vocab"]
        d["iters"] = DRY["iters"]
        if "max_iters" in d:
            d["max_iters"] = DRY["max_iters"]
        d["micro"] = min(d["micro"], d["batch"])
        out.append(d)
    return out


DRY_CAP = dict(CAP_WORKLOAD, hidden=64, layers=2, heads=4, inter=128, vocab=1000, seq=32, iters=4, max_iters=8)


DRY_CAPS = [DRY_CAP, dict(DRY_CAP, name="varlen_cap", seq_min=8)]
