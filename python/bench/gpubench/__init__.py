"""stweaver GPU benchmark: real training loops under PyTorch native, expandable segments and
stweaver (auto; trace -> `stweaver plan` -> plan), each in a fresh process, on one GPU.

    python python/bench/gpu_bench.py run --out DIR --stweaver-bin PATH [--budget-s S]
    python python/bench/gpu_bench.py run --dry-run --out DIR     (CPU, tiny models, fake stweaver)
    python python/bench/gpu_bench.py report DIR/gpu_bench.json [--markdown]

`cargo xtask gpu-bench` prepares what the GPU machine needs and prints the device command
(`scripts/gpu_bench.sh`, which builds the extension and calls `run`).

Workloads: the training configs of data/traces/make_traces.py (Hugging Face transformers
models, random init, bf16, AdamW, random token ids), plus a variable-sequence-length loop. Per
workload and allocator one fresh process trains N iterations and reports peak reserved / peak
allocated (PyTorch's own counters), per-iteration step times (synchronised), the losses (bitwise,
as float.hex) and a digest of the parameters after iteration N-1. stweaver auto runs go on past N
(up to `max_iters`) until the plan has served a few iterations after the online cache was
released; its peaks are also reported over that window ("after switch"). Finally, for one dense
workload, the largest micro-batch that fits under a fixed cap
(`torch.cuda.set_per_process_memory_fraction`) per allocator, and tokens/s at it.

Fresh processes are spawned ahead (they import torch and transformers while the previous run
builds its model and warms up, then wait for their spec on stdin); nothing touches CUDA before
the spec arrives, so stweaver can still be installed and PYTORCH_CUDA_ALLOC_CONF (set at spawn)
applies.

Step time (see BENCHMARKS.md, "Session 5: step-time method"): the training child runs pinned
to one half of the CPUs, children importing and the driver on the other (`--no-pin`: no
pinning). Each child signals "imports done" through a ready file; with `--quiet` a run waits
for every pre-spawned child's before its first counted iteration (no import overlaps a timed
window; it costs ~9 s a run on the H200, and did not remove the noise there). Every iteration records wall time, the
time spent launching and then waiting for the GPU, CPU time, run-queue wait and the machine's
other CPU use (`diag`). The step-time verdict per workload and allocator is the median of
paired per-iteration ratios to native (the same iteration of the same round) with a 95 %
bootstrap CI that resamples rounds, then iterations: "within 1 %" only when the CI lies in
[0.99, 1.01]. `--step-rounds 2,gpt2xl_rcp=4` adds interleaved rounds (native first, then last,
alternately), more for the noisy loops.

Lockstep (`--lockstep 30,qwenmoe_eager_rcp=12`; lockstep.py, BENCHMARKS.md "Session 6"):
after the trace run, the other allocators and a second native process (the A/A control) train
side by side on the GPU, all pinned to the same training CPUs, and take turns: round r runs
iteration S + r of each, one at a time, in an order that rotates and reverses, so each
allocator's iteration is paired with native's from the same round, a second apart, on the same
data. Memory and losses come from the same processes.

The package: `workloads` (configs), `child` (one training run in a fresh process), `driver`
(the pool of children, `Driver`, the cap search), `stats` (derived numbers), `report` (tables),
`cli` (`main`). `python/bench/gpu_bench.py` is the entry point and re-exports their names
(`import gpu_bench as gb`).
"""
