"""MAX's own kernels of this package's jobs, as graph ops, for the GPU run.

`python/mla_kpool/bench/kernel_times.py` (run by `benchmarks/gpu_run.sh`)
times them on the same operands as ours, in the same run. Not part of the
wheel: a peer to measure against, not a kernel of the product.
"""
