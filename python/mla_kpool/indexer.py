"""The pooled indexer on any device: :func:`index_top_k`.

MAX 26.7's ``max.nn.kernels.mla_fp8_index_top_k`` runs only on a GPU, and
with ``kpool > 1`` only on the SM100 and gfx950 scorers. This wrapper has its
signature. On the CPU it adds this package's ``mla_kpool.index_top_k`` op
(``q`` and the key blocks as ``uint8`` e4m3fn bytes, since MAX has no FP8
tensors on the CPU); on a GPU it adds MAX's builtin op, byte for byte, after
the same checks where MAX scores the shape (:func:`max_scores`), and this
package's op (its GPU path) elsewhere. The contract is in docs/ops.md
("index_top_k").

Importing this module imports ``max.nn`` (``MHAMaskVariant`` is the default
argument), which takes several seconds; ``mla_kpool.index_top_k`` imports it
on first use only.
"""

from __future__ import annotations

from max.graph import TensorValue
from max.nn.attention.mask_config import MHAMaskVariant
from max.nn.kv_cache import PagedCacheValues

from ._index_op import accelerator_arch, add_op, check_operands
from ._validate import mask_name

#: MAX's variant of each mask the op takes.
_VARIANT = {
    "causal": MHAMaskVariant.CAUSAL_MASK,
    "null": MHAMaskVariant.NULL_MASK,
}

#: The cache fields the op reads, in its operand order after the offsets.
_FIELDS = (
    "kv_blocks",
    "page_stride",
    "cache_lengths",
    "lookup_table",
    "max_prompt_length",
    "max_cache_length",
    "kv_scales",
    "scales_page_stride",
    "scales_lookup_table",
)


def _cache_fields(k_collection: object) -> list[object]:
    missing = [f for f in _FIELDS if not hasattr(k_collection, f)]
    if missing:
        raise TypeError(
            "k_collection must be a max.nn.kv_cache.PagedCacheValues, got"
            f" {type(k_collection).__name__} (no {', '.join(missing)})"
        )
    for field in ("kv_blocks_per_layer", "kv_scales_per_layer"):
        if getattr(k_collection, field, None):
            raise ValueError(
                f"k_collection.{field} must be None: the indexer reads one"
                " multi-layer buffer"
            )
    return [getattr(k_collection, f) for f in _FIELDS]


def max_scores(kpool: int) -> bool:
    """Whether MAX 26.7's own GPU indexer scores ``kpool`` on this GPU.

    It scores ``kpool == 1`` on every GPU it supports, and pooled keys
    (``kpool > 1``) only with its Blackwell (``sm_10x``) and MI355
    (``gfx950``) tensor-core scorers; elsewhere its op fails to compile.
    Read from ``max.driver.accelerator_architecture_name()``, as
    ``max.nn.kernels`` picks its own paths (in virtual-device mode, the
    virtual target). Where no accelerator answers (a GPU graph built on a
    machine without one), pooled keys get this package's op, which
    compiles for every GPU.
    """
    if kpool == 1:
        return True
    arch = accelerator_arch()
    if arch is None:
        return False
    return arch.startswith("sm_10") or arch.startswith("gfx950")


def index_top_k(
    q: TensorValue,
    q_s: TensorValue,
    input_row_offsets: TensorValue,
    k_collection: PagedCacheValues,
    layer_idx: TensorValue,
    top_k: int,
    quantization_granularity: int,
    mask_variant: MHAMaskVariant = MHAMaskVariant.CAUSAL_MASK,
    kpool: int = 1,
    *,
    scorer: str = "auto",
    emulate_gpu: bool = False,
) -> TensorValue:
    """Top-k pooled key ids per query token, scored on the paged FP8 cache.

    For token ``t`` of request ``b`` (``c = cache_lengths[b]`` cached tokens,
    ``n`` new ones, ``i = t - input_row_offsets[b]``), candidate ``j`` in
    ``[0, bound)``, ``bound = (c + n - (n - 1 - i) * causal) // kpool``,
    scores ``k_scale[j] * sum_h max(q[t, h] . k[j], 0) * q_s[t, h]``. Row
    ``t`` holds the ``min(top_k, bound)`` best ids by descending score (ties
    by ascending id in this package's op; MAX's promises only the set), then
    ``-1``. Bad runtime metadata gives ``-1`` rows, never a bad read.

    Args:
        q: Queries ``[T, num_heads, depth]``: uint8 e4m3fn bytes on the CPU,
            float8_e4m3fn on a GPU; ``num_heads`` and ``depth`` static.
        q_s: Per (token, head) weights ``[T, num_heads]`` float32, signed.
        input_row_offsets: ``[B + 1]`` uint32 token row offsets.
        k_collection: The indexer's paged key cache, with ``kv_scales``:
            ``kv_blocks`` ``[num_blocks, 1, num_layers, page_size, 1, W]``
            (dtype of ``q``), ``kv_scales`` ``[num_blocks', 1, num_layers,
            page_size, 1, 1]`` float32, uint32 ``cache_lengths`` ``[B]`` and
            lookup tables ``[B, max_pages]``, int64 ``[1]`` page strides and
            uint32 maxima on the CPU. ``W`` is ``depth / kpool`` (a pooled key
            spread over ``kpool`` rows, GLM-5-Next's) or ``depth`` (one row).
        layer_idx: uint32 scalar on the CPU, the layer to read.
        top_k: Ids per token row, 1..2048.
        quantization_granularity: Passed to the op (MAX's parameter); the
            scales are per row, so it does not change the result.
        mask_variant: ``CAUSAL_MASK`` (token ``i`` sees the cache and the new
            tokens up to itself) or ``NULL_MASK`` (every new token); the
            strings ``"causal"`` and ``"null"`` are taken too.
        kpool: Tokens per cached key; ids are pool ids when ``> 1``.
        scorer: How this package's GPU path scores (keyword only, not in
            MAX's signature): ``"auto"`` (its tensor-core scorer where it
            has one for the GPU: ``wgmma`` on sm_90, ``mfma`` on gfx942;
            else FP32 FMAs), ``"simt"`` (FP32 FMAs), ``"wgmma"`` (sm_90
            only) or ``"mfma"`` (gfx942 only). With ``"auto"``, a shape
            MAX's op scores (``kpool == 1``, or pooled keys on sm_10x and
            gfx950) runs MAX's op; any other value runs this package's op
            even there. docs/ops.md gives each scorer's error bound.
        emulate_gpu: Testing aid (keyword only, as the writers'): run this
            package's GPU path on the CPU, every block and thread of its
            grid emulated on the host, so a tensor ``scorer`` can be
            checked without its GPU. ``q`` must be on the CPU.

    Returns:
        int32 ``[T, top_k]`` ids, ``-1`` after each row's valid ones.

    Raises:
        TypeError: If an operand is not a graph value of the right kind,
            ``k_collection`` is not a ``PagedCacheValues``, or ``top_k`` /
            ``kpool`` / ``quantization_granularity`` is not an int, or
            ``scorer`` is not a str.
        ValueError: On a wrong dtype, rank, static dim or device, ``top_k``
            outside 1..2048, ``kpool < 1``, a mask other than NULL/CAUSAL, a
            row width that is neither layout, a spread page size not a
            multiple of ``kpool``, missing ``kv_scales`` or per-layer buffers,
            a ``scorer`` that is unknown or cannot run on the device, or
            ``emulate_gpu`` with ``q`` off the CPU.
    """
    mask = mask_name(mask_variant, "mask_variant")
    operands = check_operands(
        q,
        q_s,
        input_row_offsets,
        *_cache_fields(k_collection),
        layer_idx,
        top_k=top_k,
        quantization_granularity=quantization_granularity,
        mask_str=mask,
        kpool=kpool,
    )
    if (
        operands.device.is_cpu()
        or emulate_gpu
        or scorer != "auto"
        or not max_scores(kpool)
    ):
        return add_op(operands, emulate_gpu=emulate_gpu, scorer=scorer)
    # MAX's own op where it scores this shape: nobody gets slower.
    from max.nn.kernels import mla_fp8_index_top_k

    return mla_fp8_index_top_k(
        q,
        q_s,
        input_row_offsets,
        k_collection,
        layer_idx,
        top_k,
        quantization_granularity,
        _VARIANT[mask],
        kpool,
    )
