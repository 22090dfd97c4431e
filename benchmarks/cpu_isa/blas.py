"""NumPy's BLAS on the bench's index_top_k matmuls, for cpu_isa.sh.

Prints, per call of ``bench.index.INDEX_PHASES`` but the 16K prefill, the
median of 7 timings of ``bench.index.blas_matmul`` (the bench's BLAS peer:
the twin's float32 matmuls alone) in ms and GFLOP/s, and the kernel
OpenBLAS chose. cpu_isa.sh runs it with OpenBLAS's own choice and with
``OPENBLAS_CORETYPE=Haswell`` (its AVX2 kernel).
"""

from __future__ import annotations

import time

import numpy as np

from mla_kpool.bench import index
from mla_kpool.bench.blas import blas_info


def main() -> None:
    """Times the BLAS peer of the decode and 4,096-token prefill calls."""
    for phase in ("decode", "prefill"):
        w = index.make_index_workload(phase)
        call, flops = index.blas_matmul(
            w.input_row_offsets, w.cache.cache_lengths, w.shape
        )
        call()
        times = []
        for _ in range(7):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        median = float(np.median(times))
        kernel = (blas_info()["blas"] or {}).get("architecture")
        print(
            f"BLAS {phase} ms {1e3 * median:.2f} GFLOP/s"
            f" {flops / median / 1e9:.1f} (OpenBLAS kernel {kernel})"
        )


if __name__ == "__main__":
    main()
