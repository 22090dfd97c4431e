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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from max import driver
from max.driver import Buffer
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph

from . import index_runner
from ._metadata import check_metadata
from ._paths import KERNELS, builtin_kernels_only, compiled_kernels
from ._renamed import renamed_keyword
from .buffers import to_buffer, to_numpy
from .calls import CallInputs, PoolRow, pools_of_call
from .index_cache import PagedIndexCache
from .index_runner import IndexKey
from .op_table import OPS, ModelKey, Op, get_op, model_key

__all__ = [
    "DEVICES",
    "OPS",
    "ModelKey",
    "Op",
    "Runner",
    "SharedModel",
    "StepResult",
    "model_key",
]


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
        self._models: dict[ModelKey, Model | SharedModel] = {}
        self._index_models: dict[IndexKey, Model | SharedModel] = {}

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

    def model(self, key: ModelKey | IndexKey) -> Model | SharedModel:
        """The compiled model for ``key``, compiling it on first use.

        An :class:`IndexKey`'s graph is
        :func:`mla_kpool.index_runner.build_graph`'s.
        """
        store = self._store(key)
        if key not in store:
            if isinstance(key, IndexKey):
                graph = index_runner.build_graph(key, self._extensions())
            else:
                graph, _ = self._build([key])
            store[key] = self._session.load(graph)
        return store[key]

    def load(self, graph: Graph) -> Model:
        """Compiles any graph in this runner's session (a peer's, say)."""
        return self._session.load(graph)

    def has_model(self, key: ModelKey | IndexKey) -> bool:
        """Whether this runner holds a compiled model for ``key`` already.

        Raises:
            TypeError: If ``key`` is neither a :class:`ModelKey` nor an
                :class:`IndexKey`.
        """
        if not isinstance(key, (ModelKey, IndexKey)):
            raise TypeError(
                f"key must be a ModelKey or IndexKey, got {type(key).__name__}"
            )
        return key in self._store(key)

    def compile_together(self, keys: Sequence[ModelKey | IndexKey]) -> None:
        """Compiles the models of ``keys`` as one graph, unless all are ready.

        MAX pays most of a compile once per graph, whatever its ops (about
        15 s on a 2-core machine, against 1-8 s for each op in it), so a
        caller that knows which configurations it will run can compile
        them at that price once. Each key's calls then run the whole
        model: its own op on the call's operands, every other op on idle
        operands (no ring slots, tokens, requests or pages:
        :meth:`Op.idle_operands`, :func:`mla_kpool.index_runner.idle_operands`),
        which do nothing. :meth:`model` and :meth:`index_model` return a
        :class:`SharedModel` for them.

        If any key is missing, the graph holds every key given (in order,
        repeats dropped), so the same keys always make the same graph and
        MAX's cache serves it again. A single key, and every key of a runner
        on a real GPU or without this package's kernels (``kernels=None``),
        is compiled alone, as :meth:`model` or :meth:`index_model` would:
        idle calls are checked on the host devices only.

        Args:
            keys: :class:`ModelKey` and :class:`IndexKey` values, mixed.

        Raises:
            TypeError: If an entry of ``keys`` is neither key type.
            ValueError: For a :class:`ModelKey` of an unknown kind (both
                before anything compiles), or from MAX when the graph does
                not compile.
        """
        keys = list(dict.fromkeys(keys))
        for key in keys:
            if isinstance(key, ModelKey):
                get_op(key.kind)
            elif not isinstance(key, IndexKey):
                raise TypeError(
                    "keys must hold ModelKey or IndexKey values, got"
                    f" {type(key).__name__}"
                )
        if all(k in self._store(k) for k in keys):
            return
        if len(keys) < 2 or self.kernels is None or self.device_name == "gpu":
            for key in keys:
                self.model(key)
            return
        graph, spans = self._build(keys)
        model = self._session.load(graph)
        idle = tuple(buffer for key in keys for buffer in self._idle(key))
        for key, (inputs, outputs) in zip(keys, spans, strict=True):
            self._store(key)[key] = SharedModel(model, idle, inputs, outputs)

    def _extensions(self) -> list[Path]:
        """The graphs' ``custom_extensions``: this runner's kernel package.

        A package directory goes in precompiled (:func:`compiled_kernels`,
        once per process) rather than as the source directory, which MAX
        would precompile again for every graph (about 4 s each); none for
        ``kernels=None``.
        """
        if self.kernels is None:
            return []
        if self.kernels.is_dir():
            return [compiled_kernels(self.kernels)]
        return [self.kernels]

    def _store(self, key: ModelKey | IndexKey) -> dict[Any, Any]:
        """Where the compiled model of ``key`` is kept."""
        return self._index_models if isinstance(key, IndexKey) else self._models

    def _idle(self, key: ModelKey | IndexKey) -> list[Buffer]:
        """Operands on which the op of ``key`` does nothing."""
        if isinstance(key, IndexKey):
            return index_runner.idle_operands(key, self.device)
        return get_op(key.kind).idle_operands(key, self.device)

    def _build(
        self, keys: Sequence[ModelKey | IndexKey]
    ) -> tuple[Graph, list[tuple[slice, slice]]]:
        """One graph of the ops of ``keys``, each specialized on its key.

        Returns the graph and each op's inputs and outputs among the
        graph's.

        A single key keeps its op's symbolic dim names; several get ``_0``,
        ``_1``, ... on theirs. The kernels go in as :meth:`_extensions`
        gives them; without ``kernels`` the graph keeps MAX's builtins.
        """
        suffixes = (
            [""] if len(keys) == 1 else [f"_{i}" for i in range(len(keys))]
        )
        names, types = [], []
        for key, suffix in zip(keys, suffixes, strict=True):
            if isinstance(key, IndexKey):
                names.append(key.name)
                types.append(key.input_types(suffix=suffix))
            else:
                op = get_op(key.kind)
                names.append(op.graph_name(key, self.emulate_gpu))
                types.append(op.input_types(key, self._ref, suffix))
        with (
            builtin_kernels_only()
            if self.kernels is None
            else contextlib.nullcontext(),
            Graph(
                "__".join(names),
                input_types=[t for group in types for t in group],
                custom_extensions=self._extensions(),
            ) as g,
        ):
            first, outputs, spans = 0, [], []
            for key, group in zip(keys, types, strict=True):
                mine = slice(first, first + len(group))
                inputs = g.inputs[mine]
                first += len(group)
                if isinstance(key, IndexKey):
                    added = [index_runner.add_to_graph(key, inputs)]
                else:
                    op = get_op(key.kind)
                    values = [
                        value.buffer if name == "tail" else value.tensor
                        for name, value in zip(op.operands, inputs, strict=True)
                    ]
                    added = op.add(values, key, self.emulate_gpu)
                spans.append(
                    (mine, slice(len(outputs), len(outputs) + len(added)))
                )
                outputs += added
            g.output(*outputs)
        return g, spans

    # -- calls -----------------------------------------------------------

    def prepare(
        self,
        kind: str,
        kpool: int,
        *,
        always_select_tail: bool = True,
        **operands: Any,
    ) -> tuple[Model | SharedModel, list[Buffer]]:
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
                operand's rank, shape or dtype (float or index) is wrong or
                disagrees with another's (:meth:`Op.check`), before
                anything is written to the ring.
            TypeError: If an operand the op takes is missing or of the
                wrong kind, or ``pool_ids`` is not int32 or int64
                (:meth:`Op.check`).
        """
        op = get_op(kind)
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

    def index_model(self, key: IndexKey) -> Model | SharedModel:
        """The compiled index_top_k model for ``key`` (:meth:`model`)."""
        return self.model(key)

    @renamed_keyword("qs", "q_s")
    def index_top_k(
        self,
        q: np.ndarray,
        q_s: np.ndarray,
        input_row_offsets: npt.ArrayLike,
        cache: PagedIndexCache,
        layer_idx: int,
        *,
        check: bool = True,
        **options: Any,
    ) -> np.ndarray:
        """Runs :func:`mla_kpool.index_top_k` on host arrays.

        The op gives a request with bad metadata ``-1`` rows without a
        word, so by default the call's metadata is checked on the host
        first, as :func:`mla_kpool.check_index_metadata` checks it, after
        the arguments and before anything is compiled or copied.

        One model per :class:`mla_kpool.index_runner.IndexKey`; the batch,
        token, block and page counts may change between calls. On
        ``"gpu-emulated"`` the op's GPU path runs over the emulated grid;
        on ``"gpu"`` the wrapper picks MAX's op or this package's.

        Args:
            q: ``[T, H, D]`` uint8 e4m3fn bytes or ``float8_e4m3fn``.
            q_s: ``[T, H]`` float32 per (token, head) weights (the
                keyword ``qs=``, its former name, still works for a
                release, with a ``DeprecationWarning``).
            input_row_offsets: ``[B + 1]``, sent as uint32.
            cache: The :class:`mla_kpool.index_cache.PagedIndexCache` (its
                ``cache_lengths`` are this call's ``k_cache_lengths``).
            layer_idx: The layer to read.
            check: ``False`` hands bad metadata to the op as it is (for
                tests of what the op does with it).
            **options: ``top_k`` and ``kpool`` (required), ``mask``
                (``"causal"``), and the rest of
                :func:`mla_kpool.index_runner.prepare`'s keywords.

        Returns:
            int32 ``[T, top_k]``.

        Raises:
            TypeError, ValueError: As
                :func:`mla_kpool.index_runner.prepare`, before anything is
                compiled or run: among others a ``q_s`` whose rows or heads
                differ from ``q``'s and a ``layer_idx`` not below the
                cache's ``num_layers``, each message naming the operand and
                both shapes or counts.
            ValueError: With ``check``, for bad metadata (offsets not
                starting at 0, decreasing or past ``T``, a cache length
                past the request's mapped pages, a table entry past the
                arena; a padded batch, offsets ending before ``T``, passes,
                its trailing rows ``-1``), naming the field and request;
                from MAX, when the kernel raises at run time (a page
                stride smaller than a block).
        """
        model, args, _ = index_runner.prepare(
            self,
            q,
            q_s,
            input_row_offsets,
            cache,
            layer_idx,
            check=check,
            **options,
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
        check: bool = True,
    ) -> StepResult:
        """Runs :func:`mla_kpool.kpool_step` on ``tail`` for one call.

        The kernels skip a request with bad metadata without a word (its
        pools are lost), so by default the call's metadata is checked on
        the host first, as :func:`mla_kpool.check_metadata` checks it
        against ``k``'s rows and the ring's slots, before anything is
        compiled or written to the ring.

        Args:
            tail: The ring (:meth:`new_ring`), updated in place.
            call: The call's keys, gates and per-request metadata.
            ape: ``[kpool, head_dim]`` position embedding.
            kpool: Tokens per pool.
            fused: The one ``mla_kpool.step`` op (model kind ``"step"``)
                or, when ``False``, the three writers (kind ``"step3"``).
            check: ``False`` hands bad metadata to the kernels as it is
                (for tests of what the kernels do with it).

        Returns:
            The step's outputs as NumPy arrays.

        Raises:
            ValueError: With ``check``, for bad metadata (a negative or
                out-of-range value, offsets going down or past ``k``'s
                rows, two requests on one slot), naming the first bad
                request and field; and as :meth:`prepare`.
            TypeError: As :meth:`prepare`, or ``kpool`` not an int.
        """
        if check:
            check_metadata(
                call.input_row_offsets,
                call.cache_lengths,
                call.slot_idx,
                total_tokens=int(np.shape(call.k)[0]),
                max_slots=int(tail.shape[0]),
                kpool=kpool,
            )
        kind = "step" if fused else "step3"
        outs = self.run(kind, kpool, tail=tail, ape=ape, **call.operands())
        return StepResult(*outs)


@dataclass(frozen=True, eq=False)
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
    idle: tuple[Buffer, ...]
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
