"""recompute_blocks(model, "auto") on a GPU (issue #16): a 16-block residual MLP trained
with AdamW. ``unlimited``: stweaver online, no budget (the reference: peak allocated, losses).
``BUDGET``: auto mode under that budget (bytes), install's offloader, and
recompute_blocks(model, "auto"); prints the decisions, the final mode, the peak reserved and
the losses as hex, one JSON line.

    python auto_recompute_probe.py unlimited|BUDGET [ITERATIONS]
"""

import json
import os
import sys



def main() -> None:
    what = sys.argv[1]
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    os.environ.setdefault("STWEAVER_AUTO_ITERATIONS", "2")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    import stweaver

    if what == "unlimited":
        stweaver.install("online")
    else:
        stweaver.install("auto", budget=what)
    import torch

    torch.use_deterministic_algorithms(True)

    class MLPBlock(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.a = torch.nn.Linear(width, 4 * width)
            self.b = torch.nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.b(torch.nn.functional.gelu(self.a(x)))

    class Net(torch.nn.Module):
        def __init__(self, width=1024, depth=16):
            super().__init__()
            self.layers = torch.nn.ModuleList(MLPBlock(width) for _ in range(depth))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.float().pow(2).mean()

    torch.manual_seed(0)
    model = Net().cuda()
    if what != "unlimited":
        stweaver.recompute_blocks(model, "auto")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device="cuda").manual_seed(1)
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
