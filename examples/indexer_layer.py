"""One k-pooled indexer layer inside a MAX graph, driven by a decode loop.

This is how a MAX pipeline uses the package: a ``max.nn.Module`` owns the
layer's weights (the key and gate projections, the key layer norm and the
within-pool position embedding ``ape``), and its ``__call__`` stages the
k-pool step (:func:`mla_kpool.kpool_step`: one fused op doing the work of
the three writers) into a larger graph whose inputs are the hidden states,
the per-layer tail ring (a graph *buffer*, because it persists and is
updated in place across calls) and the ragged batch metadata:
``input_row_offsets``, ``cache_lengths`` and ``slot_idx``.
The graph is built with ``custom_extensions=[mla_kpool.KERNELS]``, which is
what makes the ops run on CPU (MAX's own builtins are GPU-only).

The pools then feed the indexer's scorer. After each call the driver
stores the pools it completed into a paged FP8 key cache
(:class:`mla_kpool.index_cache.PagedIndexCache`, host-side: quantized with
:func:`mla_kpool.index_cache.quantize_pooled_keys`, spread over ``kpool`` rows
of ``head_dim / kpool`` values as GLM-5-Next lays them out), and a second
graph scores every query token of the call against it with
:func:`mla_kpool.index_top_k` (MAX's ``mla_fp8_index_top_k`` signature: the
cache goes in as a ``max.nn.kv_cache.PagedCacheValues``), keeping each
token's top ``TOP_K`` pool ids. The queries are a projection of the same
hidden states, rounded to e4m3fn on the host (MAX has no FP8 tensors on the
CPU, so ``q`` and the cache travel as their bytes, ``uint8``).

The driver below plays a tiny serving engine on CPU: one prefill call for
three requests, then single-token decode calls, with ring slots that are
not the batch index and a batch order that changes between calls. After
every call it prints the pools that call completed (pool id, which writer
built it, the first channels of the pooled key) and the pools each
request's newest token selects. It checks every token's selection against
:func:`mla_kpool.reference.check_selection` (the float64 oracle: the top
``TOP_K`` set at the k-th score) as it goes; at the end it recomputes every
request's keys and gate scores in NumPy (float64) from the same weights and
checks each pool against :func:`mla_kpool.reference.pool_sequence`, the
one-shot pooling of the whole sequence: every pool exactly once, none
missing, each within tolerance.

Run it with ``python examples/indexer_layer.py`` (or ``pixi run example``).
Exit status 0 when every pool and every selection checks out, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import (
    BufferType,
    BufferValue,
    DeviceRef,
    Graph,
    TensorType,
    TensorValue,
    Weight,
)
from max.nn import LayerNorm, Linear, Module
from max.nn.attention.mask_config import MHAMaskVariant
from max.nn.kv_cache import PagedCacheValues

import mla_kpool
from mla_kpool import reference
from mla_kpool.buffers import to_buffer, to_numpy
from mla_kpool.calls import pools_of_call
from mla_kpool.index_cache import PagedIndexCache

#: Layer sizes. ``head_dim`` and ``kpool`` are compile-time parameters of
#: the kernels; everything per call (tokens, batch) is a symbolic graph dim.
HIDDEN = 64
HEAD_DIM = 32
KPOOL = 4
MAX_SLOTS = 4
LAYER_NORM_EPS = 1e-5

#: Tolerance against the float64 recomputation, relative to the request's
#: largest pooled-key magnitude (at most its largest ``|k|``: a pooled key is
#: a convex combination of its members). The graph runs the projections, the
#: layer norm and the pooling in float32 (``reference.tolerance(float32)``,
#: 1e-5, for the pooling alone); the projections and the norm add a few float32
#: roundings on top, so the check allows twice that. Seen: about 5e-7.
TOLERANCE = 2 * reference.tolerance(np.float32)

#: Channels printed per pooled key.
SHOWN_CHANNELS = 4

#: The indexer: query heads, pool ids kept per token, cache rows per page.
#: A pooled key of ``HEAD_DIM`` values spreads over ``KPOOL`` rows of
#: ``HEAD_DIM // KPOOL`` (GLM-5-Next's layout), so a page holds
#: ``PAGE_SIZE // KPOOL`` pools.
INDEX_HEADS = 4
TOP_K = 2
PAGE_SIZE = 16
PAGES_PER_REQUEST = 2


class KPoolIndexerKeys(Module):
    """The key side of a k-pooled indexer layer.

    It mirrors the key path of MAX's DSA indexer
    (``max.pipelines.architectures.deepseekV3_2.layers.indexer.Indexer``):
    keys are ``k_norm(wk(x))``, per-channel gate scores are
    ``compress_gate(x)``, and ``compress_ape`` is the learned
    within-pool position embedding added to the gate logits. Weights are
    ``float32`` here; ``ape`` must be float32 for the kernels whatever the
    checkpoint stores (cast it if it is bfloat16).

    Args:
        hidden: Width of the hidden states.
        head_dim: Width of the indexer keys.
        kpool: Tokens per pool.
        device: Where the layer runs.
    """

    def __init__(
        self, hidden: int, head_dim: int, kpool: int, device: DeviceRef
    ) -> None:
        super().__init__()
        self.kpool = kpool
        self.wk = Linear(hidden, head_dim, DType.float32, device)
        self.k_norm = LayerNorm(
            head_dim, devices=[device], dtype=DType.float32, eps=LAYER_NORM_EPS
        )
        self.compress_gate = Linear(hidden, head_dim, DType.float32, device)
        self.compress_ape = Weight(
            "compress_ape", DType.float32, (kpool, head_dim), device=device
        )

    def __call__(
        self,
        x: TensorValue,
        tail: BufferValue,
        input_row_offsets: TensorValue,
        cache_lengths: TensorValue,
        slot_idx: TensorValue,
    ) -> mla_kpool.KPoolStep:
        """Projects this call's tokens and runs the k-pool step on them.

        Args:
            x: Hidden states ``[total_tokens, hidden]``, float32.
            tail: This layer's ring ``[max_slots, 2, kpool, head_dim]``,
                float32, updated in place.
            input_row_offsets: ``[batch + 1]`` uint32 token row offsets.
            cache_lengths: ``[batch]`` uint32 tokens each request has seen.
            slot_idx: ``[batch]`` uint32 ring slot of each request.

        Returns:
            The step's outputs, see :class:`mla_kpool.KPoolStep`.
        """
        k = self.k_norm(self.wk(x))
        gate = self.compress_gate(x)
        return mla_kpool.kpool_step(
            tail,
            k,
            gate,
            self.compress_ape,
            input_row_offsets,
            cache_lengths,
            slot_idx,
            self.kpool,
        )


def random_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Weights for :class:`KPoolIndexerKeys`, by ``state_dict`` name.

    Gate scores come out with a standard deviation of about 3 and ``ape`` of
    2, so pool members get clearly different weights and a wrong member or
    a wrong ``ape`` row would change the pooled key.
    """

    def normal(scale: float, *shape: int) -> np.ndarray:
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    return {
        "wk.weight": normal(HIDDEN**-0.5, HEAD_DIM, HIDDEN),
        "k_norm.weight": 1.0 + normal(0.1, HEAD_DIM),
        "k_norm.bias": normal(0.1, HEAD_DIM),
        "compress_gate.weight": normal(3.0 * HIDDEN**-0.5, HEAD_DIM, HIDDEN),
        "compress_ape": normal(2.0, KPOOL, HEAD_DIM),
    }


def random_index_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The indexer's query weights, by name.

    ``q = x @ wq`` (``wq``: ``[hidden, H * D]``) and the signed head
    weights ``q_s = x @ w_heads`` (``[hidden, H]``).
    """
    wq = rng.standard_normal((HIDDEN, INDEX_HEADS * HEAD_DIM)) * HIDDEN**-0.5
    heads = rng.standard_normal((HIDDEN, INDEX_HEADS)) * HIDDEN**-0.5
    return {"wq": wq.astype(np.float32), "w_heads": heads.astype(np.float32)}


def index_queries(
    x: np.ndarray, weights: dict[str, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """The indexer's ``(q, q_s)`` for hidden states ``x``.

    ``q`` as e4m3fn bytes ``[T, H, D]`` (rounded on the host), ``q_s``
    float32 ``[T, H]``.
    """
    q = (x @ weights["wq"]).reshape(len(x), INDEX_HEADS, HEAD_DIM)
    fp8 = q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return fp8, (x @ weights["w_heads"]).astype(np.float32)


def build_index_graph() -> Graph:
    """One ``mla_kpool.index_top_k`` on the paged cache.

    As a pipeline stages it: the cache's fields become a
    ``PagedCacheValues``.
    """
    dev = DeviceRef.CPU()
    u32, i64 = DType.uint32, DType.int64
    page = [1, 1, PAGE_SIZE, 1]
    width = HEAD_DIM // KPOOL
    input_types = [
        TensorType(DType.uint8, ["tokens", INDEX_HEADS, HEAD_DIM], dev),
        TensorType(DType.float32, ["tokens", INDEX_HEADS], dev),
        TensorType(u32, ["batch_plus_1"], dev),
        BufferType(DType.uint8, ["blocks", *page, width], dev),
        TensorType(i64, [1], dev),
        TensorType(u32, ["batch"], dev),
        TensorType(u32, ["batch", "pages"], dev),
        TensorType(u32, [1], dev),
        TensorType(u32, [1], dev),
        BufferType(DType.float32, ["blocks", *page, 1], dev),
        TensorType(i64, [1], dev),
        TensorType(u32, ["batch", "pages"], dev),
        TensorType(u32, [], dev),
    ]
    with Graph(
        "kpool_indexer_scores",
        input_types=input_types,
        custom_extensions=[mla_kpool.KERNELS],
    ) as graph:
        q, q_s, offsets, blocks, stride, lengths, table = graph.inputs[:7]
        max_prompt, max_cache, scales, sstride, stable, layer = graph.inputs[7:]
        cache = PagedCacheValues(
            kv_blocks=blocks.buffer,
            cache_lengths=lengths.tensor,
            lookup_table=table.tensor,
            max_prompt_length=max_prompt.tensor,
            max_cache_length=max_cache.tensor,
            page_stride=stride.tensor,
            kv_scales=scales.buffer,
            scales_page_stride=sstride.tensor,
            scales_lookup_table=stable.tensor,
        )
        graph.output(
            mla_kpool.index_top_k(
                q.tensor,
                q_s.tensor,
                offsets.tensor,
                cache,
                layer.tensor,
                TOP_K,
                128,
                MHAMaskVariant.NULL_MASK,
                KPOOL,
            )
        )
    return graph


def random_hidden(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """Stand-in hidden states ``[tokens, hidden]``, float32."""
    return rng.standard_normal((tokens, HIDDEN)).astype(np.float32)


def build_graph(layer: KPoolIndexerKeys) -> Graph:
    """Stages ``layer`` into a graph with the ring and metadata as inputs."""
    dev = DeviceRef.CPU()
    input_types = [
        TensorType(DType.float32, ["total_tokens", HIDDEN], dev),
        BufferType(DType.float32, ["max_slots", 2, KPOOL, HEAD_DIM], dev),
        TensorType(DType.uint32, ["batch_plus_1"], dev),
        TensorType(DType.uint32, ["batch"], dev),
        TensorType(DType.uint32, ["batch"], dev),
    ]
    with Graph(
        "kpool_indexer_layer",
        input_types=input_types,
        custom_extensions=[mla_kpool.KERNELS],
    ) as graph:
        x, tail, offsets, cache_lengths, slot_idx = graph.inputs
        step = layer(
            x.tensor,
            tail.buffer,
            offsets.tensor,
            cache_lengths.tensor,
            slot_idx.tensor,
        )
        graph.output(*step)
    return graph


@dataclass
class Request:
    """One sequence being served.

    Attributes:
        name: Printed name.
        slot: Ring slot (deliberately not the batch index).
        prompt: Prompt length, brought by the prefill call.
        hidden: ``[prompt + decode steps, hidden]`` hidden states of every
            token the request will bring (a stand-in for the model's).
        seen: Tokens already through the layer (``cache_lengths``).
        pools: Pooled keys produced so far, ``pool id -> [(step, key)]``.
        blocks: Its pages' blocks in the indexer's key cache.
    """

    name: str
    slot: int
    prompt: int
    hidden: np.ndarray
    seen: int = 0
    pools: dict[int, list[tuple[int, np.ndarray]]] = field(default_factory=dict)
    blocks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Completed:
    """A pool one call completed, for printing."""

    request: Request
    pool: int
    writer: str
    key: np.ndarray


def run_call(
    model: Model,
    ring: Buffer,
    step: int,
    batch: list[tuple[Request, int]],
) -> list[Completed]:
    """Runs one call of the layer over ``batch`` (request, new tokens).

    Returns:
        The pools this call completed, in batch order.
    """
    x = np.concatenate([r.hidden[r.seen : r.seen + n] for r, n in batch])
    counts = [n for _, n in batch]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
    cache_lengths = np.array([r.seen for r, _ in batch], dtype=np.uint32)
    slot_idx = np.array([r.slot for r, _ in batch], dtype=np.uint32)

    outputs = model.execute(
        to_buffer(x), ring, *map(to_buffer, (offsets, cache_lengths, slot_idx))
    )
    ring_pooled, ring_closed, pooled, pool_rows, first_pool = map(
        to_numpy, outputs
    )

    produced = pools_of_call(
        ring_closed, ring_pooled, pooled, pool_rows, first_pool
    )
    completed = []
    for (request, n), pools in zip(batch, produced, strict=True):
        for pool, row in pools.items():
            completed.append(Completed(request, pool, row.writer, row.key))
        request.seen += n
    for c in completed:
        c.request.pools.setdefault(c.pool, []).append((step, c.key))
    return completed


def score_call(
    model: Model,
    cache: PagedIndexCache,
    batch: list[tuple[Request, int]],
    completed: list[Completed],
    weights: dict[str, np.ndarray],
) -> tuple[np.ndarray, int, list[str]]:
    """Stores the call's pools in the cache and scores the call's tokens.

    Call it after :func:`run_call` (``seen`` already counts the call's
    tokens). Returns the ``[tokens, TOP_K]`` pool ids, the rows that had
    to choose (more than ``TOP_K`` pools visible) and the oracle's
    complaints (:func:`mla_kpool.reference.check_selection`).
    """
    counts = [n for _, n in batch]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
    row = {id(r): b for b, (r, _) in enumerate(batch)}
    cache.lookup_table = np.array([r.blocks for r, _ in batch], np.uint32)
    cache.scales_lookup_table = cache.lookup_table
    cache.cache_lengths = np.array([r.seen - n for r, n in batch], np.uint32)
    for done in completed:
        cache.store_keys(row[id(done.request)], 0, done.pool, done.key[None])
    x = np.concatenate([r.hidden[r.seen - n : r.seen] for r, n in batch])
    q, q_s = index_queries(x, weights)
    total = cache.cache_lengths + np.asarray(counts, np.uint32)
    operands = [
        q,
        q_s,
        offsets,
        cache.blocks(),
        np.array([cache.page_stride], np.int64),
        cache.cache_lengths,
        cache.lookup_table,
        np.array([max(counts)], np.uint32),
        np.array([total.max()], np.uint32),
        cache.scales(),
        np.array([cache.scales_page_stride], np.int64),
        cache.scales_lookup_table,
        np.array(0, np.uint32),
    ]
    ids = to_numpy(model.execute(*map(to_buffer, operands))[0])
    try:
        report = reference.check_selection(
            ids, q, q_s, offsets, **cache.oracle_operands(), layer_idx=0,
            top_k=TOP_K, kpool=KPOOL, mask="null",
        )  # fmt: skip
    except AssertionError as err:
        return ids, 0, [f"index_top_k: {err}"]
    return ids, report.cut_rows, []


def expected_pools(
    request: Request, weights: dict[str, np.ndarray]
) -> np.ndarray:
    """Every complete pool of ``request``, recomputed in float64 NumPy."""
    x = request.hidden[: request.seen].astype(np.float64)
    projected = x @ weights["wk.weight"].T.astype(np.float64)
    mean = projected.mean(axis=-1, keepdims=True)
    var = projected.var(axis=-1, keepdims=True)
    k = (projected - mean) / np.sqrt(var + LAYER_NORM_EPS)
    k = k * weights["k_norm.weight"] + weights["k_norm.bias"]
    gate = x @ weights["compress_gate.weight"].T.astype(np.float64)
    return reference.pool_sequence(k, gate, weights["compress_ape"], KPOOL)


def check(
    requests: Sequence[Request], weights: dict[str, np.ndarray]
) -> list[str]:
    """Compares every produced pool with the oracle; returns the failures."""
    failures = []
    for request in requests:
        want = expected_pools(request, weights)
        got_ids = sorted(request.pools)
        if got_ids != list(range(len(want))):
            failures.append(
                f"{request.name}: pools {got_ids}, expected 0..{len(want) - 1}"
            )
        scale = float(np.abs(want).max()) if want.size else 1.0
        for pool, produced in sorted(request.pools.items()):
            if len(produced) != 1:
                steps = [s for s, _ in produced]
                failures.append(
                    f"{request.name} pool {pool}: produced in steps {steps}"
                )
            if pool >= len(want):
                continue
            for step, key in produced:
                err = float(np.abs(key.astype(np.float64) - want[pool]).max())
                if not err <= TOLERANCE * scale:
                    failures.append(
                        f"{request.name} pool {pool} (step {step}): max error"
                        f" {err:.3g} > {TOLERANCE * scale:.3g}"
                    )
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    """Builds the layer, serves a few calls, prints and checks the pools.

    Args:
        argv: Command-line arguments (``sys.argv[1:]`` when ``None``).

    Returns:
        0 when every pool matches the oracle, 1 otherwise.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=5,
        help="single-token decode calls after the prefill (default 5)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    layer = KPoolIndexerKeys(HIDDEN, HEAD_DIM, KPOOL, DeviceRef.CPU())
    weights = random_weights(rng)
    layer.load_state_dict(weights)
    graph = build_graph(layer)
    session = InferenceSession(devices=[CPU()])
    model = session.load(graph, weights_registry=layer.state_dict())
    scorer = session.load(build_index_graph())
    index_weights = random_index_weights(rng)
    ring = to_buffer(np.zeros((MAX_SLOTS, 2, KPOOL, HEAD_DIM), np.float32))

    total = args.decode_steps
    requests = [
        Request(name, slot, prompt, random_hidden(rng, prompt + total))
        for name, slot, prompt in (("A", 2, 7), ("B", 0, 5), ("C", 3, 10))
    ]
    # Each request's pages get blocks of the cache, in a shuffled order.
    order = rng.permutation(len(requests) * PAGES_PER_REQUEST).tolist()
    for i, request in enumerate(requests):
        first = i * PAGES_PER_REQUEST
        request.blocks = order[first : first + PAGES_PER_REQUEST]
    cache = PagedIndexCache(
        num_blocks=len(order),
        num_layers=1,
        page_size=PAGE_SIZE,
        head_dim=HEAD_DIM,
        kpool=KPOOL,
        max_pages=PAGES_PER_REQUEST,
    )
    a, b, c = requests
    print(
        f"indexer layer: hidden {HIDDEN}, head_dim {HEAD_DIM}, kpool {KPOOL},"
        f" float32, CPU; ring [{MAX_SLOTS}, 2, {KPOOL}, {HEAD_DIM}]; scorer:"
        f" {INDEX_HEADS} heads, top {TOP_K} pools, FP8 cache pages of"
        f" {PAGE_SIZE} rows"
    )
    index_failures: list[str] = []
    rows = selections = 0
    # Prefill all three prompts in one call, then decode one token each per
    # call, in a batch order that is neither the prefill's nor the slots'.
    calls = [("prefill", [(r, r.prompt) for r in requests])]
    calls += [("decode", [(c, 1), (a, 1), (b, 1)])] * total
    for step, (kind, batch) in enumerate(calls):
        members = ", ".join(
            f"{r.name}(slot {r.slot}, cache {r.seen}, +{n})" for r, n in batch
        )
        print(f"step {step} {kind}: {members}")
        completed = run_call(model, ring, step, batch)
        for done in completed:
            head = np.array2string(
                done.key[:SHOWN_CHANNELS].astype(np.float64),
                precision=4,
                sign=" ",
                floatmode="fixed",
            )
            print(
                f"  {done.request.name} pool {done.pool}"
                f" ({done.writer:>10}): {head[:-1]} ...]"
            )
        if not completed:
            print("  no pool completed")
        ids, chose, problems = score_call(
            scorer, cache, batch, completed, index_weights
        )
        index_failures += [f"step {step} {p}" for p in problems]
        rows += len(ids)
        selections += chose
        newest = np.cumsum([n for _, n in batch]) - 1
        picks = ", ".join(
            f"{r.name} {ids[t][ids[t] >= 0].tolist()}"
            for (r, _), t in zip(batch, newest, strict=True)
        )
        print(f"  newest tokens select pools: {picks}")

    failures = check(requests, weights) + index_failures
    pools = sum(len(r.pools) for r in requests)
    if failures:
        for failure in failures:
            print(f"FAIL {failure}")
        return 1
    print(
        f"OK: {pools} pools of {len(requests)} requests match"
        f" mla_kpool.reference.pool_sequence (tolerance {TOLERANCE:g});"
        f" {rows} index_top_k rows ({selections} chose {TOP_K} of more pools)"
        " match mla_kpool.reference.check_selection"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
