"""Shared helpers of the distributed test runner and benchmark: launching ``torchrun`` jobs
(with a hard timeout: a hang is a failure, not a stuck call) and reading per-rank results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
WORKER = os.path.join(HERE, "dist_worker.py")
SAFETY = os.path.join(HERE, "nccl_stream_safety.py")

# NVLink multicast stays off on the shared H200 machines.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
STWEAVER_VARS = ("STWEAVER_MODE", "STWEAVER_PLAN", "STWEAVER_TRACE", "STWEAVER_HOOK_OPTIMIZER",
                 "STWEAVER_AUTO_ITERATIONS", "STWEAVER_RELEASE_AT_PEAK", "STWEAVER_PLAN_WAIT",
                 "STWEAVER_SHARE_STREAMS", "PYTORCH_CUDA_ALLOC_CONF")
# gpu_dist_bench.py --lockstep: where a worker finds its turn pipes (dist_worker.py). Set per
# job by the benchmark, never inherited (a stray one would put every job into lockstep).
LOCKSTEP_DIR_VAR = "STWEAVER_BENCH_LOCKSTEP_DIR"
LOCKSTEP_KEY_VAR = "STWEAVER_BENCH_LOCKSTEP_KEY"
# Fixed rendezvous settings that concurrent jobs would share (torchrun reads PET_* as its
# arguments; MASTER_* reach the workers; without the shared TCP store torchrun falls back to
# probing a free port and binding it later, which two jobs starting together can race for).
SHARED_RDZV_VARS = ("MASTER_ADDR", "MASTER_PORT", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")


def base_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    drop = STWEAVER_VARS + (LOCKSTEP_DIR_VAR, LOCKSTEP_KEY_VAR)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(NO_MULTICAST)
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    env["PYTHONUNBUFFERED"] = "1"
    env["TORCH_CUDA_ARCH_LIST"] = env.get("TORCH_CUDA_ARCH_LIST", "9.0")
    py = os.path.join(REPO, "python")
    env["PYTHONPATH"] = py + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def torchrun(script: str, args: List[str], nproc: int, env: Dict[str, str], log: str,
             timeout: float, dry: bool = False) -> dict:
    """Runs one torchrun job; returns {rc, wall_s, timed_out, log}."""
    return finish(start(script, args, nproc, env, log, dry), timeout)


class Job:
    """A torchrun job started by `start` (its own session: `finish` can kill the whole group)."""

    def __init__(self, proc: subprocess.Popen, logf, log: str, t0: float):
        self.proc, self.logf, self.log, self.t0 = proc, logf, log, t0

    def alive(self) -> bool:
        return self.proc.poll() is None


def start(script: str, args: List[str], nproc: int, env: Dict[str, str], log: str,
          dry: bool = False) -> Job:
    """Starts one torchrun job without waiting for it.

    ``--standalone`` makes every job safe to run next to others (gpu_dist_bench.py --lockstep,
    run_dist_tests.py's parallel cases): torchrun then picks rendezvous id = a fresh uuid4 and
    endpoint localhost:0, i.e. its c10d TCP store binds a port the kernel hands out, and the
    workers' MASTER_PORT is that shared store's port (torch.distributed.elastic's
    DynamicRendezvousHandler), so no two jobs can get the same one. `concurrent_env` drops
    the inherited settings that would defeat this."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           script] + args + (["--dry-run"] if dry else [])
    t0 = time.time()
    f = open(log, "w")
    f.write("$ " + " ".join(cmd) + "\n")
    f.flush()
    p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                         start_new_session=True)
    return Job(p, f, log, t0)


def finish(job: Job, timeout: float) -> dict:
    """Waits for `job` (killing its process group after `timeout` s); {rc, wall_s, timed_out, log}."""
    timed_out = False
    try:
        rc = job.proc.wait(timeout=max(0.0, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(job.proc.pid, signal.SIGKILL)  # the job's own process group, started above
        rc = job.proc.wait()
    job.logf.close()
    return {"rc": rc, "wall_s": round(time.time() - job.t0, 1), "timed_out": timed_out, "log": job.log}


def concurrent_env(env: Dict[str, str]) -> Dict[str, str]:
    """`env` for a job that runs next to others: without PET_* (torchrun's arguments from the
    environment: a fixed rendezvous endpoint or id would be shared) and SHARED_RDZV_VARS."""
    return {k: v for k, v in env.items() if not k.startswith("PET_") and k not in SHARED_RDZV_VARS}


def read_ranks(d: str, nproc: int) -> List[Optional[dict]]:
    out = []
    for r in range(nproc):
        p = os.path.join(d, f"rank{r}.json")
        try:
            with open(p) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            out.append(None)
    return out


def tail(path: str, n: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def parallel(jobs: List[tuple], workers: int) -> List:
    """Runs fn(*args) for each (fn, args...) with up to `workers` at once; results in order."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as ex:
        futs = [ex.submit(j[0], *j[1:]) for j in jobs]
        return [f.result() for f in futs]


def plan_cli(stweaver_bin: str, trace: str, plan: str, log: str, timeout: float = 60,
             extra: tuple = ()) -> dict:
    cmd = [stweaver_bin, "plan", trace, "-o", plan, "--time-budget", "5", *extra]
    t0 = time.time()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = -9
    return {"rc": rc, "wall_s": round(time.time() - t0, 2), "log": log}
