"""index_top_k's GPU calls back to back per scorer, and their kernels' times.

The bench (``python -m mla_kpool bench --device gpu --ops index_top_k``)
times one call at a time between pauses for its NumPy peers; this script
runs the bench's decode and 4,096-token prefill calls (GLM-5-Next's
indexer) back to back on a GPU, for each scorer the GPU has, and prints
each one's milliseconds per call. Under Nsight Compute it gives each
launch's own time (plan, score, select)::

    python benchmarks/index_kernel_times.py
    KERNEL_TIMES_CALLS=2 ncu --clock-control none -k regex:mla_kpool
        --metrics gpu__time_duration.sum --csv
        python benchmarks/index_kernel_times.py > ncu.csv

(one command line).

``KERNEL_TIMES_CALLS=2``: one warm-up call and two timed ones, so ncu
profiles three calls of each phase and scorer, in the order printed.
docs/performance.md has an H200's numbers.
"""

from __future__ import annotations

import os
import time

from mla_kpool._index_op import gpu_scorers
from mla_kpool.bench import index, index_call
from mla_kpool.runner import Runner


def main() -> None:
    """Prints each (phase, scorer)'s milliseconds per call."""
    calls = int(os.environ.get("KERNEL_TIMES_CALLS", "10"))
    scorers = gpu_scorers()
    if not scorers:
        raise SystemExit("index_kernel_times: needs a GPU")
    runner = Runner("gpu")
    for phase in ("decode", "prefill"):
        w = index.make_index_workload(phase)
        for scorer in scorers:
            call = index_call(runner, w, scorer)
            for _ in range(1 if calls < 10 else 3):
                call()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            ms = 1e3 * (time.perf_counter() - start) / calls
            print(f"{phase} {scorer}: {ms:.3f} ms/call", flush=True)


if __name__ == "__main__":
    main()
