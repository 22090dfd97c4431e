#!/usr/bin/env bash
# The one GPU run: the GPU tests, then each launch's kernel time beside
# MAX's peers (python -m mla_kpool.bench.kernel_times), into one JSON
# named <gpu>-<short commit>.json. Needs one NVIDIA GPU, MAX installed and
# PyTorch (its profiler reads the kernel times); about 5-8 minutes warm or
# cold on a lent H200's 16 host cores with nothing else running.
#
#   bash benchmarks/gpu_run.sh [OUT_DIR]      # default: benchmarks/results
#
# The timing graphs compile in two background processes while the tests
# run (pytest-xdist workers), so MAX's compile cache is full before any
# timing starts. Logs go next to the JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
mkdir -p "$out"
py=${PYTHON:-python}
for item in index writers; do
    timeout 420 "$py" -m mla_kpool.bench.kernel_times --compile \
        --items "$item" >"$out/compile-$item.log" 2>&1 &
done
timeout 360 "$py" -m pytest -q -m gpu -n 10 -p no:cacheprovider tests \
    >"$out/tests.log" 2>&1
echo "tests: rc $?, $(tail -n 1 "$out/tests.log")"
wait
GPU_RUN_COMMAND="bash benchmarks/gpu_run.sh" timeout 300 \
    "$py" -m mla_kpool.bench.kernel_times --out-dir "$out" \
    --tests "$(tail -n 1 "$out/tests.log")" >"$out/times.log" 2>&1
rc=$?
tail -n 60 "$out/times.log"
exit $rc
