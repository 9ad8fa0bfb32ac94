"""recompute_blocks(model, "auto") on a GPU (issue #16): a 16-block residual MLP trained
with AdamW. ``unlimited``: stweaver online, no budget (the reference: peak allocated, losses).
``BUDGET``: auto mode under that budget (bytes), install's offloader, and
recompute_blocks(model, "auto"); prints the decisions, the final mode, the peak reserved and
the losses as hex, one JSON line.

    python auto_recompute_probe.py unlimited|BUDGET [ITERATIONS]
"""

import json
import sys

from mlp_probe_model import setup  # this directory (the script's)


def main() -> None:
    what = sys.argv[1]
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    stweaver, torch, model, gen = setup(what, 2)
    if what != "unlimited":
        stweaver.recompute_blocks(model, "auto")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, modes = [], []
    error = None
    try:
        for _ in range(iters):
            x = torch.randn(16384, 1024, device="cuda", generator=gen)
            loss = model(x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()  # stweaver's optimizer hook: the boundary (the offloader's too)
            losses.append(float(loss.item()).hex())
            modes.append(stweaver.mode())
    except torch.OutOfMemoryError as e:  # reported with the state, for the test's message
        error = str(e).splitlines()[0][:400]
    st = stweaver.offload_stats() if what != "unlimited" else {}
    print(json.dumps({
        "mode": stweaver.mode(),
        "error": error,
        "losses": losses,
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
        "auto_recompute": st.get("auto_recompute"),
        "bytes_out": st.get("bytes_out"),
        "modes": modes,
        "stweaver": stweaver.stats(),
        "offload": {k: v for k, v in st.items() if k not in ("auto_recompute", "iterations")},
    }, default=str))


if __name__ == "__main__":
    main()
