"""NumPy's BLAS for the benchmark: a clean environment and what ran.

The index op's peers are NumPy code whose time is a BLAS matmul, so the
benchmark must give NumPy its best BLAS. Two OpenBLAS variables that some
machines set for other software, ``OPENBLAS_CORETYPE`` (forces a kernel
family, for instance an old one without AVX2) and ``OPENBLAS_L2_SIZE``
(overrides the blocking), make NumPy's matmul several times slower;
OpenBLAS reads them once, when NumPy is imported, so the command line
re-executes itself without them (:func:`reexec_without_slow_blas`) and
every record names the library, kernel and threads that ran
(:func:`blas_info`).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["SLOW_BLAS_VARIABLES", "blas_info", "reexec_without_slow_blas"]


#: Environment variables the bench unsets for itself (see the module doc).
SLOW_BLAS_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")

#: What :func:`blas_info` says of the BLAS, in this order.
_BLAS_FIELDS = "internal_api architecture version num_threads filepath".split()

#: Set in the re-executed process: what was unset, ``NAME=value`` by ``;``.
UNSET_MARKER = "MLA_KPOOL_BENCH_UNSET"


def reexec_without_slow_blas(
    environ: Mapping[str, str] | None = None,
    argv: Sequence[str] | None = None,
    execve: Any = os.execve,
) -> None:
    """Re-executes this process without :data:`SLOW_BLAS_VARIABLES`.

    Only for the command line (``python -m mla_kpool bench``): the same
    interpreter and arguments (``sys.orig_argv``), the environment less
    those variables plus :data:`UNSET_MARKER` naming them. Returns without
    doing anything when none is set.

    Args:
        environ: The environment (``os.environ`` when ``None``).
        argv: The interpreter's command line (``sys.orig_argv``).
        execve: ``os.execve`` (tests pass a stand-in).
    """
    env = dict(os.environ if environ is None else environ)
    found = [name for name in SLOW_BLAS_VARIABLES if name in env]
    if not found:
        return
    unset = ";".join(f"{name}={env.pop(name)}" for name in found)
    env[UNSET_MARKER] = unset
    args = list(sys.orig_argv if argv is None else argv)
    print(
        f"bench: unsetting {', '.join(found)} (they slow NumPy's BLAS, the"
        " NumPy peers' engine) and starting again",
        file=sys.stderr,
        flush=True,
    )
    execve(sys.executable, [sys.executable, *args[1:]], env)


def _openblas_probe() -> dict[str, Any] | None:
    """OpenBLAS's own answer, through ctypes, without threadpoolctl.

    Looks for a loaded library with ``openblas`` in its name
    (``/proc/self/maps``, Linux) and asks it for its kernel (core name),
    configuration and threads under each symbol prefix the builds use
    (``openblas_``, NumPy's ``scipy_openblas_..64_``).
    """
    try:
        with open("/proc/self/maps") as f:
            paths = {
                line.split()[-1]
                for line in f
                if "openblas" in line.lower() and "/" in line
            }
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_", "64_"), ("", "64_"), ("", "")):
            symbol = f"{prefix}openblas_{{}}{suffix}".format
            core = _c_call(lib, symbol("get_corename"), ctypes.c_char_p)
            if core is None:
                continue
            config = _c_call(lib, symbol("get_config"), ctypes.c_char_p)
            return {
                "internal_api": "openblas",
                "architecture": core.decode(),
                "version": (config or b"").decode().split(" ")[1:2] or None,
                "num_threads": _c_call(
                    lib, symbol("get_num_threads"), ctypes.c_int
                ),
                "filepath": path,
            }
    return None


def _c_call(lib: Any, symbol: str, restype: Any) -> Any:
    """``lib``'s function ``symbol`` called with no argument, else ``None``."""
    fn = getattr(lib, symbol, None)
    if fn is None:
        return None
    fn.restype = restype
    return fn()


def blas_info() -> dict[str, Any]:
    """Which BLAS NumPy's matmul ran on, for the records.

    threadpoolctl's account when it is installed (library, version,
    kernel ``architecture``, threads), else OpenBLAS's own (ctypes), else
    ``None`` fields; plus the variables the command line unset
    (:func:`reexec_without_slow_blas`) and any still set.

    Returns:
        ``{"blas": {...} or None, "blas_unset": "NAME=value;..." or None,
        "blas_env": {NAME: value} of those still set}``.
    """
    found: dict[str, Any] | None = None
    try:
        import numpy as np  # noqa: F401  (loads its BLAS first)
        from threadpoolctl import threadpool_info
    except ImportError:
        found = _openblas_probe()
    else:
        for lib in threadpool_info():
            if lib.get("user_api") == "blas":
                found = {key: lib.get(key) for key in _BLAS_FIELDS}
                break
    if found is not None and isinstance(found.get("version"), list):
        found["version"] = (found["version"] or [None])[0]
    return {
        "blas": found,
        "blas_unset": os.environ.get(UNSET_MARKER),
        "blas_env": {
            name: os.environ[name]
            for name in SLOW_BLAS_VARIABLES
            if name in os.environ
        },
    }
