"""``mo.mla.kpool.expand_topk`` against the oracle, on every device.

Each case is data (:class:`Case`): the call's metadata and how its
``pool_ids`` are drawn. Every case runs on the CPU kernel, on the GPU
kernel over the emulated grid, and on a real GPU when there is one, and
must equal :func:`mla_kpool.reference.expand_topk` exactly (integers).
Where the offsets decrease, the contract only promises each row is all ``-1``
or some owning request's expansion, and those rows are checked against
:func:`mla_kpool.reference.expand_topk_candidates`.

Compile budget: ``kpool``, ``pool_topk``, ``always_select_tail`` and the
dtypes are compile-time, so the cases share three configurations that
cover them jointly (:data:`CONFIGS`: MAX's production shape with uint32
metadata, ``kpool = 1`` with int32, no tail with int64), compiled as one
graph per device (``COMPILED_TOGETHER``); batch and token counts are
dynamic. MAX's own wrapper
builds the same graph as the production configuration.

Also here: a seeded fuzz with guarded operands (the output is guarded in
``tests/mojo/test_expand_topk.mojo``, which a graph cannot do), MAX's
unchanged ``max.nn.kernels.mla_kpool_expand_topk`` running this package's
kernel on CPU, parity with MAX's GPU builtin (GPU only), and graph-build
validation.
"""

from __future__ import annotations

import functools
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from max import driver
from max.driver import Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType

import mla_kpool
from conftest import DEVICE_NAMES
from kpool_cases import max_nn_kernels, needs_mojo, run_mojo_suite
from mla_kpool import reference as ref
from mla_kpool._paths import compiled_kernels
from mla_kpool.buffers import to_buffer, to_max_dtype, to_numpy
from mla_kpool.runner import ModelKey, Runner, model_key

HAS_GPU = driver.accelerator_count() > 0
I32, I64, U32 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.uint32)
INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------
# Configurations and cases
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpandConfig:
    """One compiled expand_topk configuration."""

    kpool: int
    pool_topk: int
    always_select_tail: bool
    id_dtype: np.dtype
    index_dtype: np.dtype

    @property
    def id(self) -> str:
        tail = "tail" if self.always_select_tail else "notail"
        return (
            f"k{self.kpool}-top{self.pool_topk}-{tail}-{self.id_dtype.name}"
            f"-{self.index_dtype.name}"
        )

    @property
    def width(self) -> int:
        return ref.expand_topk_width(
            self.pool_topk, self.kpool, self.always_select_tail
        )


#: MAX's production shape (GLM-5-Next: kpool 4, 512 pools, width 2051),
#: MAX's index dtypes.
PRODUCTION = ExpandConfig(4, 512, True, I32, U32)
#: One token per pool: the tail is 0 columns even when asked for.
KPOOL_1 = ExpandConfig(1, 8, True, I32, I32)
#: No tail, a kpool that is not a power of two, 64-bit ids and metadata.
NO_TAIL = ExpandConfig(3, 5, False, I64, I64)
CONFIGS = [PRODUCTION, KPOOL_1, NO_TAIL]


def COMPILED_TOGETHER(device: str) -> list[ModelKey]:  # noqa: N802
    """Every configuration's model, compiled as one graph per host device.

    See the ``runners`` fixture in conftest.py.
    """
    return [
        model_key(
            "expand_topk",
            c.kpool,
            dtype=c.id_dtype,
            pool_topk=c.pool_topk,
            index_dtypes=c.index_dtype,
            always_select_tail=c.always_select_tail,
        )
        for c in CONFIGS
    ]


@dataclass(frozen=True)
class Case:
    """One call: metadata, plus how its ``pool_ids`` are chosen.

    Attributes:
        name: Test id; its CRC seeds the selection.
        config: The compiled configuration it runs on.
        cache: ``cache_lengths``.
        new_tokens: Tokens per request; ``offsets`` is their prefix sum.
        offsets: Explicit ``input_row_offsets`` (bad metadata), instead.
        extra_rows: Token rows past the last offset (no request owns them).
        total_tokens: Explicit token row count (offsets past it), instead.
        selection: ``"mixed"`` (valid ids among ``-1``, other negatives,
            pools not yet complete or in the future, huge ids and
            repeats), ``"valid"`` (distinct visible pools, then ``-1``) or
            ``"unused"`` (all ``-1``).
        ids: Explicit ``pool_ids`` rows, instead of a selection.
        expected: Hand-computed leading columns of each output row (the
            rest ``-1``), checking the oracle itself.
    """

    name: str
    config: ExpandConfig
    cache: tuple[int, ...]
    new_tokens: tuple[int, ...] = ()
    offsets: tuple[int, ...] | None = None
    extra_rows: int = 0
    total_tokens: int | None = None
    selection: str = "mixed"
    ids: tuple[tuple[int, ...], ...] | None = None
    expected: tuple[tuple[int, ...], ...] | None = None

    def row_offsets(self) -> list[int]:
        if self.offsets is not None:
            return list(self.offsets)
        return [0, *np.cumsum(self.new_tokens, dtype=np.int64).tolist()]

    def operands(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(pool_ids, input_row_offsets, cache_lengths)``."""
        cfg = self.config
        offsets = self.row_offsets()
        total = self.total_tokens
        if total is None:
            total = max([0, *offsets[-1:]]) + self.extra_rows
        if self.ids is not None:
            ids = np.array(self.ids, dtype=cfg.id_dtype)
            ids = ids.reshape(-1, cfg.pool_topk)
        else:
            rng = np.random.default_rng(zlib.crc32(self.name.encode()))
            ids = draw_pool_ids(
                rng, cfg, offsets, list(self.cache), total, self.selection
            )
        return (
            ids,
            np.array(offsets, dtype=cfg.index_dtype),
            np.array(self.cache, dtype=cfg.index_dtype),
        )


def _visible_counts(
    offsets: list[int], cache: list[int], total_tokens: int
) -> list[int]:
    """Each row's visible count under well-formed metadata, else a guess."""
    visible = [64] * total_tokens
    for b, c in enumerate(cache):
        for t in range(max(offsets[b], 0), min(offsets[b + 1], total_tokens)):
            visible[t] = max(c + t - offsets[b] + 1, 0)
    return visible


def draw_pool_ids(
    rng: np.random.Generator,
    cfg: ExpandConfig,
    offsets: list[int],
    cache: list[int],
    total_tokens: int,
    selection: str,
) -> np.ndarray:
    """``pool_ids`` for one call, drawn around each row's visible pools."""
    ids = np.full((total_tokens, cfg.pool_topk), -1, dtype=np.int64)
    huge = np.iinfo(cfg.id_dtype).max
    for t, visible in enumerate(_visible_counts(offsets, cache, total_tokens)):
        complete = visible // cfg.kpool
        if selection == "unused":
            continue
        if selection == "valid":
            count = min(complete, cfg.pool_topk)
            ids[t, :count] = rng.permutation(min(complete, 1 << 20))[:count]
            continue
        width = cfg.pool_topk
        kind = rng.integers(10, size=width)
        choices = [
            (kind < 4) & (complete > 0),
            kind == 4,
            kind == 5,
            kind == 6,
            kind == 7,
        ]
        values = [
            rng.integers(max(min(complete, 1 << 40), 1), size=width),
            -1 - rng.integers(3, size=width) * rng.integers(1000, size=width),
            complete + rng.integers(2, size=width),  # filling, or after it
            np.full(width, complete - 1),  # the newest complete pool
            np.full(width, huge) - rng.integers(3, size=width),
        ]
        ids[t] = np.select(choices, values, -1)
        # Kind 8 repeats an earlier column.
        for j in np.flatnonzero(kind[1:] == 8) + 1:
            ids[t, j] = ids[t, rng.integers(j)]
    return ids.astype(cfg.id_dtype)


P = PRODUCTION
CASES = [
    # Decode: one new token per request, across pool boundaries and up to
    # a context that fills all 512 selections.
    Case("decode", P, (0, 1, 3, 4, 7, 100, 2047, 2048), (1,) * 8),
    Case(
        "decode_valid", P, (3, 64, 2047, 4098, 9), (1,) * 5, selection="valid"
    ),
    # Chunked prefill: visible grows along the chunk, so pools complete
    # mid-chunk and the tail shrinks and regrows.
    Case("chunked_prefill", P, (5, 0, 1022, 12), (11, 9, 7, 0)),
    Case("prefill_valid", P, (0, 30), (13, 6), selection="valid"),
    Case("all_unused", P, (0, 9, 4000), (1, 5, 2), selection="unused"),
    Case("empty_batch", P, (), ()),
    Case("rows_no_request_owns", P, (), (), extra_rows=3),
    Case("rows_past_last_offset", P, (8, 3), (2, 1), extra_rows=4),
    Case(
        "offsets_past_tokens",
        P,
        (4, 8, 1),
        offsets=(0, 2, 5, 40),
        total_tokens=7,
    ),
    Case("span_past_tokens", P, (9, 2), offsets=(0, 5, 6), total_tokens=3),
    Case("offsets_decrease", P, (4, 8, 1, 6), offsets=(0, 4, 2, 6, 7)),
    # uint32 cache lengths near and past the int32 position limit: a query
    # may see up to 2^31 positions.
    Case(
        "positions_past_int32",
        P,
        (INT32_MAX - 3, 2**32 - 2, INT32_MAX, 2**31),
        (4, 1, 1, 1),
    ),
    Case(
        "kpool1_decode_and_prefill",
        KPOOL_1,
        (0, 5, 9, 1),
        (1, 6, 3, 0),
    ),
    Case("kpool1_valid", KPOOL_1, (0, 3, 20), (4, 1, 2), selection="valid"),
    Case("negative_cache_length", KPOOL_1, (-3, 4, -1), (2, 2, 1)),
    Case(
        "kpool1_by_hand",
        KPOOL_1,
        (2,),
        (2,),
        ids=((0, 2, 1, -1, 3, 2, -9, 0), (3, 2, 4, 0, 0, -1, 7, 1)),
        expected=((0, 2, 1, 2, 0), (3, 2, 0, 0, 1)),
    ),
    Case("no_tail_mixed", NO_TAIL, (2, 6, 30, 0), (5, 1, 4, 7)),
    Case("no_tail_valid", NO_TAIL, (1, 14), (3, 4), selection="valid"),
    # kpool 3, visible 8 then 9: pool 2 completes on the second row.
    Case(
        "no_tail_by_hand",
        NO_TAIL,
        (7,),
        (2,),
        ids=((2, 1, -1, 0, 5), (-5, 2, 2, 2**63 - 1, 3)),
        expected=((3, 4, 5, 0, 1, 2), (6, 7, 8, 6, 7, 8)),
    ),
    Case(
        "int64_cache_past_int32",
        NO_TAIL,
        (2**40, INT32_MAX - 1, -(2**62)),
        (1, 3, 1),
    ),
    Case("no_tail_decrease", NO_TAIL, (3, 9, 0), offsets=(0, 5, 1, 3)),
]


# --------------------------------------------------------------------------
# Checking one call
# --------------------------------------------------------------------------


def check_expansion(
    got: np.ndarray,
    cfg: ExpandConfig,
    pool_ids: np.ndarray,
    offsets: np.ndarray,
    cache: np.ndarray,
    what: str,
) -> np.ndarray:
    """Asserts ``got`` is the oracle's answer (or a candidate where open).

    Returns:
        The oracle's answer.
    """
    args = (pool_ids, offsets, cache, cfg.kpool, cfg.always_select_tail)
    want = ref.expand_topk(*args)
    assert got.dtype == np.int32, what
    assert got.shape == (pool_ids.shape[0], cfg.width), what
    open_rows = ref.expand_topk_ambiguous_rows(offsets, cache, len(pool_ids))
    if not open_rows.any():
        bad = np.flatnonzero((got != want).any(axis=1))
        assert not bad.size, (
            f"{what}: {bad.size} row(s) differ from the oracle, first row "
            f"{bad[0]}:\n got  {got[bad[0]][:24]}\n want {want[bad[0]][:24]}"
        )
        return want
    for t, candidates in enumerate(ref.expand_topk_candidates(*args)):
        assert (candidates == got[t]).all(axis=1).any(), (
            f"{what}: row {t} is neither all -1 nor any owner's expansion:"
            f" {got[t][:24]}"
        )
    return want


def _run(runner: Runner, case: Case) -> None:
    cfg = case.config
    pool_ids, offsets, cache = case.operands()
    (got,) = runner.run(
        "expand_topk",
        cfg.kpool,
        pool_ids=pool_ids,
        input_row_offsets=offsets,
        cache_lengths=cache,
        always_select_tail=cfg.always_select_tail,
    )
    want = check_expansion(
        got,
        cfg,
        pool_ids,
        offsets,
        cache,
        f"{case.name} on {runner.device_name}",
    )
    if case.expected is not None:
        for t, lead in enumerate(case.expected):
            row = np.full(cfg.width, -1)
            row[: len(lead)] = lead
            np.testing.assert_array_equal(want[t], row, f"oracle row {t}")


@pytest.mark.parametrize("device", DEVICE_NAMES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_oracle(
    device: str, case: Case, runners: Callable[[str], Runner]
) -> None:
    _run(runners(device), case)


def test_cases_cover_the_contract() -> None:
    """The cases reach every kind of column and row the contract names."""
    seen: Counter[str] = Counter()
    for case in CASES:
        cfg = case.config
        ids, offsets, cache = case.operands()
        out = ref.expand_topk(
            ids, offsets, cache, cfg.kpool, cfg.always_select_tail
        )
        if not len(out):
            seen["empty call"] += 1
        seen["all -1 row"] += int((out == -1).all(axis=1).sum())
        seen["full row"] += int((out >= 0).all(axis=1).sum())
        seen["negative id"] += int((ids < -1).sum())
        seen["repeated id"] += sum(
            len(row[row >= 0]) - len(set(row[row >= 0])) for row in ids
        )
        if ref.expand_topk_ambiguous_rows(offsets, cache, len(ids)).any():
            seen["decreasing offsets"] += 1
    assert seen["empty call"] and seen["decreasing offsets"], seen
    assert seen["all -1 row"] and seen["full row"], seen
    assert seen["negative id"] and seen["repeated id"], seen


# --------------------------------------------------------------------------
# Seeded fuzz with guarded operands
# --------------------------------------------------------------------------

#: Elements of guard on each side of every guarded operand.
GUARD = 64
FUZZ_CALLS = 150


def _fuzz_metadata(
    rng: np.random.Generator, cfg: ExpandConfig
) -> tuple[list[int], list[int], int]:
    """Mostly plausible metadata, often broken on purpose."""
    batch = int(rng.integers(0, 7))
    offsets = [0, *np.cumsum(rng.integers(0, 9, batch)).tolist()]
    cache = rng.integers(0, 3000, batch).tolist()
    signed = cfg.index_dtype.kind == "i"
    for b in range(batch):
        roll = rng.integers(12)
        if roll == 0:
            cache[b] = INT32_MAX - int(rng.integers(12))
        elif roll == 1:
            cache[b] = -int(rng.integers(1, 9)) if signed else 2**32 - 2
    total = offsets[-1] + int(rng.integers(0, 3))
    if batch and rng.integers(4) == 0:
        b = int(rng.integers(1, batch + 1))
        offsets[b] = int(rng.integers(0, total + 6))
    return offsets, cache, total


class Guarded:
    """An operand as a view into a device buffer with guards on both sides.

    The guards hold 0: read as a pool id it names pool 0, which every query
    past its first pool sees, so an out-of-bounds read of ``pool_ids``
    shows up as positions the oracle does not expect.
    """

    def __init__(self, body: np.ndarray, device: Device) -> None:
        self.body = body
        flat = np.zeros(2 * GUARD + body.size, body.dtype)
        flat[GUARD : GUARD + body.size] = body.ravel()
        self.flat = flat
        self.parent: Buffer = to_buffer(flat, device)
        self.view: Buffer = (
            self.parent[GUARD : GUARD + body.size].view(
                to_max_dtype(body.dtype), body.shape
            )
            if body.size
            else to_buffer(body, device)
        )

    def check_untouched(self, what: str) -> None:
        after = to_numpy(self.parent)
        assert np.array_equal(after, self.flat), f"operand written, {what}"


@pytest.mark.parametrize("device", DEVICE_NAMES)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.id)
def test_fuzz_guarded(
    device: str, cfg: ExpandConfig, runners: Callable[[str], Runner]
) -> None:
    runner = runners(device)
    seen: Counter[str] = Counter()
    for call in range(FUZZ_CALLS):
        seed = zlib.crc32(f"expand fuzz {cfg.id} {call}".encode())
        rng = np.random.default_rng(seed)
        offsets, cache, total = _fuzz_metadata(rng, cfg)
        ids = draw_pool_ids(rng, cfg, offsets, cache, total, "mixed")
        offsets_a = np.array(offsets, cfg.index_dtype)
        cache_a = np.array(cache, cfg.index_dtype)
        model, _ = runner.prepare(
            "expand_topk",
            cfg.kpool,
            pool_ids=ids,
            input_row_offsets=offsets_a,
            cache_lengths=cache_a,
            always_select_tail=cfg.always_select_tail,
        )
        guarded = [Guarded(a, runner.device) for a in (ids, offsets_a, cache_a)]
        (out,) = model.execute(*(g.view for g in guarded))
        what = f"{cfg.id} on {device}, seed {seed}"
        want = check_expansion(
            to_numpy(out), cfg, ids, offsets_a, cache_a, what
        )
        for g in guarded:
            g.check_untouched(what)
        seen["positions"] += int((want >= 0).sum())
        seen["all -1 rows"] += int((want == -1).all(axis=1).sum())
        seen["empty"] += int(total == 0)
        decreasing = bool(np.any(np.diff(offsets) < 0))
        seen["decreasing offsets"] += int(decreasing)
    assert all(
        seen[k]
        for k in ("positions", "all -1 rows", "empty", "decreasing offsets")
    ), seen


# --------------------------------------------------------------------------
# The output guards and the CPU/GPU agreement, in Mojo
# --------------------------------------------------------------------------


@needs_mojo
def test_output_guards_and_emulated_grid_in_mojo() -> None:
    """tests/mojo/test_expand_topk.mojo: guarded outputs, CPU == GPU grid."""
    output = run_mojo_suite("tests/mojo/test_expand_topk.mojo")
    assert "5 tests run: 5 passed" in output, output


# --------------------------------------------------------------------------
# MAX's own wrapper, and MAX's GPU builtin
# --------------------------------------------------------------------------


def _graph(
    cfg: ExpandConfig,
    device: DeviceRef,
    expand: Callable[..., Any],
    extensions: list[Path],
    name: str,
) -> Graph:
    inputs = [
        TensorType(
            to_max_dtype(cfg.id_dtype), ["tokens", cfg.pool_topk], device
        ),
        TensorType(to_max_dtype(cfg.index_dtype), ["offsets"], device),
        TensorType(to_max_dtype(cfg.index_dtype), ["batch"], device),
    ]
    with Graph(name, input_types=inputs, custom_extensions=extensions) as g:
        x = [value.tensor for value in g.inputs]
        g.output(expand(*x, cfg.kpool, cfg.always_select_tail))
    return g


def _op_text(graph: Graph) -> list[str]:
    return [line.strip() for line in str(graph).splitlines() if "mo." in line]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.id)
def test_max_wrapper_builds_the_same_op(cfg: ExpandConfig) -> None:
    """Ours and MAX's wrapper add the same op (no compile, any host).

    Both graphs load the kernels, so they differ in nothing else: ours
    would load them anyway (and record that on the graph), MAX's does not.
    The precompiled package saves a precompile per graph.
    """
    kernels = [compiled_kernels()]
    ours = _graph(cfg, DeviceRef.CPU(), mla_kpool.expand_topk, kernels, "same")
    theirs = _graph(
        cfg,
        DeviceRef.CPU(),
        max_nn_kernels().mla_kpool_expand_topk,
        kernels,
        "same",
    )
    assert _op_text(ours) == _op_text(theirs)
    assert any("mo.mla.kpool.expand_topk" in line for line in _op_text(ours))
    emulated = _graph(
        cfg,
        DeviceRef.CPU(),
        functools.partial(mla_kpool.expand_topk, emulate_gpu=True),
        [compiled_kernels()],  # MAX's builtin has no emulate_gpu parameter
        "same",
    )
    assert "emulate_gpu" in str(emulated) and "emulate_gpu" not in str(ours)


def test_max_wrapper_runs_our_kernel_on_cpu() -> None:
    """An unchanged MAX pipeline call compiles on CPU with KERNELS loaded.

    MAX's builtin is GPU-only; on a CPU graph the op name resolves to this
    package's kernel, built as MAX's wrapper builds it (the runner compiles
    the production configuration inside this file's shared graph).
    """
    cfg = PRODUCTION
    graph = _graph(
        cfg,
        DeviceRef.CPU(),
        max_nn_kernels().mla_kpool_expand_topk,
        [compiled_kernels()],
        f"mla_kpool_expand_topk_{to_max_dtype(cfg.id_dtype)}_k{cfg.kpool}"
        f"_t{cfg.pool_topk}_tail",
    )
    model = InferenceSession(devices=[driver.CPU()]).load(graph)
    for case in CASES:
        if case.config != cfg:
            continue
        ids, offsets, cache = case.operands()
        (out,) = model.execute(*(to_buffer(a) for a in (ids, offsets, cache)))
        check_expansion(
            to_numpy(out), cfg, ids, offsets, cache, f"MAX wrapper, {case.name}"
        )


@pytest.mark.parametrize("cfg", [PRODUCTION], ids=lambda c: c.id)
def test_parity_graphs_build(cfg: ExpandConfig) -> None:
    """The GPU parity graphs build, ours and the builtin (any host)."""
    gpu = DeviceRef.GPU()
    for expand, ext in (
        (mla_kpool.expand_topk, [compiled_kernels()]),
        (max_nn_kernels().mla_kpool_expand_topk, []),
    ):
        text = str(_graph(cfg, gpu, expand, ext, "parity_expand_topk"))
        assert "mo.mla.kpool.expand_topk" in text


@pytest.mark.gpu
@pytest.mark.skipif(
    not HAS_GPU,
    reason="MAX's mla_kpool builtins are GPU-only and there is no "
    "accelerator (max.driver.accelerator_count() == 0)",
)
@pytest.mark.parametrize("cfg", [PRODUCTION], ids=lambda c: c.id)
def test_matches_max_builtin(cfg: ExpandConfig) -> None:
    """Ours equals MAX's builtin where MAX documents the answer.

    That is well-formed metadata and selections of visible complete pools
    (or ``-1``): MAX's docstring says nothing about other ids, which ours
    skips (checked against the oracle above), so the builtin's answer for
    them is not compared. Both must also equal the oracle.
    """
    gpu = DeviceRef.GPU()
    session = InferenceSession(devices=[driver.CPU(), driver.Accelerator()])
    models = {
        label: session.load(_graph(cfg, gpu, expand, ext, f"parity_{label}"))
        for label, expand, ext in (
            ("ours", mla_kpool.expand_topk, [compiled_kernels()]),
            ("builtin", max_nn_kernels().mla_kpool_expand_topk, []),
        )
    }
    accel = driver.Accelerator()
    for case in CASES:
        # Well-formed metadata only: the builtin documents nothing else.
        if case.config != cfg or case.offsets is not None or case.extra_rows:
            continue
        if case.selection == "mixed" or not case.cache:
            continue
        if any(c >= 2**31 - 64 for c in case.cache):
            continue
        ids, offsets, cache = case.operands()
        outs = {}
        for label, model in models.items():
            args = [to_buffer(a, accel) for a in (ids, offsets, cache)]
            (out,) = model.execute(*args)
            outs[label] = to_numpy(out)
            check_expansion(
                outs[label], cfg, ids, offsets, cache, f"{label}, {case.name}"
            )
        np.testing.assert_array_equal(outs["ours"], outs["builtin"], case.name)


# --------------------------------------------------------------------------
# Graph-build validation
# --------------------------------------------------------------------------


def _build(
    pool_ids: Any = None,
    offsets: Any = None,
    cache: Any = None,
    kpool: Any = 4,
    always_select_tail: Any = True,
    **kwargs: Any,
) -> TensorType:
    cpu = DeviceRef.CPU()
    types = [
        TensorType(DType.int32, ["tokens", 16], cpu)
        if pool_ids is None
        else pool_ids,
        TensorType(DType.uint32, ["offsets"], cpu)
        if offsets is None
        else offsets,
        TensorType(DType.uint32, ["batch"], cpu) if cache is None else cache,
    ]
    with Graph("validate_expand_topk", input_types=types) as g:
        x = [value.tensor for value in g.inputs]
        out = mla_kpool.expand_topk(*x, kpool, always_select_tail, **kwargs)
        g.output(out)
    return out.type


def _t(dtype: DType, shape: list[Any], device: DeviceRef | None = None):
    return TensorType(dtype, shape, device or DeviceRef.CPU())


@dataclass(frozen=True)
class Reject:
    """One bad argument and what :func:`mla_kpool.expand_topk` raises."""

    id: str
    arg: str
    error: type[Exception]
    kwargs: tuple[tuple[str, Any], ...]


REJECTS = [
    Reject("kpool_zero", "kpool", ValueError, (("kpool", 0),)),
    Reject("kpool_float", "kpool", TypeError, (("kpool", 4.0),)),
    Reject("kpool_bool", "kpool", TypeError, (("kpool", True),)),
    Reject(
        "tail_int",
        "always_select_tail",
        TypeError,
        (("always_select_tail", 1),),
    ),
    Reject(
        "ids_rank1",
        "pool_ids",
        ValueError,
        (("pool_ids", _t(DType.int32, [8])),),
    ),
    Reject(
        "ids_rank3",
        "pool_ids",
        ValueError,
        (("pool_ids", _t(DType.int32, [8, 2, 16])),),
    ),
    Reject(
        "ids_symbolic_topk",
        "pool_ids",
        ValueError,
        (("pool_ids", _t(DType.int32, ["tokens", "topk"])),),
    ),
    Reject(
        "ids_uint32",
        "pool_ids",
        ValueError,
        (("pool_ids", _t(DType.uint32, ["tokens", 16])),),
    ),
    Reject(
        "ids_float",
        "pool_ids",
        ValueError,
        (("pool_ids", _t(DType.float32, ["tokens", 16])),),
    ),
    Reject(
        "offsets_rank2",
        "input_row_offsets",
        ValueError,
        (("offsets", _t(DType.uint32, [4, 2])),),
    ),
    Reject(
        "offsets_float",
        "input_row_offsets",
        ValueError,
        (("offsets", _t(DType.float32, ["offsets"])),),
    ),
    Reject(
        "cache_float",
        "cache_lengths",
        ValueError,
        (("cache", _t(DType.float32, ["batch"])),),
    ),
    Reject(
        "static_batch_mismatch",
        "input_row_offsets",
        ValueError,
        (
            ("offsets", _t(DType.uint32, [4])),
            ("cache", _t(DType.uint32, [4])),
        ),
    ),
    Reject(
        "offsets_on_gpu",
        "input_row_offsets",
        ValueError,
        (("offsets", _t(DType.uint32, ["offsets"], DeviceRef.GPU())),),
    ),
    Reject(
        "emulate_on_gpu",
        "emulate_gpu",
        ValueError,
        (
            ("pool_ids", _t(DType.int32, ["tokens", 16], DeviceRef.GPU())),
            ("offsets", _t(DType.uint32, ["offsets"], DeviceRef.GPU())),
            ("cache", _t(DType.uint32, ["batch"], DeviceRef.GPU())),
            ("emulate_gpu", True),
        ),
    ),
    Reject("emulate_not_bool", "emulate_gpu", TypeError, (("emulate_gpu", 1),)),
]


@pytest.mark.parametrize("case", REJECTS, ids=lambda c: c.id)
def test_rejects(case: Reject) -> None:
    with pytest.raises(case.error) as info:
        _build(**dict(case.kwargs))
    assert str(info.value).startswith(case.arg), str(info.value)


@pytest.mark.parametrize(
    ("kpool", "tail", "topk", "width"),
    [(4, True, 16, 67), (4, False, 16, 64), (1, True, 16, 16), (7, True, 0, 6)],
)
def test_output_type(kpool: int, tail: bool, topk: int, width: int) -> None:
    ids = _t(DType.int64, ["tokens", topk])
    out = _build(ids, kpool=kpool, always_select_tail=tail)
    assert out.dtype == DType.int32
    assert [str(d) for d in out.shape] == ["tokens", str(width)]
