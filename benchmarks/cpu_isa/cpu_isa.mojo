"""The CPU kernels' inner loops alone, for comparing instruction sets.

Built twice by `cpu_isa.sh`: for the host and with `--target-cpu znver3`
(AVX2 and FMA, no AVX-512), so one AVX-512 machine can run both code paths
(the AVX2 build on another microarchitecture than an AVX2-only host's:
a proxy, not that host's figure). Prints one line per measurement, the
median of 7 timed calls:

- `ring_close` at head_dim 128 on float32 at kpool 128 (batch 1024) and
  kpool 4 (batch 32768) and on bfloat16 at kpool 4 (batch 32768), both
  cores (`ring_close_cpu`), in GB/s of pool members read (keys and
  gates);
- the prefill scorer's register block (`score_head_block`, 32 heads,
  depth 128; and on AVX-512 BF16 its bfloat16 pair form, the one the op
  runs there) and the decode scorer (`score_tile`, 32 heads, depth 128, 64
  candidates), one core, in GFLOP/s (2 per multiply-add).
"""

from std.sys import size_of
from std.time import perf_counter_ns

from kernels.index.cpu.block import (
    PREFILL_HEADS,
    PREFILL_TILE,
    PREFILL_VECTORS,
    score_head_block,
    score_head_block_pairs,
    use_pairs,
)
from kernels.index.cpu.score import score_tile, scratch
from kernels.index.operands import F32_WIDTH, padded_heads_of
from kernels.grid.ragged import RaggedCall, Ring
from kernels.writers.ring_close import RingCloseOperands, ring_close_cpu

comptime F32 = DType.float32
comptime U32 = DType.uint32
comptime D = 128
comptime H = 32
comptime CALLS = 7


def _keys[dtype: DType](count: Int, salt: Int) -> List[Scalar[dtype]]:
    """A deterministic spread of values in [-1, 1]."""
    var out = List[Scalar[dtype]](length=count, fill=0)
    for i in range(count):
        out[i] = Scalar[dtype](
            Float32((i * 7919 + salt) % 2003 - 1001) / 1001.0
        )
    return out^


def _median(mut times: List[Int]) -> Float64:
    sort(times)
    return Float64(times[len(times) // 2])


def ring_close_gbps[dtype: DType, kpool: Int](batch: Int) raises -> Float64:
    """`ring_close_cpu`: half of each pool in the ring, half new rows."""
    var pending = kpool // 2
    var new = kpool - pending
    var tail = _keys[dtype](batch * 2 * kpool * D, 1)
    var k = _keys[dtype](batch * new * D, 2)
    var gate = _keys[dtype](batch * new * D, 3)
    var ape = List[Float32](length=kpool * D, fill=0)
    var pooled = List[Scalar[dtype]](length=batch * D, fill=0)
    var closed = List[Int32](length=batch, fill=0)
    var offsets = List[UInt32]()
    var cache = List[UInt32]()
    var slots = List[UInt32]()
    for b in range(batch + 1):
        offsets.append(UInt32(b * new))
    for b in range(batch):
        cache.append(UInt32(1000 * kpool + pending))
        slots.append(UInt32(b))
    var op = RingCloseOperands[dtype, U32, U32, U32, kpool, D, MutAnyOrigin](
        scratch(pooled),
        scratch(closed),
        scratch(ape),
        RaggedCall[dtype, U32, U32, MutAnyOrigin](
            scratch(k),
            scratch(gate),
            scratch(offsets),
            scratch(cache),
            batch,
            batch * new,
        ),
        Ring[dtype, U32, MutAnyOrigin](
            scratch(tail), scratch(slots), batch, kpool
        ),
    )
    var times = List[Int]()
    for _ in range(CALLS):
        var t0 = perf_counter_ns()
        ring_close_cpu(op)
        times.append(perf_counter_ns() - t0)
    if closed[0] != 1000:
        raise Error("ring_close closed pool ", closed[0], ", not 1000")
    return Float64(batch * kpool * D * size_of[dtype]() * 2) / _median(times)


def prefill_block_gflops[pairs: Bool]() raises -> Float64:
    """`score_head_block` (or, with `pairs`, `score_head_block_pairs` on
    AVX-512 BF16) over 16 rows of 32 heads, one key tile in L1."""
    comptime words = D // 2 if pairs else D
    var rows = 16
    var reps = 400
    var q = _keys[F32](rows * H * words, 4)
    var w = List[Float32](length=rows * H, fill=0.5)
    var keys = _keys[F32](words * PREFILL_TILE, 5)
    var totals = List[Float32](length=PREFILL_TILE, fill=0)
    var times = List[Int]()
    for _ in range(CALLS):
        var t0 = perf_counter_ns()
        for _ in range(reps):
            for r in range(rows):
                for b in range(0, H, PREFILL_HEADS):
                    var head = scratch(q).unsafe_offset((r * H + b) * words)
                    var weight = scratch(w).unsafe_offset(r * H + b)
                    comptime if pairs:
                        score_head_block_pairs[D](
                            head.unsafe_bitcast[UInt32](),
                            weight,
                            scratch(keys).unsafe_bitcast[UInt32](),
                            scratch(totals),
                        )
                    else:
                        score_head_block[D](
                            head, weight, scratch(keys), scratch(totals)
                        )
        times.append(perf_counter_ns() - t0)
    return 2.0 * Float64(reps * rows * H * D * PREFILL_TILE) / _median(times)


def decode_tile_gflops() raises -> Float64:
    """`score_tile`: one query row against 64 decoded candidates."""
    comptime padded = padded_heads_of[H]()
    var count = 64
    var reps = 4000
    var q = _keys[F32](D * padded, 6)
    var w = List[Float32](length=padded, fill=0.5)
    var keys = _keys[F32]((count + 8) * D, 7)
    var scales = List[Float32](length=count + 8, fill=1)
    var scores = List[Float32](length=count + 8, fill=0)
    var times = List[Int]()
    for _ in range(CALLS):
        var t0 = perf_counter_ns()
        for _ in range(reps):
            score_tile[H, D](
                scratch(q),
                scratch(w),
                scratch(keys),
                scratch(scales),
                count,
                scratch(scores),
            )
        times.append(perf_counter_ns() - t0)
    return 2.0 * Float64(reps * count * H * D) / _median(times)


def main() raises:
    print(
        "float32 lanes",
        F32_WIDTH,
        "| prefill block",
        PREFILL_HEADS,
        "heads x",
        PREFILL_VECTORS,
        "registers",
    )
    print(
        "ring_close float32 kpool 128 batch 1024 GB/s",
        ring_close_gbps[F32, 128](1024),
    )
    print(
        "ring_close float32 kpool 4 batch 32768 GB/s",
        ring_close_gbps[F32, 4](32768),
    )
    print(
        "ring_close bfloat16 kpool 4 batch 32768 GB/s",
        ring_close_gbps[DType.bfloat16, 4](32768),
    )
    print("prefill head block GFLOP/s (1 core)", prefill_block_gflops[False]())
    comptime if use_pairs[D]():
        print(
            "prefill pair block (AVX-512 BF16) GFLOP/s (1 core)",
            prefill_block_gflops[True](),
        )
    print("decode score_tile GFLOP/s (1 core)", decode_tile_gflops())
