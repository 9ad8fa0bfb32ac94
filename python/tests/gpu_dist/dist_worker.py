#!/usr/bin/env python3
"""One rank of a distributed training run (launched by ``torchrun --nproc-per-node N``).

    torchrun --standalone --nproc-per-node 2 python/tests/gpu_dist/dist_worker.py \
        --strategy ddp|fsdp --alloc native|expandable|stweaver --config tiny|llama1b \
        --iters 24 --out DIR

``--alloc stweaver`` calls ``stweaver.install()`` with no argument: the mode, trace and plan
come from STWEAVER_MODE / STWEAVER_TRACE / STWEAVER_PLAN (auto when none is set), exactly as a
user's training script under torchrun would. ``expandable`` expects
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True from the launcher.

Each rank writes DIR/rank{R}.json: per-iteration losses (float.hex of the rank's local loss),
step times, peak reserved / allocated (whole run, and for stweaver auto the window after its
switch to the plan), the stweaver mode per iteration and ``stweaver.stats()``.

Deterministic: torch.use_deterministic_algorithms(True) (strict), CUBLAS_WORKSPACE_CONFIG set
by the launcher, the model seeded identically on every rank, the data seeded per rank.
``--dry-run``: CPU and gloo, no stweaver, a tiny model (checks the orchestration only).

Lockstep (python/bench/gpu_dist_bench.py --lockstep, protocol in python/bench/lockstep.py):
when STWEAVER_BENCH_LOCKSTEP_DIR and STWEAVER_BENCH_LOCKSTEP_KEY are set, each rank takes the
participant's side of seat KEY.r{RANK} (the pipes DIR/KEY.r{RANK}.cmd and .reply). The ranks
train freely through the warm-up (``lockstep_warm``: --warmup iterations; stweaver auto until
the plan has served an iteration after its switch, it settled online, or --iters ran out),
agree that every rank is warm, say "ready", and from then on wait for the driver's command
before every iteration: "go" runs one (timed between two device synchronisations, then
"done"), "stop" ends the loop, however many iterations that makes; the outputs are as above,
plus ``lockstep_from``. The driver sends the same commands to every rank of a job, so all ranks
run the same iterations. No rank waits on its pipe while another one of its job is inside a
collective (they get "go" together and every iteration ends with a device synchronisation),
so the waits, seconds to a minute or two while other jobs warm up, never come near the
process group's timeout (NCCL's default: 10 min); nothing else is in flight meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

CONFIGS = {
    # make_traces.py's llama1b config scaled down for the tests.
    "tiny": dict(hidden=256, layers=4, heads=4, inter=688, vocab=4096, batch=4, seq=256, ckpt=True),
    # make_traces.py's llama1b_rcp (hidden 2048, 16 layers, checkpointing); per rank one
    # micro-batch of 2 x 2048 tokens.
    "llama1b": dict(hidden=2048, layers=16, heads=16, inter=5632, vocab=32000, batch=2, seq=2048, ckpt=True),
    "dry": dict(hidden=32, layers=2, heads=2, inter=64, vocab=128, batch=2, seq=16, ckpt=False),
}


def build_model(c, device, torch, dry):
    try:
        import transformers as tf
    except ImportError:
        if not dry:
            raise
        tf = None
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32 if dry else torch.bfloat16)
    try:
        with torch.device(device):
            if tf is None:  # dry run without transformers: a stand-in with the same interface
                m = _TinyLM(c, torch)
            else:
                cfg = tf.LlamaConfig(hidden_size=c["hidden"], num_hidden_layers=c["layers"],
                                     num_attention_heads=c["heads"], num_key_value_heads=c["heads"],
                                     intermediate_size=c["inter"], vocab_size=c["vocab"],
                                     max_position_embeddings=c["seq"])
                m = tf.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    if tf is not None:
        if c["ckpt"]:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.config.use_cache = False
    m.train()
    return m


def _TinyLM(c, torch):
    nn = torch.nn

    class Out:
        def __init__(self, loss):
            self.loss = loss

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(c["hidden"], c["inter"])
            self.down = nn.Linear(c["inter"], c["hidden"])

        def forward(self, h):
            return h + self.down(torch.relu(self.up(h)))

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block() for _ in range(c["layers"])])

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(c["vocab"], c["hidden"])
            self.model = Inner()
            self.head = nn.Linear(c["hidden"], c["vocab"])

        def forward(self, input_ids, labels):
            h = self.emb(input_ids)
            for b in self.model.layers:
                h = b(h)
            logits = self.head(h)
            return Out(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()))

    return LM()


LOCKSTEP_DIR_VAR = "STWEAVER_BENCH_LOCKSTEP_DIR"
LOCKSTEP_KEY_VAR = "STWEAVER_BENCH_LOCKSTEP_KEY"


def lockstep_turn(rank: int, env=None):
    """This rank's lockstep.Turn, or None when the job is not in lockstep."""
    env = os.environ if env is None else env
    d, key = env.get(LOCKSTEP_DIR_VAR), env.get(LOCKSTEP_KEY_VAR)
    if not d or not key:
        return None
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")  # python/bench
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from lockstep import Turn

    seat = os.path.join(d, f"{key}.r{rank}")  # lockstep.Seat's names for key KEY.r{RANK}
    return Turn(seat + ".cmd", seat + ".reply")


def lockstep_warm(i: int, warmup: int, iters: int, auto: bool, mode, steady_from) -> bool:
    """May this rank start waiting for turns before iteration i? (gpu_bench.py's
    `lockstep_warm`, with --warmup and --iters.) After the warm-up; stweaver auto also once the
    plan has served an iteration after its switch (the online cache is released then, so the
    timed iterations are the plan's), or it settled online, or it ran --iters iterations
    without either (its rows then say it never switched)."""
    if i < warmup:
        return False
    if not auto:
        return True
    if steady_from is not None:
        return i >= steady_from + 1
    return (mode or "").startswith("auto (online") or i >= iters


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", choices=("ddp", "fsdp"), required=True)
    ap.add_argument("--alloc", choices=("native", "expandable", "stweaver"), required=True)
    ap.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    ap.add_argument("--iters", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=5, help="iterations left out of step-time medians")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    res = {"rank": rank, "local_rank": local_rank, "world_size": world, "strategy": a.strategy,
           "alloc": a.alloc, "config": a.config, "ok": False,
           "env": {k: os.environ.get(k) for k in ("STWEAVER_MODE", "STWEAVER_PLAN", "STWEAVER_TRACE",
                                                 "PYTORCH_CUDA_ALLOC_CONF", "NCCL_NVLS_ENABLE")}}
    os.makedirs(a.out, exist_ok=True)
    out_path = os.path.join(a.out, f"rank{rank}.json")

    st = None
    if a.alloc == "stweaver" and not a.dry_run:
        import stweaver

        stweaver.install()  # everything else from the environment (torchrun + STWEAVER_*)
        st = stweaver
    import torch
    import torch.distributed as dist

    try:
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False
        torch.backends.cudnn.benchmark = False
        if a.dry_run:
            device = torch.device("cpu")
            dist.init_process_group("gloo")
        else:
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
            dist.init_process_group("nccl", device_id=device)
        cuda = device.type == "cuda"
        res["backend"] = torch.cuda.memory.get_allocator_backend() if cuda else "cpu"
        c = CONFIGS["dry" if a.dry_run else a.config]
        torch.manual_seed(0)  # same initial weights on every rank
        model = build_model(c, device, torch, a.dry_run)
        if a.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model, device_ids=[local_rank] if cuda else None)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        res["params"] = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if cuda:
            torch.cuda.synchronize()
        gen = torch.Generator().manual_seed(1234 + rank)
        steps, losses, modes, reserved, allocated = [], [], [], [], []
        switched_at = steady_from = None
        pre_peaks = None
        turn = lockstep_turn(rank)
        agree = None
        if turn is not None:
            res["lockstep"] = os.environ[LOCKSTEP_KEY_VAR]
            # The ranks must start waiting at the same iteration (one waiting on its pipe while
            # the other enters the iteration's collectives would hang both), but auto switches
            # rank by rank. They agree over a gloo group: CPU tensors, nothing through the
            # CUDA allocator under test, once per warm-up iteration, outside the timed window.
            agree = dist.new_group(backend="gloo") if cuda else None  # dry run: gloo already
        in_lockstep = False
        mode = None
        i = 0
        while True:
            if turn is None:
                if i >= a.iters:
                    break
            else:
                if not in_lockstep and i >= a.warmup:
                    auto = st is not None and (modes[0] if modes else st.mode()).startswith("auto")
                    warm = torch.tensor([int(lockstep_warm(i, a.warmup, a.iters, auto, mode, steady_from))],
                                        dtype=torch.int32)
                    dist.all_reduce(warm, op=dist.ReduceOp.MIN, group=agree)
                    if int(warm.item()):
                        turn.ready(i, mode)
                        in_lockstep = True
                        res["lockstep_from"] = i
                # Same commands to every rank of the job, so all ranks leave together.
                if in_lockstep and turn.command() != "go":
                    break
            x = torch.randint(0, c["vocab"], (c["batch"], c["seq"]), generator=gen)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            x = x.to(device)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()  # stweaver's optimizer hook marks the iteration here (per rank)
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            steps.append(time.perf_counter() - t0)
            losses.append(float(loss.detach().float()).hex())
            if cuda:
                reserved.append(torch.cuda.memory_reserved())
                allocated.append(torch.cuda.memory_allocated())
            if st is not None:
                m = mode = st.mode()
                modes.append(m)
                if m == "auto (plan)" and switched_at is None:
                    switched_at = i
                elif switched_at is not None and i == switched_at + 1 and cuda:
                    # The plan served iteration i and the online cache was released at its
                    # end: the window from here on is the plan's (rank-local, no collective).
                    pre_peaks = (torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated())
                    torch.cuda.reset_peak_memory_stats()
                    steady_from = i + 1
            if in_lockstep:
                # After the device synchronisation above: this iteration's GPU work is done
                # and none spills into the next job's turn.
                turn.done(i, steps[-1], mode)
            i += 1
        if turn is not None:
            turn.close()
        res["ok"] = True
        res["iterations"] = i
        res["losses"] = losses
        res["step_s"] = steps
        w = steps[a.warmup:] if len(steps) > a.warmup else steps
        res["step_median_s"] = statistics.median(w) if w else None
        if steady_from is not None:
            ws = steps[steady_from:]
            res["steady_step_median_s"] = statistics.median(ws) if ws else None
        res["modes"] = modes
        res["reserved"] = reserved
        res["allocated"] = allocated
        res["switched_at"] = switched_at
        res["steady_from"] = steady_from
        if cuda:
            res["max_reserved"] = torch.cuda.max_memory_reserved()
            res["max_allocated"] = torch.cuda.max_memory_allocated()
            if pre_peaks is not None:
                res["steady_max_reserved"] = res["max_reserved"]
                res["steady_max_allocated"] = res["max_allocated"]
                res["max_reserved"] = max(pre_peaks[0], res["max_reserved"])
                res["max_allocated"] = max(pre_peaks[1], res["max_allocated"])
            free, total = torch.cuda.mem_get_info()
            res["device_used_end"] = total - free
        if st is not None:
            res["stweaver"] = st.stats()
            if st.mode().startswith("trace"):
                res["trace_files"] = st.flush_trace()
        dist.barrier()
    except Exception as e:  # report, then fail the rank
        import traceback

        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["traceback"] = traceback.format_exc()[-4000:]
    with open(out_path, "w") as f:
        json.dump(res, f)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    if not res["ok"]:
        print(f"rank {rank}: {res.get('error')}\n{res.get('traceback', '')}", file=sys.stderr)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
