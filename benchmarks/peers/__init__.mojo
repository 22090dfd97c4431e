"""MAX's own kernels of this package's jobs, as graph ops, for the GPU run.

`benchmarks/gpu_run.py` times them on the same operands as ours, in the
same run. Not part of the wheel: a peer to measure against, not a kernel
of the product.
"""
