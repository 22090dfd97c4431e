"""An estimated kernel time per launch, from the emulated profile's counts.

A launch's time on a GPU is estimated as its busiest throughput (HBM,
L2, shared memory) plus the latency its phases' serial chains expose
once per wave:

    time = floor + max(dram / HBM, l2 / L2, wavefronts / shared)
                 + waves * sum over phases of
                   (barrier + cold * dram_latency
                            + (global - cold) * l1_latency
                            + shared * shared_latency
                            + (global + shared) * issue)

- ``dram``: the launch's distinct bytes read and written (what HBM must
  move at least; L2 hits between blocks are not modelled beyond that);
  ``l2``: 32 bytes for each sector a block touches first (its L1 misses,
  were its L1 to keep all it touched);
  ``wavefronts``: its shared-memory wavefronts, one per clock per SM
  (CU). A sampled launch's counts are scaled by ``grid / blocks``.
- ``waves``: blocks over the GPU's resident blocks
  (:func:`mla_kpool.gpu_report.occupancy.occupancy_by_gpu`, from the
  block's threads and shared bytes, and its registers when a gpu-report
  JSON gives them; otherwise the register limit is lifted).
- Per phase, the serial chain of its busiest thread: ``global``,
  ``cold`` and ``shared`` are the most global accesses, global accesses
  to a sector the block had not touched, and shared accesses any one
  thread made in the phase (each maximum over threads on its own, so
  an upper bound). Each access waits for the one before it: a thread
  overlaps none of its own accesses, only other warps' (Hong and Kim's
  analytical model, ISCA 2009, charges a warp's memory instructions one
  after another the same way). A cold access waits for DRAM, a warm
  one for L1, a shared one for shared memory.

It is an estimate: it knows nothing of instruction issue besides memory
accesses (FP32 FMAs, tensor-core instructions), of ptxas's scheduling (a
loop's loads overlapped, a wgmma serialized), of L1 capacity, of overlap
between a wave's tail and the next wave, or of the gaps between launches.
:data:`COST_MODELS` holds the constants, each with its source;
``benchmarks/gpu_run.sh``'s constants item measures them on the first
GPU at hand, and they are fixed before any comparison with a measured
time, never fitted per kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..gpu_report.occupancy import occupancy_by_gpu
from ..gpu_specs import GPUS

__all__ = ["COST_MODELS", "CostModel", "estimate_us", "launch_counts"]


@dataclass(frozen=True)
class CostModel:
    """The constants of one GPU's estimate (units in the names).

    Attributes:
        gpu: A key of :data:`mla_kpool.gpu_specs.GPUS` (units, HBM).
        arch: Its compile target (the occupancy rules).
        clock_ghz: The SM (CU) clock under load.
        l2_tbps: L2 to SM bandwidth, all SMs together.
        dram_latency_cycles: A global load that misses L2.
        l1_latency_cycles: A global load that hits L1.
        shared_latency_cycles: A shared-memory load.
        barrier_cycles: A block barrier every warp reaches together.
        issue_cycles: Cycles one thread's access adds to its phase's
            serial path (address arithmetic and the memory instruction).
        floor_us: The duration of a launch that does nothing.
    """

    gpu: str
    arch: str
    clock_ghz: float
    l2_tbps: float
    dram_latency_cycles: int
    l1_latency_cycles: int
    shared_latency_cycles: int
    barrier_cycles: int
    issue_cycles: int
    floor_us: float


#: Sources: clocks from the vendors' datasheets (H100/H200 SXM boost
#: 1.98 GHz; MI300X peak engine clock 2.1 GHz); L2 bandwidth, H100:
#: about 5.5 TB/s measured by Chips and Cheese ("Nvidia's H100: Funny L2,
#: and Tons of Bandwidth", 2023), the H200 the same die; MI300X: AMD's
#: 17.2 TB/s peak of its Infinity Cache (CDNA 3 white paper). Latencies,
#: Hopper: Luo et al., "Benchmarking and Dissecting the Nvidia Hopper GPU
#: Architecture" (IPDPS 2024): shared memory about 30 cycles, L1 hits
#: about 40, global memory about 480; MI300X: LDS about 64 cycles, vector
#: L1 hits about 120 and HBM about 800 (Chips and Cheese, "Testing AMD's
#: Giant MI300X", 2024, read off its latency plots). Barrier, issue and
#: floor: assumptions (40 cycles, 4 cycles, 2 us) until the constants
#: item of ``benchmarks/gpu_run.sh`` measures them.
COST_MODELS = {
    "H100": CostModel("H100", "sm_90a", 1.98, 5.5, 480, 40, 30, 40, 4, 2.0),
    "H200": CostModel("H200", "sm_90a", 1.98, 5.5, 480, 40, 30, 40, 4, 2.0),
    "MI300X": CostModel(
        "MI300X", "gfx942", 2.1, 17.2, 800, 120, 64, 40, 4, 2.0
    ),
}


def launch_counts(profile: dict[str, Any]) -> dict[str, float]:
    """A profiled launch's counts for its whole grid.

    The emulated blocks' counts scaled by ``grid / blocks`` (1 unless the
    launch was sampled).

    Returns:
        ``dram_bytes``, ``l2_bytes``, ``wavefronts``, ``scale``.
    """
    scale = profile["grid"] / max(profile["blocks"], 1)
    g = profile["global"]
    return {
        "dram_bytes": (g["bytes_read"] + g["bytes_written"]) * scale,
        "l2_bytes": 32 * g["cold_sectors"] * scale,
        "wavefronts": profile["shared"]["wavefronts"] * scale,
        "scale": scale,
    }


def _waves(profile: dict[str, Any], model: CostModel, registers: int) -> int:
    occ = occupancy_by_gpu(
        model.arch,
        registers,
        profile["shared_bytes"],
        max(profile["block_threads"], 1),
    )[model.gpu]
    resident = max(occ["resident_blocks"], 1) * occ["units"]
    return math.ceil(profile["grid"] / resident)


def estimate_us(
    profile: dict[str, Any], model: CostModel, registers: int = 0
) -> dict[str, float]:
    """The estimated time of one profiled launch on ``model``'s GPU.

    Args:
        profile: The driver's ``profile`` object of one launch.
        model: The GPU's constants.
        registers: Registers per thread (gpu-report's), 0 if unknown.

    Returns:
        ``us`` (the estimate), ``waves``, and its parts in microseconds:
        ``dram``, ``l2``, ``shared`` (the throughputs) and ``latency``.
    """
    counts = launch_counts(profile)
    spec = GPUS[model.gpu]
    clock = model.clock_ghz * 1e3  # cycles per microsecond
    dram = counts["dram_bytes"] / (spec.peak.hbm_tbps * 1e6)
    l2 = counts["l2_bytes"] / (model.l2_tbps * 1e6)
    shared = counts["wavefronts"] / (spec.units * clock)
    phase_cycles = 0.0
    for shared_path, reach, cold in zip(
        profile["phase_path"],
        profile["phase_global"],
        profile["phase_cold"],
        strict=True,
    ):
        phase_cycles += model.barrier_cycles
        phase_cycles += cold * model.dram_latency_cycles
        phase_cycles += (reach - cold) * model.l1_latency_cycles
        phase_cycles += shared_path * model.shared_latency_cycles
        phase_cycles += (shared_path + reach) * model.issue_cycles
    waves = _waves(profile, model, registers)
    latency = waves * phase_cycles / clock
    return {
        "us": model.floor_us + max(dram, l2, shared) + latency,
        "waves": waves,
        "dram": dram,
        "l2": l2,
        "shared": shared,
        "latency": latency,
    }
