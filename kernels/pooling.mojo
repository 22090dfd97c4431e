"""The one pooling routine every writer shares.

A pool of `kpool` consecutive tokens collapses to one key, channel by channel:

    score[q, ch]  = gate[q, ch] + ape[q, ch]                 (float32)
    weight[q, ch] = exp(score[q, ch] - max_q score[q, ch])
    pooled[ch]    = sum_q weight[q, ch] * key[q, ch] / sum_q weight[q, ch]

a softmax over the pool's members q, computed in float32 with max
subtraction (gates of magnitude 100 cannot overflow) and cast to the key
dtype at the end. `ring_close` and `compress` both call `pool_channels`, with
the same member order, the same fused multiply-adds and the same SIMD width
per channel, so a pool comes out bitwise identical whichever writer builds it
(SPEC section 6). NaN in a gate, ape or key reaches only its own channel, as
it does in a softmax.

Members come from two row segments: q < `split` from the ring segment (the
pending pool's members stored in the tail ring, contiguous because a pool
never straddles the ring's wrap point), q >= `split` from this call's rows
of `k` and `gate`. `compress` passes `split = 0`.
"""

from std.math import exp, isnan
from std.sys import simd_width_of, size_of
from std.algorithm import vectorize
from std.utils.numerics import nan, neg_inf

from .ragged import Ptr

comptime ACCUM = DType.float32
"""Scores, weights and sums are float32 whatever the key dtype."""


@always_inline
def cpu_pool_width[dtype: DType]() -> Int:
    """Channels one CPU SIMD step pools: one 64-byte cache line of keys.

    Parameters:
        dtype: Key dtype.

    Returns:
        The SIMD width every CPU writer uses, so that they agree bitwise.
    """
    return max(simd_width_of[ACCUM](), 64 // size_of[dtype]())


@always_inline
def _member[
    dtype: DType, width: Int
](
    key: Ptr[dtype],
    gate: Ptr[dtype],
    ape: Ptr[DType.float32],
    member_offset: Int,
    ape_offset: Int,
) -> Tuple[SIMD[ACCUM, width], SIMD[ACCUM, width]]:
    """Loads one member's (score, key) for `width` channels, in float32."""
    var score = gate.unsafe_load[width=width](member_offset).cast[
        ACCUM
    ]() + ape.unsafe_load[width=width](ape_offset)
    var value = key.unsafe_load[width=width](member_offset).cast[ACCUM]()
    return (score, value)


@always_inline
def pool_channels[
    dtype: DType, width: Int, kpool: Int
](
    ring_key: Ptr[dtype],
    ring_gate: Ptr[dtype],
    split: Int,
    new_key: Ptr[dtype],
    new_gate: Ptr[dtype],
    ape: Ptr[DType.float32],
    row_stride: Int,
    ch: Int,
) -> SIMD[dtype, width]:
    """Pools channels `[ch, ch + width)` of one pool.

    Parameters:
        dtype: Key and gate dtype (float32, bfloat16 or float16).
        width: Channels pooled at once (1 on GPU, one cache line on CPU).
        kpool: Tokens per pool.

    Args:
        ring_key: Key row of member 0 in the ring segment (`[*, row_stride]`).
        ring_gate: Gate row of member 0 in the ring segment.
        split: Members `q < split` come from the ring segment, row `q`.
        new_key: Key row of member `split` in this call's `k`.
        new_gate: Gate row of member `split` in this call's `gate`.
        ape: `[kpool, row_stride]` float32 within-pool position embedding.
        row_stride: Elements between consecutive member rows (`head_dim`).
        ch: First channel.

    Returns:
        The pooled key for the `width` channels, in the key dtype.
    """
    # Pass 1: the per-channel maximum score, so no exp can overflow.
    var peak = SIMD[ACCUM, width](neg_inf[ACCUM]())
    for q in range(kpool):
        var s: SIMD[ACCUM, width]
        if q < split:
            s = _member[dtype, width](
                ring_key,
                ring_gate,
                ape,
                q * row_stride + ch,
                q * row_stride + ch,
            )[0]
        else:
            s = _member[dtype, width](
                new_key,
                new_gate,
                ape,
                (q - split) * row_stride + ch,
                q * row_stride + ch,
            )[0]
        peak = max(peak, s)
    # Pass 2: weights and the weighted sum, members in order q = 0..kpool-1.
    var total = SIMD[ACCUM, width](0)
    var acc = SIMD[ACCUM, width](0)
    # `max` skips NaN and CPU `exp(NaN)` is +inf, so a NaN score (a NaN gate
    # or ape, or inf - inf) is tracked explicitly, as a softmax would
    # propagate it.
    var undefined = SIMD[DType.bool, width](fill=False)
    for q in range(kpool):
        var member: Tuple[SIMD[ACCUM, width], SIMD[ACCUM, width]]
        if q < split:
            member = _member[dtype, width](
                ring_key,
                ring_gate,
                ape,
                q * row_stride + ch,
                q * row_stride + ch,
            )
        else:
            member = _member[dtype, width](
                new_key,
                new_gate,
                ape,
                (q - split) * row_stride + ch,
                q * row_stride + ch,
            )
        var shifted = member[0] - peak
        undefined = undefined | isnan(shifted)
        var weight = exp(shifted)
        total += weight
        acc = weight.fma(member[1], acc)
    return undefined.select(SIMD[ACCUM, width](nan[ACCUM]()), acc / total).cast[
        dtype
    ]()


@always_inline
def cpu_pool_row[
    dtype: DType, kpool: Int, head_dim: Int
](
    ring_key: Ptr[dtype],
    ring_gate: Ptr[dtype],
    split: Int,
    new_key: Ptr[dtype],
    new_gate: Ptr[dtype],
    ape: Ptr[DType.float32],
    dest: Ptr[dtype],
):
    """Pools all `head_dim` channels of one pool into `out[0:head_dim]`.

    The CPU writers' only entry to the pooling math: one cache line of
    channels per step (`cpu_pool_width`), then a scalar tail.

    Parameters:
        dtype: Key dtype.
        kpool: Tokens per pool.
        head_dim: Channels per key (also the member row stride).

    Args:
        ring_key: See `pool_channels`.
        ring_gate: See `pool_channels`.
        split: See `pool_channels`.
        new_key: See `pool_channels`.
        new_gate: See `pool_channels`.
        ape: See `pool_channels`.
        dest: Destination row, `head_dim` elements of `dtype`.
    """

    def chunk[width: Int](ch: Int) {imm}:
        dest.unsafe_store[width=width](
            ch,
            pool_channels[dtype, width, kpool](
                ring_key,
                ring_gate,
                split,
                new_key,
                new_gate,
                ape,
                head_dim,
                ch,
            ),
        )

    vectorize[cpu_pool_width[dtype]()](head_dim, chunk)
