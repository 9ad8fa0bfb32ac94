"""The model of the auto-mode probes (auto_recompute_probe.py, watermark_probe.py): a
16-block residual MLP (1024 wide) trained with AdamW, after stweaver is installed online
(``what == "unlimited"``: the reference) or in auto mode under ``what`` bytes of budget;
deterministic (cuBLAS workspace, deterministic algorithms, seeded model and inputs)."""

import os


def setup(what: str, auto_iterations: int):
    """Installs stweaver and builds the model: returns (stweaver, torch, model, generator)."""
    os.environ.setdefault("STWEAVER_AUTO_ITERATIONS", str(auto_iterations))
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
    gen = torch.Generator(device="cuda").manual_seed(1)
    return stweaver, torch, model, gen
