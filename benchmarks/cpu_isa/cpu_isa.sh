#!/usr/bin/env bash
# Builds benchmarks/cpu_isa/cpu_isa.mojo (inner loops) and index_cpu.mojo
# (index_top_k's CPU path outside MAX) for this host and for AVX2 + FMA
# alone (--target-cpu znver3: no AVX-512), runs each build RUNS times
# (default 3), one after another, with the host's index_cpu again without
# AMX and NumPy's BLAS on the bench's index_top_k matmuls with its native
# kernel and with OpenBLAS's Haswell (AVX2) kernel. On an AVX-512 host the
# AVX2 builds and the Haswell kernel are a proxy for an AVX2-only CPU (the
# same code paths on another core design). Then the bench's memcpy
# reference (mla_kpool.bench.memcpy_gbps: np.copyto read plus write) at
# ring_close's 128 MiB of members. Run from the
# repository root, in the environment with mla_kpool, nothing else running:
#   bash benchmarks/cpu_isa/cpu_isa.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="$(mktemp -d "${TMPDIR:-/tmp}/cpu-isa.XXXXXX")"
trap 'rm -rf "$OUT"' EXIT
python -c "from mla_kpool._sysinfo import cpu_isa, cpu_model
print('host:', cpu_model(), '(' + ', '.join(cpu_isa()) + ')')"
for prog in cpu_isa index_cpu; do
  mojo build -I . "benchmarks/cpu_isa/$prog.mojo" -o "$OUT/$prog-host"
  mojo build -I . --target-cpu znver3 "benchmarks/cpu_isa/$prog.mojo" \
    -o "$OUT/$prog-avx2"
done
for i in $(seq "${RUNS:-3}"); do
  for build in host avx2; do
    echo "== run $i, $build build"
    "$OUT/cpu_isa-$build"
    "$OUT/index_cpu-$build"
  done
  echo "== run $i, host build without AMX"
  MLA_KPOOL_CPU_AMX=0 "$OUT/index_cpu-host"
  echo "== run $i, BLAS on the bench's index_top_k calls, native and Haswell kernels"
  for core in "" Haswell; do
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE ${core:+OPENBLAS_CORETYPE=$core} \
      python benchmarks/cpu_isa/blas.py
  done
done
env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -c \
  "from mla_kpool.bench import memcpy_gbps; print('memcpy GB/s', memcpy_gbps(1 << 27))"
