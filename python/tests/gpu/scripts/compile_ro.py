"""torch.compile(mode="reduce-overhead") training steps (a small MLP, forward and backward
compiled, eager AdamW). `python compile_ro.py native|stweaver trees|notrees` prints one JSON
line: losses (float.hex), the inductor cudagraph counters, or the error the run raised.
`notrees` sets torch._inductor.config.triton.cudagraph_trees = False: plain CUDA graphs, each
in its own private pool (beginAllocateToPool/endAllocateToPool/releasePool), no checkpoints."""

import json
import os
import sys
import traceback

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
mode = sys.argv[1] if len(sys.argv) > 1 else "native"
trees = (sys.argv[2] if len(sys.argv) > 2 else "notrees") == "trees"
if mode == "stweaver":
    import stweaver

    stweaver.install("online")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch._inductor.config as inductor_config  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

inductor_config.triton.cudagraph_trees = trees
# Evidence that CUDA graphs really ran: count replays of torch.cuda.CUDAGraph (a Python
# subclass of torch._C._CUDAGraph; inductor calls graph.replay()).
replays = [0]
_replay = torch.cuda.CUDAGraph.replay


def _counting_replay(self, *a, **k):
    replays[0] += 1
    return _replay(self, *a, **k)


torch.cuda.CUDAGraph.replay = _counting_replay
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
STEPS = int(os.environ.get("STEPS", "10"))

model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
cmodel = torch.compile(model, mode="reduce-overhead")
gen = torch.Generator().manual_seed(1)
losses, error = [], None
try:
    for i in range(STEPS):
        x = torch.randn(64, 256, generator=gen).cuda()
        y = torch.randint(0, 10, (64,), generator=gen).cuda()
        if trees:
            torch.compiler.cudagraph_mark_step_begin()
        loss = F.cross_entropy(cmodel(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
except Exception as e:  # reported, the test decides
    error = f"{type(e).__name__}: {e}"
    traceback.print_exc()
print(
    json.dumps(
        {
            "backend": torch.cuda.memory.get_allocator_backend(),
            "trees": trees,
            "losses": [v.hex() for v in losses],
            "error": error,
            "inductor": {k: v for k, v in counters["inductor"].items() if "cudagraph" in k},
            "max_reserved": torch.cuda.max_memory_reserved(),
            "graph_replays": replays[0],
            "graph_pool_segments": sum(
                1 for seg in torch.cuda.memory._snapshot()["segments"] if tuple(seg["segment_pool_id"]) != (0, 0)
            ),
        }
    )
)
