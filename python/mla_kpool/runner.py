"""Compile-once, run-many execution of the k-pool writers on NumPy data.

The demo, the benchmark and the tests all need the same thing: build a small
MAX graph around one writer (or the whole step), compile it once per
configuration, and call it many times with NumPy arrays of any batch and
token count. Graph dims that vary per call are symbolic (``"tokens"``,
``"batch"``, ``"offsets"``, ``"slots"``), so one compiled model serves every
batch shape; only dtype, ``kpool``, ``head_dim``, the ring length and the
index dtypes (compile-time parameters of the kernels) pick a new model.

Each op is described once, in :data:`OPS`, by the :mod:`mla_kpool.graph`
wrapper it calls (its operands are read from the wrapper's signature);
:meth:`Runner.prepare` and :meth:`Runner.run` take any op by name from it,
and :func:`model_key` keys a model from a configuration. Only the step has a
method of its own (:meth:`Runner.step`: one :class:`mla_kpool.calls.CallInputs`
in, a :class:`StepResult` out), since the table cannot say that.

The ring is persistent state, so it lives in a ``max.driver.Buffer`` that
the caller owns (:meth:`Runner.new_ring`) and the in-place ops update.

The device ``"gpu-emulated"`` builds CPU graphs whose ops run their GPU
kernels over an emulated grid on the host (``emulate_gpu=True`` in
:mod:`mla_kpool.graph`), so the GPU code can be checked against the oracle
on a machine without an accelerator.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from max import driver
from max.driver import Buffer
from max.dtype import DType
from max.engine import InferenceSession, Model
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
from . import index_runner
from ._paths import KERNELS, builtin_kernels_only, compiled_kernels
from .buffers import to_buffer, to_max_dtype, to_numpy
from .calls import CallInputs, PoolRow, pools_of_call
from .index_cache import PagedIndexCache
from .index_runner import IndexKey


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

    Its operands, their order and its options are read from the
    :mod:`mla_kpool.graph` wrapper's signature: the parameters before
    ``kpool`` are the operands, and a wrapper that takes
    ``always_select_tail`` gets :attr:`ModelKey.always_select_tail`.

    Attributes:
        kind: The :attr:`ModelKey.kind` it is compiled under.
        wrapper: The :mod:`mla_kpool.graph` function that adds it to a
            graph; called as ``wrapper(*operands, kpool, emulate_gpu=...,
            **options)``.
        options: Fixed keyword arguments for ``wrapper``.
    """

    kind: str
    wrapper: Callable[..., Any]
    options: tuple[tuple[str, Any], ...] = ()

    @functools.cached_property
    def _parameters(self) -> list[str]:
        return list(inspect.signature(self.wrapper).parameters)

    @functools.cached_property
    def operands(self) -> tuple[str, ...]:
        """Every operand's name, in argument order."""
        names = self._parameters
        return tuple(names[: names.index("kpool")])

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
    def selects(self) -> bool:
        """Whether the op takes ``always_select_tail`` (expand_topk)."""
        return "always_select_tail" in self._parameters

    @property
    def in_place(self) -> bool:
        """Whether the first operand is the ring, updated in place."""
        return self.tensors[0] == "tail"

    def operand_types(self, key: ModelKey) -> list[tuple[str, DType, list]]:
        """``(name, dtype, dims)`` of each operand for ``key``, in order."""
        types = [
            (
                name,
                DType.float32 if name == "ape" else key.dtype,
                _DIMS[name](key),
            )
            for name in self.tensors
        ]
        return types + [
            (name, dtype, _DIMS[name](key))
            for name, dtype in zip(self.indices, key.index_dtypes, strict=True)
        ]

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

    def idle_operands(self, key: ModelKey, device: driver.Device) -> list:
        """Operands on which the op does nothing, as buffers on ``device``.

        No ring slots, tokens or requests: every symbolic dim is 0 except
        ``offsets``, which is ``[0]``; ``ape`` is zeros.
        """
        return [
            Buffer.zeros(
                [_IDLE_SIZES.get(d, d) for d in dims], dtype, device=device
            )
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
                operand not a NumPy array, ``kpool`` not an int, or an
                index operand (or ``pool_ids``) of a dtype the op does not
                take.
            ValueError: If a rank, shape or float dtype is wrong or the
                operands disagree; the message names the operand, what it
                must be and what it is.
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
        self,
        kpool: int,
        values: Sequence[Any],
        always_select_tail: bool = True,
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


#: Every op the runner runs, by :attr:`ModelKey.kind`.
OPS: dict[str, Op] = {
    op.kind: op
    for op in (
        Op("ring_close", kpool_graph.ring_close),
        Op("compress", kpool_graph.compress),
        Op("seed_tail", kpool_graph.seed_tail),
        Op("step", kpool_graph.kpool_step),
        Op("step3", kpool_graph.kpool_step, (("fused", False),)),
        Op("expand_topk", kpool_graph.expand_topk),
    )
}


def _op(kind: str) -> Op:
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
    op = _op(kind)
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
        TypeError: If the ring is not a ``Buffer``, another operand not a
            NumPy array, or its dtype not one MAX has.
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
        raise TypeError(
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


def _accelerator() -> driver.Device:
    """The first accelerator, or MAX's error with each line said once.

    MAX 26.7's ``driver.Accelerator()`` raises one message in which every
    backend it tried (CUDA, HIP) repeats the ``MODULAR_DEBUG`` hint three
    times; the repeats are in MAX's string, not from calling it thrice.

    Raises:
        ValueError: Naming ``device``, with MAX's message.
    """
    try:
        return driver.Accelerator()
    except ValueError as error:
        lines = list(dict.fromkeys(str(error).splitlines()))
        raise ValueError(
            "device 'gpu' needs an accelerator: " + "\n".join(lines)
        ) from None


#: Devices a :class:`Runner` accepts.
DEVICES = ("cpu", "gpu", "gpu-emulated")


class Runner:
    """Runs the k-pool writers on one device, caching a model per config.

    Args:
        device: ``"cpu"``, ``"gpu"`` (the first accelerator) or
            ``"gpu-emulated"`` (the GPU kernels run on the host, one block
            and thread at a time: exact but slow, for tests).
        kernels: The Mojo package that implements the ops; the benchmark
            passes its no-op stand-ins here to measure MAX's own floor, and
            ``None`` to use MAX's builtins (GPU only): the wrappers then
            leave the graphs without this package's kernels instead of
            loading them.

    Raises:
        ValueError: If ``device`` is none of :data:`DEVICES`,
            ``"gpu-emulated"`` is asked for without this package's kernels,
            or ``"gpu"`` without an accelerator (MAX's message, each line
            once).
    """

    def __init__(
        self, device: str = "cpu", kernels: Path | None = KERNELS
    ) -> None:
        if device not in DEVICES:
            raise ValueError(
                f"device must be one of {', '.join(DEVICES)}, got {device!r}"
            )
        self.emulate_gpu = device == "gpu-emulated"
        if self.emulate_gpu and kernels is None:
            raise ValueError(
                "gpu-emulated runs this package's GPU kernels, so kernels"
                " must not be None (MAX's builtins have no emulation)"
            )
        on_host = device != "gpu"
        self.device_name = device
        self.kernels = kernels
        self.device: driver.Device = driver.CPU() if on_host else _accelerator()
        self._ref = DeviceRef.CPU() if on_host else DeviceRef.GPU()
        devices = [driver.CPU()] if on_host else [driver.CPU(), self.device]
        self._session = InferenceSession(devices=devices)
        self._models: dict[ModelKey, Model] = {}
        self._index_models: dict[IndexKey, Model] = {}

    # -- buffers ---------------------------------------------------------

    def new_ring(
        self,
        max_slots: int,
        ring_len: int,
        head_dim: int,
        dtype: npt.DTypeLike,
        fill: npt.ArrayLike | None = None,
    ) -> Buffer:
        """A ring buffer ``[max_slots, 2, ring_len, head_dim]`` on the device.

        Args:
            max_slots: Ring slots.
            ring_len: Members per slot (``kpool`` or a multiple of it).
            head_dim: Channels per key.
            dtype: Key dtype (NumPy, or ``ml_dtypes.bfloat16``).
            fill: Initial contents (broadcast); zeros when ``None``.

        Returns:
            A new buffer the in-place writers update.
        """
        shape = (max_slots, 2, ring_len, head_dim)
        host = np.zeros(shape, dtype=dtype)
        if fill is not None:
            host[...] = fill
        return to_buffer(host, self.device)

    def to_device(self, array: npt.ArrayLike) -> Buffer:
        """Copies an array to this runner's device."""
        return to_buffer(array, self.device)

    @staticmethod
    def read(buffer: Buffer) -> np.ndarray:
        """Copies a buffer (a ring, say) back to a NumPy array."""
        return to_numpy(buffer)

    # -- models ----------------------------------------------------------

    def model(self, key: ModelKey) -> Model | SharedModel:
        """The compiled model for ``key``, compiling it on first use."""
        model = self._models.get(key)
        if model is None:
            graph, _ = self._build([key])
            model = self._models[key] = self._session.load(graph)
        return model

    def compile_together(self, keys: Sequence[ModelKey]) -> None:
        """Compiles the models of ``keys`` not compiled yet as one graph.

        MAX pays most of a compile once per graph (about 15 s on a 2-core
        machine, against 1-8 s for each op in it), so a caller that knows
        which configurations it will run can compile them at that price
        once. Each key's calls then run the whole model: its own op on the
        call's operands, every other op on idle operands
        (:meth:`Op.idle_operands`: no ring slots, tokens or requests), which
        do nothing. :meth:`model` returns a :class:`SharedModel` for them.
        A single key left to compile gets a graph of its own, the same one
        :meth:`model` would build.
        """
        todo = list(dict.fromkeys(k for k in keys if k not in self._models))
        if len(todo) < 2:
            for key in todo:
                self.model(key)
            return
        graph, counts = self._build(todo)
        model = self._session.load(graph)
        idle = [
            buffer
            for key in todo
            for buffer in _op(key.kind).idle_operands(key, self.device)
        ]
        inputs = outputs = 0
        for key, count in zip(todo, counts, strict=True):
            op = _op(key.kind)
            shared = SharedModel(
                model,
                idle,
                slice(inputs, inputs + len(op.operands)),
                slice(outputs, outputs + count),
            )
            self._models[key] = shared
            inputs += len(op.operands)
            outputs += count

    def _build(self, keys: Sequence[ModelKey]) -> tuple[Graph, list[int]]:
        """One graph of the ops of ``keys``, each specialized on its key.

        Returns the graph and each op's number of outputs.

        A single key keeps the symbolic dim names of :data:`_DIMS`; several
        get ``_0``, ``_1``, ... on theirs. A kernel package directory goes
        in precompiled (:func:`compiled_kernels`, once per process) rather
        than as the source directory, which MAX would precompile again for
        every graph (about 4 s each). Without ``kernels`` the graph keeps
        MAX's builtins.
        """
        extensions = [] if self.kernels is None else [self.kernels]
        if self.kernels is not None and self.kernels.is_dir():
            extensions = [compiled_kernels(self.kernels)]
        suffixes = (
            [""] if len(keys) == 1 else [f"_{i}" for i in range(len(keys))]
        )
        names = [_op(k.kind).graph_name(k, self.emulate_gpu) for k in keys]
        types = [
            _op(key.kind).input_types(key, self._ref, suffix)
            for key, suffix in zip(keys, suffixes, strict=True)
        ]
        with (
            builtin_kernels_only()
            if self.kernels is None
            else contextlib.nullcontext(),
            Graph(
                "__".join(names),
                input_types=[t for group in types for t in group],
                custom_extensions=extensions,
            ) as g,
        ):
            first, outputs, counts = 0, [], []
            for key in keys:
                op = _op(key.kind)
                inputs = g.inputs[first : first + len(op.operands)]
                first += len(op.operands)
                values = [
                    value.buffer if name == "tail" else value.tensor
                    for name, value in zip(op.operands, inputs, strict=True)
                ]
                added = op.add(values, key, self.emulate_gpu)
                outputs += added
                counts.append(len(added))
            g.output(*outputs)
        return g, counts

    # -- calls -----------------------------------------------------------

    def prepare(
        self,
        kind: str,
        kpool: int,
        *,
        always_select_tail: bool = True,
        **operands: Any,
    ) -> tuple[Model, list[Buffer]]:
        """The compiled model for one call and its operands on the device.

        The benchmark times ``model.execute(*operands)`` on these directly,
        so host-to-device copies stay out of the measurement; tests swap in
        guarded operands (they are in the op's argument order, :data:`OPS`).

        Args:
            kind: An op of :data:`OPS` (see :class:`ModelKey`).
            kpool: Tokens per pool.
            always_select_tail: For expand_topk: whether rows carry the
                pool still filling.
            **operands: The operands by the graph function's argument names
                (``tail``, ``k``, ``gate``, ``ape``, ``pool_ids``, and the
                index operands); the ring is a :meth:`new_ring` buffer, the
                rest NumPy arrays, index operands as lists become uint32.
                Names the op does not take are ignored, so one workload's
                operands serve every op.

        Returns:
            ``(model, operands)``.

        Raises:
            ValueError: If ``kind`` is not an op of :data:`OPS`, or an
                operand's rank, shape or float dtype is wrong or disagrees
                with another's (:meth:`Op.check`), before anything is
                written to the ring.
            TypeError: If an operand the op takes is missing or of the
                wrong kind or index dtype (:meth:`Op.check`).
        """
        op = _op(kind)
        values = op.host_operands(operands)
        op.check(kpool, values)
        key = op.key(kpool, values, always_select_tail)
        args = [
            value if name == "tail" else self.to_device(value)
            for name, value in zip(op.operands, values, strict=True)
        ]
        return self.model(key), args

    def run(self, kind: str, kpool: int, **operands: Any) -> list[np.ndarray]:
        """Runs one op on NumPy operands; its outputs as NumPy arrays.

        Takes the arguments of :meth:`prepare`; the ring, if the op takes
        one, is updated in place.
        """
        model, args = self.prepare(kind, kpool, **operands)
        return [to_numpy(out) for out in model.execute(*args)]

    # -- the indexer -----------------------------------------------------

    def index_model(self, key: IndexKey) -> Model:
        """The compiled index_top_k model for ``key``, compiled on first use."""
        model = self._index_models.get(key)
        if model is None:
            extensions = [] if self.kernels is None else [self.kernels]
            if self.kernels is not None and self.kernels.is_dir():
                extensions = [compiled_kernels(self.kernels)]
            graph = index_runner.build_graph(key, extensions)
            model = self._session.load(graph)
            self._index_models[key] = model
        return model

    def index_top_k(
        self,
        q: np.ndarray,
        qs: np.ndarray,
        input_row_offsets: npt.ArrayLike,
        cache: PagedIndexCache,
        layer_idx: int,
        **options: Any,
    ) -> np.ndarray:
        """Runs :func:`mla_kpool.index_top_k` on host arrays.

        One model per :class:`mla_kpool.index_runner.IndexKey`; the batch,
        token, block and page counts may change between calls. On
        ``"gpu-emulated"`` the op's GPU path runs over the emulated grid;
        on ``"gpu"`` the wrapper picks MAX's op or this package's.

        Args:
            q: ``[T, H, D]`` uint8 e4m3fn bytes or ``float8_e4m3fn``.
            qs: ``[T, H]`` float32.
            input_row_offsets: ``[B + 1]``, sent as uint32.
            cache: The :class:`mla_kpool.index_cache.PagedIndexCache` (its
                ``cache_lengths`` are this call's ``k_cache_lengths``).
            layer_idx: The layer to read.
            **options: ``top_k`` and ``kpool`` (required), ``mask``
                (``"causal"``), and the rest of
                :func:`mla_kpool.index_runner.prepare`'s keywords.

        Returns:
            int32 ``[T, top_k]``.

        Raises:
            ValueError: From the graph checks, and (from MAX) when the kernel
                raises at run time (a page stride smaller than a block).
        """
        model, args, _ = index_runner.prepare(
            self, q, qs, input_row_offsets, cache, layer_idx, **options
        )
        return to_numpy(model.execute(*args)[0])

    def step(
        self,
        tail: Buffer,
        call: CallInputs,
        ape: np.ndarray,
        kpool: int,
        *,
        fused: bool = True,
    ) -> StepResult:
        """Runs :func:`mla_kpool.kpool_step` on ``tail`` for one call.

        Args:
            tail: The ring (:meth:`new_ring`), updated in place.
            call: The call's keys, gates and per-request metadata.
            ape: ``[kpool, head_dim]`` position embedding.
            kpool: Tokens per pool.
            fused: The one ``mla_kpool.step`` op (model kind ``"step"``)
                or, when ``False``, the three writers (kind ``"step3"``).

        Returns:
            The step's outputs as NumPy arrays.
        """
        kind = "step" if fused else "step3"
        outs = self.run(kind, kpool, tail=tail, ape=ape, **call.operands())
        return StepResult(*outs)


@dataclass(frozen=True)
class SharedModel:
    """One op's part of a model compiled with others.

    :meth:`Runner.compile_together` makes these; :meth:`execute` takes and
    returns what a model of the op alone would.

    Attributes:
        model: The compiled model of every op.
        idle: An idle operand for each of its inputs.
        inputs: This op's inputs among them.
        outputs: This op's outputs among the model's.
    """

    model: Model
    idle: list[Buffer]
    inputs: slice
    outputs: slice

    def execute(self, *args: Buffer) -> list[Buffer]:
        """Runs the model with ``args`` as this op's operands.

        Raises:
            ValueError: If ``args`` are not one per operand of the op.
        """
        operands = list(self.idle)
        if len(args) != self.inputs.stop - self.inputs.start:
            raise ValueError(
                f"expected {self.inputs.stop - self.inputs.start} operands,"
                f" got {len(args)}"
            )
        operands[self.inputs] = args
        return self.model.execute(*operands)[self.outputs]


@dataclass(frozen=True)
class StepResult:
    """One :meth:`Runner.step` call's outputs, as NumPy arrays.

    See :class:`mla_kpool.KPoolStep` for the meaning of each.

    Attributes:
        ring_pooled: ``[batch, head_dim]`` pool each request closed.
        ring_closed_pool: ``[batch]`` int32 its pool id, or -1.
        pooled: ``[total_tokens // kpool, head_dim]`` pools of new tokens.
        pool_row_offsets: ``[batch + 1]`` uint32 row of request b's first pool.
        first_pool: ``[batch]`` int64 pool id of that row.
    """

    ring_pooled: np.ndarray
    ring_closed_pool: np.ndarray
    pooled: np.ndarray
    pool_row_offsets: np.ndarray
    first_pool: np.ndarray

    def pools(self) -> list[dict[int, PoolRow]]:
        """Every pool this call produced, per request, with its writer.

        Returns:
            Per request, ``{pool_id: PoolRow}``
            (:func:`mla_kpool.calls.pools_of_call`).

        Raises:
            ValueError: As :func:`mla_kpool.calls.pools_of_call`, for
                ``pool_row_offsets`` that do not fit ``pooled``.
        """
        return pools_of_call(
            self.ring_closed_pool,
            self.ring_pooled,
            self.pooled,
            self.pool_row_offsets,
            self.first_pool,
        )
