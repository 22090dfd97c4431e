"""Compiles every GPU kernel of the package for one target, with no GPU.

`mojo run -I <dir holding kernels/> -D MLA_KPOOL_ARCH=<arch> kernel_asm.mojo
<out_dir>` writes each kernel's code to `<out_dir>/<kernel>__<config>.<ext>`
(PTX, `.ptx`, for `sm_*` targets; AMDGPU assembly, `.s`, otherwise) and one
JSON object per kernel, a line each, to `<out_dir>/manifest.jsonl`: the op,
kernel and config, the entry symbol's prefix, the threads per block the op
launches and the bytes the host passes (`host_bytes`: the operand struct,
plus the `Int64` phase count of a phased kernel).

Each kernel is instantiated as the op's `execute` instantiates it: the same
`gpu_kernel` / `gpu_phased_kernel`, operand struct, kernel name, shared
words and launch constants, imported rather than copied.
"""

from max.gpu.host import get_gpu_target
from max.gpu.host.compile import _compile_code
from std.sys import argv, get_defined_string, size_of

from kernels.block_phases import Shared, gpu_phased_kernel
from kernels.compress import CompressOperands, compress_thread
from kernels.expand_topk import (
    ExpandTopKOperands,
    expand_topk_launch,
    expand_topk_thread,
    row_width,
)
from kernels.index_gpu import (
    PLAN_THREADS,
    index_plan_thread,
    index_select_phase,
)
from kernels.index_gpu_score import index_score_phase, index_score_thread
from kernels.index_gpu_shape import (
    SCORE_THREADS,
    padded_heads_pow2,
    score_threads,
    tile_words,
)
from kernels.index_operands import IndexOperands
from kernels.index_select_layout import (
    SELECT_THREADS,
    SELECT_WORDS,
    select_phases,
)
from kernels.index_mfma import (
    MFMA_THREADS,
    MFMA_TILE,
    index_mfma_phase,
    mfma_instructions,
    mfma_tile_flops,
    mfma_words,
)
from kernels.index_wgmma import (
    WGMMA_THREADS,
    WGMMA_TILE,
    index_wgmma_phase,
    wgmma_instructions,
    wgmma_tile_flops,
    wgmma_words,
)
from kernels.parallel import gpu_block_width, gpu_kernel
from kernels.ring_close import RingCloseOperands, ring_close_thread
from kernels.seed_tail import SeedTailOperands, seed_tail_thread
from kernels.step import (
    StepOperands,
    step_launch,
    step_scan_launch,
    step_scan_thread,
    step_thread,
)

comptime ARCH = get_defined_string["MLA_KPOOL_ARCH", "sm_90a"]()
"""The target, from `-D MLA_KPOOL_ARCH=...`."""

comptime U32 = DType.uint32
comptime BF16 = DType.bfloat16
comptime Any = MutAnyOrigin

# The writers at GLM-5-Next's shape: bf16 keys, uint32 metadata, head_dim
# 128, kpool 4; expand_topk with int32 pool ids, 512 pools, the tail.
comptime HEAD_DIM = 128
comptime RingClose = RingCloseOperands[BF16, U32, U32, U32, 4, HEAD_DIM, Any]
comptime Compress = CompressOperands[BF16, U32, U32, U32, 4, HEAD_DIM, Any]
comptime SeedTail = SeedTailOperands[BF16, U32, U32, U32, 4, HEAD_DIM, Any]
comptime Step = StepOperands[BF16, U32, U32, U32, 4, HEAD_DIM, Any]
comptime EXPAND_WIDTH = row_width[4, 512, True]()
comptime Expand = ExpandTopKOperands[DType.int32, U32, U32, 4, 512, True, Any]
comptime WRITERS = "bf16-d128-kpool4"
comptime WRITER_PARAMS = (
    '{"dtype": "bfloat16", "metadata": "uint32", "head_dim": 128, "kpool": 4'
)

# index_top_k at uint32 metadata, causal: GLM-5-Next (H 32, D 128, kpool 4
# spread over rows of W 32) at k 512 and 2048, DeepSeek-V3.2 (H 64, D 128,
# kpool 1) at k 2048.
comptime Index[H: Int, D: Int, K: Int, P: Int, S: Bool] = IndexOperands[
    U32, U32, U32, U32, H, D, K, P, True, S, Any
]


def _ring_close(block: Int, thread: Int, op: RingClose):
    ring_close_thread(block, thread, op)


def _compress(block: Int, thread: Int, op: Compress):
    compress_thread(block, thread, op)


def _seed_tail(block: Int, thread: Int, op: SeedTail):
    seed_tail_thread(block, thread, op)


def _step_scan(block: Int, thread: Int, op: Step):
    step_scan_thread(block, thread, op)


def _step(block: Int, thread: Int, op: Step):
    step_thread(block, thread, op)


def _expand(block: Int, thread: Int, op: Expand):
    expand_topk_thread(block, thread, op)


def _plan[
    H: Int, D: Int, K: Int, P: Int, S: Bool
](block: Int, thread: Int, op: Index[H, D, K, P, S]):
    index_plan_thread(block, thread, op)


def _score_untiled[
    H: Int, D: Int, K: Int, P: Int, S: Bool
](block: Int, thread: Int, op: Index[H, D, K, P, S]):
    index_score_thread(block, thread, op)


def _score_tiled[
    H: Int, D: Int, K: Int, P: Int, S: Bool
](p: Int, block: Int, thread: Int, s: Shared, op: Index[H, D, K, P, S]):
    index_score_phase(p, block, thread, s, op)


def _score_wgmma[
    H: Int, D: Int, K: Int, P: Int, S: Bool
](p: Int, block: Int, thread: Int, s: Shared, op: Index[H, D, K, P, S]):
    index_wgmma_phase(p, block, thread, s, op)


def _score_mfma[
    H: Int, D: Int, K: Int, P: Int, S: Bool
](p: Int, block: Int, thread: Int, s: Shared, op: Index[H, D, K, P, S]):
    index_mfma_phase(p, block, thread, s, op)


def _select[
    H: Int, D: Int, K: Int, P: Int, S: Bool
](p: Int, block: Int, thread: Int, s: Shared, op: Index[H, D, K, P, S]):
    index_select_phase(p, block, thread, s, op)


struct Manifest(Movable):
    """The output directory and the manifest's lines so far."""

    var out_dir: String
    var lines: String

    def __init__(out self, out_dir: String):
        """An empty manifest for `out_dir`."""
        self.out_dir = out_dir
        self.lines = String()

    def emit[
        T: TrivialRegisterPassable, //, func: T
    ](
        mut self,
        op: String,
        kernel: String,
        config: String,
        params: String,
        entry: String,
        block_threads: Int,
        host_bytes: Int,
    ) raises:
        """Compiles `func` for `ARCH`, writes its code and a manifest line.

        Args:
            op: The graph op (`ring_close`, `index_top_k`, ...).
            kernel: The kernel within the op (`main`, `score_tiled`, ...).
            config: A short name of the instance's parameters.
            params: The parameters, a JSON object.
            entry: The entry symbol's prefix (the launch's kernel name).
            block_threads: Threads per block of the op's launch.
            host_bytes: Bytes of the kernel's arguments on the host.
        """
        var ext = ".ptx" if ARCH.startswith("sm_") else ".s"
        var name = String(op, "__", kernel, "__", config, ext)
        var code = String(_compile_code[func, target=get_gpu_target[ARCH]()]())
        with open(String(self.out_dir, "/", name), "w") as f:
            f.write(code)
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
            entry,
            '", "asm": "',
            name,
            '", "block_threads": ',
            block_threads,
            ', "host_bytes": ',
            host_bytes,
            "}\n",
        )

    def write(self) raises:
        """Writes `manifest.jsonl`."""
        with open(String(self.out_dir, "/manifest.jsonl"), "w") as f:
            f.write(self.lines)


def _writers(mut m: Manifest) raises:
    comptime width = gpu_block_width[HEAD_DIM]()
    comptime p = String(WRITER_PARAMS, "}")
    m.emit[gpu_kernel["kpool_ring_close_kernel", RingClose, _ring_close]](
        "ring_close",
        "main",
        WRITERS,
        p,
        "kpool_ring_close_kernel",
        width,
        size_of[RingClose](),
    )
    m.emit[gpu_kernel["kpool_compress_kernel", Compress, _compress]](
        "compress",
        "main",
        WRITERS,
        p,
        "kpool_compress_kernel",
        width,
        size_of[Compress](),
    )
    m.emit[gpu_kernel["kpool_seed_tail_kernel", SeedTail, _seed_tail]](
        "seed_tail",
        "main",
        WRITERS,
        p,
        "kpool_seed_tail_kernel",
        width,
        size_of[SeedTail](),
    )
    m.emit[gpu_kernel["kpool_step_scan_kernel", Step, _step_scan]](
        "step",
        "scan",
        WRITERS,
        p,
        "kpool_step_scan_kernel",
        step_scan_launch()[1],
        size_of[Step](),
    )
    m.emit[gpu_kernel["kpool_step_kernel", Step, _step]](
        "step",
        "main",
        WRITERS,
        p,
        "kpool_step_kernel",
        step_launch[HEAD_DIM](1, 1)[1],
        size_of[Step](),
    )
    m.emit[gpu_kernel["kpool_expand_topk_kernel", Expand, _expand]](
        "expand_topk",
        "main",
        "i32-kpool4-topk512-tail",
        '{"pool_ids": "int32", "metadata": "uint32", "kpool": 4,'
        ' "pool_topk": 512, "always_select_tail": true}',
        "kpool_expand_topk_kernel",
        expand_topk_launch[EXPAND_WIDTH](1)[1],
        size_of[Expand](),
    )


def _index[
    H: Int, D: Int, K: Int, P: Int, S: Bool
](mut m: Manifest, config: String) raises:
    comptime Op = Index[H, D, K, P, S]
    comptime words = tile_words[H, D]()
    # A phased kernel's arguments: the operands, then the Int64 phases.
    comptime phased = size_of[Op]() + size_of[Int64]()
    var params = String(
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
        ', "causal": true, "score_words": ',
        words,
        ', "select_words": ',
        SELECT_WORDS,
        ', "select_phases": ',
        select_phases(K),
        # What each scorer computes per candidate, for the rooflines'
        # issue bounds: the tiled FP32 scorer's fmas (heads padded to a
        # power of two), the wgmma scorer's instructions and flops per
        # tile of candidates.
        ', "simt_fma_per_candidate": ',
        padded_heads_pow2[H]() * D,
        ', "wgmma_tile": ',
        WGMMA_TILE,
        ', "wgmma_per_tile": ',
        wgmma_instructions[H, D](),
        ', "wgmma_flops_per_tile": ',
        wgmma_tile_flops[H, D](),
        ', "mfma_tile": ',
        MFMA_TILE,
        ', "mfma_per_tile": ',
        mfma_instructions[H, D](),
        ', "mfma_flops_per_tile": ',
        mfma_tile_flops[H, D](),
        "}",
    )
    m.emit[gpu_kernel["mla_kpool_index_plan_kernel", Op, _plan[H, D, K, P, S]]](
        "index_top_k",
        "plan",
        config,
        params,
        "mla_kpool_index_plan_kernel",
        PLAN_THREADS,
        size_of[Op](),
    )
    m.emit[
        gpu_phased_kernel[
            "mla_kpool_index_score_kernel",
            Op,
            words,
            _score_tiled[H, D, K, P, S],
        ]
    ](
        "index_top_k",
        "score_tiled",
        config,
        params,
        "mla_kpool_index_score_kernel",
        score_threads[H, D](),
        phased,
    )
    m.emit[
        gpu_kernel[
            "mla_kpool_index_score_kernel", Op, _score_untiled[H, D, K, P, S]
        ]
    ](
        "index_top_k",
        "score_untiled",
        config,
        params,
        "mla_kpool_index_score_kernel",
        SCORE_THREADS,
        size_of[Op](),
    )
    comptime if ARCH == "sm_90a":
        m.emit[
            gpu_phased_kernel[
                "mla_kpool_index_wgmma_score_kernel",
                Op,
                wgmma_words[H, D](),
                _score_wgmma[H, D, K, P, S],
            ]
        ](
            "index_top_k",
            "score_wgmma",
            config,
            params,
            "mla_kpool_index_wgmma_score_kernel",
            WGMMA_THREADS,
            phased,
        )
    comptime if ARCH == "gfx942" or ARCH == "mi300x":
        m.emit[
            gpu_phased_kernel[
                "mla_kpool_index_mfma_score_kernel",
                Op,
                mfma_words[H, D](),
                _score_mfma[H, D, K, P, S],
            ]
        ](
            "index_top_k",
            "score_mfma",
            config,
            params,
            "mla_kpool_index_mfma_score_kernel",
            MFMA_THREADS,
            phased,
        )
    m.emit[
        gpu_phased_kernel[
            "mla_kpool_index_select_kernel",
            Op,
            SELECT_WORDS,
            _select[H, D, K, P, S],
        ]
    ](
        "index_top_k",
        "select",
        config,
        params,
        "mla_kpool_index_select_kernel",
        SELECT_THREADS,
        phased,
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
    m.write()
