"""Where the Mojo kernel package lives."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def find_kernels() -> Path:
    """Returns the Mojo package directory to load as a custom extension.

    A wheel carries the sources as ``mla_kpool/kernels``; an editable install
    or a source checkout has them only at the repository's top-level
    ``kernels/``, two levels above this file (``python/mla_kpool``).
    """
    installed = _HERE / "kernels"
    if (installed / "__init__.mojo").is_file():
        return installed
    return _HERE.parents[1] / "kernels"


KERNELS: Path = find_kernels()

#: No-op kernels with the real ops' names and signatures (benchmark floor).
NOOP_KERNELS: Path = _HERE / "bench_noop"
