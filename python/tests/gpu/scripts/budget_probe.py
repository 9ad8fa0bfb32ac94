"""The memory budget on a GPU, in a fresh process: `python budget_probe.py BUDGET [MODE]`.

Installs stweaver with `budget=BUDGET` (e.g. 3GiB) and prints one JSON line:
- fill: 256 MiB tensors until torch.OutOfMemoryError; how many fit, the message, and
  memory_reserved at that moment (must be <= the budget);
- graph: a CUDA graph captured into a private pool while the default pool holds cache —
  the device-wide reserved bytes stay under the budget, and the graph replays correctly;
- train: a small training loop (auto mode records, plans and switches) whose peak
  reserved stays under the budget, losses finite.
"""

import json
import os
import sys

budget = sys.argv[1] if len(sys.argv) > 1 else "3GiB"
mode = sys.argv[2] if len(sys.argv) > 2 else "auto"

import stweaver  # noqa: E402

stweaver.install(mode, budget=budget)

import torch  # noqa: E402

MIB = 1 << 20
out = {"budget": budget, "mode": mode}
from stweaver._settings import parse_budget  # noqa: E402 (stweaver._settings is the install's Settings)

limit = parse_budget(budget)
if isinstance(limit, float):
    limit = int(limit * torch.cuda.get_device_properties(0).total_memory)
out["budget_bytes"] = limit

# 1. Fill until the budget says no.
held = []
try:
    while True:
        held.append(torch.empty(256 * MIB, dtype=torch.uint8, device="cuda"))
except torch.OutOfMemoryError as e:
    out["fill_message"] = str(e)
out["fill_tensors"] = len(held)
out["fill_reserved"] = torch.cuda.memory_reserved()
out["fill_max_reserved"] = torch.cuda.max_memory_reserved()
del held

# 2. A CUDA graph's private pool counts against the same budget, next to the default
# pool's cache. During a capture no cache can be given back (that needs a device
# synchronisation, which would invalidate the capture; PyTorch's allocator does the same),
# so the fill's cache goes first and a quarter of the budget stays cached.
torch.cuda.empty_cache()
torch.cuda.reset_peak_memory_stats()
cache = [torch.empty(256 * MIB, dtype=torch.uint8, device="cuda") for _ in range(max(1, limit // (1024 * MIB)))]
del cache  # freed, cached in the default pool
out["graph_cached_before"] = torch.cuda.memory_reserved()
x = torch.randn(1024, 1024, device="cuda")
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(2):
        y = (x @ x).relu()
torch.cuda.current_stream().wait_stream(s)
big_graph_bytes = max(MIB, limit // 3)
with torch.cuda.graph(g):
    scratch = torch.empty(big_graph_bytes, dtype=torch.uint8, device="cuda")
    scratch.fill_(1)
    y = (x @ x).relu() + scratch[:1].float()
g.replay()
torch.cuda.synchronize()
expect = (x @ x).relu() + 1.0
out["graph_ok"] = bool(torch.equal(y, expect))
out["graph_max_reserved"] = torch.cuda.max_memory_reserved()
del g, y, scratch, expect

# 2b. A capture that does not fit beside the cache: a clean torch.OutOfMemoryError (the
# capture is not invalidated by a synchronisation), and CUDA works afterwards.
g2 = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(g2):
        too_big = torch.empty(limit, dtype=torch.uint8, device="cuda")
    out["capture_oom"] = "no error"
except torch.OutOfMemoryError as e:
    out["capture_oom"] = "OutOfMemoryError"
    out["capture_oom_message"] = str(e).splitlines()[0][:300]
except Exception as e:  # what broke, reported
    out["capture_oom"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
del g2
torch.cuda.synchronize()
out["after_capture_oom_ok"] = bool(torch.equal(x.clone(), x)) and bool(torch.isfinite(x @ x).all())

# 3. Train under the budget.
from budget_train import train_under_budget  # noqa: E402 (beside this script)

out.update(train_under_budget(torch, stweaver))
print(json.dumps(out))
