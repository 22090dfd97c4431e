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

The driver below plays a tiny serving engine on CPU: one prefill call for
three requests, then single-token decode calls, with ring slots that are
not the batch index and a batch order that changes between calls. After
every call it prints the pools that call completed (pool id, which writer
built it, the first channels of the pooled key). At the end it recomputes
every request's keys and gate scores in NumPy (float64) from the same
weights and checks each pool against
:func:`mla_kpool.reference.pool_sequence`, the one-shot pooling of the whole
sequence: every pool exactly once, none missing, each within tolerance.

Run it with ``python examples/indexer_layer.py`` (or ``pixi run example``).
Exit status 0 when every pool checks out, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

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

import mla_kpool
from mla_kpool import reference
from mla_kpool.buffers import to_buffer, to_numpy
from mla_kpool.calls import pools_of_call

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
    """

    name: str
    slot: int
    prompt: int
    hidden: np.ndarray
    seen: int = 0
    pools: dict[int, list[tuple[int, np.ndarray]]] = field(default_factory=dict)


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
    ring = to_buffer(np.zeros((MAX_SLOTS, 2, KPOOL, HEAD_DIM), np.float32))

    total = args.decode_steps
    requests = [
        Request(name, slot, prompt, random_hidden(rng, prompt + total))
        for name, slot, prompt in (("A", 2, 7), ("B", 0, 5), ("C", 3, 10))
    ]
    a, b, c = requests
    print(
        f"indexer layer: hidden {HIDDEN}, head_dim {HEAD_DIM}, kpool {KPOOL},"
        f" float32, CPU; ring [{MAX_SLOTS}, 2, {KPOOL}, {HEAD_DIM}]"
    )
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

    failures = check(requests, weights)
    pools = sum(len(r.pools) for r in requests)
    if failures:
        for failure in failures:
            print(f"FAIL {failure}")
        return 1
    print(
        f"OK: {pools} pools of {len(requests)} requests match"
        f" mla_kpool.reference.pool_sequence (tolerance {TOLERANCE:g})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
