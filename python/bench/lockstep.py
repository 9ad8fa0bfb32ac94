"""Lockstep step timing: several training processes share one GPU (or one set of GPUs) and take
turns, one timed iteration each, so that the allocators' iterations being compared run seconds
apart instead of minutes apart.

Why (BENCHMARKS.md, "Session 5: step-time method" and "Session 6: lockstep"): on the H200
machines the launch-bound loops run the same CPU work up to 17 % slower for seconds to whole
processes, with no contention the guest can see. Fresh processes run one after another sample
different phases of that noise; a 1 % verdict would need far more of them than one call holds.
In lockstep, round r runs iteration S + r of every process back to back (native, expandable,
plan, auto, a second native as an A/A control, ...), in an order that rotates and reverses
between rounds, so a slow phase of the machine lasting a second or more hits every
participant of the round alike, and the per-round ratio to native cancels it.

Only one participant runs at a time: the others block on a pipe read (no CPU, no GPU work), so
a timed iteration has the GPU and the training CPUs to itself, as in a run alone. Each
participant synchronises the device before it reports, so no GPU work spills into the next
one's turn.

Protocol, over two named pipes per participant (made by the driver, which opens both ends it
uses read-write so that neither side's `open` blocks and a dead driver reads as end of file on
the participant's side):

    participant -> driver:  "ready I MODE"   warm, the next iteration is I, now waiting
                            "done I STEP_S MODE"   iteration I ran, STEP_S seconds (timed
                                                   between two device synchronisations)
    driver -> participant:  "go"     run one iteration
                            "stop"   leave the loop, write the result as usual

Cost: two pipe writes and reads per turn (tens of microseconds), outside the timed window.
"""

from __future__ import annotations

import math
import os
import random
import select
import statistics
import time
from typing import Dict, List, Optional, Tuple


def round_order(keys: List[str], r: int) -> List[str]:
    """The order of round r: rotated by r // 2, reversed in odd rounds. Over 2 * len(keys)
    rounds every participant takes every position equally often and follows every other one
    as often as it precedes it (a participant's first turn after another process's work may
    pay for cold caches: that cost is shared out evenly)."""
    n = len(keys)
    if n == 0:
        return []
    k = (r // 2) % n
    order = keys[k:] + keys[:k]
    return order[::-1] if r % 2 else order


class Turn:
    """The participant's side: `ready`, then `command()` before each iteration, `done` after."""

    def __init__(self, cmd_path: str, reply_path: str):
        # The driver holds both pipes open read-write, so neither open blocks.
        self._cmd = open(cmd_path, "r", buffering=1)
        self._reply = open(reply_path, "w", buffering=1)

    def ready(self, next_iter: int, mode: Optional[str]) -> None:
        self._send(f"ready {next_iter} {_word(mode)}")

    def command(self) -> str:
        """Blocks until the driver says "go" or "stop" (end of file, a dead driver: "stop")."""
        line = self._cmd.readline()
        return line.strip() or "stop"

    def done(self, it: int, step_s: float, mode: Optional[str]) -> None:
        self._send(f"done {it} {step_s!r} {_word(mode)}")

    def _send(self, line: str) -> None:
        try:
            self._reply.write(line + "\n")
            self._reply.flush()
        except OSError:
            pass  # the driver is gone; the next command() reads end of file

    def close(self) -> None:
        for f in (self._cmd, self._reply):
            try:
                f.close()
            except OSError:
                pass


def _word(mode: Optional[str]) -> str:
    return (mode or "-").replace(" ", "_")


class Seat:
    """The driver's side of one participant: its pipes and the lines it has sent."""

    def __init__(self, key: str, dirpath: str):
        self.key = key
        self.cmd_path = os.path.join(dirpath, f"{key}.cmd")
        self.reply_path = os.path.join(dirpath, f"{key}.reply")
        for p in (self.cmd_path, self.reply_path):
            if os.path.exists(p):
                os.unlink(p)
            os.mkfifo(p)
        # Read-write opens of a FIFO do not block on Linux; holding the reply pipe open for
        # writing too means "no data" is never mistaken for end of file.
        self.cmd_fd = os.open(self.cmd_path, os.O_RDWR)
        self.reply_fd = os.open(self.reply_path, os.O_RDWR | os.O_NONBLOCK)
        self._buf = b""

    def send(self, cmd: str) -> None:
        os.write(self.cmd_fd, (cmd + "\n").encode())

    def read_line(self, timeout: float, alive=lambda: True) -> Optional[str]:
        """The next line from the participant, or None at the timeout or once `alive()` says
        the process is gone (checked every 0.5 s)."""
        end = time.monotonic() + timeout
        while True:
            if b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                return line.decode()
            left = end - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([self.reply_fd], [], [], min(0.5, left))
            if r:
                try:
                    chunk = os.read(self.reply_fd, 4096)
                except BlockingIOError:
                    chunk = b""
                self._buf += chunk
            elif not alive():
                return None

    def close(self) -> None:
        for fd in (self.cmd_fd, self.reply_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        for p in (self.cmd_path, self.reply_path):
            try:
                os.unlink(p)
            except OSError:
                pass


def parse_reply(line: Optional[str]) -> Optional[Tuple[str, int, Optional[float], str]]:
    """("ready", I, None, MODE) or ("done", I, STEP_S, MODE); None for anything else."""
    if not line:
        return None
    f = line.split()
    try:
        if f[0] == "ready" and len(f) >= 3:
            return "ready", int(f[1]), None, f[2].replace("_", " ")
        if f[0] == "done" and len(f) >= 4:
            return "done", int(f[1]), float(f[2]), f[3].replace("_", " ")
    except (ValueError, IndexError):
        return None
    return None


def paired_ratios(times: Dict[str, Dict[int, float]], key: str, base: str = "native") -> List[float]:
    """Per round (keyed by iteration), `key`'s step time over `base`'s, where both ran it."""
    a, b = times.get(key) or {}, times.get(base) or {}
    return [a[i] / b[i] for i in sorted(set(a) & set(b)) if b[i] > 0]


# ------------------------------------------------------------------ the verdict (both benches)


def bootstrap_median_ci(groups: List[List[float]], reps: int = 2000, level: float = 0.95,
                        seed: int = 0) -> Optional[dict]:
    """Median of the pooled values and a percentile-bootstrap CI for it that resamples the
    groups (rounds: fresh processes, whose medians differ by more than their iterations do),
    then the values inside each drawn group. With one group it is the iteration-level
    bootstrap, which does not see how far another process would land."""
    groups = [list(g) for g in groups if g]
    if not groups:
        return None
    pooled = [x for g in groups for x in g]
    rng = random.Random(seed)
    meds = []
    for _ in range(reps):
        sample: List[float] = []
        for g in rng.choices(groups, k=len(groups)):
            sample += rng.choices(g, k=len(g))
        meds.append(statistics.median(sample))
    meds.sort()
    a = (1.0 - level) / 2.0
    lo = meds[max(0, int(math.floor(a * reps)))]
    hi = meds[min(reps - 1, int(math.ceil((1.0 - a) * reps)) - 1)]
    return {"median": statistics.median(pooled), "lo": lo, "hi": hi, "n": len(pooled),
            "rounds": len(groups), "level": level}


def step_verdict(ci: Optional[dict], tol: float = 0.01) -> str:
    """'within 1 %' only when the whole CI lies in [1 - tol, 1 + tol]."""
    if not ci:
        return "no data"
    if ci["lo"] >= 1.0 - tol and ci["hi"] <= 1.0 + tol:
        return f"within {100 * tol:g} %"
    if ci["lo"] > 1.0 + tol:
        return f"slower than native by more than {100 * tol:g} %"
    if ci["hi"] < 1.0 - tol:
        return f"faster than native by more than {100 * tol:g} %"
    return "not resolved"
