#!/usr/bin/env bash
# The one GPU run, within 540 s in all (GPU_RUN_BUDGET_S): a preflight of
# seconds (MAX, this package and PyTorch import, a GPU is visible; else it
# stops, exit status 2, with the reasons), the GPU tests while the timing
# graphs compile, then each launch's kernel time beside MAX's peers and the
# cost model's GPU constants (python -m mla_kpool.bench.kernel_times), into
# one JSON named <gpu>-<short commit>.json, written after every step and
# every timing item, its "steps" saying what each step took. Each step's
# timeout comes from what is left of the budget. Needs one NVIDIA GPU, MAX
# and PyTorch (its profiler reads the kernel times). Where the copy has no
# .git, set MLA_KPOOL_COMMIT to the commit measured.
#
#   bash benchmarks/gpu_run.sh [OUT_DIR]      # default: benchmarks/results
#
# Everything it writes (the JSON, the logs) goes to OUT_DIR. The steps are
# benchmarks/gpu_run_steps.py; GPU_RUN_FAKE=1 runs them with fast fakes and
# no GPU (tests/cli/test_gpu_run.py).
set -uo pipefail
cd "$(dirname "$0")/.."
budget=${GPU_RUN_BUDGET_S:-540}
# A guard past the steps' own budget, in case the step runner itself hangs.
exec timeout -k 5 "$((${budget%.*} + 20))" "${PYTHON:-python}" \
    benchmarks/gpu_run_steps.py "$@"
