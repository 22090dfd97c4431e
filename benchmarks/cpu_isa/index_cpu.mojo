"""`index_top_k`'s CPU path alone, outside MAX, for comparing builds.

Built by `cpu_isa.sh` for the host and with `--target-cpu znver3` (AVX2
and FMA only), so one machine times the op's AVX-512 (and AMX) path and its
AVX2 path on the bench's GLM-5-Next calls: a decode (16 requests, one new
token after 32,767 cached) and a 4,096-token causal prefill. The operands
are synthetic (e4m3fn bytes from a hash, never NaN; head weights of both
signs; unit scales; pages scattered over the arena), not the bench's
seeded normals, and the calls run back to back (warm caches), so the times
are the kernels' own, not the bench's. Prints one line per call, the
median of 9 calls in ms and GFLOP/s (`2 * H * D` per visible candidate,
as the bench counts). `MLA_KPOOL_CPU_AMX=0` turns the AMX blocks off.
"""

from std.time import perf_counter_ns

from kernels.index.cpu.tasks import index_top_k_cpu
from kernels.index.cpu.score import scratch
from kernels.index.operands import IndexOperands, no_workspace

comptime U32 = DType.uint32
comptime H = 32
comptime D = 128
comptime KPOOL = 4
comptime K = 512
comptime PAGE = 128
comptime CALLS = 9
comptime Op = IndexOperands[
    U32, U32, U32, U32, H, D, K, KPOOL, True, True, MutAnyOrigin
]


def _byte(i: Int) -> UInt8:
    """A spread of e4m3fn bytes, never NaN."""
    var b = (i * 2654435761 >> 7) % 256
    if b & 0x7F == 0x7F:
        b -= 1
    return UInt8(b)


def time_call(requests: Int, cached: Int, new: Int) raises -> Float64:
    """Median ms of `index_top_k_cpu` over `CALLS` calls; prints a line."""
    var pools = (cached + new) // KPOOL
    var pages = pools * KPOOL // PAGE
    var width = D // KPOOL
    var tokens = requests * new
    var blocks = requests * pages
    var q = List[UInt8](length=tokens * H * D, fill=0)
    for i in range(len(q)):
        q[i] = _byte(i)
    var qs = List[Float32](length=tokens * H, fill=0.0)
    for i in range(len(qs)):
        qs[i] = Float32((i * 7) % 11 - 5) / 5.0
    var keys = List[UInt8](length=blocks * PAGE * width, fill=0)
    for i in range(len(keys)):
        keys[i] = _byte(i + 12345)
    var scales = List[Float32](length=blocks * PAGE, fill=1.0)
    var offsets = List[UInt32](length=requests + 1, fill=0)
    for b in range(requests + 1):
        offsets[b] = UInt32(b * new)
    var lengths = List[UInt32](length=requests, fill=UInt32(cached))
    var table = List[UInt32](length=blocks, fill=0)
    for p in range(blocks):
        table[p] = UInt32((p * 7) % blocks)
    var output = List[Int32](length=tokens * K, fill=0)
    var op = Op(
        scratch(output),
        scratch(q),
        scratch(qs),
        scratch(offsets),
        scratch(keys),
        scratch(lengths),
        scratch(table),
        scratch(scales),
        scratch(table),
        tokens,
        requests,
        PAGE,
        pages,
        pages,
        blocks,
        blocks,
        PAGE * width,
        PAGE,
        0,
        0,
        no_workspace(),
    )
    var times = List[Int]()
    for _ in range(CALLS):
        var t0 = perf_counter_ns()
        index_top_k_cpu(op)
        times.append(perf_counter_ns() - t0)
    sort(times)
    var ms = Float64(times[CALLS // 2]) / 1e6
    # Visible candidates: a decode row sees every pool; causal prefill row
    # t sees (t + 1) // kpool.
    var candidates = 0
    for t in range(new):
        candidates += (cached + t + 1) // KPOOL
    var flops = Float64(2 * H * D * requests * candidates)
    print(
        "index_top_k",
        requests,
        "x",
        new,
        "after",
        cached,
        "ms",
        ms,
        "GFLOP/s",
        flops / ms / 1e6,
    )
    if output[(tokens - 1) * K] < 0:
        raise Error("the last row kept nothing")
    _ = len(q)
    _ = len(qs)
    _ = len(keys)
    _ = len(scales)
    _ = len(offsets)
    _ = len(lengths)
    _ = len(table)
    _ = len(output)
    return ms


def main() raises:
    _ = time_call(16, 32767, 1)
    _ = time_call(1, 0, 4096)
