"""What the demo serves: requests, and the keys and gates they bring.

A workload is a list of requests (prompt length, tokens to generate, a
cached prefix); :func:`generate_requests` draws a seeded mix. Each
request's keys and gates are drawn from a seed of its own
(:func:`request_rows`), so the oracle can recompute its whole sequence and a
request's data does not depend on how it is batched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

__all__ = [
    "DEFAULT_DTYPE",
    "DEFAULT_HEAD_DIM",
    "DEFAULT_KPOOL",
    "DEFAULT_MAX_RUNNING",
    "DEFAULT_POOL_TOPK",
    "DEFAULT_REQUESTS",
    "DTYPES",
    "Request",
    "ScheduleError",
    "draft_rows",
    "generate_requests",
    "make_ape",
    "request_rows",
]


#: Key dtypes by their command-line name.
DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}


#: Gate scores spread this wide (standard deviations) so that pool members
#: get clearly different softmax weights and a wrong member shows.
GATE_SCALE = 3.0


#: GLM-5-Next indexer shapes, the demo's default workload: key dtype (a
#: name of :data:`DTYPES`), tokens per pool, channels per key, requests
#: generated and ring slots.
DEFAULT_DTYPE = "bfloat16"


DEFAULT_KPOOL = 4


DEFAULT_HEAD_DIM = 128


DEFAULT_REQUESTS = 32


DEFAULT_MAX_RUNNING = 16


#: Pool ids an indexer query selects: GLM-5-Next's 512 (2051 positions per
#: row at kpool 4).
DEFAULT_POOL_TOPK = 512


class ScheduleError(ValueError):
    """A workload or schedule that cannot run; the message says where."""


@dataclass(frozen=True)
class Request:
    """One request of a workload.

    Attributes:
        prompt: Prompt tokens, cached prefix included, ``>= 1``.
        generate: Tokens generated after the prompt, ``>= 0``.
        cached_prefix: Leading prompt tokens processed before the workload
            starts (a prefix-cache hit), ``0 <= cached_prefix < prompt``.
            Their complete pools are not produced again; a partial last
            pool's members must be restored into the ring on admission.
        abort_at: If given, the client aborts the request once it holds
            this many tokens (``cached_prefix < abort_at < length``): the
            engine stops feeding it and frees its slot, so its pools end
            at ``abort_at // kpool``.
    """

    prompt: int
    generate: int = 0
    cached_prefix: int = 0
    abort_at: int | None = None

    @property
    def length(self) -> int:
        """Tokens in the whole sequence, ``prompt + generate``."""
        return self.prompt + self.generate

    @property
    def end(self) -> int:
        """Tokens the request reaches: ``abort_at``, else ``length``."""
        return self.length if self.abort_at is None else self.abort_at

    @property
    def new_tokens(self) -> int:
        """Tokens the calls must bring, ``end - cached_prefix``."""
        return self.end - self.cached_prefix


def generate_requests(
    rng: np.random.Generator,
    count: int,
    kpool: int,
    *,
    chunk: int = 512,
    max_prompt: int = 6000,
    max_generate: int = 256,
    cached_fraction: float = 0.25,
) -> list[Request]:
    """Draws a seeded mix of short and long requests.

    Prompt lengths are log-uniform between 2 and ``max_prompt``, so most
    are a few hundred tokens and some are thousands; four requests at random
    positions get edge lengths instead (1 token, ``kpool - 1`` tokens,
    exactly one chunk, two chunks plus ``kpool + 1``). About
    ``cached_fraction`` of the requests start with a cached prefix of random
    length (mid-pool in general, so the ring must be restored).

    Args:
        rng: Random source.
        count: Requests to draw, ``>= 1``.
        kpool: Tokens per pool (for the edge lengths).
        chunk: Prefill chunk size (for the edge lengths).
        max_prompt: Longest drawn prompt.
        max_generate: Most generated tokens per request.
        cached_fraction: Share of requests with a cached prefix.

    Returns:
        ``count`` requests.
    """
    prompts = np.exp(rng.uniform(math.log(2), math.log(max_prompt), count))
    prompts = [int(round(p)) for p in prompts]
    edges = [1, kpool - 1, chunk, 2 * chunk + kpool + 1]
    edges = [e for e in edges if e >= 1]
    where = rng.choice(count, size=min(len(edges), count), replace=False)
    for i, e in zip(where, edges, strict=False):
        prompts[int(i)] = e
    generate = rng.integers(0, max_generate + 1, count)
    cached = rng.random(count) < cached_fraction
    return [
        Request(p, int(g), int(rng.integers(1, p)) if c and p > 1 else 0)
        for p, g, c in zip(prompts, generate, cached, strict=True)
    ]


def request_rows(
    seed: int, index: int, length: int, head_dim: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """The keys and gates of request ``index``'s whole sequence.

    Drawn from a seed of their own, so the oracle can recompute them and a
    request's data does not depend on how it is batched.

    Returns:
        ``(k, gate)``, each ``[length, head_dim]`` in ``dtype``.
    """
    rng = np.random.default_rng([seed, 1, index])
    k = rng.standard_normal((length, head_dim)).astype(dtype)
    gate = GATE_SCALE * rng.standard_normal((length, head_dim))
    return k, gate.astype(dtype)


def draft_rows(
    seed: int,
    index: int,
    call: int,
    count: int,
    true_k: np.ndarray,
    dtype: np.dtype,
) -> tuple[np.ndarray, np.ndarray]:
    """Keys and gates of the drafts a verify step rejects.

    Args:
        seed: The run's seed.
        index: The request.
        call: The call (each verify step drafts afresh).
        count: Drafts rejected.
        true_k: ``[m, head_dim]`` true keys of the drafts' positions,
            ``m < count`` where the drafts run past the request's end.
        dtype: Key dtype.

    Returns:
        ``(k, gate)``, each ``[count, head_dim]``; no draft key equals the
        true key of its position (a key equal to the truth would be
        accepted).
    """
    rng = np.random.default_rng([seed, 3, index, call])
    head_dim = true_k.shape[1]
    k = rng.standard_normal((count, head_dim)).astype(dtype)
    gate = (GATE_SCALE * rng.standard_normal((count, head_dim))).astype(dtype)
    m = len(true_k)
    same = np.flatnonzero(np.all(k[:m] == true_k, axis=1))
    k[same] = (k[same].astype(np.float64) + 1.0).astype(dtype)
    return k, gate


def make_ape(seed: int, kpool: int, head_dim: int) -> np.ndarray:
    """The float32 within-pool position embedding ``[kpool, head_dim]``."""
    rng = np.random.default_rng([seed, 2])
    return rng.standard_normal((kpool, head_dim)).astype(np.float32)
