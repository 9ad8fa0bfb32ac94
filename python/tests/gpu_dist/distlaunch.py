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


def base_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in STWEAVER_VARS}
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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           script] + args + (["--dry-run"] if dry else [])
    t0 = time.time()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                             start_new_session=True)
        timed_out = False
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(p.pid, signal.SIGKILL)  # the job's own process group, started above
            rc = p.wait()
    return {"rc": rc, "wall_s": round(time.time() - t0, 1), "timed_out": timed_out, "log": log}


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
