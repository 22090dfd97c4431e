"""Theoretical occupancy of a kernel on each GPU of its compile target.

:func:`occupancy_by_gpu` turns a compiled kernel's resources (registers
per thread, shared memory per block, threads per block) into the blocks
(workgroups) that can be resident on one SM (CU) at once, the warps
(waves) they hold over the most the SM can hold, and the limit that binds.
It is the calculator's arithmetic, not a measurement: no launch, no clock.

**NVIDIA** (``sm_90a``: H100, H200; ``sm_100a``: B200). The per-SM limits
are the CUDA C++ Programming Guide's "Technical Specifications per Compute
Capability" for 9.0 and 10.0 (the same for both): 65,536 32-bit registers
per SM and per block, at most 255 registers per thread, 64 resident warps
(2,048 threads), 32 resident blocks, 1,024 threads per block, 228 KB of
shared memory per SM and 227 KB per block. The allocation rules are the
CUDA Occupancy Calculator's, as ``cuda_occupancy.h`` writes them
(``cudaOccMaxActiveBlocksPerMultiprocessor``): registers go to warps in
units of 256 (``regs * 32`` rounded up) from four sub-partitions of
16,384 each, so the resident warps are ``4 * (16384 // per_warp)``; a
block whose registers, with its warps rounded up to a multiple of 4 (the
hardware's launch check), pass 65,536 cannot launch; shared memory per
block is the kernel's plus 1 KB the driver reserves per block (compute
capability 8.0 on), rounded up to 128 bytes, out of the SM's 228 KB (the
calculator's default carveout is the largest one).

**AMD** (``gfx942``: MI300X, CDNA3). From LLVM's AMDGPU backend
(``AMDGPUBaseInfo.cpp``) and the CDNA3 ISA guide: wave64; a CU has 4
SIMDs of at most 8 waves each (``getMaxWavesPerEU`` is 8 on gfx90a and
gfx942), so 32 waves per CU; each SIMD has 512 VGPRs per lane, arch and
accumulation registers in one file (``getTotalNumVGPRs``), allocated in
granules of 8 (``getVGPRAllocGranule``), so a wave of ``v`` VGPRs gives
``min(8, 512 // roundup(v, 8))`` waves per SIMD
(``getNumWavesPerEUWithNumVGPRs``); 64 KiB of LDS per CU
(``getLocalMemorySize``), allocated in granules of 128 dwords (512
bytes: the LDS_SIZE field of COMPUTE_PGM_RSRC2, LLVM's AMDGPUUsage); and
``getMaxWorkGroupsPerCU``: 32 single-wave workgroups, else
``min(32 // waves, 16)`` (16 barriers per CU). Workgroups per CU from the
VGPRs are ``4 * waves_per_simd // waves_per_workgroup``: the four SIMDs
pooled, which assumes the dispatcher spreads a workgroup's waves over
them.

The ``fraction`` is resident warps (waves) over the most per SM (CU): 64
warps on NVIDIA, 32 waves on AMD.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..gpu_specs import ARCH_GPUS, GPUS

__all__ = ["LIMITERS", "SmLimits", "ARCH_LIMITS", "occupancy_by_gpu"]

#: The limits a result may name, in the order ties are reported.
LIMITERS = ("registers", "shared memory", "block size", "blocks per SM")


@dataclass(frozen=True)
class SmLimits:
    """One SM's (CU's) published limits, as the occupancy model uses them.

    Attributes:
        vendor: ``"nvidia"`` or ``"amd"``.
        unit: ``"SM"`` or ``"CU"``.
        warp_size: Threads per warp (wave).
        max_warps: Resident warps (waves) per SM (CU).
        max_blocks: Resident blocks per SM (NVIDIA); on AMD the barrier
            limit on workgroups of more than one wave.
        max_block_threads: Threads per block.
        registers: NVIDIA: 32-bit registers per SM; AMD: VGPRs per lane of
            one SIMD.
        register_granule: Registers allocated at a time (NVIDIA: per warp;
            AMD: per lane).
        max_registers: Registers a thread may use.
        partitions: Sub-partitions (NVIDIA) or SIMDs (AMD) per SM (CU).
        shared_bytes: Shared memory (LDS) per SM (CU), bytes.
        max_block_shared: Shared memory a block may use, bytes.
        shared_reserved: Bytes the driver reserves per block.
        shared_granule: Shared memory allocation granularity, bytes.
    """

    vendor: str
    unit: str
    warp_size: int
    max_warps: int
    max_blocks: int
    max_block_threads: int
    registers: int
    register_granule: int
    max_registers: int
    partitions: int
    shared_bytes: int
    max_block_shared: int
    shared_reserved: int
    shared_granule: int


#: Compute capability 9.0 and 10.0 (CUDA C++ Programming Guide, "Technical
#: Specifications per Compute Capability"; granules from cuda_occupancy.h).
_NVIDIA_CC_9_10 = SmLimits(
    vendor="nvidia",
    unit="SM",
    warp_size=32,
    max_warps=64,
    max_blocks=32,
    max_block_threads=1024,
    registers=65536,
    register_granule=256,
    max_registers=255,
    partitions=4,
    shared_bytes=228 * 1024,
    max_block_shared=227 * 1024,
    shared_reserved=1024,
    shared_granule=128,
)

#: CDNA3, gfx942 (LLVM AMDGPUBaseInfo.cpp, AMDGPUUsage; AMD CDNA3 ISA).
_GFX942 = SmLimits(
    vendor="amd",
    unit="CU",
    warp_size=64,
    max_warps=32,
    max_blocks=16,
    max_block_threads=1024,
    registers=512,
    register_granule=8,
    max_registers=512,
    partitions=4,
    shared_bytes=64 * 1024,
    max_block_shared=64 * 1024,
    shared_reserved=0,
    shared_granule=512,
)

#: Each compile target's limits (``sm_90``/``sm_100`` as their ``a``).
ARCH_LIMITS = {
    "sm_90a": _NVIDIA_CC_9_10,
    "sm_90": _NVIDIA_CC_9_10,
    "sm_100a": _NVIDIA_CC_9_10,
    "sm_100": _NVIDIA_CC_9_10,
    "gfx942": _GFX942,
}

_UNLIMITED = 1 << 30


def _round_up(value: int, granule: int) -> int:
    return -(-value // granule) * granule


def _nvidia_register_blocks(lim: SmLimits, registers: int, warps: int) -> int:
    """Blocks per SM the registers allow (cuda_occupancy.h's rule)."""
    if registers == 0:
        return _UNLIMITED
    if registers > lim.max_registers:
        return 0
    per_warp = _round_up(registers * lim.warp_size, lim.register_granule)
    # The launch check counts the block's warps rounded up to the four
    # sub-partitions; the software check counts them as they are.
    if per_warp * _round_up(warps, lim.partitions) > lim.registers:
        return 0
    per_partition = lim.registers // lim.partitions // per_warp
    return per_partition * lim.partitions // warps


def _amd_register_blocks(lim: SmLimits, registers: int, waves: int) -> int:
    """Workgroups per CU the VGPRs allow (LLVM's waves-per-EU rule)."""
    if registers == 0:
        return _UNLIMITED
    if registers > lim.max_registers:
        return 0
    per_simd_max = lim.max_warps // lim.partitions
    if registers < lim.register_granule:
        per_simd = per_simd_max
    else:
        rounded = _round_up(registers, lim.register_granule)
        per_simd = min(max(lim.registers // rounded, 1), per_simd_max)
    return lim.partitions * per_simd // waves


def _shared_blocks(lim: SmLimits, shared_bytes: int) -> int:
    """Blocks per SM (CU) the shared memory (LDS) allows."""
    used = shared_bytes + lim.shared_reserved
    if used == 0:
        return _UNLIMITED
    if shared_bytes > lim.max_block_shared:
        return 0
    return lim.shared_bytes // _round_up(used, lim.shared_granule)


def _limits(
    lim: SmLimits, registers: int, shared_bytes: int, block_threads: int
) -> dict[str, int]:
    """Blocks per SM (CU) each limit of :data:`LIMITERS` allows."""
    warps = -(-block_threads // lim.warp_size)
    nvidia = lim.vendor == "nvidia"
    by_registers = _nvidia_register_blocks if nvidia else _amd_register_blocks
    # AMD's getMaxWorkGroupsPerCU: single-wave workgroups take no barrier,
    # so only the waves limit them; others also meet the 16 barriers.
    most = lim.max_blocks if nvidia or warps > 1 else lim.max_warps
    return {
        "registers": by_registers(lim, registers, warps),
        "shared memory": _shared_blocks(lim, shared_bytes),
        "block size": lim.max_warps // warps,
        "blocks per SM": most,
    }


def occupancy_by_gpu(
    arch: str, registers: int, shared_bytes: int, block_threads: int
) -> dict[str, dict]:
    """Theoretical occupancy of one kernel on each GPU of ``arch``.

    The CUDA Occupancy Calculator's rules on NVIDIA and LLVM AMDGPU's on
    AMD (the module docstring gives each limit and its source).

    Args:
        arch: ``"sm_90a"`` (H100, H200), ``"sm_100a"`` (B200) or
            ``"gfx942"`` (MI300X); ``"sm_90"``/``"sm_100"`` as their
            ``a`` variants.
        registers: Registers per thread (NVIDIA: ptxas's count; AMD: the
            unified VGPR count, arch plus AccVGPRs); 0 when unknown, which
            lifts the register limit.
        shared_bytes: Static plus dynamic shared memory (LDS) per block,
            bytes, without the driver's reservation.
        block_threads: Threads per block.

    Returns:
        ``{gpu: result}`` for each GPU of ``arch`` (:data:`ARCH_GPUS`),
        each result with ``fraction`` (resident warps over ``max_warps``),
        ``limited_by`` (one of :data:`LIMITERS`: the smallest limit; ties
        go to the first in that order), ``resident_blocks``,
        ``resident_warps``, ``max_warps``, ``warps_per_block``, ``limits``
        (blocks per SM each limit allows; ``None`` for none), ``unit``
        (``"SM"`` or ``"CU"``) and ``units`` (how many the GPU has). A
        kernel that cannot launch (too many registers or too much shared
        memory) gets 0 blocks and the limit it breaks.

    Raises:
        ValueError: If ``arch`` is unknown, ``block_threads`` is outside
            1..1024, or ``registers`` or ``shared_bytes`` is negative.
    """
    lim = ARCH_LIMITS.get(arch)
    if lim is None:
        raise ValueError(
            f"unknown arch {arch!r}; known: {', '.join(sorted(ARCH_LIMITS))}"
        )
    if not 1 <= block_threads <= lim.max_block_threads:
        raise ValueError(
            f"block_threads must be 1..{lim.max_block_threads}, got "
            f"{block_threads}"
        )
    if registers < 0 or shared_bytes < 0:
        raise ValueError(
            f"registers and shared_bytes must be >= 0, got {registers} and "
            f"{shared_bytes}"
        )
    limits = _limits(lim, registers, shared_bytes, block_threads)
    blocks = min(limits.values())
    limited_by = next(k for k in LIMITERS if limits[k] == blocks)
    warps = -(-block_threads // lim.warp_size)
    result = {
        "fraction": blocks * warps / lim.max_warps,
        "limited_by": limited_by,
        "resident_blocks": blocks,
        "resident_warps": blocks * warps,
        "max_warps": lim.max_warps,
        "warps_per_block": warps,
        "limits": {
            k: None if v == _UNLIMITED else v for k, v in limits.items()
        },
        "unit": lim.unit,
    }
    base = arch + "a" if arch in ("sm_90", "sm_100") else arch
    return {gpu: result | {"units": GPUS[gpu].units} for gpu in ARCH_GPUS[base]}
