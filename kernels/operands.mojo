"""Operand shape checks for the ops' `execute` methods.

The Python graph API rejects bad shapes before a graph is built, but a
graph can call the ops another way (MAX's own wrappers, `ops.custom` with
dynamic dimensions), so each `execute` checks its operands again at run
time. A failed check names the op, the operand, the shape it must have and
the shape it has, for example

    mo.mla.kpool.ring_close: ape must be [kpool=4, head_dim=128], got [8, 128]

The checks compare integers only; the message is built only on failure.
"""

from std.utils.index import IndexList

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
](op: StaticString, operand: StaticString, rows: Int, total_tokens: Int) raises:
    """Raises if a pooled output has more rows than `total_tokens // kpool`.

    Parameters:
        kpool: Tokens per pool.

    Args:
        op: Registered op name, the message's prefix.
        operand: The pooled output's name.
        rows: Its row count.
        total_tokens: Rows of `k`.

    Raises:
        Error: If `rows > total_tokens // kpool` (a row past the last
            possible pool could not be written safely).
    """
    if rows > total_tokens // kpool:
        raise Error(
            op,
            ": ",
            operand,
            " must have at most total_tokens // kpool = ",
            total_tokens // kpool,
            " rows, got ",
            rows,
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
