"""Which scorer `index_top_k`'s GPU path builds and runs: the `scorer` parameter.

| `scorer` | runs on | kernel |
| --- | --- | --- |
| `"auto"` | every target | `"wgmma"` on an sm_90 GPU, `"mfma"` on a gfx942 one (for the depths they take), else `"simt"` |
| `"simt"` | every GPU, the emulated grid | FP32 FMAs (`score.mojo`) |
| `"wgmma"` | sm_90 GPUs, the emulated grid | Hopper FP8 tensor cores (`wgmma.mojo`) |
| `"mfma"` | gfx942 GPUs, the emulated grid | CDNA3 FP8 matrix cores (`mfma.mojo`) |

The choice is made when the op is compiled, from its target
(`_accelerator_arch()`: MAX names an H100 / H200 `nvidia:sm_90a` and an
MI300X `amdgpu:gfx942`), so a GPU builds only the scorer it runs.
"""

from std.sys.info import _accelerator_arch

from .gpu.score import TENSOR_MAX_DEPTH, SimtScore, tensor_fits
from .gpu.mfma import MfmaScore
from .operands import IndexTopK
from .gpu.wgmma import WgmmaScore


comptime AUTO = "auto"
"""The target's tensor scorer where it fits the depth, else `SIMT`."""

comptime SIMT = "simt"
"""FP32 FMAs: every GPU, any depth."""

comptime WGMMA = "wgmma"
"""Hopper's FP8 tensor cores."""

comptime MFMA = "mfma"
"""MI300's FP8 matrix cores."""

comptime GPU_SCORERS = (SIMT, WGMMA, MFMA)
"""The scorers with a kernel, in the order reports list them. The `scorer`
names the op accepts are `AUTO` and these: the one place they are listed
(`mla_kpool._index_op.SCORERS` is the Python twin;
tests/docs_and_layout/test_kernel_constants.py checks they agree)."""

comptime ScoreKernel[
    scorer: StaticString, Op: type_of(IndexTopK), grouped: Bool = False
] = (
    WgmmaScore[Op, grouped] if scorer
    == WGMMA else (MfmaScore[Op] if scorer == MFMA else SimtScore[Op])
)
"""The score launch's kernel (`gpu_kernel.GpuKernel`) of each scorer: the
one place a scorer's name meets its kernel."""


def scorer_gpu[scorer: StaticString]() -> StaticString:
    """The GPU family whose targets build `scorer`'s kernel: `"sm_90"`,
    `"gfx942"`, or `""` for a scorer every GPU builds (`SIMT`; `AUTO` and
    an unknown name too). The one place a scorer's name meets its GPU
    (`mla_kpool._index_op._TENSOR_ARCH` is the Python twin)."""
    comptime if scorer == WGMMA:
        return "sm_90"
    elif scorer == MFMA:
        return "gfx942"
    return ""


def is_tensor_scorer[scorer: StaticString]() -> Bool:
    """Whether `scorer` is a tensor scorer: one GPU family builds it, for
    the depths `score.tensor_fits` takes."""
    return scorer_gpu[scorer]() != ""


def is_scorer[name: StaticString]() -> Bool:
    """Whether the op accepts `name` as its `scorer`: `AUTO` or one of
    `GPU_SCORERS`."""
    comptime if name == AUTO:
        return True
    comptime for i in range(len(GPU_SCORERS)):
        comptime if name == GPU_SCORERS[i]:
            return True
    return False


def scorer_names() -> String:
    """The names `is_scorer` accepts, comma separated (for messages)."""
    var names = String(AUTO)
    comptime for i in range(len(GPU_SCORERS)):
        names += String(", ", GPU_SCORERS[i])
    return names


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


def in_family(family: StaticString, arch: StaticString) -> Bool:
    """Whether the GPU `arch` is of `family` (`scorer_gpu`'s names; `""`:
    every GPU)."""
    if family == "sm_90":
        return is_hopper(arch)
    if family == "gfx942":
        return is_cdna3(arch)
    return family == ""


def scorer_targets[scorer: StaticString](arch: StaticString) -> Bool:
    """Whether `scorer`'s kernel is built for the GPU `arch` (`SIMT`'s
    for every one)."""
    return in_family(scorer_gpu[scorer](), arch)


def scorer_kernel[
    scorer: StaticString, target: StaticString, emulate_gpu: Bool, depth: Int
]() -> StaticString:
    """The scorer the GPU path builds: one of `GPU_SCORERS`.

    A tensor scorer only where it can run (a target of its GPU family, or
    the emulated grid) and for the depths it takes; `SIMT` otherwise, so
    a refused name never builds a kernel its target lacks (`check_scorer`
    raises for it before anything launches). `AUTO` takes the first
    tensor scorer the GPU target builds.
    """
    comptime gpu = target != "cpu"
    comptime arch = _accelerator_arch()
    comptime if scorer == AUTO:
        comptime for i in range(len(GPU_SCORERS)):
            comptime candidate: StaticString = GPU_SCORERS[i]
            comptime if (
                gpu
                and is_tensor_scorer[candidate]()
                and scorer_targets[candidate](arch)
                and tensor_fits[depth]()
            ):
                return candidate
        return SIMT
    comptime if (
        is_tensor_scorer[scorer]()
        and (emulate_gpu or (gpu and scorer_targets[scorer](arch)))
        and tensor_fits[depth]()
    ):
        return scorer
    return SIMT


def check_scorer[
    scorer: StaticString, target: StaticString, emulate_gpu: Bool, depth: Int
](op_name: StaticString) raises:
    """Raises unless `scorer` names a scorer this call can run.

    Raises:
        Error: For an unknown name (listing the valid ones), or a tensor
            scorer on a target that cannot run it (naming the target) or
            with a depth it does not take.
    """
    comptime if not is_scorer[scorer]():
        raise Error(
            op_name,
            ": scorer must be one of ",
            scorer_names(),
            ", got '",
            scorer,
            "'",
        )
    comptime if is_tensor_scorer[scorer]():
        comptime family = scorer_gpu[scorer]()
        comptime gpu = target != "cpu"
        comptime arch = _accelerator_arch() if gpu else "host"
        comptime runs_here = gpu and scorer_targets[scorer](arch)
        # On a GPU a tensor scorer the target lacks fails the build: a graph
        # names its scorer for the GPU it is compiled for (and an arch name
        # this file does not know would otherwise quietly build SIMT).
        comptime assert not gpu or runs_here, String(
            "mla_kpool.index_top_k: scorer '",
            scorer,
            "' runs only on ",
            family,
            " GPU targets",
        )
        comptime if not emulate_gpu and not runs_here:
            raise Error(
                op_name,
                ": scorer '",
                scorer,
                "' runs only on ",
                family,
                " GPUs (or with emulate_gpu on the CPU); this target is ",
                target,
                " (",
                arch,
                ")",
            )
        comptime if not tensor_fits[depth]():
            raise Error(
                op_name,
                ": scorer '",
                scorer,
                "' takes depth up to ",
                TENSOR_MAX_DEPTH,
                ", got ",
                depth,
            )
