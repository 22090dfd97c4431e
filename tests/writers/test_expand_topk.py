"""``mo.mla.kpool.expand_topk`` against the oracle, on every device.

Each case is data (:mod:`expand_topk_cases`, which the GPU emulation's
planted faults share): the call's metadata and how its ``pool_ids`` are
drawn. Every case runs on the CPU kernel, on the GPU
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
from mla_kpool import reference as ref
from mla_kpool._paths import compiled_kernels
from mla_kpool.buffers import to_buffer, to_max_dtype, to_numpy
from mla_kpool.runner import ModelKey, Runner, model_key
from support.expand_topk_cases import (
    CASES,
    CONFIGS,
    INT32_MAX,
    PRODUCTION,
    Case,
    ExpandConfig,
    check_expansion,
    draw_pool_ids,
    run_case,
)
from support.kpool_cases import max_nn_kernels, needs_mojo, run_mojo_suite

HAS_GPU = driver.accelerator_count() > 0


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


@pytest.mark.parametrize("device", DEVICE_NAMES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_oracle(
    device: str, case: Case, runners: Callable[[str], Runner]
) -> None:
    run_case(runners(device), case)


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
