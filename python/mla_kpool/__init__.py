"""MAX graph custom ops for the k-pooled sparse-attention indexer.

Drop-in, CPU+GPU replacements for MAX's GPU-only
``max.nn.kernels.mla_kpool_*`` writers, with the same Python signatures.
Call the writers (or :func:`kpool_step`, all three in order) inside a
graph; each loads this package's kernels into the graph if it lacks them::

    with Graph("indexer", input_types=...) as graph:
        step = kpool_step(tail, k, gate, ape, row_offsets, cache, slots, 4)

Graphs that call MAX's own wrappers (an unchanged MAX pipeline) get the
kernels when built inside :func:`kernels_loaded`.

:func:`index_top_k` is the pooled indexer that scores the cached pools
(MAX's ``mla_fp8_index_top_k`` signature, on the CPU too);
:mod:`mla_kpool.index_cache` fills its paged FP8 cache on the host. It is
imported on first use: its module imports ``max.nn``, which takes seconds.

Attributes:
    __version__: This package's version, from the installed distribution's
        metadata (``importlib.metadata``); from the checkout's
        ``pyproject.toml`` when the package is used from a source tree that
        is not installed (``PYTHONPATH=python``, as the pixi tasks do);
        ``"0+unknown"`` if neither is there.
    KERNELS: The Mojo package directory (it holds ``__init__.mojo``), which
        can also be passed as ``custom_extensions=[KERNELS]`` to ``Graph``
        or ``InferenceSession``. A wheel carries it as
        ``mla_kpool/kernels``; an editable install or a source checkout uses
        the repository's top-level ``kernels/``.
"""

# No ``from __future__ import annotations`` and only private names for the
# standard library, so that ``dir(mla_kpool)`` shows the package's own API.
from importlib import metadata as _dist_metadata
from pathlib import Path as _Path
from typing import Any as _Any

from . import buffers, reference
from ._metadata import check_index_metadata, check_metadata
from ._paths import KERNELS, kernels_loaded
from .graph import (
    KPoolStep,
    compress,
    expand_topk,
    kpool_step,
    pool_row_offsets,
    ring_close,
    seed_tail,
)
from .ring import ring_length

#: The distribution name on PyPI and in ``importlib.metadata``.
_DISTRIBUTION = "mla-kpool"


def _find_version() -> str:
    """The installed distribution's version, else the checkout's.

    Returns:
        A PEP 440 version string; ``"0+unknown"`` when the package is
        neither installed nor inside a checkout with its ``pyproject.toml``.
    """
    try:
        return _dist_metadata.version(_DISTRIBUTION)
    except _dist_metadata.PackageNotFoundError:
        pass
    # A source checkout: python/mla_kpool/__init__.py -> pyproject.toml.
    import tomllib

    pyproject = _Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        with pyproject.open("rb") as f:
            project = tomllib.load(f).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return "0+unknown"
    if project.get("name") != _DISTRIBUTION:
        return "0+unknown"
    return str(project.get("version", "0+unknown"))


__version__: str = _find_version()


def __getattr__(name: str) -> _Any:
    """``index_top_k``, imported on first use (it imports ``max.nn``)."""
    if name == "index_top_k":
        from .indexer import index_top_k

        return index_top_k
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "KERNELS",
    "__version__",
    "KPoolStep",
    "buffers",
    "check_index_metadata",
    "check_metadata",
    "compress",
    "expand_topk",
    "index_top_k",
    "kernels_loaded",
    "kpool_step",
    "pool_row_offsets",
    "reference",
    "ring_close",
    "ring_length",
    "seed_tail",
]
