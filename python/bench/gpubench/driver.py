"""The driver: the pool of children spawned ahead (`Pool`), CPU pinning, and `Driver` (runs
every workload and allocator, lockstep rounds, the memory-cap search, the result files)."""

from __future__ import annotations

import gzip
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

from .common import ENTRY, GiB, PY_DIR, write_json
from .workloads import ALLOCATORS, CAP_ALLOCATORS, CAP_BYTES, CAP_WORKLOADS, DRY_CAPS, WARMUP, WORKLOADS, dry_workloads
from .child import _median
from .stats import finalize_workload, noise_note, paired_ratios, round_times, steady_indices, steady_median
from .report import render_noise, render_step_rounds, render_table


def child_env(kind: str) -> dict:
    """The environment of a training child: no STWEAVER_* or allocator settings inherited,
    expandable segments for `kind == "expandable"`, deterministic cuBLAS, python/ importable.
    Shared with budget_bench.py."""
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("STWEAVER_") or k == "PYTORCH_CUDA_ALLOC_CONF":
            del env[k]
    if kind == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    env["PYTHONUNBUFFERED"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONPATH"] = PY_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class Pool:
    """Children spawned ahead, per environment class (PYTORCH_CUDA_ALLOC_CONF differs). Each
    writes its ready file once its imports are done; `importing()` lists those still at it."""

    def __init__(self, logdir: str, dry: bool, spare_cpus: Optional[List[int]] = None):
        self.logdir, self.dry, self.ready, self.n = logdir, dry, {}, 0
        self.spare_cpus = spare_cpus

    def _env(self, kind: str) -> dict:
        return child_env(kind)

    def _spawn(self, kind: str):
        self.n += 1
        base = os.path.join(self.logdir, f"child{self.n:03d}")
        log = open(base + ".log", "w")
        spare = self.spare_cpus
        # Imports run on the spare CPUs; the child moves itself to the training CPUs when its
        # spec says so.
        pre = (lambda: os.sched_setaffinity(0, spare)) if spare else None
        p = subprocess.Popen([sys.executable, ENTRY, "child", base + ".ready"],
                             stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                             env=self._env(kind), text=True, preexec_fn=pre)
        return (p, log, base + ".ready")

    def warm(self, kinds):
        for kind in kinds:
            if kind not in self.ready:
                self.ready[kind] = self._spawn(kind)

    def take(self, alloc: str, respawn: bool = True):
        kind = "expandable" if alloc == "expandable" else "default"
        child = self.ready.pop(kind, None) or self._spawn(kind)
        if respawn:
            self.ready[kind] = self._spawn(kind)  # the next run of this kind imports meanwhile
        return child

    def importing(self) -> List[str]:
        """Ready files not written yet by children still alive."""
        return [r for p, _, r in self.ready.values() if p.poll() is None and not os.path.exists(r)]

    @staticmethod
    def import_s(ready: str) -> Optional[float]:
        try:
            with open(ready) as f:
                return json.load(f).get("import_s")
        except (OSError, ValueError):
            return None

    def close(self):
        for p, log, _ in self.ready.values():
            try:
                p.stdin.close()
                p.wait(timeout=60)
            except Exception:
                p.kill()
            log.close()
        self.ready = {}


def collect_result(child: tuple, alloc: str, workload: str, limit: float) -> Tuple[dict, Optional[float]]:
    """Wait for a training child `(process, log, ready file, result file)` and read its result
    (or say why there is none): a child that wrote its result gets 20 s to exit (a hung
    teardown must not eat the budget); any child is stopped at `limit` (time.time()). Returns
    the result and when it was written (None if never)."""
    p, log, ready, result = child
    rc, done_at = None, None
    while rc is None:
        try:
            rc = p.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            now = time.time()
            if done_at is None and os.path.exists(result):
                done_at = now
            if now > limit or (done_at is not None and now > done_at + 20):
                p.kill()
                p.wait()
                rc = "killed after its result" if done_at is not None else "timeout"
    log.close()
    try:
        with open(result) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = {"ok": False, "alloc": alloc, "workload": workload, "error": f"no result (rc={rc})"}
    res["rc"] = rc
    res["child_import_s"] = Pool.import_s(ready)
    if not res.get("ok") and not res.get("oom"):
        with open(log.name) as f:
            res["log_tail"] = f.read()[-4000:]
    return res, done_at


def cpu_split(cpus: List[int]) -> Tuple[List[int], List[int]]:
    """Training CPUs (the upper half: CPU 0 takes most interrupts) and spare CPUs (the rest)."""
    cpus = sorted(cpus)
    if len(cpus) < 4:
        return cpus, cpus
    h = len(cpus) // 2
    return cpus[h:], cpus[:h]


def parse_cpus(text: str) -> List[int]:
    """'8-15' or '0,2,4-7' -> CPU numbers."""
    out: List[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            out += list(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return sorted(set(out))


def parse_rounds(text) -> Tuple[int, Dict[str, int]]:
    """`--step-rounds`: '2' (every workload), '2,gpt2xl_rcp=4' (4 for that one) or
    'gpt2xl_rcp=4' (that one only)."""
    default, per = 0, {}
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if "=" in part:
            k, v = part.split("=", 1)
            per[k.strip()] = int(v)
        else:
            default = int(part)
    return default, per


class Driver:
    def __init__(self, args):
        self.args = args
        self.dry = args.dry_run
        self.t_start = time.time()
        self.deadline = self.t_start + args.budget_s
        self.tmp = tempfile.mkdtemp(prefix="stweaver-bench-")
        self.logdir = os.path.join(self.tmp, "logs")
        os.makedirs(self.logdir)
        avail = sorted(os.sched_getaffinity(0))
        self.train_cpus: Optional[List[int]] = None
        spare: Optional[List[int]] = None
        if not args.no_pin:
            self.train_cpus, spare = cpu_split(avail)
            if args.train_cpus:
                self.train_cpus = [c for c in parse_cpus(args.train_cpus) if c in avail] or self.train_cpus
                spare = [c for c in avail if c not in self.train_cpus] or spare
            os.sched_setaffinity(0, spare)  # the driver and `stweaver plan` stay off them too
        self.pool = Pool(self.logdir, self.dry, spare)
        self.out = args.out
        os.makedirs(self.out, exist_ok=True)
        self.doc: dict = {
            "schema": 1,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "dry_run": self.dry,
            "host": platform.node(),
            "python": sys.version.split()[0],
            "workloads": [],
            "cap_search": None,
            "skipped": [],
            "timing": {"quiet": args.quiet, "cpus": avail, "train_cpus": self.train_cpus,
                       "spare_cpus": spare, "threads": args.threads, "warmup": WARMUP,
                       "step_rounds": args.step_rounds, "order": "ABBA"},
        }

    def remaining(self) -> float:
        return self.deadline - time.time()

    def save(self):
        write_json(os.path.join(self.out, "gpu_bench.json"), self.doc)

    def run_one(self, workload: dict, alloc: str, est_s: float, extra: Optional[dict] = None) -> dict:
        if self.remaining() < est_s + 15:
            msg = f"{workload['name']}/{alloc}: skipped, {self.remaining():.0f} s left (needs ~{est_s:.0f} s)"
            print(msg, flush=True)
            self.doc["skipped"].append(msg)
            return {"ok": False, "alloc": alloc, "workload": workload["name"], "skipped": True,
                    "error": "out of time"}
        result = os.path.join(self.tmp, f"{workload['name']}_{alloc}_{workload['batch']}_{time.time_ns()}.json")
        spec = self.child_spec(alloc, workload, result, min(self.deadline - 10, time.time() + 4 * est_s), extra)
        p, log, ready = self.pool.take(alloc)
        if self.args.quiet:
            # The replacement child just spawned (and any other still importing) must be done
            # before this run's first counted iteration.
            spec["quiet"] = {"at": WARMUP, "wait": self.pool.importing(), "timeout": 60.0}
        t0 = time.time()
        limit = t0 + max(5.0, min(self.remaining() - 3, max(180.0, 6 * est_s)))
        try:
            p.stdin.write(json.dumps(spec) + "\n")
            p.stdin.close()
        except OSError:
            pass  # the child died during its imports; its log says why
        res, done_at = collect_result((p, log, ready, result), alloc, workload["name"], limit)
        res["wall_s"] = (done_at or time.time()) - t0
        return res

    def child_spec(self, alloc: str, workload: dict, result: str, deadline: float,
                   extra: Optional[dict]) -> dict:
        """What a training child gets on stdin: the run, and the harness options it obeys."""
        spec = {"alloc": alloc, "workload": workload, "result": result, "dry_run": self.dry,
                "deadline": deadline}
        spec.update(extra or {})
        if self.args.no_release_at_peak:
            spec["release_at_peak"] = False
        spec["gc_outside_steps"] = not self.args.gc_in_steps
        if self.train_cpus:
            spec["cpus"] = self.train_cpus
        if self.args.threads:
            spec["threads"] = self.args.threads
        return spec

    def plan_trace(self, trace: str, plan: str) -> dict:
        cmd = [self.args.stweaver_bin, "plan", trace, "-o", plan, "--json", "--time-budget", "15"]
        t0 = time.time()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5.0, min(120.0, self.remaining() - 20)))
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"ok": False, "error": str(e), "wall_s": time.time() - t0}
        out = {"ok": r.returncode == 0, "wall_s": time.time() - t0, "rc": r.returncode}
        try:
            out["summary"] = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            out["stdout"] = r.stdout[-2000:]
        if r.returncode != 0:
            out["error"] = r.stderr[-2000:]
        return out

    def plan_extra(self, w: dict, entry: dict) -> Optional[dict]:
        """Plan the trace run's trace: the plan run's spec extras, or None (and a failed plan
        row saying why)."""
        plan = os.path.join(self.tmp, f"{w['name']}.stwp")
        t = entry["runs"].get("trace", {})
        files = t.get("trace_files") or []
        if not (t.get("ok") and files):
            entry["runs"]["plan"] = {"ok": False, "alloc": "plan", "error": "no trace to plan"}
            return None
        if not self.args.stweaver_bin or not os.path.isfile(self.args.stweaver_bin):
            entry["planner"] = {"ok": False, "error": f"no stweaver binary at {self.args.stweaver_bin!r}"}
            entry["runs"]["plan"] = {"ok": False, "alloc": "plan", "error": "no planner binary"}
            return None
        entry["planner"] = self.plan_trace(files[0], plan)
        pl = entry["planner"]
        print(f"  stweaver plan: {'ok' if pl['ok'] else 'FAILED'} in {pl['wall_s']:.1f} s"
              + (f", LB {pl['summary']['lower_bound'] / GiB:.3f} GiB, pool {pl['summary']['pool'] / GiB:.3f} GiB"
                 if pl.get("summary") else f" {pl.get('error', '')[-300:]}"), flush=True)
        if not pl["ok"] or self.dry:
            entry["runs"]["plan"] = {"ok": False, "alloc": "plan",
                                     "error": "planning failed" if not pl["ok"] else "dry run"}
            return None
        return {"plan": plan}

    def workload(self, w: dict) -> dict:
        entry = {"config": w, "runs": {}, "planner": None}
        self.doc["workloads"].append(entry)
        est = float(w.get("est_s", 15))
        trace = os.path.join(self.tmp, f"{w['name']}.stwt")
        allocs = self.args.allocators.split(",") if self.args.allocators else ALLOCATORS
        default, per = parse_rounds(self.args.lockstep)
        lock_rounds = per.get(w["name"], default)
        group: List[str] = []
        if lock_rounds > 0:
            # The trace run goes first, alone (its trace feeds the plan run); everything else
            # trains side by side in lockstep.
            group = [a for a in allocs if a != "trace"]
            if "native" in group and self.args.aa_control:
                group.append("native_aa")
            allocs = [a for a in allocs if a == "trace"]
        for alloc in allocs:
            extra = {}
            wr = w
            if alloc == "trace":
                extra = {"trace": self.args.dry_trace if self.dry else trace}
                t_def, t_per = parse_rounds(self.args.trace_iters)
                if t_per.get(w["name"], t_def) > 0:
                    wr = dict(w, iters=t_per.get(w["name"], t_def))
                    extra["digest_at"] = w["iters"] - 1  # the parameters every run compares
            if alloc == "plan":
                extra = self.plan_extra(w, entry)
                if extra is None:
                    continue
            r = self.run_one(wr, alloc, est * (2 if alloc == "auto" else 1) * wr["iters"] / w["iters"], extra)
            if r.get("determinism_error") and w.get("strict", True):
                print(f"{w['name']}: strict determinism failed ({r['error']}); rerunning with warn_only",
                      flush=True)
                self.doc["workloads"].remove(entry)
                return self.workload(dict(w, strict=False, strict_error=r["determinism_error"]))
            entry["runs"][alloc] = r
            if alloc == "trace" and r.get("ok") and self.args.save_traces:
                for f in r.get("trace_files") or []:
                    dst = os.path.join(self.args.save_traces, os.path.basename(f) + ".gz")
                    os.makedirs(self.args.save_traces, exist_ok=True)
                    with open(f, "rb") as src, gzip.open(dst, "wb") as out:
                        shutil.copyfileobj(src, out)
                    print(f"  saved {dst}", flush=True)
            if r.get("ok"):
                est = max(est, r["wall_s"])
            print(self.progress_line(w["name"], alloc, r), flush=True)
            self.save()
        if group:
            extras: Dict[str, dict] = {}
            for key in group:
                if key == "plan":
                    ex = self.plan_extra(w, entry)
                    if ex is None:
                        continue
                    extras[key] = ex
                else:
                    extras[key] = {}
            results = self.run_lockstep(w, list(extras), extras, lock_rounds, est)
            orders = results.pop("_orders", [])
            for key, r in results.items():
                if r.get("determinism_error") and w.get("strict", True):
                    print(f"{w['name']}: strict determinism failed ({r['error']}); rerunning with warn_only",
                          flush=True)
                    self.doc["workloads"].remove(entry)
                    return self.workload(dict(w, strict=False, strict_error=r["determinism_error"]))
            entry["runs"].update(results)
            entry["lockstep"] = {"keys": list(extras), "rounds_asked": lock_rounds, "orders": orders}
            for key in extras:
                if key in entry["runs"]:
                    print(self.progress_line(w["name"], key, entry["runs"][key]), flush=True)
            self.save()
        finalize_workload(entry)
        self.save()
        return entry

    def run_lockstep(self, w: dict, keys: List[str], extras: Dict[str, dict], rounds: int,
                     est: float) -> Dict[str, dict]:
        """Train `keys` side by side on the GPU, in lockstep (lockstep.py): each warms up on its
        own, the ones ahead wait until all reach the same iteration S, then round r runs
        iteration S + r of each, one at a time, in `round_order`. Returns each key's result
        (with `lockstep_iters`, the iterations timed in rounds) and "_orders"."""
        from lockstep import Seat, paired_ratios, parse_reply, round_order

        if not keys:
            return {}
        need = est * 2 + 60
        if self.remaining() < need:
            msg = f"{w['name']}/lockstep: skipped, {self.remaining():.0f} s left (needs ~{need:.0f} s)"
            print(msg, flush=True)
            self.doc["skipped"].append(msg)
            return {k: {"ok": False, "alloc": k, "workload": w["name"], "skipped": True,
                        "error": "out of time"} for k in keys}
        pipes = tempfile.mkdtemp(prefix="lockstep-", dir=self.tmp)
        seats: Dict[str, "Seat"] = {}
        kids: Dict[str, tuple] = {}
        out: Dict[str, dict] = {}
        t0 = time.time()
        print(f"  lockstep: {', '.join(keys)} side by side, {rounds} rounds", flush=True)
        for key in keys:
            alloc = "native" if key == "native_aa" else key
            seat = Seat(key, pipes)
            seats[key] = seat
            result = os.path.join(self.tmp, f"{w['name']}_{key}_lockstep_{time.time_ns()}.json")
            spec = self.child_spec(alloc, w, result, self.deadline - 15, extras.get(key))
            spec["lockstep"] = {"cmd": seat.cmd_path, "reply": seat.reply_path}
            p, log, ready = self.pool.take(alloc, respawn=False)
            try:
                p.stdin.write(json.dumps(spec) + "\n")
                p.stdin.close()
            except OSError:
                pass
            kids[key] = (p, log, ready, result)

        def alive(key):
            return lambda: kids[key][0].poll() is None

        # Warm-up, each on its own (concurrently; nothing is timed yet).
        nxt: Dict[str, int] = {}
        modes: Dict[str, str] = {}
        limit = max(120.0, 8 * est)
        for key in keys:
            rep = parse_reply(seats[key].read_line(max(1.0, min(limit - (time.time() - t0), self.remaining() - 20)),
                                                   alive(key)))
            if rep and rep[0] == "ready":
                nxt[key], modes[key] = rep[1], rep[3]
            else:
                print(f"  lockstep: {key} not ready (exited or timed out)", flush=True)
        live = [k for k in keys if k in nxt]
        times: Dict[str, Dict[int, float]] = {k: {} for k in keys}
        orders: List[List[str]] = []
        if live:
            start = max(nxt.values())
            # Catch up to iteration `start`, all laggards at once (untimed).
            while True:
                behind = [k for k in live if nxt[k] < start]
                if not behind:
                    break
                for k in behind:
                    seats[k].send("go")
                for k in behind:
                    rep = parse_reply(seats[k].read_line(max(30.0, 10 * est), alive(k)))
                    if rep and rep[0] == "done":
                        nxt[k] = rep[1] + 1
                    else:
                        live.remove(k)
                        print(f"  lockstep: {k} failed while catching up", flush=True)
            warm = ", ".join(f"{k}: {modes.get(k) or '?'}" for k in live)
            print(f"  lockstep: warm in {time.time() - t0:.0f} s; rounds from iteration {start} ({warm})",
                  flush=True)
            round_s = None
            for r in range(rounds):
                t_r = time.time()
                if round_s is not None and self.remaining() < 1.5 * round_s + 25:
                    msg = f"{w['name']}/lockstep: stopped after {r} of {rounds} rounds ({self.remaining():.0f} s left)"
                    print("  " + msg, flush=True)
                    self.doc["skipped"].append(msg)
                    break
                order = round_order(list(live), r)
                orders.append(order)
                for k in order:
                    seats[k].send("go")
                    rep = parse_reply(seats[k].read_line(max(30.0, 20 * est), alive(k)))
                    if rep and rep[0] == "done":
                        times[k][rep[1]] = rep[2]
                        modes[k] = rep[3]
                    else:
                        live.remove(k)
                        print(f"  lockstep: {k} failed in round {r}", flush=True)
                round_s = time.time() - t_r
                if r % 5 == 4 or r == rounds - 1:
                    nat = times.get("native") or {}
                    parts = []
                    for k in live:
                        if k == "native" or not nat:
                            continue
                        rs = paired_ratios(times, k)
                        if rs:
                            parts.append(f"{k} {statistics.median(rs):.3f}")
                    print(f"  lockstep: round {r + 1}/{rounds} ({round_s:.1f} s/round); median ratio to native: "
                          + (", ".join(parts) or "–"), flush=True)
        for key in keys:
            seats[key].send("stop")
        # Results, as run_one collects them.
        deadline = time.time() + 120
        for key in keys:
            res, _ = collect_result(kids[key], key, w["name"], deadline)
            res["wall_s"] = time.time() - t0
            res["lockstep_iters"] = sorted(times[key])
            if key == "native_aa":
                res["control_of"] = "native"
            out[key] = res
            seats[key].close()
        shutil.rmtree(pipes, ignore_errors=True)
        self.pool.warm(["default", "expandable"])
        out["_orders"] = orders
        return out

    @staticmethod
    def progress_line(name: str, alloc: str, r: dict) -> str:
        if not r.get("ok"):
            extra = ""
            if r.get("log_tail"):
                extra = " | " + r["log_tail"].strip().splitlines()[-1][-200:]
            return f"{name:18s} {alloc:10s} FAILED: {r.get('error', '')[:300]}{extra}"
        med = steady_median(r) or _median(r["step_s"])  # lockstep: its timed rounds only
        s = (f"{name:18s} {alloc:10s} res={r['max_reserved'] / GiB:7.3f}G "
             f"alloc={(r.get('max_allocated') or 0) / GiB:7.3f}G step={med * 1e3:8.1f}ms "
             f"iters={r['iterations']} wall={r['wall_s']:.0f}s")
        if r.get("steady_max_reserved") is not None:
            s += f" steady_res={r['steady_max_reserved'] / GiB:.3f}G from_it={r['steady_from']}"
        if r.get("stweaver"):
            s += f" mode={r['stweaver'].get('mode')!r}"
        return s + noise_note(r)

    # ---------------------------------------------------------- step-time rounds

    def step_rounds(self):
        """Extra interleaved rounds for step time alone: per round and workload, native and
        each allocator of --step-allocators (the plan run reuses the workload's plan file), a
        fresh process each, native first in even rounds and last in odd ones (round 0, the
        main run, has it first), so a slow drift of the machine cancels in the paired ratios.
        `--step-rounds 2,gpt2xl_rcp=4`: 2 rounds for every workload, 4 for gpt2xl_rcp."""
        allocs = [a for a in self.args.step_allocators.split(",") if a and a != "native"]
        default, per = parse_rounds(self.args.step_rounds)
        n_rounds = max([default] + list(per.values()))
        for k in range(1, n_rounds + 1):
            print(f"== step-time round {k}", flush=True)
            for entry in self.doc["workloads"]:
                w = entry["config"]
                if k > per.get(w["name"], default):
                    continue
                rounds = entry.setdefault("step_rounds", {})
                iters = entry.setdefault("step_rounds_iters", {})
                if not rounds:
                    for alloc, r in entry["runs"].items():
                        if alloc == "native" or alloc in allocs:
                            rounds[alloc] = [steady_median(r)]
                            iters[alloc] = [round_times(r)]
                est = float(w.get("est_s", 15))
                order = ["native"] + allocs if k % 2 == 0 else allocs + ["native"]
                entry.setdefault("step_rounds_order", [["native"] + allocs]).append(order)
                for alloc in order:
                    extra = {}
                    if alloc == "plan":
                        plan = os.path.join(self.tmp, f"{w['name']}.stwp")
                        if not os.path.isfile(plan):
                            continue
                        extra = {"plan": plan}
                    if alloc == "trace":
                        extra = {"trace": os.path.join(self.tmp, f"{w['name']}.round.stwt")}
                    r = self.run_one(w, alloc, est * (2 if alloc == "auto" else 1), extra)
                    rounds.setdefault(alloc, []).append(steady_median(r) if r.get("ok") else None)
                    iters.setdefault(alloc, []).append(round_times(r))
                    print(f"{w['name']:18s} {alloc:10s} round {k}: step "
                          f"{(steady_median(r) or 0) * 1e3:.1f} ms{noise_note(r)}", flush=True)
                    self.save()

    # ---------------------------------------------------------- memory you can spend

    def cap_search(self):
        """The cap search on every loop of CAP_WORKLOADS (or those --cap-workloads names)."""
        self.doc["cap_search"] = []
        names = self.args.cap_workloads.split(",") if self.args.cap_workloads else None
        for w0 in (DRY_CAPS if self.dry else CAP_WORKLOADS):
            if names and w0["name"] not in names:
                continue
            if self.remaining() < 60 and not self.dry:
                self.doc["skipped"].append(f"cap search {w0['name']}: {self.remaining():.0f} s left")
                continue
            self.cap_search_one(dict(w0))

    def cap_search_one(self, w0: dict):
        cap_bytes = w0["cap_bytes"]
        doc = {"workload": w0, "cap_bytes": cap_bytes, "allocators": {}, "note": ""}
        self.doc["cap_search"].append(doc)
        guess = self.cap_guess(w0)
        doc["first_guess"] = guess
        for alloc in CAP_ALLOCATORS:
            tried: Dict[int, dict] = {}
            b = guess
            while len(tried) < 5 and b >= 1 and b not in tried:
                w = dict(w0, batch=b)
                est = w0["est_s"] * (2 if alloc == "auto" else 1)
                r = self.run_one(w, alloc, est, {"cap_bytes": cap_bytes})
                if r.get("skipped"):
                    break
                tried[b] = r
                fits = bool(r.get("ok"))
                print(f"cap {cap_bytes / GiB:.0f} GiB {w0['name']} {alloc:10s} micro-batch {b:3d}: "
                      + ("fits" if fits else ("OOM" if r.get("oom") else "FAILED " + str(r.get("error", ""))[:200]))
                      + (f", peak reserved {r['max_reserved'] / GiB:.2f} GiB" if fits else ""), flush=True)
                if not fits and not r.get("oom"):
                    break  # a crash is not an answer
                nb = next_probe(b, fits, {k: bool(v.get("ok")) for k, v in tried.items()})
                if nb is None:
                    break
                b = nb
            summary = cap_summary(tried, w0.get("iters"))
            doc["allocators"][alloc] = summary
            self.save()
            if summary.get("largest"):
                guess = summary["largest"] + 1
        doc["note"] = ("stweaver row: auto mode (records 4 iterations online, then serves its plan); "
                       "a batch fits when every iteration ran without an out-of-memory error")

    def cap_guess(self, w0: dict) -> int:
        """First micro-batch to try: --cap-guess, the loop's own guess, else from
        llama1b_rcp's native run (persistent bytes from the parameter count, activation
        bytes per sample from its lower bound), else 6."""
        if self.args.cap_guess:
            return self.args.cap_guess
        if self.dry:
            return 2
        if w0.get("guess"):
            return w0["guess"]
        CAP_BYTES = w0["cap_bytes"]
        for e in self.doc["workloads"]:
            if e["config"]["name"] != "llama1b_rcp":
                continue
            n = e["runs"].get("native", {})
            lb = e.get("lower_bound")
            if not (n.get("ok") and lb and n.get("params")):
                break
            persistent = 8 * n["params"]  # bf16 params, grads, exp_avg, exp_avg_sq
            per_sample = (lb - persistent) / (e["config"]["batch"] // e["config"]["micro"])
            util = lb / n["max_reserved"]
            if per_sample <= 0:
                break
            return max(1, min(32, int((CAP_BYTES * util - persistent) / per_sample)))
        return 6

    def main(self):
        self.pool.warm(["default", "expandable"])
        ws = dry_workloads() if self.dry else WORKLOADS
        if self.args.cap_only:
            ws = []
        elif self.args.only:
            ws = [w for w in ws if w["name"] in self.args.only.split(",")]
        for w in ws:
            print(f"== {w['name']}: {w['note']}", flush=True)
            self.workload(w)
        default, per = parse_rounds(self.args.step_rounds)
        if default > 0 or any(v > 0 for v in per.values()):
            self.step_rounds()
        if not self.args.no_cap:
            print("== memory you can spend", flush=True)
            if self.remaining() > 120 or self.dry:
                self.cap_search()
            else:
                msg = f"cap search: skipped, {self.remaining():.0f} s left"
                print(msg, flush=True)
                self.doc["skipped"].append(msg)
        self.pool.close()
        if not self.args.keep_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        self.doc["wall_s"] = time.time() - self.t_start
        for e in self.doc["workloads"]:
            for r in e["runs"].values():
                dev = r.get("device")
                if dev:
                    self.doc["device"] = dev
                    break
        self.save()
        text = render_table(self.doc, markdown=False)
        rounds = render_step_rounds(self.doc)
        if rounds:
            text += "\n" + "\n".join(rounds) + "\n"
        noise = render_noise(self.doc)
        if noise:
            text += "\n" + "\n".join(noise) + "\n"
        with open(os.path.join(self.out, "table.txt"), "w") as f:
            f.write(text)
        print("\n" + text, flush=True)
        return 0


def next_probe(b: int, fits: bool, tried: Dict[int, bool]) -> Optional[int]:
    """Galloping search by one: up while it fits, down while it does not; stop at the edge."""
    if fits:
        if tried.get(b + 1) is False:
            return None
        return b + 1 if (b + 1) not in tried else None
    if b - 1 < 1 or tried.get(b - 1) is True:
        return None
    return b - 1 if (b - 1) not in tried else None


def cap_summary(tried: Dict[int, dict], base_iters: Optional[int] = None) -> dict:
    """The largest micro-batch that fit and its tokens/s (median of per-iteration tokens / step).

    An auto run that never served a plan (variable lengths: it stays online) runs up to the
    loop's `max_iters`, more than native's `base_iters`; its tokens/s counts only the window
    native and expandable count (warm-up to `base_iters`), the same iterations with the same
    sequence lengths, so a loop of random lengths compares like with like."""
    ok = {b: r for b, r in tried.items() if r.get("ok")}
    out = {"probes": [{"batch": b, "fits": bool(r.get("ok")), "oom_iter": r.get("oom_iter"),
                       "max_reserved": r.get("max_reserved"), "steady_max_reserved": r.get("steady_max_reserved"),
                       "mode": (r.get("stweaver") or {}).get("mode"), "error": None if r.get("ok") else r.get("error"),
                       "wall_s": r.get("wall_s"), "step_s": r.get("step_s"), "tokens_per_iter": r.get("tokens_per_iter")}
                      for b, r in sorted(tried.items())]}
    if not ok:
        out["largest"] = None
        return out
    b = max(ok)
    # The edge is proven only if b + 1 was tried and did not fit.
    out["largest"] = b
    out["edge_proven"] = (b + 1) in tried and not tried[b + 1].get("ok")
    r = ok[b]
    steady = steady_indices(r)
    out["tokens_basis"] = "steady iterations"
    if not steady and r.get("step_s"):
        # auto that never served a plan (e.g. rejected under the cap): its online iterations
        n = len(r["step_s"])
        end = min(n, base_iters) if base_iters else n
        steady = list(range(min(WARMUP, end - 1), end))
        out["tokens_basis"] = (f"iterations {steady[0]}-{steady[-1]}, as native's (no plan served)"
                               if steady else "no iteration")
    times = [r["step_s"][i] for i in steady]
    toks = [r["tokens_per_iter"][i] for i in steady]
    if times:
        out["step_s"] = statistics.median(times)
        out["tokens_per_s"] = statistics.median([t / s for t, s in zip(toks, times)])
    out["max_reserved"] = r.get("max_reserved")
    return out
