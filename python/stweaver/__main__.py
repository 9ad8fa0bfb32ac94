"""``python -m stweaver``:

- ``run [--mode M] [--plan P] [--trace T] [--no-hook] script.py [args...]`` — runs a script
  under stweaver with no code change (iteration boundaries from the optimizer hook);
- ``build [--verbose]`` — builds the torch extension ahead of time (what
  ``cargo xtask build-torch-ext`` calls).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import List, Optional


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m stweaver", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a Python script under stweaver")
    run.add_argument("--mode", choices=("online", "trace", "plan", "auto"), default=None)
    run.add_argument("--plan", default=None, help="plan file to serve")
    run.add_argument("--trace", default=None, help="trace file to write")
    run.add_argument("--no-hook", action="store_true",
                     help="do not mark iterations at optimizer steps")
    run.add_argument("script", help="the script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    build = sub.add_parser("build", help="build the torch extension ahead of time")
    build.add_argument("--verbose", action="store_true")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "build":
        from ._build import build_ahead_of_time

        path = build_ahead_of_time(verbose=args.verbose)
        print(f"stweaver: built {path}")
        return 0
    if not os.path.isfile(args.script):
        print(f"python -m stweaver run: no such script: {args.script}", file=sys.stderr)
        return 2
    import stweaver

    hook = False if args.no_hook else None
    if hook is None and "STWEAVER_HOOK_OPTIMIZER" not in os.environ:
        hook = True
    settings = stweaver.install(args.mode, args.plan, args.trace, hook_optimizer=hook)
    print(f"stweaver: serving {args.script} in {settings.mode} mode", file=sys.stderr)
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    runpy.run_path(args.script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
