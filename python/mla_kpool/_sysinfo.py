"""Where a measurement was taken: versions, machine, commit, command line.

The benchmark stamps every record with these so that a JSON file read
months later (or next to one from another machine) says what produced it.
Every function degrades to ``None`` or a fallback instead of raising: a
missing field must never cost a measurement.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Where this package's sources sit inside its repository.
_PACKAGE_DIR = Path(__file__).resolve().parent
_IN_REPO = Path("python", "mla_kpool")


def package_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or ``None``."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpuinfo_value(cpuinfo: Path, keys: tuple[str, ...]) -> str | None:
    """The first non-empty value of one of ``keys`` in ``cpuinfo``.

    A ``/proc/cpuinfo`` style file: the first CPU's line counts; ``None``
    when there is no such line or no file.
    """
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys and value.strip():
            return value.strip()
    return None


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's marketing name.

    Linux's ``/proc/cpuinfo`` ``model name`` (``Processor`` on some Arm
    kernels); elsewhere, or when it names nothing, ``platform.processor()``
    and finally ``platform.machine()``.
    """
    return (
        _cpuinfo_value(cpuinfo, ("model name", "Processor"))
        or platform.processor()
        or platform.machine()
        or "unknown"
    )


#: The instruction sets the CPU kernels choose between, by the Linux
#: ``/proc/cpuinfo`` flag that announces each: the vector width and the
#: prefill scorer's form follow them.
CPU_ISA_FLAGS = (
    ("AVX2", "avx2"),
    ("FMA", "fma"),
    ("AVX-512", "avx512f"),
    ("AVX512-BF16", "avx512_bf16"),
    ("AMX", "amx_tile"),
)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (``avx2``, ``amx_bf16``, ...).

    Read from the first ``flags`` line of Linux's ``/proc/cpuinfo``; an
    empty set where there is none (another OS, or a non-x86 CPU).
    """
    return set((_cpuinfo_value(cpuinfo, ("flags",)) or "").split())


def cpu_isa(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The vector instruction sets of :data:`CPU_ISA_FLAGS` the CPU has.

    In that order, from :func:`cpu_flags`.
    """
    flags = cpu_flags(cpuinfo)
    return [name for name, flag in CPU_ISA_FLAGS if flag in flags]


#: The environment variable that turns the CPU path's AMX blocks off (``0``).
CPU_AMX_ENV = "MLA_KPOOL_CPU_AMX"


def cpu_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether index_top_k's CPU path scores on AMX tiles in this process.

    The kernels' own check, made from Python: the CPU lists ``amx_tile``
    and ``amx_bf16``, :data:`CPU_AMX_ENV` is not ``0``, and Linux grants
    the process the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``, which the kernels would request anyway). False
    on other systems.
    """
    if os.environ.get(CPU_AMX_ENV) == "0":
        return False
    if not {"amx_tile", "amx_bf16"} <= cpu_flags(cpuinfo):
        return False
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
        return libc.syscall(158, 0x1023, 18) == 0
    except (OSError, AttributeError):
        return False


#: The environment variables that name the commit when there is no
#: checkout to ask (a copy of the working tree without ``.git``, as a lent
#: GPU machine gets): the sha, and ``1`` / ``0`` for tracked files changed.
COMMIT_ENV = "MLA_KPOOL_COMMIT"
DIRTY_ENV = "MLA_KPOOL_DIRTY"


def git_commit(
    package_dir: Path = _PACKAGE_DIR,
) -> tuple[str, bool | None] | None:
    """The commit of the checkout this package is imported from.

    Only a repository whose ``python/mla_kpool`` is this package counts, so
    an installed wheel inside some other repository (a virtual environment
    kept in a project, say) reports ``None`` rather than that project's
    commit. Without such a checkout (no ``.git``, or no ``git``), the
    commit is :data:`COMMIT_ENV`'s value when set, and whether the files
    differ from it :data:`DIRTY_ENV`'s (``None``, unknown, unless it is
    ``1`` or ``0``).

    Returns:
        ``(commit sha, whether tracked files differ from it)``, or ``None``
        outside a checkout with :data:`COMMIT_ENV` unset.
    """

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(package_dir), *args],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    found = git("rev-parse", "--show-toplevel", "HEAD")
    top, _, sha = (found or "").partition("\n")
    if not sha or Path(top).resolve() / _IN_REPO != package_dir.resolve():
        named = os.environ.get(COMMIT_ENV, "").strip()
        if not named:
            return None
        dirty = {"1": True, "0": False}.get(os.environ.get(DIRTY_ENV, ""))
        return named, dirty
    return sha, bool(git("status", "--porcelain", "--untracked-files=no"))


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that started this process, shell-quoted.

    ``python -m mla_kpool`` shows as that rather than as the path of
    ``__main__.py``.
    """
    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).name == "__main__.py":
        argv[0:1] = ["python", "-m", Path(argv[0]).parent.name]
    return shlex.join(argv)


def run_info(
    device: str, accelerator_name: str | None = None
) -> dict[str, Any]:
    """The fields every benchmark record carries.

    Args:
        device: ``"cpu"`` or ``"gpu"``.
        accelerator_name: The GPU's model name (``driver.Accelerator()
            .model_name``) when ``device`` is ``"gpu"``.

    Returns:
        ``max_version``, ``mojo_version``, ``cpu_model``, ``cpu_isa``
        (:func:`cpu_isa`), ``cpu_amx`` (:func:`cpu_amx`), ``cores``,
        ``device_name`` (the accelerator's name on a GPU, else the CPU
        model), ``git_commit`` and ``git_dirty`` (``None`` outside a
        checkout) and ``command``.
    """
    cpu = cpu_model()
    commit = git_commit()
    return {
        "max_version": package_version("max"),
        "mojo_version": package_version("mojo"),
        "cpu_model": cpu,
        "cpu_isa": cpu_isa(),
        "cpu_amx": cpu_amx(),
        "cores": os.cpu_count() or 1,
        "device_name": accelerator_name if device == "gpu" else cpu,
        "git_commit": commit[0] if commit else None,
        "git_dirty": commit[1] if commit else None,
        "command": command_line(),
    }
