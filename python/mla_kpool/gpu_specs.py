"""Published GPU peaks and sizes, shared by the bench and the roofline.

One table (:data:`GPUS`) for ``bench --device gpu`` (its shares of the
peaks and its lower bounds) and for ``python -m mla_kpool gpu-report``'s
occupancy and roofline models (:mod:`mla_kpool.gpu_report`). A GPU is
found by a substring of the driver's model name (:func:`gpu_spec`), so
``"NVIDIA H200"`` and ``"AMD Instinct MI300X"`` both match.

Sources, per GPU (dense figures: a tensor-core figure quoted "with
sparsity" is halved):

- **H100 SXM**: NVIDIA H100 Tensor Core GPU datasheet: FP32 67 TFLOP/s,
  FP8 Tensor Core 3,958 TFLOP/s with sparsity (1,979 dense), 3.35 TB/s
  HBM3; 132 SMs (NVIDIA H100 whitepaper, SXM5).
- **H200**: NVIDIA H200 Tensor Core GPU datasheet (SXM): FP32 67 TFLOP/s,
  FP8 3,958 TFLOP/s with sparsity (1,979 dense), 4.8 TB/s HBM3e; the same
  GH100 with 132 SMs.
- **B200**: NVIDIA HGX B200 datasheet, "Individual Blackwell GPU
  Specifications": FP32 75 TFLOP/s, FP8/FP6 Tensor Core 9 PFLOP/s with
  sparsity (4,500 dense), 180 GB HBM3e at 7.7 TB/s (earlier NVIDIA
  material quoted 8 TB/s); 148 SMs (two dies of 74).
- **MI300X**: AMD Instinct MI300X datasheet: FP32 vector 163.4 TFLOP/s,
  FP8 2,614.9 TFLOP/s dense (5,229.8 with sparsity), 5.3 TB/s HBM3; 304
  CUs.

The H100 row is the SXM part: an H100 PCIe or NVL (other clocks and
memory) also matches ``"H100"`` and gets the SXM peaks.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ARCH_GPUS",
    "GPUS",
    "GPU_PEAKS",
    "GpuPeak",
    "GpuSpec",
    "gpu_peak",
    "gpu_spec",
    "lower_bound_seconds",
]


@dataclass(frozen=True)
class GpuPeak:
    """A GPU's published peaks (dense, no sparsity).

    Attributes:
        fp32_tflops: FP32 (non-tensor) TFLOP/s, the precision this
            package's GPU scorer computes in.
        fp8_tflops: FP8 tensor-core TFLOP/s, what a tensor-core scorer could
            reach.
        hbm_tbps: Memory bandwidth, TB/s (10^12 bytes per second).
    """

    fp32_tflops: float
    fp8_tflops: float
    hbm_tbps: float


@dataclass(frozen=True)
class GpuSpec:
    """One GPU: its name, target architecture, size and peaks.

    Attributes:
        name: The table's key (a substring of the driver's model name).
        arch: The compile target (``sm_90a``, ``sm_100a``, ``gfx942``).
        units: Streaming multiprocessors (NVIDIA) or compute units (AMD).
        peak: The published peaks.
    """

    name: str
    arch: str
    units: int
    peak: GpuPeak


#: The GPUs the bench and the reports know, by a substring of the
#: driver's model name, tried in this order (H200 before H100). Sources in
#: the module docstring.
GPUS = {
    "H200": GpuSpec("H200", "sm_90a", 132, GpuPeak(67.0, 1979.0, 4.8)),
    "H100": GpuSpec("H100", "sm_90a", 132, GpuPeak(67.0, 1979.0, 3.35)),
    "B200": GpuSpec("B200", "sm_100a", 148, GpuPeak(75.0, 4500.0, 7.7)),
    "MI300X": GpuSpec("MI300X", "gfx942", 304, GpuPeak(163.4, 2614.9, 5.3)),
}

#: Each GPU's peaks (``mla_kpool.bench.index.GPU_PEAKS``).
GPU_PEAKS = {name: spec.peak for name, spec in GPUS.items()}

#: The GPUs of each compile target, as ``gpu-report`` compiles for them.
ARCH_GPUS = {
    "sm_90a": ("H100", "H200"),
    "sm_100a": ("B200",),
    "gfx942": ("MI300X",),
}


def gpu_spec(model_name: str | None) -> GpuSpec | None:
    """The GPU whose key is in ``model_name`` (case-insensitive), if any.

    Args:
        model_name: A ``max.driver`` device name (``"NVIDIA H200"``) or a
            key of :data:`GPUS`; ``None`` for none.

    Returns:
        The first :data:`GPUS` entry whose key ``model_name`` contains, or
        ``None``.
    """
    for key, spec in GPUS.items():
        if model_name and key.lower() in model_name.lower():
            return spec
    return None


def gpu_peak(model_name: str | None) -> GpuPeak | None:
    """The peaks of ``model_name`` (``max.driver`` device name), if known."""
    spec = gpu_spec(model_name)
    return None if spec is None else spec.peak


def lower_bound_seconds(
    nbytes: int, flops: int, peak: GpuPeak, precision: str = "fp32"
) -> float:
    """The roofline's lower bound on a call's time, in seconds.

    ``max(bytes / bandwidth, flops / peak)``: no call moving ``nbytes``
    through HBM and doing ``flops`` arithmetic can finish sooner (Williams,
    Waterman and Patterson, "Roofline", CACM 2009).

    Args:
        nbytes: Bytes the call must move to or from HBM.
        flops: Floating-point operations it must do.
        peak: The GPU's peaks.
        precision: ``"fp32"`` (the FP32 peak) or ``"fp8"`` (dense FP8).

    Returns:
        The bound, seconds.

    Raises:
        ValueError: If ``precision`` is neither.
    """
    if precision not in ("fp32", "fp8"):
        raise ValueError(
            f"precision must be 'fp32' or 'fp8', got {precision!r}"
        )
    tflops = peak.fp32_tflops if precision == "fp32" else peak.fp8_tflops
    return max(nbytes / (peak.hbm_tbps * 1e12), flops / (tflops * 1e12))
