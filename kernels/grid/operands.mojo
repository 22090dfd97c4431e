"""Operand structs' contract, and shape checks for the ops' `execute` methods.

`KernelOperands` is what every op's operand struct conforms to; its bytes
are copied as they are into a GPU kernel's argument buffer, which is right
only for the layout `check_kernel_layout` enforces at compile time.

The Python graph API rejects bad shapes before a graph is built, but a
graph can call the ops another way (MAX's own wrappers, `ops.custom` with
dynamic dimensions), so each `execute` checks its operands again at run
time. A failed check names the op, the operand, the shape it must have and
the shape it has, for example

    mo.mla.kpool.ring_close: ape must be [kpool=4, head_dim=128], got [8, 128]

The checks compare integers only; the message is built only on failure.
"""

from std.builtin.device_passable import DevicePassable, DeviceTypeEncoder
from std.sys import size_of
from std.utils.index import IndexList


def kernel_words[T: AnyType]() -> Int:
    """`T`'s leaf fields if every one is 8 bytes, else -1 (compile time).

    A leaf is a field that is not a Mojo struct (the MLIR value inside a
    pointer, `Int` or `Int64`); nested structs count their leaves. Mojo's
    reflection lists a struct's fields, so this counts them recursively.
    """
    comptime if not reflect[T].is_struct():
        return 1 if size_of[T]() == 8 else -1
    else:
        comptime types = reflect[T].field_types()
        var words = 0
        comptime for i in range(reflect[T].field_count()):
            comptime leaf_words = kernel_words[types[i]]()
            comptime if leaf_words < 0:
                return -1
            words += leaf_words
        return words


@always_inline
def check_kernel_layout[T: AnyType]():
    """Fails the build unless `T` is only 8-byte fields, without padding.

    That is what copying a struct's host bytes into a kernel argument
    assumes: every leaf field an 8-byte pointer, `Int` or `Int64` (the same
    size and alignment on host and device, so each lands at offset `8 * i`
    on both) and `size_of[T]() == 8 * leaves`. A 4-byte field (`Int32`, a
    `Bool`) is refused even where the layouts would agree today.

    Parameters:
        T: An operand struct.
    """
    comptime words = kernel_words[T]()
    comptime assert words > 0 and size_of[T]() == 8 * words, (
        "KernelOperands: an operand struct must hold only 8-byte pointers,"
        " Int or Int64 fields (its bytes are the kernel argument)"
    )


trait KernelOperands(DevicePassable, TrivialRegisterPassable):
    """One call's operands of an op: raw tensor pointers and sizes.

    A struct of this trait is built once in the op's `execute` and passed
    whole to the CPU driver, the thread body and the GPU kernel, which
    receives it as one by-value kernel argument: its bytes copied as they
    are, which `check_kernel_layout` makes a compile-time guarantee (the
    build fails for a struct with a field that is not 8 bytes).
    """

    comptime device_type: AnyType = Self
    """The kernel receives the struct itself."""

    def _to_device_type(
        self, mut encoder: Some[DeviceTypeEncoder], target: MutOpaquePointer[_]
    ):
        """Copies the struct into the kernel's argument buffer."""
        check_kernel_layout[Self]()
        encoder.encode(self, target)

    @staticmethod
    def get_type_name() -> String:
        """Name used in launch diagnostics."""
        return "mla_kpool kernel operands"


comptime ANY = -1
"""A dimension `expect_shape` does not check; its name is printed alone."""


def _want_text[rank: Int](names: StaticString, want: IndexList[rank]) -> String:
    """`[name=size, ...]`: the name alone for ANY or where it is the size."""
    var parts = names.split(", ")
    var text = String("[")
    for i in range(rank):
        if i > 0:
            text += ", "
        var name = String(parts[i]) if i < len(parts) else String("?")
        if want[i] == ANY or name == String(want[i]):
            text += name
        else:
            text += String(name, "=", want[i])
    return text + "]"


def _got_text[rank: Int](got: IndexList[rank]) -> String:
    """`[d0, d1, ...]`."""
    var text = String("[")
    for i in range(rank):
        if i > 0:
            text += ", "
        text += String(got[i])
    return text + "]"


@always_inline
def expect_shape[
    rank: Int
](
    op: StaticString,
    operand: StaticString,
    got: IndexList[rank],
    names: StaticString,
    want: IndexList[rank],
) raises:
    """Raises unless every checked dimension of `got` equals `want`'s.

    Parameters:
        rank: Operand rank.

    Args:
        op: Registered op name, the message's prefix.
        operand: Operand name, as in the op's signature.
        got: The operand's shape.
        names: What each dimension is, comma-separated
            (`"kpool, head_dim"`); a name that is the size itself (the
            ring's `2` planes) prints alone.
        want: The size each dimension must have, or `ANY`.

    Raises:
        Error: `"<op>: <operand> must be [<name>=<size>, ...], got [...]"`.
    """
    for i in range(rank):
        if want[i] != ANY and got[i] != want[i]:
            raise Error(
                op,
                ": ",
                operand,
                " must be ",
                _want_text(names, want),
                ", got ",
                _got_text(got),
            )


@always_inline
def expect_ring_length[kpool: Int](op: StaticString, ring_len: Int) raises:
    """Raises unless the ring length `tail.shape[2]` is a multiple of kpool.

    Parameters:
        kpool: Tokens per pool.

    Args:
        op: Registered op name, the message's prefix.
        ring_len: `tail.shape[2]`.

    Raises:
        Error: If `ring_len` is not a positive multiple of `kpool`.
    """
    if ring_len < kpool or ring_len % kpool != 0:
        raise Error(
            op,
            ": tail's ring length (dimension 2) must be a positive multiple",
            " of kpool=",
            kpool,
            ", got ",
            ring_len,
        )


@always_inline
def expect_pool_rows[
    kpool: Int
](
    op: StaticString,
    operand: StaticString,
    got: IndexList[2],
    head_dim: Int,
    total_tokens: Int,
) raises:
    """Raises unless a pooled output is `[rows, head_dim]`, rows bounded.

    Parameters:
        kpool: Tokens per pool.

    Args:
        op: Registered op name, the message's prefix.
        operand: The pooled output's name.
        got: Its shape.
        head_dim: The op's `head_dim` parameter.
        total_tokens: Rows of `k`.

    Raises:
        Error: From `expect_shape`, or if `rows > total_tokens // kpool` (a
            row past the last possible pool could not be written safely).
    """
    expect_shape(op, operand, got, "rows, head_dim", dims(ANY, head_dim))
    if got[0] > total_tokens // kpool:
        raise Error(
            op,
            ": ",
            operand,
            " must have at most total_tokens // kpool = ",
            total_tokens // kpool,
            " rows, got ",
            got[0],
        )


@always_inline
def dims(d0: Int) -> IndexList[1]:
    """Expected sizes of a rank-1 operand, for `expect_shape`."""
    return IndexList[1](d0)


@always_inline
def dims(d0: Int, d1: Int) -> IndexList[2]:
    """Expected sizes of a rank-2 operand, for `expect_shape`."""
    return IndexList[2](d0, d1)


@always_inline
def dims(d0: Int, d1: Int, d2: Int, d3: Int) -> IndexList[4]:
    """Expected sizes of a rank-4 operand, for `expect_shape`."""
    return IndexList[4](d0, d1, d2, d3)


@always_inline
def expect_rows(
    op: StaticString, k: IndexList[2], gate: IndexList[2], head_dim: Int
) raises:
    """Raises unless `k` is `[total_tokens, head_dim]` and `gate` the same.

    Args:
        op: Registered op name, the message's prefix.
        k: `k.shape()`.
        gate: `gate.shape()`.
        head_dim: The op's `head_dim` parameter.

    Raises:
        Error: From `expect_shape`, naming `k` or `gate`.
    """
    expect_shape(op, "k", k, "total_tokens, head_dim", dims(ANY, head_dim))
    expect_shape(
        op, "gate", gate, "total_tokens, head_dim", dims(k[0], head_dim)
    )


@always_inline
def expect_ring[
    kpool: Int
](op: StaticString, tail: IndexList[4], head_dim: Int) raises:
    """Raises unless `tail` is a ring for this `kpool` and `head_dim`.

    That is `[max_slots, 2, R, head_dim]` with `R` a positive multiple of
    `kpool`.

    Parameters:
        kpool: Tokens per pool.

    Args:
        op: Registered op name, the message's prefix.
        tail: `tail.shape()`.
        head_dim: The op's `head_dim` parameter.

    Raises:
        Error: From `expect_shape` or `expect_ring_length`.
    """
    expect_shape(
        op,
        "tail",
        tail,
        "max_slots, 2, ring_len, head_dim",
        dims(ANY, 2, ANY, head_dim),
    )
    expect_ring_length[kpool](op, tail[2])


@always_inline
def expect_offsets(
    op: StaticString, operand: StaticString, got: IndexList[1], batch: Int
) raises:
    """Raises unless a row-offsets operand is `[batch + 1]`.

    Args:
        op: Registered op name, the message's prefix.
        operand: `input_row_offsets` or `pool_row_offsets`.
        got: The operand's shape.
        batch: Requests in the call.

    Raises:
        Error: From `expect_shape`.
    """
    expect_shape(op, operand, got, "batch + 1", dims(batch + 1))


@always_inline
def expect_target[
    emulate_gpu: Bool, target: StaticString
](op: StaticString) raises:
    """Raises if `emulate_gpu` is asked of a GPU target.

    Parameters:
        emulate_gpu: The op's `emulate_gpu` parameter.
        target: The op's `target` parameter.

    Args:
        op: Registered op name, the message's prefix.

    Raises:
        Error: `"<op>: emulate_gpu needs a CPU target"`.
    """
    comptime if emulate_gpu and target != "cpu":
        raise Error(op, ": emulate_gpu needs a CPU target")
