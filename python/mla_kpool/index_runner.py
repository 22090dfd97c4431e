"""Compile-once, run-many execution of :func:`mla_kpool.index_top_k`.

:meth:`mla_kpool.runner.Runner.index_top_k` calls :func:`prepare` and runs
the model. A model is compiled per :class:`IndexKey` (what the kernel is
specialized on: heads, depth, row width, layers, page size, ``top_k``,
``kpool``, mask); tokens, requests, blocks and pages are symbolic graph dims,
so one model serves every batch and cache size.

The key and scale arenas are bound as MAX binds a padded page arena
(``max.nn.kv_cache.cache_params.contiguous_page_view_and_stride``): a
packed-shape view of the start of the flat arena, the stride beside it, and
the op reads block ``i`` at ``i * page_stride`` past the view's end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
from max import driver
from max.driver import Buffer
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Graph, TensorType

from ._index_op import (
    MAX_TOP_K,
    add_op,
    check_int,
    check_operands,
    check_scorer,
)
from ._metadata import check_index_metadata
from ._renamed import renamed_keyword
from ._validate import mask_name
from .buffers import to_buffer, zeros
from .index_cache import PagedIndexCache


@dataclass(frozen=True)
class IndexKey:
    """What one compiled index_top_k model is specialized on.

    Attributes:
        num_heads: ``H``.
        depth: ``D``.
        width: Cache row width ``W`` (``D`` or ``D / kpool``).
        num_layers: Layers of the cache.
        page_size: Rows per page.
        top_k: Ids per row.
        kpool: Tokens per key.
        mask: ``"causal"`` or ``"null"``.
        quantization_granularity: MAX's parameter (unused by the math).
        gpu: A GPU graph (FP8 operands, through
            :func:`mla_kpool.index_top_k`, which picks MAX's op or ours).
        emulate_gpu: A CPU graph whose op runs its GPU path over an
            emulated grid.
        gpu_op: On a GPU, ``"auto"`` (the wrapper picks MAX's op where MAX
            scores the shape, else this package's) or ``"ours"`` (this
            package's GPU path whatever the GPU, for tests and benches).
        scorer: The GPU path's scorer (``mla_kpool._index_op.SCORERS``):
            ``"auto"``, ``"simt"``, ``"wgmma"`` or ``"mfma"``; on a GPU, a
            scorer other than ``"auto"`` always runs this package's op.
    """

    num_heads: int
    depth: int
    width: int
    num_layers: int
    page_size: int
    top_k: int
    kpool: int
    mask: str
    quantization_granularity: int = 128
    gpu: bool = False
    emulate_gpu: bool = False
    gpu_op: str = "auto"
    scorer: str = "auto"

    @property
    def name(self) -> str:
        """The graph name: everything the model is specialized on."""
        return (
            f"mla_kpool_index_top_k_h{self.num_heads}_d{self.depth}"
            f"_w{self.width}_l{self.num_layers}_p{self.page_size}"
            f"_k{self.top_k}_kp{self.kpool}_{self.mask}"
            + ("_gpu" if self.gpu else "")
            + ("_emulated" if self.emulate_gpu else "")
            + ("_ours" if self.gpu and self.gpu_op == "ours" else "")
            + ("" if self.scorer == "auto" else f"_{self.scorer}")
        )

    def input_types(
        self, device: DeviceRef | None = None, suffix: str = ""
    ) -> list[TensorType | BufferType]:
        """The graph inputs in operand order; per-call dims symbolic.

        Args:
            device: Where the device operands go (default: GPU 0 for a
                GPU key, else the CPU); host operands stay on the CPU.
            suffix: Appended to every symbolic dim's name (several calls
                in one graph).
        """
        dev = device or (DeviceRef.GPU() if self.gpu else DeviceRef.CPU())
        cpu = DeviceRef.CPU()
        fp8 = DType.float8_e4m3fn if self.gpu else DType.uint8
        u32, i64 = DType.uint32, DType.int64
        page = [self.num_layers, self.page_size, 1]
        tokens, batch = "tokens" + suffix, "batch" + suffix
        return [
            TensorType(fp8, [tokens, self.num_heads, self.depth], dev),
            TensorType(DType.float32, [tokens, self.num_heads], dev),
            TensorType(u32, ["offsets" + suffix], dev),
            BufferType(fp8, ["blocks" + suffix, 1, *page, self.width], dev),
            TensorType(i64, [1], cpu),
            TensorType(u32, [batch], dev),
            TensorType(u32, [batch, "pages" + suffix], dev),
            TensorType(u32, [1], cpu),
            TensorType(u32, [1], cpu),
            BufferType(
                DType.float32, ["scale_blocks" + suffix, 1, *page, 1], dev
            ),
            TensorType(i64, [1], cpu),
            TensorType(u32, [batch, "scale_pages" + suffix], dev),
            TensorType(u32, [], cpu),
        ]


def build_graph(key: IndexKey, extensions: list[Any]) -> Graph:
    """The one-op graph of ``key`` (:func:`add_to_graph`)."""
    with Graph(
        key.name, input_types=key.input_types(), custom_extensions=extensions
    ) as g:
        g.output(add_to_graph(key, g.inputs))
    return g


def add_to_graph(key: IndexKey, inputs: Sequence[Any]) -> Any:
    """Adds ``key``'s op on graph ``inputs`` (of :meth:`IndexKey.input_types`).

    CPU graphs add ``mla_kpool.index_top_k`` from the flat operands (no
    ``max.nn`` import), its GPU path emulated with ``key.emulate_gpu``; GPU
    graphs go through :func:`mla_kpool.index_top_k`, which picks MAX's
    builtin where MAX scores the shape and ours elsewhere.

    Returns:
        The op's int32 ``[T, top_k]`` output.
    """
    values = [
        x.buffer if i in _ARENAS else x.tensor for i, x in enumerate(inputs)
    ]
    if key.gpu and key.gpu_op == "auto" and key.scorer == "auto":
        return _gpu_op(key, values)
    operands = check_operands(
        *values,
        top_k=key.top_k,
        quantization_granularity=key.quantization_granularity,
        mask_str=key.mask,
        kpool=key.kpool,
        prefix="",
    )
    return add_op(operands, emulate_gpu=key.emulate_gpu, scorer=key.scorer)


#: Operand positions of the key and scale arenas (buffers), and of their
#: page strides (``-1`` is packed).
_ARENAS = (3, 9)
_STRIDES = (4, 10)

#: Symbolic dim sizes of an idle call: no tokens, requests, blocks or pages.
_IDLE_SIZES = {"offsets": 1}


def idle_operands(key: IndexKey, device: driver.Device) -> list[Buffer]:
    """Operands on which ``key``'s op does nothing, as buffers.

    No tokens, requests, blocks or pages (offsets ``[0]``), packed strides,
    layer 0 and zero maxima; device operands on ``device``, host operands
    on the CPU. Every value is written when this returns
    (:func:`mla_kpool.buffers.zeros`): a model run at once reads layer 0,
    not the stale bytes of an unfinished fill.
    """
    cpu = driver.CPU()
    idle = []
    for t in key.input_types():
        shape = [
            int(d) if str(d).isdigit() else _IDLE_SIZES.get(str(d), 0)
            for d in t.shape
        ]
        where = cpu if t.device == DeviceRef.CPU() else device
        idle.append(zeros(shape, t.dtype, where))
    for i in _STRIDES:
        idle[i] = to_buffer(np.array([-1], np.int64), cpu)
    return idle


def _gpu_op(key: IndexKey, values: list[Any]) -> Any:
    from max.nn.kv_cache import PagedCacheValues

    from .indexer import index_top_k

    q, qs, offsets, blocks, stride, lengths, table, mp, mc = values[:9]
    scales, sstride, stable, layer = values[9:]
    cache = PagedCacheValues(
        kv_blocks=blocks,
        cache_lengths=lengths,
        lookup_table=table,
        max_prompt_length=mp,
        max_cache_length=mc,
        page_stride=stride,
        kv_scales=scales,
        scales_page_stride=sstride,
        scales_lookup_table=stable,
    )
    # The wrapper takes the mask's name as MAX's variant (mask_name).
    return index_top_k(
        q, qs, offsets, cache, layer, key.top_k,
        key.quantization_granularity, key.mask, key.kpool,
    )  # fmt: skip


def bind_arena(
    flat: np.ndarray,
    offset: int,
    count: int,
    block_shape: tuple[int, ...],
    dtype: DType,
    device: driver.Device,
) -> tuple[Buffer, Buffer]:
    """A ``[count, *block_shape]`` view of ``flat`` from ``offset``, as MAX.

    Args:
        flat: The whole flat arena (uint8 bytes or float32), guards included.
        offset: Elements before block 0 (a test's leading guard).
        count: Blocks (``shape[0]`` of the view).
        block_shape: One block's shape.
        dtype: The view's dtype (``float8_e4m3fn`` on a GPU).
        device: Where the arena goes.

    Returns:
        ``(view, whole)``: the bound view and the whole flat buffer (read it
        back to check guards).
    """
    whole = to_buffer(np.ascontiguousarray(flat), device)
    if dtype != whole.dtype:
        whole = whole.view(dtype, shape=(flat.size,))
    packed = math.prod(block_shape)
    prefix = whole[offset : offset + count * packed]
    return prefix.view(dtype=dtype, shape=(count, *block_shape)), whole


def _u32(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.uint32)


@renamed_keyword("qs", "q_s")
def prepare(
    runner: Any,
    q: np.ndarray,
    q_s: np.ndarray,
    input_row_offsets: np.ndarray,
    cache: PagedIndexCache,
    layer_idx: int,
    *,
    top_k: int,
    kpool: int,
    mask: str = "causal",
    quantization_granularity: int = 128,
    k_max_prompt_length: int | None = None,
    k_max_cache_length: int | None = None,
    key_arena: tuple[np.ndarray, int] | None = None,
    scale_arena: tuple[np.ndarray, int] | None = None,
    gpu_op: str = "auto",
    scorer: str = "auto",
    check: bool = False,
) -> tuple[Any, list[Buffer], tuple[Buffer, Buffer]]:
    """The compiled model and device operands of one call.

    Args:
        runner: A :class:`mla_kpool.runner.Runner` (any device).
        q: ``[T, H, D]`` uint8 e4m3fn bytes (or ``float8_e4m3fn``, viewed
            as its bytes).
        q_s: ``[T, H]`` float32 (``qs=``, its former keyword, still works
            for a release, with a ``DeprecationWarning``).
        input_row_offsets: ``[B + 1]`` (sent as uint32).
        cache: The paged cache (arenas, tables, lengths, strides).
        layer_idx: The layer to read.
        top_k: Ids per row.
        kpool: Tokens per key.
        mask: ``"causal"`` or ``"null"``, or MAX's
            ``MHAMaskVariant.CAUSAL_MASK`` / ``NULL_MASK``.
        quantization_granularity: MAX's parameter.
        k_max_prompt_length: Default: the largest new-token count.
        k_max_cache_length: Default: the largest ``c + n``, at most
            2^32 - 1.
        key_arena: ``(flat, offset)`` to bind in place of ``cache.arena``
            (a guarded copy); ``scale_arena`` likewise.
        scale_arena: See ``key_arena``.
        gpu_op: ``"auto"`` or ``"ours"`` (:class:`IndexKey`); only a
            ``"gpu"`` runner reads it.
        scorer: The GPU path's scorer (:class:`IndexKey`); the CPU
            runner takes only ``"auto"`` and ``"simt"``.
        check: Also check the metadata's values
            (:func:`mla_kpool.check_index_metadata`: offsets, cache
            lengths against the mapped pages, table entries), after the
            arguments and before anything is compiled or copied.

    Returns:
        ``(model, operands, (key_buffer, scale_buffer))``, the last two the
        whole flat arenas as bound.

    Raises:
        TypeError: For a ``cache`` that is not a ``PagedIndexCache``, a
            ``layer_idx``, ``top_k`` or ``kpool`` that is not an int, or
            both ``q_s`` and ``qs``.
        ValueError: For a ``gpu_op`` other than ``"auto"`` or ``"ours"`` (on
            every runner), a ``scorer`` this runner cannot run, a ``q``
            that is not ``[T, H, D]`` uint8 or float8_e4m3fn, a ``q_s``
            that is not float32 ``[T, H]`` with ``q``'s ``T`` and ``H``,
            ``input_row_offsets`` of a non-integer dtype or not rank 1
            ``[B + 1]`` (``B`` the cache's batch), a ``layer_idx`` outside
            uint32 or not below the cache's ``num_layers``, ``top_k``
            outside 1..2048, ``kpool < 1``, another mask, and from the graph
            checks; with ``check``, bad metadata values. All before
            anything is compiled or copied.
    """
    gpu = runner.device_name == "gpu"
    emulated = runner.device_name == "gpu-emulated"
    _validate_gpu_op(gpu_op)
    scorer = check_scorer(
        scorer,
        DeviceRef.GPU() if gpu else DeviceRef.CPU(),
        emulated,
        np.shape(q)[-1] if np.ndim(q) == 3 else None,
    )
    _validate_cache(cache)
    q = _fp8_bytes(q)
    q_s = _validate_q_s(q_s, q)
    input_row_offsets = _offsets(input_row_offsets, len(cache.cache_lengths))
    layer_idx = _validate_layer_idx(layer_idx, cache)
    top_k = check_int("top_k", top_k, 1, MAX_TOP_K)
    kpool = _validate_kpool(kpool, cache)
    mask = mask_name(mask)
    key = IndexKey(
        num_heads=int(q.shape[1]),
        depth=int(q.shape[2]),
        width=cache.width,
        num_layers=cache.num_layers,
        page_size=cache.page_size,
        top_k=int(top_k),
        kpool=int(kpool),
        mask=mask,
        quantization_granularity=int(quantization_granularity),
        gpu=gpu,
        emulate_gpu=emulated,
        gpu_op=gpu_op if gpu else "auto",
        scorer=scorer,
    )
    if check:
        check_index_metadata(
            input_row_offsets, cache, layer_idx, total_tokens=q.shape[0]
        )
    maxima = _maxima(
        input_row_offsets, cache, k_max_prompt_length, k_max_cache_length
    )
    args, arenas = _device_operands(
        runner, q, q_s, input_row_offsets, cache, layer_idx, maxima,
        key_arena, scale_arena,
    )  # fmt: skip
    return runner.index_model(key), args, arenas


def _validate_gpu_op(gpu_op: object) -> None:
    """Raises ``ValueError`` unless ``gpu_op`` is ``"auto"`` or ``"ours"``."""
    if gpu_op not in ("auto", "ours"):
        raise ValueError(f"gpu_op must be 'auto' or 'ours', got {gpu_op!r}")


def _validate_cache(cache: object) -> None:
    """Raises ``TypeError`` unless ``cache`` is a :class:`PagedIndexCache`."""
    if not isinstance(cache, PagedIndexCache):
        raise TypeError(
            "cache must be a mla_kpool.index_cache.PagedIndexCache, got"
            f" {type(cache).__name__}"
        )


def _validate_q_s(q_s: Any, q: np.ndarray) -> np.ndarray:
    """``q_s`` as float32 ``[T, H]`` with ``q``'s ``T`` and ``H``.

    Raises:
        ValueError: For an array of another dtype or shape.
    """
    q_s = _float32("q_s", q_s)
    if q_s.shape != q.shape[:2]:
        # Checked here: the graph would only say that a symbolic dim of
        # input 1 does not match, naming neither operand.
        raise ValueError(
            f"q_s must be [T, num_heads] = {list(q.shape[:2])} to match q"
            f" {list(q.shape)}, got {list(q_s.shape)}"
        )
    return q_s


def _validate_layer_idx(layer_idx: Any, cache: PagedIndexCache) -> int:
    """``layer_idx`` as an int in uint32, below the cache's layer count.

    Raises:
        TypeError: If it is not an int.
        ValueError: If it is out of range.
    """
    layer_idx = check_int("layer_idx", layer_idx, 0, 2**32 - 1)
    if layer_idx >= cache.num_layers:
        # The op raises too, but only once the graph runs, after a compile.
        raise ValueError(
            f"layer_idx must be below the cache's {cache.num_layers} layers,"
            f" got {layer_idx}"
        )
    return layer_idx


def _validate_kpool(kpool: Any, cache: PagedIndexCache) -> int:
    """``kpool`` as an int, the cache's own.

    Raises:
        TypeError: If it is not an int.
        ValueError: If it is below 1 or not the cache's.
    """
    kpool = check_int("kpool", kpool, 1)
    if kpool != cache.kpool:
        # The op sees only the rows, and would name their width.
        raise ValueError(
            f"kpool must be the cache's kpool={cache.kpool} (its"
            f" {cache.layout} rows of W={cache.width}), got {kpool}"
        )
    return kpool


def _maxima(
    input_row_offsets: np.ndarray,
    cache: PagedIndexCache,
    k_max_prompt_length: int | None,
    k_max_cache_length: int | None,
) -> tuple[int, int]:
    """``(k_max_prompt_length, k_max_cache_length)``, defaults filled in.

    The maxima are uint32 operands: a length near 2^32 saturates them (the
    op gives that request -1 rows; the maxima only size scratch).

    Raises:
        TypeError: For a given maximum that is not an int.
        ValueError: For one outside uint32.
    """
    offsets = np.asarray(input_row_offsets).astype(np.int64)
    lengths = cache.cache_lengths.astype(np.int64)
    new = np.diff(offsets) if len(offsets) > 1 else np.zeros(0, np.int64)
    if k_max_prompt_length is None:
        k_max_prompt_length = int(np.clip(new, 0, None).max(initial=0))
    if k_max_cache_length is None:
        total = lengths + np.clip(new, 0, None)
        k_max_cache_length = min(int(total.max(initial=0)), 2**32 - 1)
    return (
        check_int("k_max_prompt_length", k_max_prompt_length, 0, 2**32 - 1),
        check_int("k_max_cache_length", k_max_cache_length, 0, 2**32 - 1),
    )


def _device_operands(
    runner: Any,
    q: np.ndarray,
    q_s: np.ndarray,
    input_row_offsets: np.ndarray,
    cache: PagedIndexCache,
    layer_idx: int,
    maxima: tuple[int, int],
    key_arena: tuple[np.ndarray, int] | None,
    scale_arena: tuple[np.ndarray, int] | None,
) -> tuple[list[Buffer], tuple[Buffer, Buffer]]:
    """The 13 operands on ``runner``'s device, in the op's order.

    Returns:
        ``(operands, (key_buffer, scale_buffer))``, the last two the whole
        flat arenas as bound (:func:`bind_arena`).
    """
    gpu = runner.device_name == "gpu"
    fp8 = DType.float8_e4m3fn if gpu else DType.uint8
    dev, cpu = runner.device, driver.CPU()
    keys, key_whole = bind_arena(
        *(key_arena or (cache.arena, 0)),
        cache.num_blocks,
        cache.block_shape,
        fp8,
        dev,
    )
    scales, scale_whole = bind_arena(
        *(scale_arena or (cache.scale_arena, 0)),
        cache.num_scale_blocks,
        cache.scale_shape,
        DType.float32,
        dev,
    )
    q_buf = to_buffer(q, dev)
    if gpu:
        q_buf = q_buf.view(fp8, shape=q.shape)
    args = [
        q_buf,
        to_buffer(np.asarray(q_s, np.float32), dev),
        to_buffer(_u32(input_row_offsets), dev),
        keys,
        to_buffer(np.array([cache.page_stride], np.int64), cpu),
        to_buffer(_u32(cache.cache_lengths), dev),
        to_buffer(_u32(cache.lookup_table), dev),
        to_buffer(_u32([maxima[0]]), cpu),
        to_buffer(_u32([maxima[1]]), cpu),
        scales,
        to_buffer(np.array([cache.scales_page_stride], np.int64), cpu),
        to_buffer(_u32(cache.scales_lookup_table), dev),
        to_buffer(_u32(layer_idx), cpu),
    ]
    return args, (key_whole, scale_whole)


def _fp8_bytes(q: Any) -> np.ndarray:
    """``q`` as ``[T, H, D]`` uint8 e4m3fn bytes (float8_e4m3fn viewed).

    Raises:
        ValueError: For another dtype (values are never converted) or a
            rank other than 3.
    """
    q = np.asarray(q)
    if q.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
        q = q.view(np.uint8)
    if q.dtype != np.uint8:
        raise ValueError(
            "q must be uint8 e4m3fn bytes or ml_dtypes.float8_e4m3fn, got"
            f" {q.dtype}"
        )
    if q.ndim != 3:
        raise ValueError(f"q must be rank 3 [T, H, D], got shape {q.shape}")
    return q


def _float32(name: str, values: Any) -> np.ndarray:
    """``values`` as float32: a list is converted, an array must be float32.

    Raises:
        ValueError: For an array of another dtype (never converted).
    """
    if not isinstance(values, np.ndarray):
        return np.asarray(values, np.float32)
    if values.dtype != np.float32:
        raise ValueError(f"{name} dtype must be float32, got {values.dtype}")
    return values


def _offsets(values: Any, batch: int) -> np.ndarray:
    """``input_row_offsets`` checked to be rank 1 ``[batch + 1]`` integers.

    A list becomes int64 (its values are the op's contract, checked by
    :func:`mla_kpool.check_index_metadata`, not here).

    Raises:
        ValueError: For a non-integer dtype, another rank or length.
    """
    arr = np.asarray(values)
    if not isinstance(values, np.ndarray) and arr.size == 0:
        arr = arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"input_row_offsets must have an integer dtype, got {arr.dtype}"
        )
    if arr.ndim != 1 or len(arr) != batch + 1:
        raise ValueError(
            f"input_row_offsets must be rank 1 [B + 1] = [{batch + 1}] (B from"
            f" cache.cache_lengths), got shape {list(arr.shape)}"
        )
    return arr
