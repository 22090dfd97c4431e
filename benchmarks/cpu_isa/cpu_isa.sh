#!/usr/bin/env bash
# Builds benchmarks/cpu_isa/cpu_isa.mojo for this host and for AVX2 + FMA
# alone (--target-cpu znver3: no AVX-512), runs each build RUNS times
# (default 3), one after another. On an AVX-512 host the AVX2 build is a
# proxy for an AVX2-only CPU (the same code path on another core design).
# Then the bench's memcpy reference (mla_kpool.bench.memcpy_gbps: np.copyto
# read plus write) at ring_close's 128 MiB of members. Run from the
# repository root, in the environment with mla_kpool, nothing else running:
#   bash benchmarks/cpu_isa/cpu_isa.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="$(mktemp -d "${TMPDIR:-/tmp}/cpu-isa.XXXXXX")"
trap 'rm -rf "$OUT"' EXIT
python -c "from mla_kpool._sysinfo import cpu_isa, cpu_model
print('host:', cpu_model(), '(' + ', '.join(cpu_isa()) + ')')"
mojo build -I . benchmarks/cpu_isa/cpu_isa.mojo -o "$OUT/host"
mojo build -I . --target-cpu znver3 benchmarks/cpu_isa/cpu_isa.mojo -o "$OUT/avx2"
for i in $(seq "${RUNS:-3}"); do
  for build in host avx2; do
    echo "== run $i, $build build"
    "$OUT/$build"
  done
done
env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -c \
  "from mla_kpool.bench import memcpy_gbps; print('memcpy GB/s', memcpy_gbps(1 << 27))"
