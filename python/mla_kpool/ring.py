"""Choosing the ring length for speculative decoding."""

from __future__ import annotations

import operator


def ring_length(kpool: int, max_new_tokens: int) -> int:
    """Smallest ring length that no call can corrupt before a pool is redone.

    The pending pool ``p`` of a request at cache length ``c`` has its
    members at absolute positions ``[p * kpool, c)``, ring index
    ``pos % R``. A call that brings ``n <= max_new_tokens`` tokens stashes
    positions inside ``[c, c + n)``. A stashed position ``y`` lands on the
    ring index of a pending member ``x`` only if ``y - x`` is a multiple of
    ``R``, and ``y - x <= (c + n - 1) - p * kpool <= kpool + n - 2`` because
    ``c < (p + 1) * kpool``. So ``R >= kpool + max_new_tokens - 1`` keeps
    every member of the pending pool intact however many of the call's
    tokens are later rejected: the next call, resuming at the last accepted
    position, re-closes the pool from true members. The ops need ``R`` to be
    a multiple of ``kpool`` (a pool never straddles the ring's end), hence
    the rounding up. ``R == kpool`` suffices only when every call brings a
    single token.

    The hazard and the deeper-ring fix come from production serving of
    k-pooled indexers (vLLM's fix for kpool 4 with 7 speculative tokens).

    Args:
        kpool: Tokens per pool, ``>= 1``.
        max_new_tokens: Most tokens one call brings to a request (a verify
            step with ``d`` drafts brings ``d + 1``), ``>= 1``.

    Returns:
        ``R``, the ring length to allocate ``tail[max_slots, 2, R,
        head_dim]`` with: a multiple of ``kpool``, ``>= kpool``.

    Raises:
        TypeError: If an argument is not an integer.
        ValueError: If an argument is below 1.
    """
    for name, value in (("kpool", kpool), ("max_new_tokens", max_new_tokens)):
        if isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got bool")
        try:
            operator.index(value)
        except TypeError:
            raise TypeError(
                f"{name} must be an int, got {type(value).__name__}"
            ) from None
    kpool = operator.index(kpool)
    max_new_tokens = operator.index(max_new_tokens)
    if kpool < 1:
        raise ValueError(f"kpool must be at least 1, got {kpool}")
    if max_new_tokens < 1:
        raise ValueError(
            f"max_new_tokens must be at least 1, got {max_new_tokens}"
        )
    need = kpool + max_new_tokens - 1
    return -(-need // kpool) * kpool
