"""`python bench_alloc.py native|stweaver`: µs per torch.empty + del pair, by size (JSON)."""

import json
import sys
import time

if sys.argv[1] == "stweaver":
    import stweaver

    stweaver.install("online")
import torch  # noqa: E402

torch.empty(1, device="cuda")
torch.cuda.synchronize()
out = {"backend": torch.cuda.memory.get_allocator_backend()}
for size in (4096, 1 << 20, 64 << 20):
    for _ in range(2000):
        t = torch.empty(size, dtype=torch.uint8, device="cuda")
        del t
    n = 50000
    best = float("inf")
    for _rep in range(3):  # best of 3: the machine is shared
        t0 = time.perf_counter()
        for _ in range(n):
            t = torch.empty(size, dtype=torch.uint8, device="cuda")
            del t
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    out[str(size)] = best
print(json.dumps(out))
