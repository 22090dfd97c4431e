"""Empty-bodied registrations with the real k-pool ops' signatures."""

import extensibility
from extensibility import InputTensor, OutputTensor
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext


@extensibility.register("mo.mla.kpool.ring_close")
struct NoopRingClose:
    """`mo.mla.kpool.ring_close` that leaves its outputs unwritten."""

    @staticmethod
    def execute[
        *, head_dim: Int, kpool: Int, target: StaticString
    ](
        pooled: OutputTensor[rank=2, ...],
        closed_pool: OutputTensor[dtype=DType.int32, rank=1, ...],
        tail: MutableInputTensor[dtype=pooled.dtype, rank=4, ...],
        k: InputTensor[dtype=pooled.dtype, rank=2, ...],
        gate: InputTensor[dtype=pooled.dtype, rank=2, ...],
        ape: InputTensor[dtype=DType.float32, rank=2, ...],
        input_row_offsets: InputTensor[rank=1, ...],
        cache_lengths: InputTensor[rank=1, ...],
        slot_idx: InputTensor[rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        """Does nothing: the framework floor of a ring_close call."""
        pass


@extensibility.register("mo.mla.kpool.compress")
struct NoopCompress:
    """`mo.mla.kpool.compress` that leaves its output unwritten."""

    @staticmethod
    def execute[
        *, head_dim: Int, kpool: Int, target: StaticString
    ](
        pooled: OutputTensor[rank=2, ...],
        k: InputTensor[dtype=pooled.dtype, rank=2, ...],
        gate: InputTensor[dtype=pooled.dtype, rank=2, ...],
        ape: InputTensor[dtype=DType.float32, rank=2, ...],
        input_row_offsets: InputTensor[rank=1, ...],
        pool_row_offsets: InputTensor[rank=1, ...],
        cache_lengths: InputTensor[rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        """Does nothing: the framework floor of a compress call."""
        pass


@extensibility.register("mo.mla.kpool.seed_tail")
struct NoopSeedTail:
    """`mo.mla.kpool.seed_tail` that leaves the ring untouched."""

    @staticmethod
    def execute[
        *, head_dim: Int, kpool: Int, target: StaticString
    ](
        tail: MutableInputTensor[rank=4, ...],
        k: InputTensor[dtype=tail.dtype, rank=2, ...],
        gate: InputTensor[dtype=tail.dtype, rank=2, ...],
        input_row_offsets: InputTensor[rank=1, ...],
        cache_lengths: InputTensor[rank=1, ...],
        slot_idx: InputTensor[rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        """Does nothing: the framework floor of a seed_tail call."""
        pass


@extensibility.register("mla_kpool.step")
struct NoopStep:
    """`mla_kpool.step` that leaves its outputs and the ring untouched."""

    @staticmethod
    def execute[
        *, head_dim: Int, kpool: Int, target: StaticString
    ](
        ring_pooled: OutputTensor[rank=2, ...],
        ring_closed_pool: OutputTensor[dtype=DType.int32, rank=1, ...],
        pooled: OutputTensor[dtype=ring_pooled.dtype, rank=2, ...],
        pool_row_offsets: OutputTensor[dtype=DType.uint32, rank=1, ...],
        first_pool: OutputTensor[dtype=DType.int64, rank=1, ...],
        tail: MutableInputTensor[dtype=ring_pooled.dtype, rank=4, ...],
        k: InputTensor[dtype=ring_pooled.dtype, rank=2, ...],
        gate: InputTensor[dtype=ring_pooled.dtype, rank=2, ...],
        ape: InputTensor[dtype=DType.float32, rank=2, ...],
        input_row_offsets: InputTensor[rank=1, ...],
        cache_lengths: InputTensor[rank=1, ...],
        slot_idx: InputTensor[rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        """Does nothing: the framework floor of a fused step call."""
        pass


@extensibility.register("mo.mla.kpool.expand_topk")
struct NoopExpandTopK:
    """`mo.mla.kpool.expand_topk` that leaves its output unwritten."""

    @staticmethod
    def execute[
        *,
        kpool: Int,
        pool_topk: Int,
        always_select_tail: Bool,
        target: StaticString,
    ](
        positions: OutputTensor[dtype=DType.int32, rank=2, ...],
        pool_ids: InputTensor[rank=2, ...],
        input_row_offsets: InputTensor[rank=1, ...],
        cache_lengths: InputTensor[rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        """Does nothing: the framework floor of an expand_topk call."""
        pass
