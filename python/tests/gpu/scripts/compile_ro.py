"""torch.compile(mode="reduce-overhead") training steps (a small MLP, forward and backward
compiled, eager AdamW), then a graph-break branch that makes cudagraph trees restore a
pool checkpoint. `python compile_ro.py native|stweaver trees|notrees|eager` prints one JSON
line: losses and branch results (float.hex), the inductor cudagraph counters, how often the
trees called the allocator's checkpoint API, or the error the run raised.

- `trees` (the default of reduce-overhead): CUDA graph trees. Every recorded graph is
  checkpointed (`_cuda_getCheckpointState`); recording or warming up a new branch after a
  replay restores the parent's checkpoint (`_cuda_setCheckpointPoolState`).
- `notrees` sets torch._inductor.config.triton.cudagraph_trees = False: plain CUDA graphs,
  each in its own private pool (beginAllocateToPool/endAllocateToPool/releasePool), no
  checkpoints.
- `eager`: the same steps without torch.compile (the reference for tolerances)."""

import json
import os
import sys
import traceback

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
mode = sys.argv[1] if len(sys.argv) > 1 else "native"
variant = sys.argv[2] if len(sys.argv) > 2 else "notrees"
assert variant in ("trees", "notrees", "eager"), variant
trees = variant == "trees"
compiled = variant != "eager"
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

# Evidence that the checkpoint API really ran: cudagraph trees look these up on torch._C at
# every call, so counting wrappers see every call.
api_calls = {"getCheckpointState": 0, "setCheckpointPoolState": 0}


def _counted(name, fn):
    def wrapper(*a, **k):
        api_calls[name] += 1
        return fn(*a, **k)

    return wrapper


for _name in api_calls:
    _attr = f"_cuda_{_name}"
    if hasattr(torch._C, _attr):
        setattr(torch._C, _attr, _counted(_name, getattr(torch._C, _attr)))

torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
STEPS = int(os.environ.get("STEPS", "10"))


def step_begin():
    if trees:
        torch.compiler.cudagraph_mark_step_begin()


model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
cmodel = torch.compile(model, mode="reduce-overhead") if compiled else model
gen = torch.Generator().manual_seed(1)


def branchy(x, flag: bool):
    # Two graphs around the break; the second depends on `flag`. After the True path has
    # been recorded and replayed, the first call with False replays the first graph and
    # then has to warm up (and later record) a new child: the trees restore the first
    # graph's checkpoint before each.
    y = x * 2.0 + 1.0
    torch._dynamo.graph_break()
    if flag:
        return torch.sin(y) * y
    return torch.cos(y) - y


cbranchy = torch.compile(branchy, mode="reduce-overhead") if compiled else branchy
FLAGS = [True, True, True, False, False, False, True, False, True, False]

losses, branch, error = [], [], None
try:
    for i in range(STEPS):
        x = torch.randn(64, 256, generator=gen).cuda()
        y = torch.randint(0, 10, (64,), generator=gen).cuda()
        step_begin()
        loss = F.cross_entropy(cmodel(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    bx = torch.randn(4096, generator=gen).cuda()
    for flag in FLAGS:
        step_begin()
        out = cbranchy(bx, flag)
        branch.append(out.double().sum().item())
        del out
    torch.cuda.synchronize()
except Exception as e:  # reported, the test decides
    error = f"{type(e).__name__}: {e}"
    traceback.print_exc()

failed_frees = None
if mode == "stweaver":
    failed_frees = stweaver.stats().get("failed_frees")
print(
    json.dumps(
        {
            "backend": torch.cuda.memory.get_allocator_backend(),
            "variant": variant,
            "trees": trees,
            "losses": [v.hex() for v in losses],
            "branch": [v.hex() for v in branch],
            "error": error,
            "inductor": {k: v for k, v in counters["inductor"].items() if "cudagraph" in k},
            "checkpoint_api": api_calls,
            "failed_frees": failed_frees,
            "memory_allocated": torch.cuda.memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved(),
            "graph_replays": replays[0],
            "graph_pool_segments": sum(
                1 for seg in torch.cuda.memory._snapshot()["segments"] if tuple(seg["segment_pool_id"]) != (0, 0)
            ),
        }
    )
)
