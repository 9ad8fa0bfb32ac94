#!/usr/bin/env python3
"""stweaver GPU benchmark: the entry point, and every name of the `gpubench` package (whose
docstring describes the benchmark) under one module, as before it was split
(`import gpu_bench as gb`: budget_bench.py, plot_bench.py, python/tests/test_gpu_bench.py).

    python python/bench/gpu_bench.py run --out DIR --stweaver-bin PATH [--budget-s S]
    python python/bench/gpu_bench.py run --dry-run --out DIR     (CPU, tiny models, fake stweaver)
    python python/bench/gpu_bench.py report DIR/gpu_bench.json [--markdown]
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # imported by path from elsewhere: the package and lockstep live here
    sys.path.insert(0, _HERE)

from lockstep import bootstrap_median_ci, step_verdict  # noqa: E402,F401 (shared with gpu_dist_bench)

from gpubench.common import (  # noqa: E402,F401
    HERE, REPO, PY_DIR, ENTRY, GiB, MiB,
)
from gpubench.workloads import (  # noqa: E402,F401
    WORKLOADS, CAP_WORKLOAD, CAP_WORKLOADS, CAP_BYTES, CAP_ALLOCATORS, DRY, ALLOCATORS, LABELS,
    CONTROL, WARMUP, dry_workloads, DRY_CAP, DRY_CAPS,
)
from gpubench.child import (  # noqa: E402,F401
    _FakeStweaver, _build_model, _median, _CLK_TCK, _read, IterClock, pin_process, wait_ready,
    run_spec, lockstep_warm, child_main,
)
from gpubench.stats import (  # noqa: E402,F401
    steady_indices, round_indices, steady_median, round_times, paired_ratio_groups, paired_ratios,
    low_quantile, floor_ratios, fmt_ci, step_estimates, _cv, run_noise, noise_note,
    finalize_workload,
)
from gpubench.report import (  # noqa: E402,F401
    render_noise, render_step_rounds, _gib, _pct, _ratio, render_table, targets,
)
from gpubench.driver import (  # noqa: E402,F401
    child_env, Pool, collect_result, cpu_split, parse_cpus, parse_rounds, Driver, next_probe,
    cap_summary,
)
from gpubench.cli import (  # noqa: E402,F401
    main,
)


if __name__ == "__main__":
    sys.exit(main())
