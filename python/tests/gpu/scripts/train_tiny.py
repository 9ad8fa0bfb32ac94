"""A small deterministic training loop (embedding + 2-layer transformer encoder + conv + head),
no external dependencies. `python train_tiny.py native|stweaver` prints one JSON line:
losses (float.hex, for bitwise comparison), peaks, step time. Under `python -m stweaver run`
stweaver is already installed and its optimizer hook marks iterations."""

import json
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
mode = sys.argv[1] if len(sys.argv) > 1 else "native"
if mode == "stweaver":
    import stweaver

    stweaver.install("online")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.manual_seed(0)
torch.use_deterministic_algorithms(True, warn_only=True)
torch.backends.cudnn.benchmark = False
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.enable_flash_sdp(False)
torch.backends.cuda.enable_mem_efficient_sdp(False)

V, D, T, B = 1000, 256, 64, 16
STEPS = int(os.environ.get("STEPS", "30"))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, 4, 512, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.conv = nn.Conv1d(D, D, 3, padding=1)
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = self.enc(self.emb(x))
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h)


model = Net().cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(1)
losses = []
torch.cuda.synchronize()
t0 = time.perf_counter()
for i in range(STEPS):
    x = torch.randint(0, V, (B, T), generator=gen).cuda()
    y = torch.randint(0, V, (B, T), generator=gen).cuda()
    loss = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item())
torch.cuda.synchronize()
elapsed = time.perf_counter() - t0
backend = torch.cuda.memory.get_allocator_backend()
info = None
if backend == "stweaver":
    import stweaver

    info = stweaver.stats()
print(
    json.dumps(
        {
            "backend": backend,
            "losses": [v.hex() for v in losses],
            "max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved(),
            "step_ms": elapsed / STEPS * 1e3,
            "stweaver": info,
        }
    )
)
