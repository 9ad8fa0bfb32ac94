"""A loop of iteration classes on the GPU (issue #18): train_tiny.py's model with the sequence
length drawn per iteration from {32, 64, 96}, and from iteration NEW_FROM (default 70) every
fourth iteration of length 128, a class first seen after auto's switch. `KEYS=1` names each
iteration by its length (`stweaver.iteration_key`, the optimizer hook marking the boundaries).
`python train_classes.py native|stweaver` (or under `python -m stweaver run`) prints one JSON
line: losses (float.hex), peaks, the lengths, stweaver's stats."""

import json
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
mode = sys.argv[1] if len(sys.argv) > 1 else "native"
if mode == "stweaver":
    import stweaver

    stweaver.install("auto", hook_optimizer=True)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.manual_seed(0)
torch.use_deterministic_algorithms(True, warn_only=True)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cuda.enable_flash_sdp(False)
torch.backends.cuda.enable_mem_efficient_sdp(False)

V, D, B = 1000, 256, 16
STEPS = int(os.environ.get("STEPS", "150"))
NEW_FROM = int(os.environ.get("NEW_FROM", "70"))
KEYS = os.environ.get("KEYS") == "1"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, 4, 512, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, V)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)))


model = Net().cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(1)
st = None
if torch.cuda.memory.get_allocator_backend() == "stweaver":
    import stweaver as st
losses, lengths = [], []
for i in range(STEPS):
    if i >= NEW_FROM and i % 4 == 0:
        T = 128
    else:
        T = (32, 64, 96)[int(torch.randint(0, 3, (1,), generator=gen))]
    lengths.append(T)
    if KEYS and st is not None:
        st.iteration_key(T)
    x = torch.randint(0, V, (B, T), generator=gen).cuda()
    y = torch.randint(0, V, (B, T), generator=gen).cuda()
    loss = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))
    loss.backward()
    opt.step()  # stweaver's optimizer hook marks the iteration here
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())
torch.cuda.synchronize()
print(
    json.dumps(
        {
            "backend": torch.cuda.memory.get_allocator_backend(),
            "losses": [v.hex() for v in losses],
            "lengths": lengths,
            "max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved(),
            "stweaver": st.stats() if st is not None else None,
        },
        default=str,
    )
)
