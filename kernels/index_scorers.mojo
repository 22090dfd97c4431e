"""Which scorer `index_top_k`'s GPU path builds and runs: the `scorer` parameter.

| `scorer` | runs on | kernel |
| --- | --- | --- |
| `"auto"` | every target | `"wgmma"` on an sm_90 GPU, `"mfma"` on a gfx942 one (for the depths they take), else `"simt"` |
| `"simt"` | every GPU, the emulated grid | FP32 FMAs (`index_gpu_score.mojo`) |
| `"wgmma"` | sm_90 GPUs, the emulated grid | Hopper FP8 tensor cores (`index_wgmma.mojo`) |
| `"mfma"` | gfx942 GPUs, the emulated grid | CDNA3 FP8 matrix cores (`index_mfma.mojo`) |

The choice is made when the op is compiled, from its target
(`_accelerator_arch()`: MAX names an H100 / H200 `nvidia:sm_90a` and an
MI300X `amdgpu:gfx942`), so a GPU builds only the scorer it runs.
"""

from std.sys.info import _accelerator_arch

from .index_gpu_score import SimtScore
from .index_mfma import MFMA_MAX_DEPTH, MfmaScore, mfma_fits
from .index_operands import IndexTopK
from .index_wgmma import WGMMA_MAX_DEPTH, WgmmaScore, wgmma_fits


comptime SCORERS = "auto, simt, wgmma, mfma"
"""The `scorer` names the op accepts."""

comptime GPU_SCORERS = ("simt", "wgmma", "mfma")
"""The scorers with a kernel, in the order reports list them."""

comptime ScoreKernel[scorer: StaticString, Op: type_of(IndexTopK)] = (
    WgmmaScore[Op] if scorer
    == "wgmma" else (MfmaScore[Op] if scorer == "mfma" else SimtScore[Op])
)
"""The score launch's kernel (`gpu_kernel.GpuKernel`) of each scorer: the
one place a scorer's name meets its kernel."""


def is_hopper(arch: StaticString) -> Bool:
    """Whether `arch` names an sm_90 GPU, as MAX (`nvidia:sm_90a`) or
    Mojo's targets (`sm_90a`) spell it."""
    return (
        arch == "nvidia:sm_90a"
        or arch == "nvidia:90a"
        or arch == "nvidia:90"
        or arch == "sm_90a"
        or arch == "sm_90"
    )


def is_cdna3(arch: StaticString) -> Bool:
    """Whether `arch` names a gfx942 (MI300) GPU (`amdgpu:gfx942`,
    `gfx942`, `mi300x`)."""
    return (
        arch == "amdgpu:gfx942"
        or arch == "amdgpu:94"
        or arch == "gfx942"
        or arch == "mi300x"
    )


def scorer_targets[scorer: StaticString](arch: StaticString) -> Bool:
    """Whether `scorer`'s kernel is built for the GPU `arch` (`"simt"`
    for every one)."""
    comptime if scorer == "wgmma":
        return is_hopper(arch)
    elif scorer == "mfma":
        return is_cdna3(arch)
    return True


def hopper_target() -> Bool:
    """Whether the graph's accelerator is an sm_90 (Hopper) GPU."""
    return is_hopper(_accelerator_arch())


def cdna3_target() -> Bool:
    """Whether the graph's accelerator is a gfx942 (MI300) GPU."""
    return is_cdna3(_accelerator_arch())


def scorer_kernel[
    scorer: StaticString, target: StaticString, emulate_gpu: Bool, depth: Int
]() -> StaticString:
    """The scorer the GPU path builds: `"simt"`, `"wgmma"` or `"mfma"`.

    A tensor scorer only where it can run (an sm_90 / gfx942 target, or
    the emulated grid) and for the depths it takes; `"simt"` otherwise,
    so a refused name never builds a kernel its target lacks
    (`check_scorer` raises for it before anything launches).
    """
    comptime gpu = target != "cpu"
    comptime if scorer == "auto":
        comptime if gpu and hopper_target() and wgmma_fits[depth]():
            return "wgmma"
        comptime if gpu and cdna3_target() and mfma_fits[depth]():
            return "mfma"
        return "simt"
    elif scorer == "wgmma":
        comptime if (emulate_gpu or (gpu and hopper_target())) and wgmma_fits[
            depth
        ]():
            return "wgmma"
        return "simt"
    elif scorer == "mfma":
        comptime if (emulate_gpu or (gpu and cdna3_target())) and mfma_fits[
            depth
        ]():
            return "mfma"
        return "simt"
    return "simt"


def check_scorer[
    scorer: StaticString, target: StaticString, emulate_gpu: Bool, depth: Int
](op_name: StaticString) raises:
    """Raises unless `scorer` names a scorer this call can run.

    Raises:
        Error: For an unknown name (listing the valid ones), or a tensor
            scorer on a target that cannot run it (naming the target) or
            with a depth it does not take.
    """
    comptime if (
        scorer != "auto"
        and scorer != "simt"
        and scorer != "wgmma"
        and scorer != "mfma"
    ):
        raise Error(
            op_name, ": scorer must be one of ", SCORERS, ", got '", scorer, "'"
        )
    comptime gpu = target != "cpu"
    comptime arch = _accelerator_arch() if gpu else "host"
    # On a GPU a tensor scorer the target lacks fails the build: a graph
    # names its scorer for the GPU it is compiled for (and an arch name
    # this file does not know would otherwise quietly build "simt").
    comptime assert (
        not gpu or scorer != "wgmma" or hopper_target()
    ), "mla_kpool.index_top_k: scorer 'wgmma' needs an sm_90 GPU target"
    comptime assert (
        not gpu or scorer != "mfma" or cdna3_target()
    ), "mla_kpool.index_top_k: scorer 'mfma' needs a gfx942 GPU target"
    comptime if scorer == "wgmma":
        comptime if not emulate_gpu and not (gpu and hopper_target()):
            raise Error(
                op_name,
                ": scorer 'wgmma' needs an sm_90 GPU (or emulate_gpu on the",
                " CPU); this target is ",
                target,
                " (",
                arch,
                ")",
            )
        comptime if not wgmma_fits[depth]():
            raise Error(
                op_name,
                ": scorer 'wgmma' takes depth up to ",
                WGMMA_MAX_DEPTH,
                ", got ",
                depth,
            )
    elif scorer == "mfma":
        comptime if not emulate_gpu and not (gpu and cdna3_target()):
            raise Error(
                op_name,
                ": scorer 'mfma' needs a gfx942 GPU (or emulate_gpu on the",
                " CPU); this target is ",
                target,
                " (",
                arch,
                ")",
            )
        comptime if not mfma_fits[depth]():
            raise Error(
                op_name,
                ": scorer 'mfma' takes depth up to ",
                MFMA_MAX_DEPTH,
                ", got ",
                depth,
            )
