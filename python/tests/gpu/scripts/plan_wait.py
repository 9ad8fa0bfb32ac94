"""A planned range held by a free pending on another stream, served by a stream wait.

Each iteration: x (64 MiB of 1.0) is allocated on the main stream, read on a side stream
(``y.copy_(x)``), recorded there (``x.record_stream(side)``) and freed; then z (the same
size, 2.0) is allocated on the main stream. While auto mode records (the first iterations)
the host synchronises before z, so x's free has completed and the plan puts z on x's
range. Once the plan is served the side stream first sleeps ~0.2 s, so x's free is still
pending when z is requested: with stream waits (``STWEAVER_PLAN_WAIT``, default on) the
main stream waits for the side stream's event and z gets x's address; without, z goes
elsewhere. Either way y must read 1.0: z's fill must not overtake the side stream's copy.
Prints one JSON line: per iteration (mode, z on x's address, y intact), and the stats.
"""

import json
import os
import sys

import stweaver

stweaver.install("auto")
import torch  # noqa: E402

N = 16 << 20  # floats: 64 MiB
ITERS = int(os.environ.get("ITERS", "14"))
main = torch.cuda.current_stream()
side = torch.cuda.Stream()
rows = []
for it in range(ITERS):
    served = stweaver.mode() == "auto (plan)"
    x = torch.full((N,), 1.0, device="cuda")
    y = torch.empty_like(x)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        if served:
            torch.cuda._sleep(400_000_000)
        y.copy_(x)
    x.record_stream(side)
    xp = x.data_ptr()
    del x
    if not served:
        torch.cuda.synchronize()
    z = torch.full((N,), 2.0, device="cuda")
    zp = z.data_ptr()
    main.wait_stream(side)
    intact = bool((y == 1.0).all().item())
    rows.append({"served": served, "reused": xp == zp, "intact": intact})
    del y, z
    stweaver.step()
torch.cuda.synchronize()
print(json.dumps({"rows": rows, "stweaver": stweaver.stats()}))
sys.stdout.flush()
