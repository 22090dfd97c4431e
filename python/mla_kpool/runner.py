"""Compile-once, run-many execution of the k-pool writers on NumPy data.

The demo, the benchmark and the tests all need the same thing: build a small
MAX graph around one writer (or the whole step), compile it once per
configuration, and call it many times with NumPy arrays of any batch and
token count. Graph dims that vary per call are symbolic (``"tokens"``,
``"batch"``, ``"offsets"``, ``"slots"``), so one compiled model serves every
batch shape; only dtype, ``kpool``, ``head_dim``, the ring length and the
index dtypes (compile-time parameters of the kernels) pick a new model.

The ring is persistent state, so it lives in a ``max.driver.Buffer`` that
the caller owns (:meth:`Runner.new_ring`) and the in-place ops update.

The device ``"gpu-emulated"`` builds CPU graphs whose ops run their GPU
kernels over an emulated grid on the host (``emulate_gpu=True`` in
:mod:`mla_kpool.graph`), so the GPU code can be checked against the oracle
on a machine without an accelerator.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from max import driver
from max.driver import Buffer
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import BufferType, DeviceRef, Graph, TensorType

from . import graph as kpool_graph
from ._paths import KERNELS, builtin_kernels_only
from .buffers import to_buffer, to_max_dtype, to_numpy


@dataclass(frozen=True)
class ModelKey:
    """What a compiled model is specialized on.

    Attributes:
        kind: ``"ring_close"``, ``"compress"``, ``"seed_tail"``, ``"step"``
            (the fused ``mla_kpool.step`` op), ``"step3"`` (the three
            writers and the offsets helper, ``kpool_step(fused=False)``)
            or ``"expand_topk"``.
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


def _index_array(values: npt.ArrayLike) -> np.ndarray:
    """An index operand as an array; Python lists become uint32 (MAX's)."""
    if isinstance(values, np.ndarray):
        return values
    return np.asarray(values, dtype=np.uint32)


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
        ValueError: If ``device`` is none of :data:`DEVICES`, or
            ``"gpu-emulated"`` is asked for without this package's kernels.
        RuntimeError: From MAX, if ``"gpu"`` is asked for without one.
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
        self.device: driver.Device = (
            driver.CPU() if on_host else driver.Accelerator()
        )
        self._ref = DeviceRef.CPU() if on_host else DeviceRef.GPU()
        devices = [driver.CPU()] if on_host else [driver.CPU(), self.device]
        self._session = InferenceSession(devices=devices)
        self._models: dict[ModelKey, Model] = {}

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

    def model(self, key: ModelKey) -> Model:
        """The compiled model for ``key``, compiling it on first use."""
        model = self._models.get(key)
        if model is None:
            model = self._session.load(self._build(key))
            self._models[key] = model
        return model

    @property
    def compiled_models(self) -> int:
        """How many distinct models this runner has compiled."""
        return len(self._models)

    def _kernel_scope(self) -> contextlib.AbstractContextManager[None]:
        """Keeps MAX's builtins in the graph when ``kernels`` is ``None``."""
        if self.kernels is None:
            return builtin_kernels_only()
        return contextlib.nullcontext()

    def _build(self, key: ModelKey) -> Graph:
        if key.kind == "expand_topk":
            return self._build_expand_topk(key)
        dev = self._ref
        hd, kp, dt = key.head_dim, key.kpool, key.dtype
        ring = BufferType(dt, ["slots", 2, key.ring_len, hd], dev)
        rows = TensorType(dt, ["tokens", hd], dev)
        ape = TensorType(DType.float32, [kp, hd], dev)
        off_dt, *rest = key.index_dtypes
        offsets = TensorType(off_dt, ["offsets"], dev)
        name = f"mla_kpool_{key.kind}_{dt}_k{kp}_d{hd}_r{key.ring_len}"
        if self.emulate_gpu:
            name += "_gpu_emulated"
        emulate = {"emulate_gpu": self.emulate_gpu}

        if key.kind == "compress":
            pool_dt, len_dt = rest
            inputs: list[Any] = [
                rows,
                rows,
                ape,
                offsets,
                TensorType(pool_dt, ["offsets"], dev),
                TensorType(len_dt, ["batch"], dev),
            ]
        else:
            len_dt, slot_dt = rest
            per_request = [
                TensorType(len_dt, ["batch"], dev),
                TensorType(slot_dt, ["batch"], dev),
            ]
            if key.kind == "seed_tail":
                inputs = [ring, rows, rows, offsets, *per_request]
            else:
                inputs = [ring, rows, rows, ape, offsets, *per_request]

        with (
            self._kernel_scope(),
            Graph(
                name,
                input_types=inputs,
                custom_extensions=[self.kernels] if self.kernels else [],
            ) as g,
        ):
            x = [
                value.buffer
                if i == 0 and key.kind != "compress"
                else value.tensor
                for i, value in enumerate(g.inputs)
            ]
            if key.kind == "ring_close":
                g.output(*kpool_graph.ring_close(*x, kp, **emulate))
            elif key.kind == "compress":
                g.output(kpool_graph.compress(*x, kp, **emulate))
            elif key.kind == "seed_tail":
                kpool_graph.seed_tail(*x, kp, **emulate)
                g.output()
            elif key.kind == "step":
                g.output(*kpool_graph.kpool_step(*x, kp, **emulate))
            elif key.kind == "step3":
                g.output(
                    *kpool_graph.kpool_step(*x, kp, fused=False, **emulate)
                )
            else:
                raise ValueError(f"unknown kind {key.kind!r}")
        return g

    def _build_expand_topk(self, key: ModelKey) -> Graph:
        dev = self._ref
        off_dt, len_dt = key.index_dtypes
        tail = "tail" if key.always_select_tail else "notail"
        name = (
            f"mla_kpool_expand_topk_{key.dtype}_k{key.kpool}"
            f"_t{key.pool_topk}_{tail}"
        )
        if self.emulate_gpu:
            name += "_gpu_emulated"
        inputs = [
            TensorType(key.dtype, ["tokens", key.pool_topk], dev),
            TensorType(off_dt, ["offsets"], dev),
            TensorType(len_dt, ["batch"], dev),
        ]
        with (
            self._kernel_scope(),
            Graph(
                name,
                input_types=inputs,
                custom_extensions=[self.kernels] if self.kernels else [],
            ) as g,
        ):
            g.output(
                kpool_graph.expand_topk(
                    *(value.tensor for value in g.inputs),
                    key.kpool,
                    key.always_select_tail,
                    emulate_gpu=self.emulate_gpu,
                )
            )
        return g

    # -- calls -----------------------------------------------------------

    @staticmethod
    def operands(
        kind: str,
        *,
        k: np.ndarray,
        gate: np.ndarray,
        input_row_offsets: npt.ArrayLike,
        cache_lengths: npt.ArrayLike,
        tail: Buffer | None = None,
        ape: np.ndarray | None = None,
        slot_idx: npt.ArrayLike | None = None,
        pool_row_offsets: npt.ArrayLike | None = None,
    ) -> tuple[Buffer | None, list[np.ndarray], list[npt.ArrayLike]]:
        """A kind's operands in the op's argument order.

        Returns:
            ``(ring, float operands, index operands)`` for :meth:`prepare`.
        """
        if kind == "compress":
            return (
                None,
                [k, gate, np.asarray(ape, np.float32)],
                [input_row_offsets, pool_row_offsets, cache_lengths],
            )
        per_request = [input_row_offsets, cache_lengths, slot_idx]
        if kind == "seed_tail":
            return tail, [k, gate], per_request
        return tail, [k, gate, np.asarray(ape, np.float32)], per_request

    def prepare(
        self,
        kind: str,
        kpool: int,
        k: np.ndarray,
        ring: Buffer | None,
        tensors: list[np.ndarray],
        indices: list[npt.ArrayLike],
    ) -> tuple[Model, list[Buffer]]:
        """The compiled model for one call and its operands on the device.

        The benchmark times ``model.execute(*operands)`` on these directly,
        so host-to-device copies stay out of the measurement.

        Args:
            kind: ``"ring_close"``, ``"compress"``, ``"seed_tail"``,
                ``"step"`` or ``"step3"`` (see :class:`ModelKey`).
            kpool: Tokens per pool.
            k: This call's keys (gives dtype and head_dim).
            ring: The ring buffer, for every kind but compress.
            tensors: The float operands in argument order.
            indices: The index operands in argument order (lists become
                uint32).

        Returns:
            ``(model, operands)``.
        """
        index_arrays = [_index_array(i) for i in indices]
        key = ModelKey(
            kind=kind,
            dtype=to_max_dtype(k.dtype),
            kpool=int(kpool),
            head_dim=int(k.shape[1]),
            ring_len=int(ring.shape[2]) if ring is not None else 0,
            index_dtypes=tuple(to_max_dtype(a.dtype) for a in index_arrays),
        )
        args: list[Buffer] = [] if ring is None else [ring]
        args += [self.to_device(a) for a in tensors]
        args += [self.to_device(a) for a in index_arrays]
        return self.model(key), args

    def _run(self, kind: str, kpool: int, **operands: Any) -> list[np.ndarray]:
        ring, tensors, indices = self.operands(kind, **operands)
        model, args = self.prepare(
            kind, kpool, operands["k"], ring, tensors, indices
        )
        return [to_numpy(out) for out in model.execute(*args)]

    def ring_close(
        self,
        tail: Buffer,
        k: np.ndarray,
        gate: np.ndarray,
        ape: np.ndarray,
        input_row_offsets: npt.ArrayLike,
        cache_lengths: npt.ArrayLike,
        slot_idx: npt.ArrayLike,
        kpool: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Runs ``mo.mla.kpool.ring_close``; see :func:`mla_kpool.ring_close`.

        Returns:
            ``(pooled, closed_pool)``: ``[batch, head_dim]`` in k's dtype and
            ``[batch]`` int32.
        """
        pooled, closed = self._run(
            "ring_close",
            kpool,
            tail=tail,
            k=k,
            gate=gate,
            ape=ape,
            input_row_offsets=input_row_offsets,
            cache_lengths=cache_lengths,
            slot_idx=slot_idx,
        )
        return pooled, closed

    def compress(
        self,
        k: np.ndarray,
        gate: np.ndarray,
        ape: np.ndarray,
        input_row_offsets: npt.ArrayLike,
        pool_row_offsets: npt.ArrayLike,
        cache_lengths: npt.ArrayLike,
        kpool: int,
    ) -> np.ndarray:
        """Runs ``mo.mla.kpool.compress``; see :func:`mla_kpool.compress`.

        Returns:
            ``[total_tokens // kpool, head_dim]`` pooled keys in k's dtype.
        """
        (pooled,) = self._run(
            "compress",
            kpool,
            k=k,
            gate=gate,
            ape=ape,
            input_row_offsets=input_row_offsets,
            pool_row_offsets=pool_row_offsets,
            cache_lengths=cache_lengths,
        )
        return pooled

    def seed_tail(
        self,
        tail: Buffer,
        k: np.ndarray,
        gate: np.ndarray,
        input_row_offsets: npt.ArrayLike,
        cache_lengths: npt.ArrayLike,
        slot_idx: npt.ArrayLike,
        kpool: int,
    ) -> None:
        """Runs ``mo.mla.kpool.seed_tail`` on ``tail`` in place."""
        self._run(
            "seed_tail",
            kpool,
            tail=tail,
            k=k,
            gate=gate,
            input_row_offsets=input_row_offsets,
            cache_lengths=cache_lengths,
            slot_idx=slot_idx,
        )

    def step(
        self,
        tail: Buffer,
        k: np.ndarray,
        gate: np.ndarray,
        ape: np.ndarray,
        input_row_offsets: npt.ArrayLike,
        cache_lengths: npt.ArrayLike,
        slot_idx: npt.ArrayLike,
        kpool: int,
        *,
        fused: bool = True,
    ) -> StepResult:
        """Runs :func:`mla_kpool.kpool_step` on ``tail``.

        The arguments are those of :func:`mla_kpool.kpool_step`: ``fused``
        picks the one ``mla_kpool.step`` op (model kind ``"step"``) or, when
        ``False``, the three writers (kind ``"step3"``).

        Returns:
            The step's outputs as NumPy arrays; ``tail`` is updated in place.
        """
        outs = self._run(
            "step" if fused else "step3",
            kpool,
            tail=tail,
            k=k,
            gate=gate,
            ape=ape,
            input_row_offsets=input_row_offsets,
            cache_lengths=cache_lengths,
            slot_idx=slot_idx,
        )
        return StepResult(*outs)

    def prepare_expand_topk(
        self,
        pool_ids: np.ndarray,
        input_row_offsets: npt.ArrayLike,
        cache_lengths: npt.ArrayLike,
        kpool: int,
        always_select_tail: bool = True,
    ) -> tuple[Model, list[Buffer]]:
        """The compiled expand_topk model for one call and its operands.

        Like :meth:`prepare`: the benchmark times
        ``model.execute(*operands)``, and tests swap in guarded operands.

        Args:
            pool_ids: ``[total_tokens, pool_topk]`` int32 or int64.
            input_row_offsets: ``[batch + 1]`` (lists become uint32).
            cache_lengths: ``[batch]`` (lists become uint32).
            kpool: Tokens per pool.
            always_select_tail: Whether rows carry the pool still filling.

        Returns:
            ``(model, operands)``.
        """
        index_arrays = [
            _index_array(input_row_offsets),
            _index_array(cache_lengths),
        ]
        key = ModelKey(
            kind="expand_topk",
            dtype=to_max_dtype(pool_ids.dtype),
            kpool=int(kpool),
            head_dim=0,
            ring_len=0,
            index_dtypes=tuple(to_max_dtype(a.dtype) for a in index_arrays),
            pool_topk=int(pool_ids.shape[1]),
            always_select_tail=bool(always_select_tail),
        )
        args = [self.to_device(a) for a in (pool_ids, *index_arrays)]
        return self.model(key), args

    def expand_topk(
        self,
        pool_ids: np.ndarray,
        input_row_offsets: npt.ArrayLike,
        cache_lengths: npt.ArrayLike,
        kpool: int,
        always_select_tail: bool = True,
    ) -> np.ndarray:
        """Runs ``mo.mla.kpool.expand_topk``; see :func:`mla_kpool.expand_topk`.

        Returns:
            ``[total_tokens, pool_topk * kpool + tail]`` int32 positions.
        """
        model, args = self.prepare_expand_topk(
            pool_ids,
            input_row_offsets,
            cache_lengths,
            kpool,
            always_select_tail,
        )
        (positions,) = model.execute(*args)
        return to_numpy(positions)


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

    def pools(self) -> list[dict[int, np.ndarray]]:
        """Every pool this call produced, per request: ``{pool_id: key}``.

        The keys of :func:`mla_kpool.serving.pools_of_call`, which also
        says which writer built each one.
        """
        from .serving import pools_of_call

        rows = pools_of_call(
            self.ring_closed_pool,
            self.ring_pooled,
            self.pooled,
            self.pool_row_offsets,
            self.first_pool,
        )
        return [{p: row.key for p, row in got.items()} for got in rows]
