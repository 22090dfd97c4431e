"""The runner's op table: each op's operands, graph types, key and checks.

:data:`OPS` describes every op :class:`mla_kpool.runner.Runner` runs once,
by the :mod:`mla_kpool.graph` wrapper it calls and the operands it passes
it, listed by name; :func:`model_key` keys a model from a
configuration, and :meth:`Op.check` judges a call's host operands as the
graph wrapper would, before anything compiles or is written. The names
are also importable from :mod:`mla_kpool.runner`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from max import driver
from max.driver import Buffer
from max.dtype import DType
from max.graph import (
    BufferType,
    BufferValue,
    DeviceRef,
    Graph,
    TensorType,
    TensorValue,
)

from . import _validate as v
from . import graph as kpool_graph
from .buffers import to_max_dtype, zeros


@dataclass(frozen=True)
class ModelKey:
    """What a compiled model is specialized on.

    Make one with :func:`model_key` (from a configuration) or let
    :meth:`Runner.prepare` derive it from a call's arrays.

    Attributes:
        kind: An op of :data:`OPS`: ``"ring_close"``, ``"compress"``,
            ``"seed_tail"``, ``"step"`` (the fused ``mla_kpool.step`` op),
            ``"step3"`` (the three writers and the offsets helper,
            ``kpool_step(fused=False)``) or ``"expand_topk"``.
        dtype: Key dtype (``k``, ``gate``, ``tail``, pooled outputs); for
            expand_topk, the dtype of ``pool_ids``.
        kpool: Tokens per pool.
        head_dim: Channels per key (0 for expand_topk).
        ring_len: Ring length ``R`` (``kpool`` or a multiple); 0 for compress
            and expand_topk.
        index_dtypes: Dtypes of the index operands, in argument order.
        pool_topk: Selected pools per token row (expand_topk only).
        always_select_tail: Whether rows carry the pool still filling
            (expand_topk only).
    """

    kind: str
    dtype: DType
    kpool: int
    head_dim: int
    ring_len: int
    index_dtypes: tuple[DType, ...]
    pool_topk: int = 0
    always_select_tail: bool = False


#: Graph dims of each operand, from the model key. ``"tokens"``, ``"slots"``,
#: ``"offsets"`` and ``"batch"`` are symbolic: they vary per call.
_DIMS: dict[str, Callable[[ModelKey], list[Any]]] = {
    "tail": lambda key: ["slots", 2, key.ring_len, key.head_dim],
    "k": lambda key: ["tokens", key.head_dim],
    "gate": lambda key: ["tokens", key.head_dim],
    "ape": lambda key: [key.kpool, key.head_dim],
    "pool_ids": lambda key: ["tokens", key.pool_topk],
    "input_row_offsets": lambda key: ["offsets"],
    "pool_row_offsets": lambda key: ["offsets"],
    "cache_lengths": lambda key: ["batch"],
    "slot_idx": lambda key: ["batch"],
}


#: Tensor operands that are float32 whatever the key dtype.
_FLOAT32 = {"ape": DType.float32}

#: Symbolic dim sizes of an idle call (:meth:`Op.idle_operands`).
_IDLE_SIZES = {"tokens": 0, "slots": 0, "batch": 0, "offsets": 1}


#: Operands that carry per-request or per-call indices; every other operand
#: before ``kpool`` is the ring, a float operand or ``pool_ids``.
_INDEX_OPERANDS = (
    "input_row_offsets",
    "pool_row_offsets",
    "cache_lengths",
    "slot_idx",
)


@dataclass(frozen=True)
class Op:
    """One op the runner can compile and run.

    Attributes:
        kind: The :attr:`ModelKey.kind` it is compiled under.
        wrapper: The :mod:`mla_kpool.graph` function that adds it to a
            graph; called as ``wrapper(*operands, kpool, emulate_gpu=...,
            **options)``.
        operands: Every operand's name, in the wrapper's argument order
            (its parameters before ``kpool``; tests/writers/test_runner_ops.py
            checks that they agree).
        options: Fixed keyword arguments for ``wrapper``.
        selects: Whether the wrapper takes ``always_select_tail``
            (expand_topk), which :attr:`ModelKey.always_select_tail` gives.
    """

    kind: str
    wrapper: Callable[..., Any]
    operands: tuple[str, ...]
    options: tuple[tuple[str, Any], ...] = ()
    selects: bool = False

    @functools.cached_property
    def tensors(self) -> tuple[str, ...]:
        """The ring and float (or ``pool_ids``) operands, in order.

        ``"tail"``, when present, is first: the ring buffer the op updates
        in place, which the caller owns.
        """
        return tuple(n for n in self.operands if n not in _INDEX_OPERANDS)

    @functools.cached_property
    def indices(self) -> tuple[str, ...]:
        """The index operands in argument order, after :attr:`tensors`."""
        return tuple(n for n in self.operands if n in _INDEX_OPERANDS)

    @property
    def in_place(self) -> bool:
        """Whether the first operand is the ring, updated in place."""
        return self.tensors[0] == "tail"

    def operand_types(self, key: ModelKey) -> list[tuple[str, DType, list]]:
        """``(name, dtype, dims)`` of each operand for ``key``, in order."""
        named = [(n, _FLOAT32.get(n, key.dtype)) for n in self.tensors]
        named += zip(self.indices, key.index_dtypes, strict=True)
        return [(name, dtype, _DIMS[name](key)) for name, dtype in named]

    def input_types(
        self, key: ModelKey, device: DeviceRef, suffix: str = ""
    ) -> list[TensorType | BufferType]:
        """The graph's input types for ``key``, in argument order.

        ``suffix`` goes on every symbolic dim, so that ops compiled into
        one graph (:meth:`Runner.compile_together`) keep their dims apart.
        """
        return [
            (BufferType if name == "tail" else TensorType)(
                dtype,
                [f"{d}{suffix}" if isinstance(d, str) else d for d in dims],
                device,
            )
            for name, dtype, dims in self.operand_types(key)
        ]

    def idle_operands(
        self, key: ModelKey, device: driver.Device
    ) -> list[Buffer]:
        """Operands on which the op does nothing, as buffers on ``device``.

        No ring slots, tokens or requests: every symbolic dim is 0 except
        ``offsets``, which is ``[0]``; ``ape`` is zeros. The zeros are
        written when this returns (:func:`mla_kpool.buffers.zeros`), so a
        model run at once reads them.
        """
        return [
            zeros([_IDLE_SIZES.get(d, d) for d in dims], dtype, device)
            for _, dtype, dims in self.operand_types(key)
        ]

    def graph_name(self, key: ModelKey, emulate_gpu: bool) -> str:
        """The graph's name: the op and everything it is specialized on.

        What a profiler trace needs to tell two compiled instances apart.
        """
        name = f"mla_kpool_{self.kind}_{key.dtype}_k{key.kpool}"
        if self.selects:
            tail = "tail" if key.always_select_tail else "notail"
            name += f"_t{key.pool_topk}_{tail}"
        else:
            name += f"_d{key.head_dim}_r{key.ring_len}"
        return name + "_gpu_emulated" if emulate_gpu else name

    def add(
        self, values: Sequence[Any], key: ModelKey, emulate_gpu: bool
    ) -> list[Any]:
        """Adds the op on the graph's input ``values``; returns its outputs."""
        options = dict(self.options)
        if self.selects:
            options["always_select_tail"] = key.always_select_tail
        result = self.wrapper(
            *values, key.kpool, emulate_gpu=emulate_gpu, **options
        )
        if result is None or isinstance(result, tuple):
            return list(result or ())
        return [result]

    def host_operands(self, operands: Mapping[str, Any]) -> list[Any]:
        """This op's operands from ``operands``, in argument order.

        The ring stays the caller's buffer; ``ape`` given as a list becomes
        float32 and index operands given as lists become uint32 arrays
        (arrays keep their dtype: :meth:`check` judges it); names the op
        does not take are ignored.

        Raises:
            TypeError: If an operand the op takes is missing or ``None``.
        """
        missing = [n for n in self.operands if operands.get(n) is None]
        if missing:
            raise TypeError(f"{self.kind} needs {', '.join(missing)}")
        values: list[Any] = []
        for name in self.tensors:
            value = operands[name]
            if name == "ape" and not isinstance(value, np.ndarray):
                value = np.asarray(value, np.float32)
            values.append(value)
        values += [_index_array(operands[n]) for n in self.indices]
        return values

    def check(self, kpool: object, values: Sequence[Any]) -> None:
        """Checks a call's host operands as the graph wrapper checks its own.

        The operands' concrete shapes and dtypes become the inputs of a
        throwaway graph (nothing is added to it or compiled) and go through
        the wrapper's own checks (:mod:`mla_kpool._validate`), so a
        mismatch is refused by name before MAX sees it and before anything
        is written to the ring. Checked: the ring's rank and shape,
        ``k`` and ``gate`` of the same rows and of the ring's head_dim and
        dtype, ``ape`` float32 ``[kpool, head_dim]``, ``pool_ids``, and
        index operands of rank 1, an index dtype and one batch
        (``[batch + 1]`` row offsets). Metadata *values* are the ops'
        contract (:func:`mla_kpool.check_metadata` checks them).

        Args:
            kpool: Tokens per pool.
            values: :meth:`host_operands`' result.

        Raises:
            TypeError: If the ring is not a ``max.driver.Buffer``, another
                operand not a NumPy array, ``kpool`` not an int, or
                ``pool_ids`` not int32 or int64
                (:func:`mla_kpool.expand_topk`'s check).
            ValueError: If a rank, shape or dtype (float or index) is wrong
                or the operands disagree; the message names the operand,
                what it must be and what it is.
        """
        named = dict(zip(self.operands, values, strict=True))
        types = [_graph_type(name, named[name]) for name in self.operands]
        with Graph(f"check_{self.kind}", input_types=types) as g:
            got = {
                name: value.buffer if name == "tail" else value.tensor
                for name, value in zip(self.operands, g.inputs, strict=True)
            }
            kpool = v.check_kpool(kpool)
            if "k" in got:
                _, _, head_dim = v.check_keys(got["k"], got["gate"])
                if "tail" in got:
                    _keys_fit_ring(got["k"], got["tail"])
                    v.check_tail(got["tail"], kpool, head_dim, got["k"].dtype)
                if "ape" in got:
                    v.check_ape(got["ape"], kpool, head_dim)
            if "pool_ids" in got:
                kpool_graph._check_pool_ids(got["pool_ids"])
            extra = {n: int(n.endswith("row_offsets")) for n in self.indices}
            for name in self.indices:
                what = "batch + 1" if extra[name] else "batch"
                v.check_index(name, got[name], what)
            v.check_batch(
                got["cache_lengths"],
                **{
                    name: (got[name], extra[name])
                    for name in self.indices
                    if name != "cache_lengths"
                },
            )

    def key(
        self, kpool: int, values: Sequence[Any], always_select_tail: bool = True
    ) -> ModelKey:
        """The model key of a call on ``values`` (:meth:`host_operands`).

        The second dim of the first non-ring tensor gives ``head_dim``
        (``k``) or, for expand_topk, ``pool_topk`` (``pool_ids``).
        """
        named = dict(zip(self.operands, values, strict=True))
        first = named[self.tensors[1 if self.in_place else 0]]
        width = "pool_topk" if self.selects else "head_dim"
        sizes = {width: int(first.shape[1])}
        if self.in_place:
            sizes["ring_len"] = int(named["tail"].shape[2])
        return model_key(
            self.kind,
            kpool,
            dtype=first.dtype,
            index_dtypes=[named[n].dtype for n in self.indices],
            always_select_tail=always_select_tail,
            **sizes,
        )


#: Each wrapper's operands, in its argument order.
_RING_CLOSE = (
    "tail", "k", "gate", "ape",
    "input_row_offsets", "cache_lengths", "slot_idx",
)  # fmt: skip
_COMPRESS = (
    "k", "gate", "ape",
    "input_row_offsets", "pool_row_offsets", "cache_lengths",
)  # fmt: skip
_SEED_TAIL = (
    "tail", "k", "gate",
    "input_row_offsets", "cache_lengths", "slot_idx",
)  # fmt: skip
_STEP = (
    "tail", "k", "gate", "ape",
    "input_row_offsets", "cache_lengths", "slot_idx",
)  # fmt: skip
_EXPAND = ("pool_ids", "input_row_offsets", "cache_lengths")

#: Every op the runner runs, by :attr:`ModelKey.kind`.
OPS: dict[str, Op] = {
    op.kind: op
    for op in (
        Op("ring_close", kpool_graph.ring_close, _RING_CLOSE),
        Op("compress", kpool_graph.compress, _COMPRESS),
        Op("seed_tail", kpool_graph.seed_tail, _SEED_TAIL),
        Op("step", kpool_graph.kpool_step, _STEP),
        Op("step3", kpool_graph.kpool_step, _STEP, (("fused", False),)),
        Op("expand_topk", kpool_graph.expand_topk, _EXPAND, selects=True),
    )
}


def get_op(kind: str) -> Op:
    """The op of :data:`OPS` named ``kind``.

    Raises:
        ValueError: If ``kind`` is not one of :data:`OPS`.
    """
    try:
        return OPS[kind]
    except KeyError:
        raise ValueError(
            f"kind must be one of {', '.join(OPS)}, got {kind!r}"
        ) from None


def _max_dtype(dtype: DType | npt.DTypeLike) -> DType:
    return dtype if isinstance(dtype, DType) else to_max_dtype(dtype)


def model_key(
    kind: str,
    kpool: int,
    *,
    dtype: DType | npt.DTypeLike,
    head_dim: int = 0,
    ring_len: int = 0,
    index_dtypes: DType | npt.DTypeLike | Sequence[Any] = np.uint32,
    pool_topk: int = 0,
    always_select_tail: bool = True,
) -> ModelKey:
    """The :class:`ModelKey` of an op on a configuration.

    What :meth:`Runner.model` takes to compile a model ahead of its first
    call; :meth:`Runner.prepare` makes the same key from the call's arrays.

    Args:
        kind: An op of :data:`OPS`.
        kpool: Tokens per pool.
        dtype: Key dtype (for expand_topk, that of ``pool_ids``), NumPy or
            MAX.
        head_dim: Channels per key (writers and steps).
        ring_len: Ring length (ops that take the ring).
        index_dtypes: One dtype for every index operand (uint32, MAX's,
            by default) or one per operand, in argument order.
        pool_topk: Selected pools per token row (expand_topk).
        always_select_tail: Whether rows carry the pool still filling
            (expand_topk; ignored by the other ops).

    Returns:
        The key.

    Raises:
        ValueError: If ``kind`` is not an op of :data:`OPS`.
    """
    op = get_op(kind)
    if isinstance(index_dtypes, (list, tuple)):
        dtypes = tuple(_max_dtype(d) for d in index_dtypes)
    else:
        dtypes = (_max_dtype(index_dtypes),) * len(op.indices)
    return ModelKey(
        kind=kind,
        dtype=_max_dtype(dtype),
        kpool=int(kpool),
        head_dim=int(head_dim),
        ring_len=int(ring_len),
        index_dtypes=dtypes,
        pool_topk=int(pool_topk),
        always_select_tail=bool(always_select_tail) and op.selects,
    )


def _graph_type(name: str, value: Any) -> TensorType | BufferType:
    """The graph input type of one host operand, its shape static.

    Raises:
        TypeError: If the ring is not a ``Buffer`` or another operand not a
            NumPy array.
        ValueError: If an array's dtype is not one MAX has.
    """
    cpu = DeviceRef.CPU()
    if name == "tail":
        if not isinstance(value, Buffer):
            raise TypeError(
                "tail must be a max.driver.Buffer (Runner.new_ring), got"
                f" {type(value).__name__}"
            )
        return BufferType(value.dtype, list(value.shape), cpu)
    if not isinstance(value, np.ndarray):
        raise TypeError(
            f"{name} must be a NumPy array, got {type(value).__name__}"
        )
    try:
        dtype = to_max_dtype(value.dtype)
    except (TypeError, ValueError):
        raise ValueError(
            f"{name} dtype must be one MAX has, got {value.dtype}"
        ) from None
    return TensorType(dtype, list(value.shape), cpu)


def _keys_fit_ring(k: TensorValue, tail: BufferValue) -> None:
    """Refuses keys of another dtype or head_dim than the ring's.

    The ring is the caller's persistent state, so the message names ``k``
    (a ring of the wrong shape is named by :func:`_validate.check_tail`).
    """
    if k.dtype != tail.dtype:
        raise ValueError(
            f"k dtype must be the ring's (tail) {tail.dtype.name}, got"
            f" {k.dtype.name}"
        )
    if tail.rank == 4 and k.shape[1] != tail.shape[3]:
        raise ValueError(
            f"k must be [tokens, head_dim={tail.shape[3]}] to match the ring"
            f" (tail {v.fmt_shape(tail.shape)}), got {v.fmt_shape(k.shape)}"
        )


def _index_array(values: npt.ArrayLike) -> np.ndarray:
    """An index operand as an array; Python lists become uint32 (MAX's)."""
    if isinstance(values, np.ndarray):
        return values
    return np.asarray(values, dtype=np.uint32)
