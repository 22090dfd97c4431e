"""Graphs get this package's kernels without ``custom_extensions``.

Without the kernels, a CPU graph calling ``mo.mla.kpool.*`` builds and then
fails in ``InferenceSession.load`` with MAX's generic "Failed to compile the
model". Two routes keep users away from that:

- ``mla_kpool.kernels_loaded()``: graphs created inside it load the kernels,
  so MAX's own ``max.nn.kernels.mla_kpool_*`` wrappers (an unchanged
  pipeline) run them on the CPU. One compiled graph calls four of MAX's
  wrappers and is checked against the NumPy oracle.
- this package's wrappers load the kernels into a graph that lacks them, at
  build time (checked here without compiling; ``examples/quickstart.py``
  compiles and runs such a graph, see
  ``tests/docs_and_layout/test_example.py``).
"""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import BufferType, DeviceRef, Graph, TensorType, ops

import mla_kpool
from mla_kpool import _paths
from mla_kpool import reference as ref
from mla_kpool.buffers import to_buffer, to_numpy
from support.kpool_cases import (
    F32,
    assert_pooled_close,
    max_nn_kernels,
    random_ape,
    random_rows,
)

KPOOL = 4
HEAD_DIM = 16
POOL_TOPK = 2
#: ``(cache_length, new_tokens)`` per request: a decode that closes a pool,
#: one that does not, an aligned prefill, a chunk that closes and runs on,
#: nothing new, and a fresh request.
BATCH = [(7, 1), (9, 1), (8, 13), (10, 7), (11, 0), (0, 6)]
MAX_SLOTS = len(BATCH) + 2
CPU_REF = DeviceRef.CPU()


def _input_types() -> list[TensorType | BufferType]:
    f32, u32 = DType.float32, DType.uint32
    return [
        BufferType(f32, ["slots", 2, KPOOL, HEAD_DIM], CPU_REF),
        TensorType(f32, ["tokens", HEAD_DIM], CPU_REF),
        TensorType(f32, ["tokens", HEAD_DIM], CPU_REF),
        TensorType(f32, [KPOOL, HEAD_DIM], CPU_REF),
        TensorType(u32, ["offsets"], CPU_REF),
        TensorType(u32, ["offsets"], CPU_REF),
        TensorType(u32, ["batch"], CPU_REF),
        TensorType(u32, ["batch"], CPU_REF),
        TensorType(DType.int32, ["tokens", POOL_TOPK], CPU_REF),
    ]


def _max_pipeline_graph() -> Graph:
    """A CPU graph built only from MAX's wrappers, no custom_extensions."""
    max_nn = max_nn_kernels()
    with Graph("max_wrappers", input_types=_input_types()) as graph:
        tail = graph.inputs[0].buffer
        k, gate, ape, offsets, pool_offsets, cache, slots, pool_ids = (
            value.tensor for value in graph.inputs[1:]
        )
        pooled, closed = max_nn.mla_kpool_ring_close(
            tail, k, gate, ape, offsets, cache, slots, KPOOL
        )
        pools = max_nn.mla_kpool_compress(
            k, gate, ape, offsets, pool_offsets, cache, KPOOL
        )
        max_nn.mla_kpool_seed_tail(tail, k, gate, offsets, cache, slots, KPOOL)
        positions = max_nn.mla_kpool_expand_topk(
            pool_ids, offsets, cache, KPOOL
        )
        graph.output(pooled, closed, pools, positions)
    return graph


def test_max_wrappers_run_this_package_inside_kernels_loaded() -> None:
    seed = zlib.crc32(b"kernels_loaded")
    rng = np.random.default_rng(seed)
    with mla_kpool.kernels_loaded():
        graph = _max_pipeline_graph()
    assert _paths.has_kernels(graph)
    # The scope ends with the block: a graph created after it has nothing.
    assert not _paths.has_kernels(Graph("after", input_types=[]))
    model = InferenceSession(devices=[CPU()]).load(graph)

    offsets = np.cumsum([0] + [n for _, n in BATCH]).astype(np.uint32)
    cache = np.array([c for c, _ in BATCH], np.uint32)
    # Slots that are not the batch index, so a wrong mapping shows.
    slots = np.arange(MAX_SLOTS - 1, 1, -1).astype(np.uint32)
    pool_offsets = ref.pool_row_offsets(offsets, cache, KPOOL).astype(np.uint32)
    tokens = int(offsets[-1])
    k, gate = random_rows(rng, tokens, HEAD_DIM, F32)
    ape = random_ape(rng, KPOOL, HEAD_DIM)
    keys, gates = random_rows(rng, MAX_SLOTS * KPOOL, HEAD_DIM, F32)
    ring = np.stack(
        [
            keys.reshape(MAX_SLOTS, KPOOL, HEAD_DIM),
            gates.reshape(MAX_SLOTS, KPOOL, HEAD_DIM),
        ],
        axis=1,
    )
    # Ids from -1 (unused) to past the visible pools (skipped).
    pool_ids = rng.integers(-1, 7, size=(tokens, POOL_TOPK), dtype=np.int32)

    tail = to_buffer(ring)
    operands = [k, gate, ape, offsets, pool_offsets, cache, slots, pool_ids]
    pooled, closed, pools, positions = (
        to_numpy(out)
        for out in model.execute(tail, *(to_buffer(a) for a in operands))
    )

    what = f"seed {seed}"
    want_pooled, want_closed = ref.ring_close(
        ring, k, gate, ape, offsets, cache, slots, KPOOL
    )
    want_pools = ref.compress(k, gate, ape, offsets, pool_offsets, cache, KPOOL)
    want_ring = ref.seed_tail(ring, k, gate, offsets, cache, slots, KPOOL)
    want_positions = ref.expand_topk(pool_ids, offsets, cache, KPOOL)
    # The batch reaches every writer's interesting path.
    assert (want_closed >= 0).any() and (want_closed < 0).any()
    assert pool_offsets[-1] > 0 and (want_positions >= 0).any()
    assert not np.array_equal(want_ring, ring)

    scale = float(np.abs(np.concatenate([k, keys])).max())
    np.testing.assert_array_equal(closed, want_closed, what)
    # Every row, not only the closing ones: this package's kernels write
    # zeros where nothing closed (MAX's builtin leaves those unspecified).
    assert_pooled_close(pooled, want_pooled, F32, scale, f"ring_close {what}")
    assert_pooled_close(pools, want_pools, F32, scale, f"compress {what}")
    np.testing.assert_array_equal(to_numpy(tail), want_ring, what)
    np.testing.assert_array_equal(positions, want_positions, what)


# --------------------------------------------------------------------------
# This package's wrappers load the kernels at build time (no compile)
# --------------------------------------------------------------------------


def _call(op: str, graph: Graph) -> None:
    tail = graph.inputs[0].buffer
    k, gate, ape, offsets, pool_offsets, cache, slots, pool_ids = (
        value.tensor for value in graph.inputs[1:]
    )
    if op == "ring_close":
        mla_kpool.ring_close(tail, k, gate, ape, offsets, cache, slots, KPOOL)
    elif op == "compress":
        mla_kpool.compress(k, gate, ape, offsets, pool_offsets, cache, KPOOL)
    elif op == "seed_tail":
        mla_kpool.seed_tail(tail, k, gate, offsets, cache, slots, KPOOL)
    elif op == "expand_topk":
        mla_kpool.expand_topk(pool_ids, offsets, cache, KPOOL)
    else:
        mla_kpool.kpool_step(
            tail, k, gate, ape, offsets, cache, slots, KPOOL, fused=op == "step"
        )


WRAPPERS = ["ring_close", "compress", "seed_tail", "expand_topk", "step"]


@pytest.mark.parametrize("op", [*WRAPPERS, "step3"])
def test_wrapper_loads_the_kernels_into_a_graph_without_them(op: str) -> None:
    with Graph(f"bare_{op}", input_types=_input_types()) as graph:
        assert graph.kernel_libraries_paths == []
        assert not _paths.has_kernels(graph)
        _call(op, graph)
        assert _paths.has_kernels(graph)
        assert graph.kernel_libraries_paths == [_paths.compiled_kernels()]
        # The kernel library is recorded on the graph op, which is what
        # InferenceSession.load compiles against.
        assert str(_paths.compiled_kernels()) in str(graph)


def test_wrapper_keeps_the_kernels_a_graph_already_has() -> None:
    """A graph built with kernels (the benchmark's no-op stand-ins, say)
    keeps exactly those: the wrappers add nothing on top."""
    with Graph(
        "noop",
        input_types=_input_types(),
        custom_extensions=[_paths.NOOP_KERNELS],
    ) as graph:
        before = list(graph.kernel_libraries_paths)
        assert len(before) == 1 and _paths.has_kernels(graph)
        for op in WRAPPERS:
            _call(op, graph)
        assert graph.kernel_libraries_paths == before


def test_builtin_mode_leaves_the_graph_to_max_builtins() -> None:
    with (
        _paths.builtin_kernels_only(),
        Graph("builtin", input_types=_input_types()) as graph,
    ):
        _call("step3", graph)
        assert graph.kernel_libraries_paths == []
        # MAX ships no fused op, so that one cannot be staged at all.
        with pytest.raises(ValueError, match=r"pass fused=False"):
            _call("step", graph)
    # Only inside the block.
    with Graph("after_builtin", input_types=_input_types()) as graph:
        _call("ring_close", graph)
        assert _paths.has_kernels(graph)


def test_without_a_way_to_load_the_wrapper_says_what_to_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Should MAX drop the private hook, the error comes at build time."""
    with Graph("no_hook", input_types=_input_types()) as graph:
        monkeypatch.delattr(Graph, "_import_kernels")
        for op in WRAPPERS:
            with pytest.raises(
                ValueError,
                match=rf"^{'kpool_step' if op == 'step' else op} needs this"
                r" package's kernels.*custom_extensions=\[mla_kpool\.KERNELS\]"
                r".*mla_kpool\.kernels_loaded\(\)",
            ):
                _call(op, graph)


def test_loading_into_one_graph_leaves_graphs_sharing_its_library_alone(
    tmp_path: Path,
) -> None:
    """MAX shares one kernel-library analysis among graphs that load the same
    paths; loading this package into one of them must not make the others
    look as if they had it (their compile would then fail without it)."""
    other = tmp_path / "other_ops"
    shutil.copytree(_paths.NOOP_KERNELS, other)
    source = (other / "noop.mojo").read_text()
    (other / "noop.mojo").write_text(
        source.replace('"mo.mla.kpool.', '"other_ops.').replace(
            '"mla_kpool.step"', '"other_ops.step"'
        )
    )

    def graph_with_another_op(name: str) -> Graph:
        graph = Graph(
            name, input_types=_input_types(), custom_extensions=[other]
        )
        with graph:
            tail = graph.inputs[0].buffer
            k, gate, _, offsets, _, cache, slots, _ = (
                value.tensor for value in graph.inputs[1:]
            )
            ops.inplace_custom(
                "other_ops.seed_tail",
                device=CPU_REF,
                values=[tail, k, gate, offsets, cache, slots],
                parameters={"head_dim": HEAD_DIM, "kpool": KPOOL},
            )
        return graph

    first = graph_with_another_op("first")
    assert not _paths.has_kernels(first)
    with first:
        _call("ring_close", first)
    assert _paths.has_kernels(first)

    second = graph_with_another_op("second")
    assert not _paths.has_kernels(second)
    assert _paths.compiled_kernels() not in second.kernel_libraries_paths
    with second:
        _call("ring_close", second)
    assert _paths.has_kernels(second)
    assert str(_paths.compiled_kernels()) in str(second)
