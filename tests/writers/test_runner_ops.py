"""The runner's op table: keys and graph names, with no compile.

:data:`mla_kpool.runner.OPS` describes each op once; these check that the key
:meth:`Runner.prepare` derives from a call's arrays is the one
:func:`mla_kpool.runner.model_key` gives for the same configuration (so a
model compiled ahead, as the demo does, is the one the call uses), that graph
names keep what a profiler trace needs, and that a wrong kind or a missing
operand says so before anything compiles. Models compiled together share
one graph: each op's idle operands (an empty call, its values written
before a model can read them) and its slice of the shared model's operands
and outputs.
"""

from __future__ import annotations

import ctypes
import inspect

import ml_dtypes
import numpy as np
import pytest
from max.driver import CPU
from max.dtype import DType
from max.graph import DeviceRef

from mla_kpool import KERNELS
from mla_kpool.buffers import to_numpy
from mla_kpool.calls import CallInputs
from mla_kpool.index_runner import IndexKey, idle_operands
from mla_kpool.runner import OPS, ModelKey, Runner, SharedModel, model_key

KPOOL, HEAD_DIM, RING = 4, 16, 8


class _Ring:
    """Stands in for a ring buffer: only its shape is read for the key."""

    shape = (3, 2, RING, HEAD_DIM)


def _operands() -> dict[str, object]:
    k = np.zeros((8, HEAD_DIM), ml_dtypes.bfloat16)
    return {
        "tail": _Ring(),
        "k": k,
        "gate": k,
        "ape": np.zeros((KPOOL, HEAD_DIM)).tolist(),
        "pool_ids": np.zeros((8, 5), np.int64),
        "input_row_offsets": [0, 8],
        "pool_row_offsets": np.zeros(2, np.int64),
        "cache_lengths": np.zeros(1, np.int32),
        "slot_idx": [0],
    }


@pytest.mark.parametrize("kind", list(OPS))
def test_listed_operands_are_the_wrappers(kind: str) -> None:
    # The table names each op's operands; the wrapper it calls takes them
    # positionally, so the two orders must agree.
    op = OPS[kind]
    names = list(inspect.signature(op.wrapper).parameters)
    assert op.operands == tuple(names[: names.index("kpool")])
    assert op.selects == ("always_select_tail" in names)


@pytest.mark.parametrize("kind", list(OPS))
def test_key_from_arrays_is_model_key(kind: str) -> None:
    op = OPS[kind]
    values = op.host_operands(_operands())
    given = dict(zip(op.operands, values, strict=True))
    index_dtypes = [given[name].dtype for name in op.indices]
    if kind == "expand_topk":
        want = model_key(
            kind,
            KPOOL,
            dtype=np.int64,
            pool_topk=5,
            index_dtypes=index_dtypes,
            always_select_tail=False,
        )
    else:
        want = model_key(
            kind,
            KPOOL,
            dtype=ml_dtypes.bfloat16,
            head_dim=HEAD_DIM,
            ring_len=RING if op.in_place else 0,
            index_dtypes=index_dtypes,
        )
    assert op.key(KPOOL, values, always_select_tail=False) == want
    # Lists become arrays: index operands uint32 (MAX's), ape float32.
    assert given["input_row_offsets"].dtype == np.uint32
    if "ape" in op.tensors:
        assert given["ape"].dtype == np.float32


def test_model_key_defaults_to_uint32_indices() -> None:
    key = model_key("step", KPOOL, dtype=np.float32, head_dim=8, ring_len=4)
    assert key.index_dtypes == (DType.uint32,) * 3
    assert key.dtype == DType.float32
    assert not key.always_select_tail  # only expand_topk takes it


@pytest.mark.parametrize(
    ("key", "name"),
    [
        (
            model_key(
                "step", 4, dtype=DType.bfloat16, head_dim=128, ring_len=12
            ),
            "mla_kpool_step_DType.bfloat16_k4_d128_r12",
        ),
        (
            model_key("compress", 8, dtype=np.float16, head_dim=64),
            "mla_kpool_compress_DType.float16_k8_d64_r0",
        ),
        (
            model_key("expand_topk", 4, dtype=np.int32, pool_topk=512),
            "mla_kpool_expand_topk_DType.int32_k4_t512_tail",
        ),
    ],
    ids=["step", "compress", "expand_topk"],
)
def test_graph_names_carry_the_specialization(key, name) -> None:
    assert OPS[key.kind].graph_name(key, emulate_gpu=False) == name
    emulated = OPS[key.kind].graph_name(key, emulate_gpu=True)
    assert emulated == name + "_gpu_emulated"


def test_unknown_kind_and_missing_operand() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        model_key("close", KPOOL, dtype=np.float32)
    runner = Runner.__new__(Runner)  # no session: nothing may compile
    with pytest.raises(ValueError, match="got 'close'"):
        runner.prepare("close", KPOOL)
    operands = _operands()
    del operands["slot_idx"]
    with pytest.raises(TypeError, match="ring_close needs slot_idx"):
        runner.prepare("ring_close", KPOOL, **operands)


@pytest.mark.parametrize("kind", list(OPS))
def test_idle_operands_are_empty_calls(kind: str) -> None:
    """An idle call has no slots, tokens or requests; offsets are ``[0]``."""
    op = OPS[kind]
    key = op.key(KPOOL, op.host_operands(_operands()))
    idle = op.idle_operands(key, CPU())
    types = op.input_types(key, DeviceRef.CPU(), suffix="_3")
    assert len(idle) == len(types) == len(op.operands)
    for name, buffer, t in zip(op.operands, idle, types, strict=True):
        assert buffer.dtype == t.dtype, name
        want = {
            "tail": (0, 2, RING, HEAD_DIM),
            "k": (0, HEAD_DIM),
            "gate": (0, HEAD_DIM),
            "ape": (KPOOL, HEAD_DIM),
            "pool_ids": (0, 5),
            "input_row_offsets": (1,),
            "pool_row_offsets": (1,),
        }.get(name, (0,))
        assert tuple(buffer.shape) == want, name
        assert not np.any(to_numpy(buffer)), name
        # Every symbolic dim carries the suffix; static dims stay numbers.
        for dim in t.shape:
            assert str(dim).isdigit() or str(dim).endswith("_3"), (name, dim)


class _Recorder:
    """Stands in for a compiled model: records its operands, returns them."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def execute(self, *args):
        self.calls.append(args)
        return [f"out{i}" for i in range(5)]


def test_shared_model_runs_its_op_on_its_slice() -> None:
    model = _Recorder()
    shared = SharedModel(model, ["a", "b", "c", "d"], slice(1, 3), slice(2, 4))
    assert shared.execute("X", "Y") == ["out2", "out3"]
    assert model.calls == [("a", "X", "Y", "d")]
    with pytest.raises(ValueError, match="expected 2 operands, got 3"):
        shared.execute("X", "Y", "Z")
    assert len(model.calls) == 1


def test_compile_together_compiles_alone_where_it_must() -> None:
    """Nothing when all are ready; alone for one key, a GPU or no kernels."""
    done, todo, other = (
        model_key("step", k, dtype=np.float32) for k in (2, 4, 8)
    )
    runner = Runner.__new__(Runner)  # no session: nothing may compile
    runner._models, runner._index_models = {done: "compiled"}, {}
    asked = []
    runner.model = asked.append
    runner.compile_together([done, done])
    assert asked == []
    runner.compile_together([todo, todo])
    assert asked == [todo]
    for device, kernels in (("gpu", KERNELS), ("cpu", None)):
        asked.clear()
        runner.device_name, runner.kernels = device, kernels
        runner.compile_together([done, todo, other])
        assert asked == [done, todo, other], (device, kernels)


def test_has_model_looks_in_the_store_of_the_key_kind() -> None:
    runner = Runner.__new__(Runner)  # no session: nothing may compile
    step = model_key("step", 4, dtype=np.float32)
    index = IndexKey(4, 32, 32, 2, 16, 64, 4, "causal")
    runner._models, runner._index_models = {step: "compiled"}, {}
    assert runner.has_model(step) is True
    assert runner.has_model(index) is False
    assert runner.has_model(model_key("step", 2, dtype=np.float32)) is False
    runner._index_models[index] = "compiled"
    assert runner.has_model(index) is True
    with pytest.raises(TypeError, match="ModelKey or IndexKey, got str"):
        runner.has_model("step")


def test_compile_together_refuses_bad_keys_before_compiling() -> None:
    runner = Runner.__new__(Runner)  # no session: nothing may compile
    runner._models, runner._index_models = {}, {}
    good = model_key("step", 4, dtype=np.float32)
    with pytest.raises(TypeError, match="ModelKey or IndexKey values, got str"):
        runner.compile_together(["ring_close"])
    bogus = ModelKey(**{**vars(good), "kind": "bogus"})
    with pytest.raises(ValueError, match="got 'bogus'"):
        runner.compile_together([good, bogus])
    assert runner._models == {}


@pytest.mark.parametrize(
    ("field", "values", "message"),
    [
        ("cache_lengths", [-5, 0], r"request 0: cache_lengths\[0\]=-5 < 0"),
        ("slot_idx", [0, 3], r"request 1: slot_idx\[1\]=3 >= max_slots=3"),
        ("slot_idx", [2, 2], r"request 1: slot_idx\[1\]=2 duplicates"),
    ],
)
def test_step_refuses_bad_metadata_before_compiling(
    field: str, values: list[int], message: str
) -> None:
    runner = Runner.__new__(Runner)  # no session: nothing may compile
    runner._models, runner._index_models = {}, {}
    k = np.zeros((8, HEAD_DIM), np.float32)
    meta = {
        "input_row_offsets": np.array([0, 5, 8], np.int32),
        "cache_lengths": np.array([0, 0], np.int32),
        "slot_idx": np.array([0, 1], np.int32),
    }
    meta[field] = np.array(values, np.int32)
    call = CallInputs(k, k, **meta)
    ape = np.zeros((KPOOL, HEAD_DIM), np.float32)
    with pytest.raises(ValueError, match=message):
        runner.step(_Ring(), call, ape, KPOOL)
    assert runner._models == {}


def test_index_idle_operands_are_an_empty_call() -> None:
    """No tokens, requests, blocks or pages; packed strides, layer 0."""
    key = IndexKey(4, 32, 8, 3, 16, 64, 4, "causal")
    idle = idle_operands(key, CPU())
    types = key.input_types()
    assert [b.dtype for b in idle] == [t.dtype for t in types]
    shapes = [tuple(b.shape) for b in idle]
    assert shapes == [
        (0, 4, 32),
        (0, 4),
        (1,),
        (0, 1, 3, 16, 1, 8),
        (1,),
        (0,),
        (0, 0),
        (1,),
        (1,),
        (0, 1, 3, 16, 1, 1),
        (1,),
        (0, 0),
        (),
    ]
    values = [to_numpy(b).tolist() for b in idle]
    assert values[2] == [0] and values[4] == values[10] == [-1]
    assert values[7] == values[8] == [0] and values[12] == 0


def _bytes_now(buffer) -> bytes:
    """The buffer's bytes as they are at this instant, read from memory.

    ``to_numpy`` may wait for the buffer's device queue, which would hide
    a fill that had not run yet when a model launched on the buffer.
    """
    size = buffer.num_elements * buffer.element_size
    return ctypes.string_at(buffer._data_ptr(), size) if size else b""


def test_idle_operands_hold_their_values_when_returned() -> None:
    """A model run at once on idle operands reads zeros, not stale bytes.

    ``Buffer.zeros`` returns before its fill has run and ``Model.execute``
    does not wait for it: the demo's shared model at kpool 1024 and
    head_dim 128 read ``layer_idx=4292902920`` on its first idle run. The
    operands are made here as :meth:`Runner.compile_together` makes them
    for the demo (the step's, with its 512 KiB ``ape``, then the
    indexer's, its scalar layer last), several times over: unsynchronized,
    most rounds found the layer unfilled.
    """
    step = model_key(
        "step", 1024, dtype=ml_dtypes.bfloat16, head_dim=128, ring_len=1024
    )
    index = IndexKey(32, 128, 128, 2, 128, 512, 1024, "null")
    for _ in range(20):
        ops_idle = OPS["step"].idle_operands(step, CPU())
        index_idle = idle_operands(index, CPU())
        now = [_bytes_now(b) for b in ops_idle + index_idle]
        assert now[-1] == bytes(4), f"layer_idx {now[-1].hex()}, not 0"
        for i, (buffer, raw) in enumerate(
            zip(ops_idle + index_idle, now, strict=True)
        ):
            want = to_numpy(buffer)
            assert raw == want.tobytes(), i
        assert not any(np.any(to_numpy(b)) for b in ops_idle)
        values = [to_numpy(b).tolist() for b in index_idle]
        assert values[4] == values[10] == [-1]
        assert values[12] == 0 and values[2] == [0]
