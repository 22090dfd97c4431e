"""The indexer half of every call: cache the pools, score, check the pick.

After a call's step, :class:`IndexCache` stores the pools the call
completed (each request's rows from ``Runner.step``, quantized by
:func:`mla_kpool.index_cache.quantize_pooled_keys`) into a paged FP8 cache
laid out as MAX's indexer reads it
(:class:`mla_kpool.index_cache.PagedIndexCache`: GLM-5-Next's spread rows
when ``head_dim`` splits into ``kpool`` rows, else one row per pool). Then
every query token of the call (:func:`make_queries`) is scored with
``mla_kpool.index_top_k``
(:func:`mla_kpool.demo.checked_run.index_and_expand`) on the step's device
(:func:`index_scorer`: the CPU kernel on ``cpu``; on ``gpu`` MAX's
builtin where it scores the shape, else the op's GPU path; on
``gpu-emulated`` the op's GPU path over the emulated grid) and
:func:`check_call` checks the call's rows against the float64 oracle
(:func:`mla_kpool.reference.check_selection`: valid ids first, none past the
row's bound, and the selected *set* the top ``k`` within the float32
tolerance at the k-th score).

The cache is shaped to catch a kernel reading the wrong place: two layers
(the indexer reads layer 1; layer 0 holds random bytes), blocks handed out
in a shuffled order and freed (stale) when a request finishes, key and scale
blocks mapped by separate lookup tables, lookup entries past a request's
pages pointing at random blocks, and rows of pools not yet complete holding
whatever was there (random bytes, NaN scales among them).

Pools of a cached prefix (a prefix-cache hit: the workload never sends
those tokens) are stored from the oracle on admission, as an engine's
prefix cache would hold them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .. import reference
from ..calls import PoolRow
from ..index_cache import PagedIndexCache
from ..index_runner import IndexKey
from .scheduling import Entry, Plan

__all__ = [
    "INDEX_HEADS",
    "INDEX_LAYER",
    "INDEX_LAYERS",
    "INDEX_PAGE_SIZE",
    "IndexCache",
    "INDEX_MASKS",
    "IndexCheck",
    "check_call",
    "index_key",
    "index_scorer",
    "index_width",
    "make_queries",
]


#: Query heads ``H`` of the indexer (GLM-5-Next's 32).
INDEX_HEADS = 32

#: Rows per page of the key cache (GLM-5-Next's 128).
INDEX_PAGE_SIZE = 128

#: Layers of the cache, and the one the indexer reads (the other holds
#: random bytes, so a wrong layer stride shows).
INDEX_LAYERS = 2
INDEX_LAYER = 1

#: Masks ``--index-mask`` takes; GLM-5-Next's pipeline calls with null.
INDEX_MASKS = ("null", "causal")


def index_width(kpool: int, head_dim: int, page_size: int) -> int:
    """Row width ``W``: ``head_dim // kpool`` (spread) where it can be.

    GLM-5-Next spreads a pooled key over ``kpool`` rows; that needs
    ``kpool > 1`` dividing both ``head_dim`` and the page size. Otherwise
    each pool is one row of ``head_dim`` values (the whole layout).
    """
    if kpool > 1 and head_dim % kpool == 0 and page_size % kpool == 0:
        return head_dim // kpool
    return head_dim


def index_layout(kpool: int, head_dim: int, page_size: int) -> tuple[str, str]:
    """The key cache layout :func:`index_width` picks, and why not spread.

    Returns:
        ``("spread", "")``, ``("whole", "")`` for ``kpool == 1``, or
        ``("whole", reason)`` where a pooled key cannot spread, the reason
        such as ``"head_dim 7 is not a multiple of kpool 4"``.
    """
    if kpool == 1:
        return "whole", ""
    if index_width(kpool, head_dim, page_size) != head_dim:
        return "spread", ""
    off = [
        f"{name} {value} is not a multiple of kpool {kpool}"
        for name, value in (("head_dim", head_dim), ("page size", page_size))
        if value % kpool
    ]
    return "whole", " and ".join(off)


def index_key(
    kpool: int, head_dim: int, top_k: int, mask: str, device: str = "cpu"
) -> IndexKey:
    """The compiled indexer the demo runs, for ``Runner.index_model``.

    Args:
        kpool: Tokens per pool.
        head_dim: Channels per pooled key (the query depth).
        top_k: Ids per row.
        mask: ``"null"`` or ``"causal"``.
        device: The runner's device: ``"gpu"`` builds the GPU graph (MAX's
            op or this package's, :func:`index_scorer`), ``"gpu-emulated"``
            a CPU graph running the op's GPU path over the emulated grid,
            ``"cpu"`` the CPU kernel's. The key is the one
            ``Runner.index_top_k`` builds on that device, so a model
            compiled ahead is the one the calls use.
    """
    return IndexKey(
        num_heads=INDEX_HEADS,
        depth=head_dim,
        width=index_width(kpool, head_dim, INDEX_PAGE_SIZE),
        num_layers=INDEX_LAYERS,
        page_size=INDEX_PAGE_SIZE,
        top_k=top_k,
        kpool=kpool,
        mask=mask,
        gpu=device == "gpu",
        emulate_gpu=device == "gpu-emulated",
    )


def index_scorer(device: str, kpool: int) -> dict[str, str]:
    """Which index_top_k scores the demo's queries on ``device``.

    Args:
        device: ``"cpu"``, ``"gpu"`` or ``"gpu-emulated"``.
        kpool: Tokens per pool (MAX's GPU op scores pooled keys only on
            some GPUs).

    Returns:
        ``{"op", "path", "grid"}``: ``op`` is ``"mla_kpool"`` (this
        package's op) or ``"max"`` (MAX's builtin, which
        :func:`mla_kpool.index_top_k` picks on a GPU where MAX scores the
        shape); ``path`` the op's code path, ``"cpu"`` or ``"gpu"``;
        ``grid`` where a GPU path's blocks run, ``"device"`` or
        ``"emulated"`` (on the host, thread by thread), ``"-"`` on the CPU
        path.
    """
    if device == "cpu":
        return {"op": "mla_kpool", "path": "cpu", "grid": "-"}
    if device == "gpu-emulated":
        return {"op": "mla_kpool", "path": "gpu", "grid": "emulated"}
    from ..indexer import max_scores  # imports max.nn: only on a GPU

    op = "max" if max_scores(kpool) else "mla_kpool"
    return {"op": op, "path": "gpu", "grid": "device"}


def make_queries(
    seed: int, call: int, tokens: int, head_dim: int
) -> tuple[np.ndarray, np.ndarray]:
    """One call's indexer queries, seeded by the call.

    Returns:
        ``(q, qs)``: ``[tokens, H, head_dim]`` uint8 e4m3fn bytes of
        standard normals, and ``[tokens, H]`` float32 signed head weights.
    """
    rng = np.random.default_rng([seed, 5, call])
    q = rng.standard_normal((tokens, INDEX_HEADS, head_dim), np.float32)
    qs = rng.standard_normal((tokens, INDEX_HEADS), np.float32)
    return q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), qs


class IndexCache:
    """The demo's paged key cache across calls.

    Each request gets its pages' key blocks and scale blocks when it is
    admitted (enough for every pool it will have, plus one), from shuffled
    free lists, and gives them back when it finishes; the blocks keep their
    bytes. :meth:`bind` points the cache's lookup tables and lengths at one
    call's batch.

    Args:
        plan_: The run (sizes the arena: the most pages a request needs,
            times the ring slots).
        kpool: Tokens per pool.
        head_dim: Channels per pooled key.
        seed: Seeds the block order and the arena's initial bytes.
    """

    def __init__(
        self, plan_: Plan, kpool: int, head_dim: int, seed: int
    ) -> None:
        self.kpool = kpool
        self.rng = np.random.default_rng([seed, 6])
        width = index_width(kpool, head_dim, INDEX_PAGE_SIZE)
        self.rows_per_pool = head_dim // width
        self.max_pages = max(
            self.pages(r.end // kpool + 1) for r in plan_.requests
        )
        blocks = plan_.max_slots * self.max_pages
        self.cache = PagedIndexCache(
            num_blocks=blocks,
            num_layers=INDEX_LAYERS,
            page_size=INDEX_PAGE_SIZE,
            head_dim=head_dim,
            kpool=kpool,
            width=width,
            max_pages=self.max_pages,
        )
        self.cache.arena[:] = self.rng.integers(0, 256, self.cache.arena.size)
        scales = self.rng.standard_normal(self.cache.scale_arena.size)
        scales[self.rng.random(scales.size) < 0.01] = np.nan
        self.cache.scale_arena[:] = scales.astype(np.float32)
        self.free_keys = list(self.rng.permutation(blocks))
        self.free_scales = list(self.rng.permutation(blocks))
        #: request -> (key blocks, scale blocks), one per page
        self.held: dict[int, tuple[list[int], list[int]]] = {}

    def pages(self, pools: int) -> int:
        """Pages that ``pools`` pools occupy."""
        return -(-pools * self.rows_per_pool // INDEX_PAGE_SIZE)

    def admit(self, request: int, pools: int) -> None:
        """Gives ``request`` blocks for ``pools`` pools."""
        count = self.pages(pools)
        self.held[request] = (self.free_keys[:count], self.free_scales[:count])
        del self.free_keys[:count], self.free_scales[:count]

    def release(self, request: int) -> None:
        """Returns ``request``'s blocks to the free lists, bytes kept."""
        keys, scales = self.held.pop(request)
        self.free_keys += keys
        self.free_scales += scales

    def bind(self, call: Sequence[Entry]) -> None:
        """Points the lookup tables and lengths at ``call``'s batch.

        Row ``b`` is the call's ``b``-th entry; columns past a request's
        pages get random blocks of the arena (what a stale table holds).
        """
        shape = (len(call), self.max_pages)
        blocks = self.cache.num_blocks
        keys = self.rng.integers(0, blocks, shape).astype(np.uint32)
        scales = self.rng.integers(0, blocks, shape).astype(np.uint32)
        for b, e in enumerate(call):
            mine_k, mine_s = self.held[e.request]
            keys[b, : len(mine_k)] = mine_k
            scales[b, : len(mine_s)] = mine_s
        self.cache.lookup_table = keys
        self.cache.scales_lookup_table = scales
        self.cache.cache_lengths = np.array(
            [e.cache_length for e in call], dtype=np.uint32
        )

    def store(self, b: int, first_pool: int, keys: np.ndarray) -> None:
        """Quantizes and stores entry ``b``'s pools from ``first_pool``."""
        self.cache.store_keys(
            b, INDEX_LAYER, first_pool, keys.astype(np.float32)
        )

    def store_pools(self, b: int, pools: Mapping[int, PoolRow]) -> None:
        """Stores one call's pools of entry ``b`` (contiguous runs at once)."""
        ids = sorted(pools)
        for run in np.split(ids, np.flatnonzero(np.diff(ids) != 1) + 1):
            if len(run):
                self.store(
                    b, int(run[0]), np.stack([pools[p].key for p in run])
                )


@dataclass
class IndexCheck:
    """What checking one call's index_top_k rows found.

    Attributes:
        rows: Token rows checked.
        selections: Of those, rows with more candidates than ``top_k``
            (where the op had to choose).
        worst_margin: Smallest margin at the k-th score over the
            selections (``inf`` if none).
        problem: The first wrong row, or ``None``.
    """

    rows: int = 0
    selections: int = 0
    worst_margin: float = float("inf")
    problem: str | None = None


_ROW = re.compile(r"^row (\d+): ")
#: The oracle names a row's request by its batch entry; the demo's message
#: names the workload's request already.
_ENTRY = re.compile(r"request \d+ bound (\d+): ")


def check_call(
    c: int,
    call: Sequence[Entry],
    got: np.ndarray,
    q: np.ndarray,
    qs: np.ndarray,
    cache: PagedIndexCache,
    *,
    top_k: int,
    kpool: int,
    mask: str,
) -> IndexCheck:
    """Checks one call's index_top_k rows against the oracle.

    Args:
        c: The call's number (for messages).
        call: Its entries, in batch order (token rows follow them).
        got: int32 ``[tokens, top_k]`` from the op.
        q: ``[tokens, H, D]`` the queries the oracle scores.
        qs: ``[tokens, H]`` the head weights the oracle uses.
        cache: The cache bound to the call (:meth:`IndexCache.bind`),
            with the call's true lengths.
        top_k: Ids per row.
        kpool: Tokens per pool.
        mask: ``"null"`` or ``"causal"``.

    Returns:
        The counts and worst margin; on a wrong row (the oracle stops at
        the first) a problem line naming its request, slot, call, token row
        and query position.
    """
    counts = [e.tokens for e in call]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
    try:
        report = reference.check_selection(
            got,
            q,
            qs,
            offsets,
            **cache.oracle_operands(),
            layer_idx=INDEX_LAYER,
            top_k=top_k,
            kpool=kpool,
            mask=mask,
        )
    except AssertionError as err:
        text = str(err)
        found = _ROW.match(text)
        if found is None:
            return IndexCheck(problem=f"call {c}: index_top_k: {text}")
        row = int(found.group(1))
        b = int(np.searchsorted(offsets, row, side="right")) - 1
        e = call[min(b, len(call) - 1)]
        local = row - int(offsets[b])
        why = _ENTRY.sub(r"bound \1: ", text[found.end() :])
        return IndexCheck(
            rows=len(got),
            problem=(
                f"request {e.request} (slot {e.slot}): call {c}: index_top_k"
                f" row {row} (query position {e.cache_length + local}) "
                f"differs from the oracle: {why}"
            ),
        )
    return IndexCheck(report.rows, report.cut_rows, report.worst_margin)
