"""The command line (`run`, `report`, and the internal `child`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import __doc__ as PACKAGE_DOC
from .common import REPO
from .workloads import ALLOCATORS
from .child import child_main
from .stats import finalize_workload
from .report import render_noise, render_step_rounds, render_table, targets
from .driver import Driver


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["child"]:
        return child_main(argv[1] if len(argv) > 1 else None)
    ap = argparse.ArgumentParser(description=PACKAGE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the benchmark")
    r.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    r.add_argument("--stweaver-bin", default=os.path.join(REPO, "target/release/stweaver"))
    r.add_argument("--budget-s", type=float, default=480.0, help="stop starting runs after this")
    r.add_argument("--dry-run", action="store_true", help="CPU, tiny models, stweaver faked")
    r.add_argument("--dry-trace", default=None, help="dry run: a .stwt to feed `stweaver plan`")
    r.add_argument("--only", default=None, help="comma-separated workload names")
    r.add_argument("--no-cap", action="store_true", help="skip the memory-cap search")
    r.add_argument("--allocators", default=None,
                   help=f"comma-separated subset of {','.join(ALLOCATORS)} (default: all)")
    r.add_argument("--save-traces", default=None, help="copy each trace run's .stwt, gzipped, here")
    r.add_argument("--keep-tmp", action="store_true", help="keep traces, plans and child logs")
    r.add_argument("--step-rounds", default="0",
                   help="extra interleaved rounds of native + --step-allocators per workload, for "
                        "step time alone (one run per configuration does not resolve 1 %% here): "
                        "N, or N,NAME=M,... for M rounds of workload NAME")
    r.add_argument("--cap-only", action="store_true", help="the memory-cap search alone")
    r.add_argument("--quiet", action="store_true",
                   help="a run's counted iterations wait until no other child is importing (costs "
                        "~9 s a run on the H200, where imports take 10-11 s; off by default: "
                        "BENCHMARKS.md, session 5)")
    r.add_argument("--cap-workloads", default="",
                   help="comma-separated loops of the cap search (default: all of CAP_WORKLOADS)")
    r.add_argument("--cap-guess", type=int, default=0,
                   help="first micro-batch of the cap search (default: from llama1b_rcp's native run, else 6)")
    r.add_argument("--no-pin", action="store_true",
                   help="no CPU pinning (by default a training child runs on the upper half of "
                        "the CPUs, children importing and the driver on the lower half)")
    r.add_argument("--train-cpus", default=None, help="the training child's CPUs, e.g. 8-15")
    r.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in each child")
    r.add_argument("--step-allocators", default="plan,auto,expandable")
    r.add_argument("--lockstep", default="0",
                   help="step time in lockstep (lockstep.py): after the trace run, every other "
                        "allocator trains side by side on the GPU and they take turns, one timed "
                        "iteration each per round; N rounds, or N,NAME=M,... (0: off, each "
                        "allocator in a fresh process of its own, one after another)")
    r.add_argument("--trace-iters", default="0",
                   help="iterations of the trace run (default: the workload's), N or N,NAME=M: "
                        "a longer trace to replay on the CPU, and a trace row over as many "
                        "iterations as lockstep's runs make")
    r.add_argument("--no-aa-control", dest="aa_control", action="store_false",
                   help="lockstep without the second native process (the A/A control, whose "
                        "ratio to native shows the method's own noise)")
    r.add_argument("--gc-in-steps", action="store_true",
                   help="leave Python's garbage collector alone (by default it is frozen after "
                        "setup and run between iterations, outside the timed window)")
    r.add_argument("--no-release-at-peak", action="store_true",
                   help="stweaver runs with STWEAVER_RELEASE_AT_PEAK=0 (no giving holes back "
                        "before a new peak; it is on by default)")
    p = sub.add_parser("report", help="print the table of a result file")
    p.add_argument("json")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--targets", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        return Driver(a).main()
    with open(a.json) as f:
        doc = json.load(f)
    for e in doc["workloads"]:
        finalize_workload(e)  # recomputed: the report's rules may be newer than the run
    print(render_table(doc, a.markdown), end="")
    rounds = render_step_rounds(doc)
    if rounds:
        print("\n" + "\n".join(rounds))
    noise = render_noise(doc)
    if noise:
        print("\n" + "\n".join(noise))
    if a.targets:
        print("\n".join(targets(doc)))
    return 0
