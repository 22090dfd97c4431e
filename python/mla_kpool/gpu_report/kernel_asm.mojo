"""Compiles every GPU kernel of the package for one target, with no GPU.

`mojo run -I <dir holding kernels/> -D MLA_KPOOL_ARCH=<arch> kernel_asm.mojo
<out_dir>` writes each kernel's code to `<out_dir>/<op>__<kernel>__<config>.<ext>`
(PTX, `.ptx`, for `sm_*` targets; AMDGPU assembly, `.s`, otherwise) and one
JSON object per kernel, a line each, to `<out_dir>/manifest.jsonl`: the op,
kernel and config, the instance's parameters, and the launch facts of the
kernel's declaration (`gpu_kernel.GpuKernel`): the entry symbol's prefix,
threads per block, shared words (the most a block uses, the scratch of its
block collectives included: `block_shared_words`) and whether they are
sized at launch (`dynamic_shared`: the code then declares none), phases,
the grid rule and the bytes the host passes (`host_bytes`). A score kernel's row also carries what it
computes per candidate (`column_flops`, `padded_tile`, `flops_peak`), for
the rooflines' issue bounds.

Each kernel is compiled from the same declaration the op's `execute`
launches (`kernel_code`), for the scorers the target builds
(`scorers.scorer_targets`).
"""

from std.sys import argv, get_defined_string

from kernels.writers.compress import CompressKernel, CompressOperands
from kernels.writers.expand_topk import ExpandTopKKernel, ExpandTopKOperands
from kernels.grid.gpu_kernel import (
    GpuKernel,
    block_shared_words,
    phase_count,
    host_bytes,
    kernel_code,
)
from kernels.index.gpu.launches import PlanKernel, SelectKernel
from kernels.index.operands import IndexOperands
from kernels.index.scorers import GPU_SCORERS, ScoreKernel, scorer_targets
from kernels.writers.ring_close import RingCloseKernel, RingCloseOperands
from kernels.writers.seed_tail import SeedTailKernel, SeedTailOperands
from kernels.writers.step import StepKernel, StepOperands, StepScanKernel

comptime ARCH = get_defined_string["MLA_KPOOL_ARCH", "sm_90a"]()
"""The target, from `-D MLA_KPOOL_ARCH=...`."""

comptime U32 = DType.uint32
comptime BF16 = DType.bfloat16
comptime Any = MutAnyOrigin

# The writers at GLM-5-Next's shape: bf16 keys, uint32 metadata, head_dim
# 128, kpool 4; expand_topk with int32 pool ids, 512 pools, the tail.
comptime RingClose = RingCloseOperands[BF16, U32, U32, U32, 4, 128, Any]
comptime Compress = CompressOperands[BF16, U32, U32, U32, 4, 128, Any]
comptime SeedTail = SeedTailOperands[BF16, U32, U32, U32, 4, 128, Any]
comptime Step = StepOperands[BF16, U32, U32, U32, 4, 128, Any]
comptime Expand = ExpandTopKOperands[DType.int32, U32, U32, 4, 512, True, Any]
comptime WRITERS = "bf16-d128-kpool4"
comptime WRITER_PARAMS = (
    '{"dtype": "bfloat16", "metadata": "uint32", "head_dim": 128, "kpool": 4}'
)

# index_top_k at uint32 metadata, causal: GLM-5-Next (H 32, D 128, kpool 4
# spread over rows of W 32) at k 512 and 2048, DeepSeek-V3.2 (H 64, D 128,
# kpool 1) at k 2048, and a 128-head shape whose query is too large for the
# tiled FP32 scorer (its untiled form).
comptime Index[H: Int, D: Int, K: Int, P: Int, S: Bool] = IndexOperands[
    U32, U32, U32, U32, H, D, K, P, True, S, Any
]


def _json_string(text: StaticString) -> String:
    return String('"', text, '"')


struct Manifest(Movable):
    """The output directory and the manifest's lines so far."""

    var out_dir: String
    var lines: String

    def __init__(out self, out_dir: String):
        """An empty manifest for `out_dir`."""
        self.out_dir = out_dir
        self.lines = String()

    def emit[
        K: GpuKernel
    ](
        mut self,
        op: String,
        kernel: String,
        config: String,
        params: String,
        issue: String = "",
    ) raises:
        """Compiles `K` for `ARCH`, writes its code and a manifest line.

        Args:
            op: The graph op (`ring_close`, `index_top_k`, ...).
            kernel: The kernel within the op (`main`, `score_simt`, ...).
            config: A short name of the instance's parameters.
            params: The parameters, a JSON object.
            issue: More JSON members (`, "column_flops": ...`), or empty.
        """
        var ext = ".ptx" if ARCH.startswith("sm_") else ".s"
        var name = String(op, "__", kernel, "__", config, ext)
        with open(String(self.out_dir, "/", name), "w") as f:
            f.write(kernel_code[K, ARCH]())
        self.lines += String(
            '{"op": "',
            op,
            '", "kernel": "',
            kernel,
            '", "config": "',
            config,
            '", "params": ',
            params,
            ', "entry": "',
            K.name,
            '", "asm": "',
            name,
            '", "block_threads": ',
            K.block_threads,
            ', "shared_words": ',
            block_shared_words[K](),
            ', "dynamic_shared": ',
            "true" if K.dynamic_shared else "false",
            ', "phases": ',
            phase_count[K](),
            ', "grid": {"rows": ',
            _json_string(K.grid_rows),
            ', "rows_per_block": ',
            K.rows_per_block,
            ', "columns": ',
            _json_string(K.grid_columns),
            ', "columns_per_block": ',
            K.columns_per_block,
            '}, "host_bytes": ',
            host_bytes[K](),
            issue,
            "}\n",
        )

    def write(self) raises:
        """Writes `manifest.jsonl`."""
        with open(String(self.out_dir, "/manifest.jsonl"), "w") as f:
            f.write(self.lines)


def _writers(mut m: Manifest) raises:
    comptime p = WRITER_PARAMS
    m.emit[RingCloseKernel[RingClose]]("ring_close", "main", WRITERS, p)
    m.emit[CompressKernel[Compress]]("compress", "main", WRITERS, p)
    m.emit[SeedTailKernel[SeedTail]]("seed_tail", "main", WRITERS, p)
    m.emit[StepScanKernel[Step]]("step", "scan", WRITERS, p)
    m.emit[StepKernel[Step]]("step", "main", WRITERS, p)
    m.emit[ExpandTopKKernel[Expand]](
        "expand_topk",
        "main",
        "i32-kpool4-topk512-tail",
        '{"pool_ids": "int32", "metadata": "uint32", "kpool": 4,'
        ' "pool_topk": 512, "always_select_tail": true}',
    )


def _score[
    Score: GpuKernel
](
    mut m: Manifest,
    scorer: String,
    config: String,
    fields: String,
    grouped: Bool,
    keyed: Bool,
) raises:
    """Emits a score kernel: `score_<scorer>`, `score_<scorer>_rows` for
    the `grouped` one (blocks of several rows and tiles); for a scorer
    that has both (`keyed`), `grouped` is the params' last member."""
    var kernel = String("score_", scorer, "_rows" if grouped else "")
    var close = String("}")
    if keyed:
        close = String(', "grouped": ', "true}" if grouped else "false}")
    m.emit[Score](
        "index_top_k",
        kernel,
        config,
        fields + close,
        String(
            ', "scorer": "',
            scorer,
            '", "column_flops": ',
            Score.column_flops,
            ', "padded_tile": ',
            Score.padded_tile,
            ', "flops_peak": "',
            Score.flops_peak,
            '"',
        ),
    )


def _index[
    H: Int, D: Int, K: Int, P: Int, S: Bool
](mut m: Manifest, config: String) raises:
    comptime Op = Index[H, D, K, P, S]
    var fields = String(
        '{"metadata": "uint32", "num_heads": ',
        H,
        ', "depth": ',
        D,
        ', "k": ',
        K,
        ', "kpool": ',
        P,
        ', "spread": ',
        "true" if S else "false",
        ', "causal": true',
    )
    m.emit[PlanKernel[Op]]("index_top_k", "plan", config, fields + "}")
    comptime for i in range(len(GPU_SCORERS)):
        comptime scorer = GPU_SCORERS[i]
        comptime if scorer_targets[scorer](ARCH):
            comptime Score = ScoreKernel[scorer, Op]
            comptime Grouped = ScoreKernel[scorer, Op, True]
            # A scorer with a grouped kernel (several rows a tile) runs it
            # at prefill, its own at decode (the workload's `grouped`).
            comptime grouped = Grouped.name != Score.name
            _score[Score](m, scorer, config, fields, False, grouped)
            comptime if grouped:
                _score[Grouped](m, scorer, config, fields, True, True)
    # One of the two runs a window, by `select_slices` (the workload's
    # `split`).
    m.emit[SelectKernel[Op, False]](
        "index_top_k", "select", config, fields + ', "split": false}'
    )
    m.emit[SelectKernel[Op, True]](
        "index_top_k", "split_select", config, fields + ', "split": true}'
    )


def main() raises:
    var args = argv()
    if len(args) != 2:
        raise Error("usage: kernel_asm.mojo OUT_DIR")
    var m = Manifest(String(args[1]))
    _writers(m)
    _index[32, 128, 512, 4, True](m, "glm5next-k512")
    _index[32, 128, 2048, 4, True](m, "glm5next-k2048")
    _index[64, 128, 2048, 1, False](m, "dsv32-k2048")
    _index[128, 128, 2048, 1, False](m, "h128-k2048")
    m.write()
