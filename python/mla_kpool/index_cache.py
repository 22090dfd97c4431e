"""The indexer's paged FP8 key cache on the host: quantize, store, bind.

The producer side of :func:`mla_kpool.index_top_k`, for tests, the demo and
the benchmark. Everything here is NumPy on the host, with ml_dtypes for the
FP8 rounding; MAX's serving path does the same on the device (its
``quantize_pooled_keys`` and ``store_k_cache_ragged``).

Layout (docs/ops.md, "index_top_k"): ``k_blocks[block, 0, layer, slot, 0,
:W]`` uint8 e4m3fn bytes and ``k_scales[block, 0, layer, slot, 0, 0]``
float32. Cache row ``r`` of request ``b`` sits on page ``r // page_size``,
slot ``r % page_size``, block ``lookup_table[b, page]`` (the scale on
``scales_lookup_table[b, page]``). A pooled key of ``D`` values is *spread*
over ``kpool`` rows of ``W = D / kpool`` values (pool ``p`` on rows ``kpool*p
.. kpool*p + kpool - 1``, its scale on each), or *whole* on one row of ``W =
D`` (pool ``p`` on row ``p``; ``kpool == 1`` is this layout).

A padded arena (``page_stride != -1``) puts block ``i`` at ``i *
page_stride`` elements of a flat array, as MAX's paged pools do when a page
is padded; the op is bound a packed-shape view of the arena's start and
reads past its end by the stride (:meth:`PagedIndexCache.bind`).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

#: Largest e4m3fn magnitude.
FP8_MAX = 448.0
#: Largest ``amax`` a scale follows; larger keys saturate.
AMAX_CLAMP = 1200.0


def quantize_pooled_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantizes pooled keys to e4m3fn, one float32 scale per key.

    ``scale = min(amax, 1200) / 448`` in float32 (``amax = max |key|``),
    values ``key / scale`` saturated to +-448 and rounded to nearest-even
    e4m3fn by ml_dtypes, on the host. A zero key gets scale 0 and zero
    bytes; a NaN value becomes a NaN byte (0x7F or 0xFF).

    Args:
        keys: ``[N, D]`` float32 (other float dtypes are converted).

    Returns:
        ``(bytes, scales)``: uint8 ``[N, D]`` e4m3fn bytes and float32 ``[N]``.

    Raises:
        ValueError: If ``keys`` is not rank 2.
    """
    x = np.asarray(keys, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"keys must be rank 2 [N, D], got shape {x.shape}")
    amax = np.max(np.abs(x), axis=1, initial=np.float32(0))
    scale = np.minimum(amax, np.float32(AMAX_CLAMP)) / np.float32(FP8_MAX)
    scale = scale.astype(np.float32)
    safe = np.where(scale == 0, np.float32(1), scale)
    values = np.where(scale[:, None] == 0, np.float32(0), x / safe[:, None])
    values = np.clip(values, -FP8_MAX, FP8_MAX).astype(np.float32)
    fp8 = values.astype(ml_dtypes.float8_e4m3fn)
    return fp8.view(np.uint8), scale


def _packed_view(flat: np.ndarray, count: int, stride: int, shape: tuple):
    """``[count, *shape]`` view of blocks ``stride`` elements apart."""
    packed = math.prod(shape)
    rows = flat[: count * stride].reshape(count, stride)[:, :packed]
    view = rows.reshape(count, *shape)
    assert np.shares_memory(view, flat)
    return view


class PagedIndexCache:
    """A host-side paged FP8 key cache, the operands of ``index_top_k``.

    Mirrors ``max.nn.kv_cache.PagedCacheValues``: ``arena`` (the
    ``kv_blocks`` bytes), ``scale_arena`` (``kv_scales``), ``lookup_table``,
    ``scales_lookup_table``, ``cache_lengths``, ``page_stride`` and
    ``scales_page_stride`` are plain NumPy attributes a test may edit.

    Args:
        num_blocks: Key blocks in the arena.
        num_layers: Layers per block.
        page_size: Rows per page.
        head_dim: ``D``, values per pooled key.
        kpool: Tokens per pooled key.
        width: Row width ``W``: ``head_dim // kpool`` (spread, the default
            when ``kpool > 1``) or ``head_dim`` (whole).
        batch: Requests.
        max_pages: Columns of the lookup tables.
        page_stride: Elements from one key block to the next; -1 (packed)
            or at least one block's ``num_layers * page_size * W``.
        num_scale_blocks: Scale blocks (default ``num_blocks``).
        scales_page_stride: As ``page_stride``, for the scale arena.
        fill: Initial arena byte (0x7F fills with FP8 NaN).
        scale_fill: Initial scale value.

    Raises:
        ValueError: On a width that is neither layout, a spread layout whose
            ``page_size`` is not a multiple of ``kpool``, or a stride smaller
            than one block.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        num_layers: int,
        page_size: int,
        head_dim: int,
        kpool: int = 1,
        width: int | None = None,
        batch: int = 1,
        max_pages: int = 1,
        page_stride: int = -1,
        num_scale_blocks: int | None = None,
        scales_page_stride: int = -1,
        fill: int = 0,
        scale_fill: float = 0.0,
    ) -> None:
        if width is None:
            width = head_dim // kpool if kpool > 1 else head_dim
        spread = width != head_dim
        if spread and (kpool < 2 or width * kpool != head_dim):
            raise ValueError(
                f"width must be head_dim={head_dim} or head_dim/kpool, got"
                f" {width} (kpool={kpool})"
            )
        if spread and page_size % kpool:
            raise ValueError(
                f"page_size must be a multiple of kpool={kpool} for the"
                f" spread layout, got {page_size}"
            )
        self.num_layers, self.page_size = num_layers, page_size
        self.head_dim, self.kpool, self.width = head_dim, kpool, width
        self.spread = spread
        self.num_blocks = num_blocks
        self.num_scale_blocks = (
            num_blocks if num_scale_blocks is None else num_scale_blocks
        )
        self.block_shape = (1, num_layers, page_size, 1, width)
        self.scale_shape = (1, num_layers, page_size, 1, 1)
        self.page_stride = page_stride
        self.scales_page_stride = scales_page_stride
        key_stride = self._stride(page_stride, self.block_shape, "page_stride")
        scale_stride = self._stride(
            scales_page_stride, self.scale_shape, "scales_page_stride"
        )
        self.arena = np.full(num_blocks * key_stride, fill, dtype=np.uint8)
        self.scale_arena = np.full(
            self.num_scale_blocks * scale_stride, scale_fill, np.float32
        )
        self.lookup_table = np.zeros((batch, max_pages), dtype=np.uint32)
        self.scales_lookup_table = np.zeros((batch, max_pages), np.uint32)
        self.cache_lengths = np.zeros(batch, dtype=np.uint32)

    @staticmethod
    def _stride(stride: int, shape: tuple, name: str) -> int:
        packed = math.prod(shape)
        if stride == -1:
            return packed
        if stride < packed:
            raise ValueError(
                f"{name} must be -1 or at least one block ({packed}"
                f" elements), got {stride}"
            )
        return stride

    @property
    def layout(self) -> str:
        """``"spread"`` (``W = D / kpool``) or ``"whole"`` (``W = D``)."""
        return "spread" if self.spread else "whole"

    def blocks(self) -> np.ndarray:
        """The logical ``k_blocks`` ``[num_blocks, 1, L, P, 1, W]`` (a view)."""
        stride = self._stride(self.page_stride, self.block_shape, "")
        return _packed_view(
            self.arena, self.num_blocks, stride, self.block_shape
        )

    def scales(self) -> np.ndarray:
        """The logical ``k_scales`` ``[num_scale_blocks, 1, L, P, 1, 1]``."""
        stride = self._stride(self.scales_page_stride, self.scale_shape, "")
        return _packed_view(
            self.scale_arena, self.num_scale_blocks, stride, self.scale_shape
        )

    def map_pages(
        self, rng: np.random.Generator | None = None, separate: bool = False
    ) -> None:
        """Gives every (request, page) a distinct block, shuffled by ``rng``.

        With ``separate`` the scale table gets its own shuffle (of
        ``num_scale_blocks``); otherwise it copies the key table. Entries
        past the blocks available wrap around (tests overwrite them).
        """
        rng = rng or np.random.default_rng(0)
        cells = self.lookup_table.size
        keys = rng.permutation(max(cells, self.num_blocks)) % self.num_blocks
        self.lookup_table[...] = keys[:cells].reshape(self.lookup_table.shape)
        if separate:
            n = max(cells, self.num_scale_blocks)
            scales = rng.permutation(n) % self.num_scale_blocks
            self.scales_lookup_table[...] = scales[:cells].reshape(
                self.lookup_table.shape
            )
        else:
            self.scales_lookup_table[...] = self.lookup_table

    def _locate(
        self, b: int, rows: np.ndarray, table: np.ndarray, count: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Blocks and slots of request ``b``'s cache ``rows``, checked."""
        pages, slots = np.divmod(rows, self.page_size)
        if pages.size and pages.max() >= table.shape[1]:
            raise ValueError(
                f"request {b} row {rows.max()} is on page {pages.max()}, past"
                f" the lookup table's {table.shape[1]} pages"
            )
        blocks = table[b, pages].astype(np.int64)
        if blocks.size and blocks.max() >= count:
            raise ValueError(
                f"request {b} maps a page to block {blocks.max()}, past the"
                f" arena's {count}"
            )
        return blocks, slots

    def store(
        self,
        b: int,
        layer: int,
        first_pool: int,
        key_bytes: np.ndarray,
        scales: np.ndarray,
    ) -> None:
        """Writes request ``b``'s pools ``[first_pool, first_pool + N)``.

        Spread: each pool's ``kpool`` rows, ``W`` values each, the scale on
        every row; whole: one row per pool.

        Args:
            b: The request (row of the lookup tables).
            layer: The layer axis to write.
            first_pool: The first pool id written.
            key_bytes: ``[N, D]`` uint8 e4m3fn bytes
                (:func:`quantize_pooled_keys`).
            scales: ``[N]`` float32 scales.

        Raises:
            ValueError: On a shape mismatch, or a row whose page is past the
                lookup table or maps past the arena.
        """
        key_bytes = np.asarray(key_bytes, dtype=np.uint8)
        scales = np.asarray(scales, dtype=np.float32)
        if key_bytes.ndim != 2 or key_bytes.shape[1] != self.head_dim:
            raise ValueError(
                f"key_bytes must be [N, {self.head_dim}], got {key_bytes.shape}"
            )
        if scales.shape != key_bytes.shape[:1]:
            raise ValueError(f"scales must be [N], got {scales.shape}")
        per_pool = self.kpool if self.spread else 1
        count = key_bytes.shape[0]
        rows = first_pool * per_pool + np.arange(count * per_pool)
        blk, slot = self._locate(b, rows, self.lookup_table, self.num_blocks)
        sblk, _ = self._locate(
            b, rows, self.scales_lookup_table, self.num_scale_blocks
        )
        self.blocks()[blk, 0, layer, slot, 0, :] = key_bytes.reshape(
            count * per_pool, self.width
        )
        self.scales()[sblk, 0, layer, slot, 0, 0] = np.repeat(scales, per_pool)

    def store_keys(
        self, b: int, layer: int, first_pool: int, keys: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """:func:`quantize_pooled_keys` then :meth:`store`; returns both."""
        key_bytes, scales = quantize_pooled_keys(keys)
        self.store(b, layer, first_pool, key_bytes, scales)
        return key_bytes, scales

    def oracle_operands(self) -> dict[str, np.ndarray]:
        """The cache operands of ``mla_kpool.reference.index_top_k``."""
        return {
            "k_blocks": self.blocks(),
            "k_cache_lengths": self.cache_lengths,
            "k_lookup_table": self.lookup_table,
            "k_scales": self.scales(),
            "k_scales_lookup_table": self.scales_lookup_table,
        }
