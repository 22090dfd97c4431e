"""The fused ``mla_kpool.step`` op against the three-op step, bit for bit.

``kpool_step`` adds one ``mla_kpool.step`` op by default and, with
``fused=False``, the three writers plus the ``pool_row_offsets`` helper. On
the same device the two must agree exactly: every output (pooled keys,
``-1``s, zero rows, ``pool_row_offsets``, ``first_pool``) and every ring
write, for good and bad metadata. The oracle checks of the writers live in
their own test files; this file checks that the fused op is the three-op
step, which a wrong ordering of close and seed inside it would break.

- **Streams** (``STREAM_CASES``): on each device, a few configurations
  covering every key dtype, kpool 1, 2, 4 and 16, head_dim 32, 128 and 1089
  (wider than a GPU block) and a ring of three pools. Each runs a seeded
  stream of calls on two rings, one per path, with ring slots reused
  across calls, random ragged batches and, in some calls, bad metadata
  (slots past the ring, offsets going down or past the rows, cache lengths
  near 2^32); after every call the outputs and the rings must be equal.
- **Guarded fuzz** at ``MAIN`` (the vectors and guarded buffers of
  ``guarded.py``): both paths run on rings, keys and gates that are views
  into sentinel-guarded buffers; the guards must stay untouched, the inputs
  unchanged, and the outputs and rings equal.

Models: both paths of every ``STREAM_CASES`` configuration, compiled as one
graph per host device (``COMPILED_TOGETHER``): 10 ops on ``cpu``, 6 on
``gpu-emulated``, where separate graphs cost 13 compiles.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Graph, TensorType

import mla_kpool
from conftest import DEVICE_NAMES
from mla_kpool._paths import compiled_kernels
from mla_kpool.buffers import to_numpy
from mla_kpool.calls import CallInputs
from mla_kpool.runner import (
    ModelKey,
    Runner,
    SharedModel,
    StepResult,
    model_key,
)
from support.guarded import (
    GUARD_ROWS,
    GUARD_SLOTS,
    HEAD_DIM,
    KPOOL,
    U32_MAX,
    Guarded,
    Meta,
    check_guards,
    draw_data,
    draw_meta,
)
from support.kpool_cases import (
    BF16,
    F16,
    F32,
    MAIN,
    STEP_CONFIGS,
    Config,
    bits,
    random_ape,
    random_rows,
)


def assert_same_step(
    fused: list[np.ndarray], three: list[np.ndarray], what: str
) -> None:
    """Asserts two steps' outputs are equal in shape, dtype and bits."""
    names = StepResult.__dataclass_fields__
    for name, a, b in zip(names, fused, three, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{name}: fused {a.dtype}{a.shape} vs three-op "
            f"{b.dtype}{b.shape}, {what}"
        )
        if not np.array_equal(bits(a), bits(b)):
            rows = np.argwhere(bits(a) != bits(b))[:, 0]
            raise AssertionError(
                f"{name} differs (fused vs three-op) at rows "
                f"{sorted(set(rows.tolist()))[:8]}: fused "
                f"{a[rows[0]] if a.ndim else a}, three-op "
                f"{b[rows[0]] if b.ndim else b}, {what}"
            )


# --------------------------------------------------------------------------
# Streams of calls
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamCase:
    """A configuration run as a stream of calls on both paths.

    Attributes:
        cfg: Dtype, kpool and head_dim.
        ring_len: Ring length R (``kpool`` or a multiple).
        emulated: Whether it also runs on ``gpu-emulated``.
    """

    cfg: Config
    ring_len: int
    emulated: bool

    @property
    def id(self) -> str:
        return f"{self.cfg.id}-r{self.ring_len}"


STREAM_CASES = [
    StreamCase(MAIN, 4, emulated=True),
    StreamCase(MAIN, 12, emulated=True),
    StreamCase(Config(BF16, 2, 1089), 2, emulated=True),
    StreamCase(Config(F16, 16, 32), 16, emulated=False),
    StreamCase(Config(F32, 1, 32), 1, emulated=False),
]
assert all(c.cfg in STEP_CONFIGS for c in STREAM_CASES)


def COMPILED_TOGETHER(device: str) -> list[ModelKey]:  # noqa: N802
    """The models this file runs on ``device``, compiled as one graph.

    Both paths of every stream case on the device; the guarded fuzz runs
    ``MAIN`` with a ring of one pool, the first case's (see the
    ``runners`` fixture in conftest.py).
    """
    return [
        model_key(
            kind,
            case.cfg.kpool,
            dtype=case.cfg.dtype,
            head_dim=case.cfg.head_dim,
            ring_len=case.ring_len,
        )
        for case in STREAM_CASES
        if device != "gpu-emulated" or case.emulated
        for kind in ("step", "step3")
    ]


#: Calls per stream, ring slots.
CALLS = 24
MAX_SLOTS = 7


def _stream_params() -> list:
    params = []
    for device in DEVICE_NAMES:
        name = device.values[0]
        for case in STREAM_CASES:
            if name == "gpu-emulated" and not case.emulated:
                continue
            params.append(
                pytest.param(
                    name, case, id=f"{name}-{case.id}", marks=device.marks
                )
            )
    return params


def draw_call(
    rng: np.random.Generator, kpool: int, positions: np.ndarray, bad: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """One call's metadata for a stream; advances ``positions`` in place.

    Each slot holds one request whose next position is ``positions[slot]``;
    a call picks distinct slots (not in slot order) and brings each request
    0 to ``3 * kpool + 2`` tokens. With ``bad``, one kind of bad metadata
    is planted in the call.

    Returns:
        ``(input_row_offsets, cache_lengths, slot_idx, total_tokens)``,
        index arrays as uint32.
    """
    batch = int(rng.integers(0, MAX_SLOTS + 1))
    slots = rng.permutation(MAX_SLOTS)[:batch].astype(np.int64)
    n = rng.integers(0, 3 * kpool + 3, size=batch)
    n[rng.random(batch) < 0.3] = 1
    cache = positions[slots].copy()
    offsets = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
    tokens = int(offsets[-1]) + int(rng.integers(0, kpool + 1))
    positions[slots] += n
    if bad and batch:
        b = int(rng.integers(0, batch))
        kind = int(rng.integers(0, 4))
        if kind == 0:
            slots[b] = MAX_SLOTS + int(rng.integers(0, 3)) * 4096
        elif kind == 1:
            offsets[b] = offsets[b + 1] + int(rng.integers(1, 5))
        elif kind == 2:
            offsets[b + 1] = tokens + int(rng.integers(1, 9))
        else:
            cache[b] = U32_MAX - int(rng.integers(0, 2 * kpool))
    u32 = np.uint32
    return offsets.astype(u32), cache.astype(u32), slots.astype(u32), tokens


@pytest.mark.parametrize(("device", "case"), _stream_params())
def test_stream_fused_equals_three_op(
    device: str, case: StreamCase, runners: Callable[[str], Runner]
) -> None:
    runner = runners(device)
    cfg, kp, hd = case.cfg, case.cfg.kpool, case.cfg.head_dim
    seed = zlib.crc32(repr(("stream", case.id)).encode())
    rng = np.random.default_rng(seed)
    ring, ring_gates = random_rows(
        rng, MAX_SLOTS * case.ring_len, hd, cfg.dtype
    )
    host = np.stack([ring, ring_gates]).reshape(2, MAX_SLOTS, case.ring_len, hd)
    host = np.ascontiguousarray(host.transpose(1, 0, 2, 3))
    rings = {
        fused: runner.new_ring(MAX_SLOTS, case.ring_len, hd, cfg.dtype, host)
        for fused in (True, False)
    }
    ape = random_ape(rng, kp, hd)
    positions = rng.integers(0, 3 * kp, size=MAX_SLOTS)
    closed = pools = 0
    for call in range(CALLS):
        what = f"{case.id} on {device}, seed {seed}, call {call}"
        offsets, cache, slots, tokens = draw_call(
            rng, kp, positions, bad=call % 3 == 2
        )
        k, gate = random_rows(rng, tokens, hd, cfg.dtype)
        call_in = CallInputs(k, gate, offsets, cache, slots)
        outs = {
            fused: runner.step(
                rings[fused], call_in, ape, kp, fused=fused, check=False
            )
            for fused in (True, False)
        }
        assert_same_step(
            list(vars(outs[True]).values()),
            list(vars(outs[False]).values()),
            what,
        )
        got, want = runner.read(rings[True]), runner.read(rings[False])
        assert np.array_equal(bits(got), bits(want)), f"ring, {what}"
        closed += int((outs[True].ring_closed_pool >= 0).sum())
        pools += int(outs[True].pool_row_offsets[-1])
    # The stream did real work on both sides of the op.
    assert pools > CALLS, (pools, case.id)
    if kp > 1:
        assert closed > CALLS // 2, (closed, case.id)


# --------------------------------------------------------------------------
# Guarded fuzz at MAIN
# --------------------------------------------------------------------------

#: Vectors per device (the emulated grid runs every thread in turn).
FUZZ_VECTORS = {"cpu": 1000, "gpu-emulated": 400, "gpu": 1000}
#: Seed stream of the vectors (``test_fuzz.py`` uses 1 to 3 and 9).
STREAM = 5


def run_guarded(
    runner: Runner, meta: Meta, fused: bool
) -> tuple[list[np.ndarray], np.ndarray]:
    """One step on guarded operands; returns its outputs and ring body.

    Asserts that every guard holds the sentinel afterwards and that ``k``
    and ``gate`` are unchanged.
    """
    data = draw_data(meta, "step")
    idx = meta.arrays()
    device = runner.device
    ring = Guarded(data.ring, GUARD_SLOTS * 2 * KPOOL * HEAD_DIM, device)
    k = Guarded(data.k, GUARD_ROWS * HEAD_DIM, device)
    gate = Guarded(data.gate, GUARD_ROWS * HEAD_DIM, device)
    kind = "step" if fused else "step3"
    model, args = runner.prepare(
        kind,
        KPOOL,
        k=data.k,
        gate=data.gate,
        ape=data.ape,
        tail=ring.view,
        input_row_offsets=idx["input_row_offsets"],
        cache_lengths=idx["cache_lengths"],
        slot_idx=idx["slot_idx"],
    )
    args[1], args[2] = k.view, gate.view
    outs = [to_numpy(out) for out in model.execute(*args)]
    where = f"{kind}, {meta.describe()}"
    flat = ring.read()
    check_guards(flat, ring.guard, ring.shape, "tail", where)
    for name, guarded, host in (("k", k, data.k), ("gate", gate, data.gate)):
        read = guarded.read()
        check_guards(read, guarded.guard, guarded.shape, name, where)
        assert np.array_equal(bits(guarded.body(read)), bits(host)), (
            f"{name} was written, {where}"
        )
    return outs, ring.body(flat)


@pytest.mark.parametrize("device", DEVICE_NAMES)
def test_guarded_fuzz_fused_equals_three_op(
    device: str, runners: Callable[[str], Runner]
) -> None:
    runner = runners(device)
    count = FUZZ_VECTORS[device]
    start = time.perf_counter()
    failures: dict[str, str] = {}
    closed = rows = stashed = 0
    for i in range(count):
        if i == 1:
            start = time.perf_counter()  # the first vector compiles
        meta = draw_meta(STREAM, i)
        try:
            fused, fused_ring = run_guarded(runner, meta, fused=True)
            three, three_ring = run_guarded(runner, meta, fused=False)
            what = meta.describe()
            assert_same_step(fused, three, what)
            assert np.array_equal(bits(fused_ring), bits(three_ring)), (
                f"ring differs (fused vs three-op), {what}"
            )
        except AssertionError as error:
            failures[meta.name] = str(error)
            continue
        closed += int((fused[1] >= 0).sum())
        rows += int(fused[2].any(axis=1).sum())
        ring = draw_data(meta, "step").ring
        stashed += int((bits(fused_ring) != bits(ring)).any())
    assert not failures, (
        f"{len(failures)} of {count} vectors failed on {device}; first: "
        + "\n".join(list(failures.values())[:3])
    )
    # Enough vectors close, compress and stash, so "skip all" cannot pass.
    assert min(closed, rows, stashed) >= count // 10, (closed, rows, stashed)
    seconds = time.perf_counter() - start
    print(f"step fuzz, {device}: {count - 1} in {seconds:.1f} s")


# --------------------------------------------------------------------------
# The graph each path builds (no compile)
# --------------------------------------------------------------------------


def _step_graph(
    fused: bool, emulate_gpu: bool = False
) -> tuple[mla_kpool.KPoolStep, Graph]:
    cpu = DeviceRef.CPU()
    u32, f32 = DType.uint32, DType.float32
    types = [
        BufferType(f32, ["slots", 2, KPOOL, HEAD_DIM], device=cpu),
        TensorType(f32, ["tokens", HEAD_DIM], device=cpu),
        TensorType(f32, ["tokens", HEAD_DIM], device=cpu),
        TensorType(f32, [KPOOL, HEAD_DIM], device=cpu),
        TensorType(u32, ["offsets"], device=cpu),
        TensorType(u32, ["batch"], device=cpu),
        TensorType(u32, ["batch"], device=cpu),
    ]
    with Graph(
        f"step_{fused}",
        input_types=types,
        custom_extensions=[compiled_kernels()],
    ) as graph:
        x = [
            v.buffer if i == 0 else v.tensor for i, v in enumerate(graph.inputs)
        ]
        step = mla_kpool.kpool_step(
            *x, KPOOL, fused=fused, emulate_gpu=emulate_gpu
        )
        graph.output(*step)
    return step, graph


def test_fused_step_is_one_op_with_the_three_op_outputs() -> None:
    fused, fused_graph = _step_graph(True)
    three, three_graph = _step_graph(False)
    text = str(fused_graph)
    assert text.count("mla_kpool.step") == 1, text
    assert "mo.mla.kpool" not in text, text
    assert "mo.mla.kpool.ring_close" in str(three_graph)
    for name in mla_kpool.KPoolStep._fields:
        a, b = getattr(fused, name), getattr(three, name)
        assert a.dtype == b.dtype, name
        assert a.rank == b.rank, name
    assert list(fused.pooled.shape) == list(three.pooled.shape)
    assert list(fused.ring_pooled.shape) == ["batch", HEAD_DIM]
    assert list(fused.first_pool.shape) == ["batch"]
    # The op carries the writers' parameters, emulate_gpu only when set.
    assert f"head_dim = {HEAD_DIM} : index, kpool = {KPOOL} : index" in text
    assert "emulate_gpu" not in text
    _, emulated = _step_graph(True, emulate_gpu=True)
    assert "emulate_gpu = true" in str(emulated)


def test_fused_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="fused must be a bool"):
        mla_kpool.kpool_step(*([None] * 7), KPOOL, fused=1)


def test_stream_models_share_one_graph() -> None:
    """``compile_together`` makes one model with a slice for each op.

    A runner of its own, so that no model compiled before (another file's,
    in the same worker) is left out; the graph is the one the ``runners``
    fixture compiled for this file, which MAX's cache holds.
    """
    runner = Runner("cpu")
    keys = COMPILED_TOGETHER("cpu")
    runner.compile_together(keys)
    shared = [runner.model(key) for key in keys]
    assert all(isinstance(m, SharedModel) for m in shared), shared
    assert len({id(m.model) for m in shared}) == 1
    spans = [(m.inputs, m.outputs) for m in shared]
    for (i0, o0), (i1, o1) in zip(spans, spans[1:], strict=False):
        assert i0.stop == i1.start and o0.stop == o1.start, spans
    assert spans[0][0].start == spans[0][1].start == 0
