"""The programs the report runs: ``mojo``, ``ptxas`` and ``nvdisasm``."""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from .._paths import KERNELS

#: The Mojo program that compiles every kernel for one target.
DRIVER = Path(__file__).resolve().parent / "kernel_asm.mojo"

#: The repository root, when this package runs from a source checkout.
_CHECKOUT = Path(__file__).resolve().parents[3]


def install_command(checkout: Path | None = None) -> str:
    """The command that installs the ``gpu-report`` extra, in backquotes.

    Args:
        checkout: The source checkout to name; ``None`` takes this
            package's own when it runs from one (an editable install: the
            folder holding ``python/mla_kpool`` has a ``pyproject.toml``).

    Returns:
        From a checkout, ``pip install -e '.[gpu-report]'`` run at its
        root; otherwise ``pip install 'mla-kpool[gpu-report]'``. Either
        brings the nvidia-cuda-nvcc wheel (ptxas) and the
        nvidia-cuda-nvdisasm wheel (nvdisasm).
    """
    if checkout is None and (_CHECKOUT / "pyproject.toml").is_file():
        checkout = _CHECKOUT
    if checkout is not None:
        return f"`pip install -e '.[gpu-report]'` in {checkout}"
    return "`pip install 'mla-kpool[gpu-report]'`"


def ptxas_hint(checkout: Path | None = None) -> str:
    """The one line that says what to install for ``ptxas``.

    Args:
        checkout: As for :func:`install_command`.

    Returns:
        The line, naming :func:`install_command` and the
        nvidia-cuda-nvcc wheel, which carries ptxas.
    """
    return (
        "ptxas not found: registers, spills and occupancy of the NVIDIA "
        f"kernels need it; install it with {install_command(checkout)} (the "
        "nvidia-cuda-nvcc wheel)"
    )


class ToolError(RuntimeError):
    """A program the report needs is missing or failed (one-line message)."""


def mojo_command() -> str | None:
    """The ``mojo`` beside this interpreter (a venv's), else on ``PATH``."""
    beside = Path(sys.executable).parent / "mojo"
    return str(beside) if beside.exists() else shutil.which("mojo")


def find_ptxas() -> str | None:
    """NVIDIA's PTX assembler, or ``None`` if it is not installed.

    The ``nvidia-cuda-nvcc`` wheel's (:func:`find_nvidia_tool`), else
    ``PATH``'s.
    """
    return find_nvidia_tool("ptxas")


def find_nvdisasm() -> str | None:
    """NVIDIA's cubin disassembler (SASS), or ``None`` if not installed.

    The ``nvidia-cuda-nvdisasm`` wheel's (:func:`find_nvidia_tool`), else
    ``PATH``'s.
    """
    return find_nvidia_tool("nvdisasm")


def find_nvidia_tool(name: str) -> str | None:
    """A CUDA tool from NVIDIA's PyPI wheels, else from ``PATH``.

    Looks for ``nvidia/cu13/bin/<name>`` (or ``cu12``) in the installed
    ``nvidia`` namespace package. A wheel unpacked without file modes
    leaves the tool not executable: then an executable copy is made in
    this user's cache (``$XDG_CACHE_HOME`` or ``~/.cache``,
    ``mla-kpool/tools``; nothing inside site-packages is changed), and that
    copy is returned.
    """
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        for cuda in ("cu13", "cu12"):
            path = Path(root) / cuda / "bin" / name
            if path.is_file():
                return _executable(path)
    return shutil.which(name)


def _executable(path: Path) -> str:
    """``path``, or an executable copy of it when it is not executable.

    The copy lives in a folder only this user can write, and is made again
    whenever its size or modification time differs from the original's.

    Raises:
        ToolError: If that folder is a link, or not this user's alone.
    """
    if os.access(path, os.X_OK):
        return str(path)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = cache / "mla-kpool" / "tools"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.lstat()
    if (
        stat.S_ISLNK(info.st_mode)
        or info.st_uid != os.getuid()
        or info.st_mode & 0o077
    ):
        raise ToolError(f"{folder} must be a folder only you can write")
    copy = folder / f"{path.parent.parent.name}-{path.name}"
    source = path.stat()
    if (
        not copy.is_file()
        or copy.stat().st_size != source.st_size
        or copy.stat().st_mtime != source.st_mtime
    ):
        shutil.copy2(path, copy)
        copy.chmod(stat.S_IRWXU)
    return str(copy)


def compile_kernels(arch: str, out_dir: Path, timeout: float = 900) -> None:
    """Runs the driver: every kernel's code for ``arch`` into ``out_dir``.

    Args:
        arch: A target ``get_gpu_target`` knows (``sm_90a``, ``gfx942``).
        out_dir: Existing directory for the code and ``manifest.jsonl``.
        timeout: Seconds before the compile is abandoned.

    Raises:
        ToolError: If ``mojo`` is missing, or the compile fails (with the
            compiler's last error line).
    """
    mojo = mojo_command()
    if mojo is None:
        raise ToolError(
            "the mojo command is not found (beside this Python or on PATH); "
            "install the `mojo` package"
        )
    flags = ["-I", str(KERNELS.parent), "-D", f"MLA_KPOOL_ARCH={arch}"]
    argv = [mojo, "run", *flags, str(DRIVER), str(out_dir)]
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        raise ToolError(f"compiling for {arch} took over {timeout} s") from e
    if proc.returncode != 0:
        raise ToolError(
            f"compiling the kernels for {arch} failed: "
            + compile_error(proc.stderr, proc.returncode)
        )


def compile_error(stderr: str, returncode: int) -> str:
    """The one line that says why a ``mojo`` compile failed.

    The compiler's first line with ``error`` (else its last line), and,
    when a ``constraint failed`` note says what the code refused (an
    unknown GPU architecture, say), that note's first line too.
    """
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if "error" in line] or lines[-1:]
    message = errors[0].strip() if errors else f"exit status {returncode}"
    for line in lines:
        if "constraint failed:" in line:
            reason = line.split("constraint failed:", 1)[1].strip()
            return f"{message} (constraint failed: {reason})"
    return message


def run_ptxas(
    ptxas: str, arch: str, ptx_file: Path, cubin: Path | None = None
) -> str:
    """``ptxas -arch=<arch> -v`` of one PTX file: its info output.

    Args:
        ptxas: The assembler.
        arch: Its ``-arch``.
        ptx_file: The PTX.
        cubin: Where the machine code goes (discarded when ``None``).

    Raises:
        ToolError: If ptxas refuses the file.
    """
    out = os.devnull if cubin is None else str(cubin)
    argv = [ptxas, f"-arch={arch}", "-v", str(ptx_file), "-o", out]
    proc = _run_tool(argv, f"ptxas failed on {ptx_file.name}")
    return proc.stdout + proc.stderr


def run_nvdisasm(nvdisasm: str, cubin: Path) -> str:
    """The SASS of a cubin (``nvdisasm``'s listing).

    Raises:
        ToolError: If nvdisasm refuses the file.
    """
    return _run_tool(
        [nvdisasm, str(cubin)], f"nvdisasm failed on {cubin.name}"
    ).stdout


def _run_tool(argv: list[str], failed: str) -> subprocess.CompletedProcess:
    """Runs ``argv``; a failure raises ``failed`` with its first error line.

    Raises:
        ToolError: If the program exits with a nonzero status.
    """
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        first = (proc.stderr.strip().splitlines() or ["?"])[0]
        raise ToolError(f"{failed}: {first}")
    return proc
