"""Graph API of the k-pool writers, drop-ins for ``max.nn.kernels``.

A pool is ``kpool`` consecutive tokens of one request collapsed to one key,
``pooled[ch] = sum_q softmax_q(gate[q, ch] + ape[q, ch]) * k[q, ch]``.
Serving brings a request's tokens over many calls, so three writers run on
every call, in this order:

1. :func:`ring_close` closes the pool the per-request ``tail`` ring partly
   holds, once this call brings its missing members.
2. :func:`compress` builds every pool made only of this call's tokens.
3. :func:`seed_tail` stashes the trailing incomplete tokens into the ring.

:func:`kpool_step` does all of it for one call: by default as one fused op
(``mla_kpool.step``), or with ``fused=False`` as the three ops in that order
with :func:`pool_row_offsets` in between. Each wrapper checks every operand
first and then adds exactly one custom op (``mo.mla.kpool.<verb>``). If
the graph being built does not load this package's kernels yet, the wrapper
loads :data:`mla_kpool.KERNELS` into it before adding the op, so that the
CPU+GPU kernels replace MAX's GPU-only builtins of the same names and no
``custom_extensions`` argument is needed (passing
``custom_extensions=[mla_kpool.KERNELS]`` still works).

:func:`expand_topk` is the op that reads pools back: it widens the pool ids
an indexer selected for each query token into the token positions
attention reads.

Index tensors (``input_row_offsets``, ``cache_lengths``, ``slot_idx``,
``pool_row_offsets``) are rank 1, uint32 by MAX's convention; int32, int64
and uint64 are accepted too.
"""

from __future__ import annotations

from typing import NamedTuple

from max.dtype import DType
from max.graph import BufferValue, TensorType, TensorValue, ops
from max.graph.dim import StaticDim

from . import _validate as v
from ._paths import ensure_kernels


class _RaggedCall(NamedTuple):
    """The operands every writer takes, checked."""

    kpool: int
    k: TensorValue
    gate: TensorValue
    input_row_offsets: TensorValue
    cache_lengths: TensorValue
    head_dim: int


class _RingCall(NamedTuple):
    """The operands of ``ring_close`` and the fused step, checked."""

    call: _RaggedCall
    tail: BufferValue
    ape: TensorValue
    slot_idx: TensorValue


def _check_common(
    k: object,
    gate: object,
    input_row_offsets: object,
    cache_lengths: object,
    kpool: object,
) -> _RaggedCall:
    kpool = v.check_kpool(kpool)
    k, gate, head_dim = v.check_keys(k, gate)
    return _RaggedCall(
        kpool=kpool,
        k=k,
        gate=gate,
        input_row_offsets=v.check_index(
            "input_row_offsets", input_row_offsets, "batch + 1"
        ),
        cache_lengths=v.check_index("cache_lengths", cache_lengths, "batch"),
        head_dim=head_dim,
    )


def _check_ring_operands(
    tail: object,
    k: object,
    gate: object,
    ape: object,
    input_row_offsets: object,
    cache_lengths: object,
    slot_idx: object,
    kpool: object,
) -> _RingCall:
    """Checks the operands of ``ring_close`` and the fused step."""
    c = _check_common(k, gate, input_row_offsets, cache_lengths, kpool)
    ring = _RingCall(
        call=c,
        tail=v.check_tail(tail, c.kpool, c.head_dim, c.k.dtype),
        ape=v.check_ape(ape, c.kpool, c.head_dim),
        slot_idx=v.check_index("slot_idx", slot_idx, "batch"),
    )
    v.check_batch(
        c.cache_lengths,
        input_row_offsets=(c.input_row_offsets, 1),
        slot_idx=(ring.slot_idx, 0),
    )
    v.check_devices(
        c.k.device,
        "k",
        tail=ring.tail,
        gate=c.gate,
        ape=ring.ape,
        input_row_offsets=c.input_row_offsets,
        cache_lengths=c.cache_lengths,
        slot_idx=ring.slot_idx,
    )
    return ring


def _ring_values(r: _RingCall) -> list:
    """``ring_close``'s and the step's operands, in the ops' order."""
    c = r.call
    return [
        r.tail,
        c.k,
        c.gate,
        r.ape,
        c.input_row_offsets,
        c.cache_lengths,
        r.slot_idx,
    ]


def ring_close(
    tail: BufferValue,
    k: TensorValue,
    gate: TensorValue,
    ape: TensorValue,
    input_row_offsets: TensorValue,
    cache_lengths: TensorValue,
    slot_idx: TensorValue,
    kpool: int,
    *,
    emulate_gpu: bool = False,
) -> tuple[TensorValue, TensorValue]:
    """Closes each request's pending pool from the ring plus this call's tokens.

    Request ``b`` with ``c = cache_lengths[b]`` has ``r = c % kpool`` members
    of pool ``p = c // kpool`` in the ring. When this call brings the other
    ``kpool - r`` (its first rows), the pool is built from ring members
    ``q < r`` and this call's rows for ``q >= r``. At most one pool per
    request can be pending, so the outputs have one row per request.

    Args:
        tail: The ring, ``[max_slots, 2, ring, head_dim]``, dtype of ``k``;
            plane 0 keys, plane 1 gate scores, position ``pos`` at
            ``pos % ring``. ``ring`` is ``kpool`` (as MAX's) or a multiple
            of it. Read only, but a buffer: MAX only passes persistent state
            as buffers, and that also orders this op before :func:`seed_tail`.
        k: This call's keys, ``[total_tokens, head_dim]``, float32, bfloat16
            or float16; ``head_dim`` static.
        gate: This call's gate scores, same shape and dtype as ``k``.
        ape: Within-pool position embedding, ``[kpool, head_dim]``, float32.
        input_row_offsets: Token row offsets per request, ``[batch + 1]``.
        cache_lengths: Tokens already seen per request, ``[batch]``.
        slot_idx: Ring slot per request, ``[batch]``.
        kpool: Tokens per pool.
        emulate_gpu: Testing aid: run the op's GPU kernel on the CPU, every
            block and thread of its launch in turn, instead of the CPU
            kernel (see docs/ops.md). The operands must be on the CPU. Slow;
            MAX's own wrappers never set it.

    Returns:
        ``(pooled, closed_pool)``: ``pooled`` ``[batch, head_dim]`` in the
        dtype of ``k`` (zero where nothing closed), ``closed_pool``
        ``[batch]`` int32, the pool id closed or ``-1``. ``batch`` is
        ``cache_lengths.shape[0]``.

    Raises:
        TypeError: If ``tail`` is not a ``BufferValue``, another operand is not
            a ``TensorValue``, or ``kpool`` is not an int.
        ValueError: If ``kpool < 1``, a rank, shape, dtype (an index tensor
            not uint32, int32, int64 or uint64) or device is wrong,
            the static batch sizes disagree, ``emulate_gpu`` is set off the
            CPU, or the graph lacks this package's kernels and this MAX
            version cannot add them to an existing graph.
    """
    r = _check_ring_operands(
        tail, k, gate, ape, input_row_offsets, cache_lengths, slot_idx, kpool
    )
    c = r.call
    ensure_kernels("ring_close")
    batch = c.cache_lengths.shape[0]
    dev = c.k.device
    results = ops.inplace_custom(
        "mo.mla.kpool.ring_close",
        device=dev,
        values=_ring_values(r),
        out_types=[
            TensorType(c.k.dtype, [batch, c.head_dim], device=dev),
            TensorType(DType.int32, [batch], device=dev),
        ],
        parameters=v.kernel_parameters(c.head_dim, c.kpool, emulate_gpu, dev),
    )
    return results[0].tensor, results[1].tensor


def compress(
    k: TensorValue,
    gate: TensorValue,
    ape: TensorValue,
    input_row_offsets: TensorValue,
    pool_row_offsets: TensorValue,
    cache_lengths: TensorValue,
    kpool: int,
    *,
    emulate_gpu: bool = False,
) -> TensorValue:
    """Builds every pool made entirely of this call's tokens.

    Request ``b`` builds pools ``ceil(c / kpool)`` up to (excluding)
    ``(c + n) // kpool`` and writes them from row ``pool_row_offsets[b]``
    on; the leading tokens that finish a pending pool are left to
    :func:`ring_close`, the trailing ones to :func:`seed_tail`.

    Args:
        k: This call's keys, ``[total_tokens, head_dim]``, float32, bfloat16
            or float16; ``head_dim`` static.
        gate: This call's gate scores, same shape and dtype as ``k``.
        ape: Within-pool position embedding, ``[kpool, head_dim]``, float32.
        input_row_offsets: Token row offsets per request, ``[batch + 1]``.
        pool_row_offsets: Output row offsets per request, ``[batch + 1]``,
            the exclusive prefix sum of the per-request pool counts (see
            :func:`pool_row_offsets`).
        cache_lengths: Tokens already seen per request, ``[batch]``.
        kpool: Tokens per pool.
        emulate_gpu: Testing aid: run the op's GPU kernel on the CPU, every
            block and thread of its launch in turn, instead of the CPU
            kernel (see docs/ops.md). The operands must be on the CPU. Slow;
            MAX's own wrappers never set it.

    Returns:
        ``[total_tokens // kpool, head_dim]`` pooled keys in the dtype of
        ``k``. The row count is an upper bound, because the real count depends
        on runtime values and a graph output shape cannot; rows past
        ``pool_row_offsets[batch]`` are zero.

    Raises:
        TypeError: If an operand is not a ``TensorValue`` or ``kpool`` is not
            an int.
        ValueError: If ``kpool < 1``, a rank, shape, dtype (an index tensor
            not uint32, int32, int64 or uint64) or device is wrong,
            the static batch sizes disagree, ``emulate_gpu`` is set off the
            CPU, or the graph lacks this package's kernels and this MAX
            version cannot add them to an existing graph.
    """
    kpool, k, gate, input_row_offsets, cache_lengths, head_dim = _check_common(
        k, gate, input_row_offsets, cache_lengths, kpool
    )
    ape = v.check_ape(ape, kpool, head_dim)
    pool_row_offsets = v.check_index(
        "pool_row_offsets", pool_row_offsets, "batch + 1"
    )
    v.check_batch(
        cache_lengths,
        input_row_offsets=(input_row_offsets, 1),
        pool_row_offsets=(pool_row_offsets, 1),
    )
    v.check_devices(
        k.device,
        "k",
        gate=gate,
        ape=ape,
        input_row_offsets=input_row_offsets,
        pool_row_offsets=pool_row_offsets,
        cache_lengths=cache_lengths,
    )

    ensure_kernels("compress")
    return ops.custom(
        "mo.mla.kpool.compress",
        device=k.device,
        values=[
            k,
            gate,
            ape,
            input_row_offsets,
            pool_row_offsets,
            cache_lengths,
        ],
        out_types=[
            TensorType(
                k.dtype, [k.shape[0] // kpool, head_dim], device=k.device
            )
        ],
        parameters=v.kernel_parameters(head_dim, kpool, emulate_gpu, k.device),
    )[0].tensor


def seed_tail(
    tail: BufferValue,
    k: TensorValue,
    gate: TensorValue,
    input_row_offsets: TensorValue,
    cache_lengths: TensorValue,
    slot_idx: TensorValue,
    kpool: int,
    *,
    emulate_gpu: bool = False,
) -> None:
    """Stashes each request's trailing incomplete tokens into the ring.

    Positions from ``max(c, ((c + n) // kpool) * kpool - (ring - kpool))``
    to ``c + n`` are written to ``tail[s, :, pos % ring]``: with a
    one-pool ``ring == kpool`` (as MAX's) that is the trailing incomplete
    pool; a deeper ring also keeps the ``ring - kpool`` tokens before it (see
    :func:`ring_length`). Nothing below ``c`` is written, and a request
    whose slot or offsets do not address the ring and the call's rows is
    skipped.
    Must come after :func:`ring_close` in the same call, which reads ring
    slots this op can overwrite; MAX keeps in-place ops on one device in
    program order, so calling them in that order is enough.

    Args:
        tail: The ring, ``[max_slots, 2, ring, head_dim]``, dtype of ``k``,
            updated in place; ``ring`` is ``kpool`` or a multiple of it.
        k: This call's keys, ``[total_tokens, head_dim]``, float32, bfloat16
            or float16; ``head_dim`` static.
        gate: This call's gate scores, same shape and dtype as ``k``.
        input_row_offsets: Token row offsets per request, ``[batch + 1]``.
        cache_lengths: Tokens already seen per request, ``[batch]``.
        slot_idx: Ring slot per request, ``[batch]``.
        kpool: Tokens per pool.
        emulate_gpu: Testing aid: run the op's GPU kernel on the CPU, every
            block and thread of its launch in turn, instead of the CPU
            kernel (see docs/ops.md). The operands must be on the CPU. Slow;
            MAX's own wrappers never set it.

    Raises:
        TypeError: If ``tail`` is not a ``BufferValue``, another operand is not
            a ``TensorValue``, or ``kpool`` is not an int.
        ValueError: If ``kpool < 1``, a rank, shape, dtype (an index tensor
            not uint32, int32, int64 or uint64) or device is wrong,
            the static batch sizes disagree, ``emulate_gpu`` is set off the
            CPU, or the graph lacks this package's kernels and this MAX
            version cannot add them to an existing graph.
    """
    kpool, k, gate, input_row_offsets, cache_lengths, head_dim = _check_common(
        k, gate, input_row_offsets, cache_lengths, kpool
    )
    tail = v.check_tail(tail, kpool, head_dim, k.dtype)
    slot_idx = v.check_index("slot_idx", slot_idx, "batch")
    v.check_batch(
        cache_lengths,
        input_row_offsets=(input_row_offsets, 1),
        slot_idx=(slot_idx, 0),
    )
    v.check_devices(
        k.device,
        "k",
        tail=tail,
        gate=gate,
        input_row_offsets=input_row_offsets,
        cache_lengths=cache_lengths,
        slot_idx=slot_idx,
    )

    ensure_kernels("seed_tail")
    ops.inplace_custom(
        "mo.mla.kpool.seed_tail",
        device=k.device,
        values=[
            tail,
            k,
            gate,
            input_row_offsets,
            cache_lengths,
            slot_idx,
        ],
        parameters=v.kernel_parameters(head_dim, kpool, emulate_gpu, k.device),
    )


def _first_pool(cache_lengths: TensorValue, kpool: int) -> TensorValue:
    """``ceil(c / kpool)`` per request, int64: the first pool compress owns."""
    c = cache_lengths.cast(DType.int64)
    return (c + (kpool - 1)) // kpool


def pool_row_offsets(
    input_row_offsets: TensorValue, cache_lengths: TensorValue, kpool: int
) -> TensorValue:
    """Computes the ``pool_row_offsets`` operand of :func:`compress`.

    Request ``b`` with ``n`` new tokens and ``c`` cached ones gets
    ``max(0, (c + n) // kpool - ceil(c / kpool))`` rows; the result is the
    exclusive prefix sum of those counts. The arithmetic is int64 because
    ``c + n`` can pass 2^32. Bad metadata, a negative span
    (``input_row_offsets`` going down) or a negative cache length, counts
    zero pools.

    Args:
        input_row_offsets: Token row offsets per request, ``[batch + 1]``.
        cache_lengths: Tokens already seen per request, ``[batch]``.
        kpool: Tokens per pool.

    Returns:
        ``[batch + 1]`` uint32, ``batch`` being ``cache_lengths.shape[0]``;
        entry 0 is 0 and the last entry is the call's pool count.

    Raises:
        TypeError: If an operand is not a ``TensorValue``, ``kpool`` is not an
            int, or an index tensor is not uint32, int32, int64 or uint64.
        ValueError: If ``kpool < 1``, a rank, shape or device is wrong, or the
            static batch sizes disagree.
    """
    kpool = v.check_kpool(kpool)
    input_row_offsets = v.check_index(
        "input_row_offsets", input_row_offsets, "batch + 1"
    )
    cache_lengths = v.check_index("cache_lengths", cache_lengths, "batch")
    v.check_batch(cache_lengths, input_row_offsets=(input_row_offsets, 1))
    device = cache_lengths.device
    v.check_devices(
        device, "cache_lengths", input_row_offsets=input_row_offsets
    )

    zero = ops.constant(0, DType.int64, device=device)
    offsets = input_row_offsets.cast(DType.int64)
    # `input_row_offsets` has its own length symbol; one span per request makes
    # the spans as long as `cache_lengths` at run time, which the rebind
    # asserts so the elementwise ops below see one shape.
    n = (offsets[1:] - offsets[:-1]).rebind(
        cache_lengths.shape, "input_row_offsets must be [batch + 1]"
    )
    c = cache_lengths.cast(DType.int64)
    counts = ops.max((c + n) // kpool - _first_pool(cache_lengths, kpool), zero)
    # Bad metadata (a span that goes backwards, a negative int32 length)
    # owns no pools, as in the reference and the compress kernel.
    counts = ops.where((n < 0) | (c < 0), zero, counts)
    prefix = ops.concat([zero.reshape([1]), ops.cumsum(counts, axis=0)], axis=0)
    return prefix.cast(DType.uint32)


class KPoolStep(NamedTuple):
    """Outputs of one :func:`kpool_step` call.

    Attributes:
        ring_pooled: ``[batch, head_dim]``, dtype of ``k``: the pool each
            request closed from the ring (zero where none).
        ring_closed_pool: ``[batch]`` int32: its pool id, or ``-1``.
        pooled: ``[total_tokens // kpool, head_dim]``, dtype of ``k``: the
            pools built from this call's tokens, request ``b``'s from row
            ``pool_row_offsets[b]``.
        pool_row_offsets: ``[batch + 1]`` uint32, see
            :func:`pool_row_offsets`.
        first_pool: ``[batch]`` int64, ``ceil(cache_lengths / kpool)``: the
            pool id of request ``b``'s first row in ``pooled``, so row
            ``pool_row_offsets[b] + j`` is pool ``first_pool[b] + j``. int64
            because it is derived from 64-bit position arithmetic.
    """

    ring_pooled: TensorValue
    ring_closed_pool: TensorValue
    pooled: TensorValue
    pool_row_offsets: TensorValue
    first_pool: TensorValue


def kpool_step(
    tail: BufferValue,
    k: TensorValue,
    gate: TensorValue,
    ape: TensorValue,
    input_row_offsets: TensorValue,
    cache_lengths: TensorValue,
    slot_idx: TensorValue,
    kpool: int,
    *,
    fused: bool = True,
    emulate_gpu: bool = False,
) -> KPoolStep:
    """Runs one call's k-pool work on one ring: close, compress, seed.

    Together they produce every pool that this call completes exactly once:
    the pending pool (if finished) in ``ring_pooled``, the rest in
    ``pooled``; afterwards the ring holds the tokens of the pool still
    filling.

    By default this is one op, ``mla_kpool.step``, which reads each
    request's pending pool from the ring before it writes that request's
    tokens into it, so no ordering is left to the graph; it costs one op
    call (one CPU task, two GPU launches) instead of three plus about a
    dozen MAX ops for the offsets. ``fused=False`` adds the three writers
    (:func:`ring_close`, :func:`compress`, :func:`seed_tail`) and
    :func:`pool_row_offsets` instead, the way a pipeline calling MAX's
    wrappers one by one does: there the order matters, since
    :func:`seed_tail` may overwrite ring slots that :func:`ring_close`
    reads; both are in-place ops on ``tail``'s device, which MAX chains in
    program order, so issuing ring_close first is what sequences them.
    Both forms give bitwise identical outputs and ring contents on the
    same device, for any metadata.

    Args:
        tail: The ring, ``[max_slots, 2, ring, head_dim]``, dtype of ``k``,
            updated in place; ``ring`` is ``kpool`` or a multiple of it.
        k: This call's keys, ``[total_tokens, head_dim]``, float32, bfloat16
            or float16; ``head_dim`` static.
        gate: This call's gate scores, same shape and dtype as ``k``.
        ape: Within-pool position embedding, ``[kpool, head_dim]``, float32.
        input_row_offsets: Token row offsets per request, ``[batch + 1]``.
        cache_lengths: Tokens already seen per request, ``[batch]``.
        slot_idx: Ring slot per request, ``[batch]``.
        kpool: Tokens per pool.
        fused: One ``mla_kpool.step`` op (default), or the three writers.
        emulate_gpu: Testing aid: run the op's GPU kernel on the CPU, every
            block and thread of its launch in turn, instead of the CPU
            kernel (see docs/ops.md). The operands must be on the CPU. Slow;
            MAX's own wrappers never set it.

    Returns:
        A :class:`KPoolStep`.

    Raises:
        TypeError: As :func:`ring_close`, or if ``fused`` is not a bool.
        ValueError: As :func:`ring_close`, or, for the fused op, if the
            graph holds kernels without ``mla_kpool.step`` and the wrapper
            was told not to load this package's (MAX has no builtin of that
            name).
    """
    if not isinstance(fused, bool):
        raise TypeError(f"fused must be a bool, got {type(fused).__name__}")
    if fused:
        return _fused_step(
            tail,
            k,
            gate,
            ape,
            input_row_offsets,
            cache_lengths,
            slot_idx,
            kpool,
            emulate_gpu,
        )
    ring_pooled, ring_closed_pool = ring_close(
        tail,
        k,
        gate,
        ape,
        input_row_offsets,
        cache_lengths,
        slot_idx,
        kpool,
        emulate_gpu=emulate_gpu,
    )
    offsets = pool_row_offsets(input_row_offsets, cache_lengths, kpool)
    pooled = compress(
        k,
        gate,
        ape,
        input_row_offsets,
        offsets,
        cache_lengths,
        kpool,
        emulate_gpu=emulate_gpu,
    )
    seed_tail(
        tail,
        k,
        gate,
        input_row_offsets,
        cache_lengths,
        slot_idx,
        kpool,
        emulate_gpu=emulate_gpu,
    )
    return KPoolStep(
        ring_pooled=ring_pooled,
        ring_closed_pool=ring_closed_pool,
        pooled=pooled,
        pool_row_offsets=offsets,
        first_pool=_first_pool(cache_lengths, kpool),
    )


#: ``pool_ids`` dtypes: signed, because ``-1`` marks an unused selection.
POOL_ID_DTYPES: tuple[DType, ...] = (DType.int32, DType.int64)


def _check_pool_ids(pool_ids: object) -> tuple[TensorValue, int]:
    """Checks ``pool_ids`` and returns it with its static ``pool_topk``."""
    pool_ids = v.check_tensor("pool_ids", pool_ids)
    if pool_ids.rank != 2:
        raise ValueError(
            "pool_ids must be rank 2 [total_tokens, pool_topk], got rank"
            f" {pool_ids.rank} {v.fmt_shape(pool_ids.shape)}"
        )
    topk = pool_ids.shape[1]
    if not isinstance(topk, StaticDim):
        raise ValueError(
            "pool_ids must have a static pool_topk (it is a kernel"
            f" parameter), got {v.fmt_shape(pool_ids.shape)}"
        )
    if pool_ids.dtype not in POOL_ID_DTYPES:
        raise ValueError(
            "pool_ids must be int32 or int64 (signed: -1 marks an unused"
            f" selection), got {pool_ids.dtype.name}"
        )
    return pool_ids, int(topk)


def expand_topk(
    pool_ids: TensorValue,
    input_row_offsets: TensorValue,
    cache_lengths: TensorValue,
    kpool: int,
    always_select_tail: bool = True,
    *,
    emulate_gpu: bool = False,
) -> TensorValue:
    """Expands the pools an indexer selected into the positions they cover.

    The indexer scores pools; attention reads tokens. Pool ``p`` covers
    positions ``p * kpool`` to ``p * kpool + kpool - 1``. Token row ``t`` of
    request ``b`` (``input_row_offsets[b] <= t < input_row_offsets[b + 1]``)
    is the query at position ``c + t - input_row_offsets[b]``
    (``c = cache_lengths[b]``) and sees ``visible`` positions, one more than
    that. Its output row is packed: the positions of each selected pool in
    selection order, then, with ``always_select_tail``, the
    ``visible % kpool`` newest positions (the pool still filling, the query
    included), then ``-1`` in every remaining column. Valid entries come
    first because the sparse decode bounds its scan by them, and a column is
    never a clamped position, which would point attention at a token the
    indexer did not choose.

    Where MAX's documentation is silent, this keeps attention safe: an id
    that is negative, or names a pool that is not complete and visible to
    the query (``(p + 1) * kpool > visible``), is skipped rather than
    expanded into positions the query must not see (a repeated id is
    expanded each time). A row that no request owns (past the last offset,
    or inside the span of a request whose offsets decrease or pass
    ``total_tokens``, or whose cache length is negative) is all ``-1``, and
    so is a row whose positions would not fit int32 (``visible > 2^31``).
    Rows are matched to requests by binary search over
    ``input_row_offsets``, exact for non-decreasing offsets; where the
    offsets decrease, a row holds all ``-1`` or the expansion for some
    request whose span holds it. Position arithmetic is 64-bit.

    Args:
        pool_ids: Selected pool ids, ``[total_tokens, pool_topk]``, int32
            (MAX's) or int64, ``-1`` where fewer were selected; ``pool_topk``
            static.
        input_row_offsets: Token row offsets per request, ``[batch + 1]``.
        cache_lengths: Tokens already seen per request, ``[batch]``.
        kpool: Tokens per pool.
        always_select_tail: Whether to append the pool still filling.
        emulate_gpu: Testing aid: run the op's GPU kernel on the CPU, every
            block and thread of its launch in turn, instead of the CPU
            kernel (see docs/ops.md). The operands must be on the CPU. Slow;
            MAX's own wrappers never set it.

    Returns:
        ``[total_tokens, pool_topk * kpool + tail]`` int32 token positions,
        ``-1`` where unused; ``tail`` is ``kpool - 1`` with
        ``always_select_tail``, else 0.

    Raises:
        TypeError: If an operand is not a ``TensorValue``, ``kpool`` is not an
            int or ``always_select_tail`` is not a bool.
        ValueError: If ``kpool < 1``, a rank, shape, dtype (``pool_ids`` not
            int32/int64, an index tensor not uint32, int32, int64 or uint64)
            or device is wrong,
            ``pool_topk`` is not static, the static batch sizes disagree,
            ``emulate_gpu`` is set off the CPU, or the graph lacks this
            package's kernels and this MAX version cannot add them to an
            existing graph.
    """
    kpool = v.check_kpool(kpool)
    if not isinstance(always_select_tail, bool):
        raise TypeError(
            "always_select_tail must be a bool, got"
            f" {type(always_select_tail).__name__} {always_select_tail!r}"
        )
    pool_ids, pool_topk = _check_pool_ids(pool_ids)
    input_row_offsets = v.check_index(
        "input_row_offsets", input_row_offsets, "batch + 1"
    )
    cache_lengths = v.check_index("cache_lengths", cache_lengths, "batch")
    v.check_batch(cache_lengths, input_row_offsets=(input_row_offsets, 1))
    device = pool_ids.device
    v.check_devices(
        device,
        "pool_ids",
        input_row_offsets=input_row_offsets,
        cache_lengths=cache_lengths,
    )

    tail = kpool - 1 if always_select_tail else 0
    ensure_kernels("expand_topk")
    return ops.custom(
        "mo.mla.kpool.expand_topk",
        device=device,
        values=[pool_ids, input_row_offsets, cache_lengths],
        out_types=[
            TensorType(
                DType.int32,
                [pool_ids.shape[0], pool_topk * kpool + tail],
                device=device,
            )
        ],
        parameters={
            "kpool": kpool,
            "pool_topk": pool_topk,
            "always_select_tail": always_select_tail,
            **v.kernel_parameters(None, kpool, emulate_gpu, device),
        },
    )[0].tensor


def _fused_step(
    tail: object,
    k: object,
    gate: object,
    ape: object,
    input_row_offsets: object,
    cache_lengths: object,
    slot_idx: object,
    kpool: object,
    emulate_gpu: object,
) -> KPoolStep:
    """:func:`kpool_step` as the one ``mla_kpool.step`` op (checked first)."""
    r = _check_ring_operands(
        tail, k, gate, ape, input_row_offsets, cache_lengths, slot_idx, kpool
    )
    c = r.call
    batch = c.cache_lengths.shape[0]
    dev = c.k.device
    parameters = v.kernel_parameters(c.head_dim, c.kpool, emulate_gpu, dev)
    ensure_kernels("kpool_step")
    try:
        results = ops.inplace_custom(
            "mla_kpool.step",
            device=dev,
            values=_ring_values(r),
            out_types=[
                TensorType(c.k.dtype, [batch, c.head_dim], device=dev),
                TensorType(DType.int32, [batch], device=dev),
                TensorType(
                    c.k.dtype,
                    [c.k.shape[0] // c.kpool, c.head_dim],
                    device=dev,
                ),
                TensorType(DType.uint32, [batch + 1], device=dev),
                TensorType(DType.int64, [batch], device=dev),
            ],
            parameters=parameters,
        )
    except ValueError as error:
        if "no kernel registered" not in str(error):
            raise
        # MAX has no builtin of this name. The wrappers load the kernels
        # unless told not to (a graph meant for MAX's builtins), so this is
        # that case, or a kernel package without the fused op.
        raise ValueError(
            "kpool_step adds the fused op mla_kpool.step, which MAX does not"
            " ship and the kernels loaded into this graph do not provide:"
            " load this package's kernels (custom_extensions="
            "[mla_kpool.KERNELS], or build inside mla_kpool.kernels_loaded()),"
            " or pass fused=False for the three ops MAX also names"
        ) from error
    return KPoolStep(*(result.tensor for result in results))
