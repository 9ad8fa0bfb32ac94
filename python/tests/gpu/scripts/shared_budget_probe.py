"""One of N processes sharing a GPU, each under its own budget (issue #17 item 2):
`python shared_budget_probe.py BUDGET SYNC_DIR N`.

Installs stweaver with `budget=BUDGET` (a fraction of the device, e.g. 0.3), then:
- fill: 256 MiB tensors until torch.OutOfMemoryError; how many fit and memory_reserved;
- hold: writes SYNC_DIR/<pid> and waits (60 s at most) until N processes have, so all N
  fills are held at once, and reads the device-wide free memory (cudaMemGetInfo) then;
- train: frees the fill and trains a small MLP for 12 steps (auto mode records, plans and
  switches) under the same budget: its peak reserved and whether the losses are finite.
Prints one JSON line.
"""

import json
import os
import sys
import time

budget, sync_dir, n = sys.argv[1], sys.argv[2], int(sys.argv[3])

import stweaver  # noqa: E402

stweaver.install("auto", budget=budget)

import torch  # noqa: E402

MIB = 1 << 20
from stweaver._settings import parse_budget  # noqa: E402

total = torch.cuda.get_device_properties(0).total_memory
limit = parse_budget(budget)
if isinstance(limit, float):
    limit = int(limit * total)
out = {"budget": budget, "budget_bytes": limit, "total": total, "pid": os.getpid()}

held = []
try:
    while True:
        held.append(torch.empty(256 * MIB, dtype=torch.uint8, device="cuda"))
except torch.OutOfMemoryError as e:
    out["fill_message"] = str(e)[:2000]
out["fill_tensors"] = len(held)
out["fill_reserved"] = torch.cuda.memory_reserved()

open(os.path.join(sync_dir, str(os.getpid())), "w").close()
deadline = time.time() + 60
while len(os.listdir(sync_dir)) < n and time.time() < deadline:
    time.sleep(0.05)
out["all_holding"] = len(os.listdir(sync_dir)) >= n
free, _ = torch.cuda.mem_get_info()
out["device_used_while_all_hold"] = total - free
time.sleep(1.0)  # the others read the device while this one still holds its fill
del held

from budget_train import train_under_budget  # noqa: E402 (beside this script)

out.update(train_under_budget(torch, stweaver))
print(json.dumps(out))
