"""An operand struct with a 4-byte field: building this must fail.

Not a test suite: `tests/writers/test_operand_layout.py` builds it and expects
`check_kernel_layout`'s compile-time message. `Int32` is 4 bytes, so the
struct's bytes are not the 8-byte words a kernel argument copy assumes.
"""

from max.gpu.host import DeviceContext

from kernels.grid.operands import KernelOperands
from kernels.grid.parallel import launch
from kernels.grid.ragged import Field


@fieldwise_init
struct NarrowOperands[origin: MutOrigin](KernelOperands):
    """A pointer and a 4-byte count: refused."""

    var out: Field[DType.float32, Self.origin]
    """Output."""
    var count: Int32
    """The 4-byte field."""


comptime Narrow = NarrowOperands[MutAnyOrigin]


def _body(block: Int, thread: Int, op: Narrow):
    if block < Int(op.count):
        op.out[unsafe_offset=block] = Float32(thread)


def main() raises:
    var out = List[Float32](length=2, fill=0)
    var op = Narrow(
        Field[DType.float32, MutAnyOrigin](
            unsafe_from_address=Int(out.unsafe_ptr())
        ),
        2,
    )
    launch["narrow_kernel", _body, True](op, (2, 1), DeviceContext(api="cpu"))
    print(out[0], out[1])
