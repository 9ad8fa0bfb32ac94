"""Auto mode under a budget with install()'s offloader and nothing recomputed (issue #16):
what the iterations before the plan move and pin, with the watermark (``STWEAVER_OFFLOAD_WATERMARK=1``) or without
(the default). A 16-block residual MLP trained with AdamW, as
auto_recompute_probe.py's. ``unlimited``: stweaver online, no budget (the reference: peak
allocated, losses). ``BUDGET``: auto mode under that budget (bytes). Prints one JSON line:
per iteration the mode, the bytes offloaded, the candidates the watermark kept, the
offloader's pinned pool and torch's pinned host bytes (in use + cached), the step time;
then the losses as hex, the peaks and the offloader's stats.

    python watermark_probe.py unlimited|BUDGET [ITERATIONS]
"""

import json
import sys
import time

from mlp_probe_model import setup  # this directory (the script's)


def main() -> None:
    what = sys.argv[1]
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    stweaver, torch, model, gen = setup(what, 5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, per_it = [], []
    error = None
    try:
        for _ in range(iters):
            x = torch.randn(16384, 1024, device="cuda", generator=gen)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = model(x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()  # stweaver's optimizer hook: the boundary (the offloader's too)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            losses.append(float(loss.item()).hex())
            st = stweaver.offload_stats() if what != "unlimited" else {}
            last = st.get("last_iteration") or {}
            per_it.append({
                "mode": stweaver.mode(),
                "step_s": dt,
                "bytes_out": last.get("bytes_out"),
                "watermark_kept": last.get("watermark_kept"),
                "watermark": last.get("watermark"),
                "host_capacity": st.get("host_capacity"),
                "schedule_bytes": st.get("schedule_bytes"),
                "pinned": torch.cuda.host_memory_stats().get("allocated_bytes.current", 0),
            })
    except torch.OutOfMemoryError as e:  # reported with the state, for the test's message
        error = str(e).splitlines()[0][:400]
    st = stweaver.offload_stats() if what != "unlimited" else {}
    print(json.dumps({
        "mode": stweaver.mode(),
        "error": error,
        "losses": losses,
        "iterations": per_it,
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
        "offload": {k: v for k, v in st.items() if k not in ("last_iteration", "current_iteration")},
        "stweaver": stweaver.stats(),
    }, default=str))


if __name__ == "__main__":
    main()
