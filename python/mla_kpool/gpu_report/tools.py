"""The programs the report runs: ``mojo`` (the kernel driver) and ``ptxas``."""

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

#: What to install for ``ptxas`` (the optional extra and its wheel).
PTXAS_HINT = (
    "ptxas not found: registers, spills and occupancy of the NVIDIA kernels "
    "need it; install it with `pip install 'mla-kpool[gpu-report]'` "
    "(the nvidia-cuda-nvcc wheel)"
)


class ToolError(RuntimeError):
    """A program the report needs is missing or failed (one-line message)."""


def mojo_command() -> str | None:
    """The ``mojo`` beside this interpreter (a venv's), else on ``PATH``."""
    beside = Path(sys.executable).parent / "mojo"
    return str(beside) if beside.exists() else shutil.which("mojo")


def find_ptxas() -> str | None:
    """NVIDIA's PTX assembler, or ``None`` if it is not installed.

    Looks in the ``nvidia-cuda-nvcc`` wheel (``nvidia/cu13/bin/ptxas``, or
    ``cu12``), then on ``PATH``. A wheel unpacked without file modes leaves
    it not executable; it is made executable here.
    """
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        for cuda in ("cu13", "cu12"):
            path = Path(root) / cuda / "bin" / "ptxas"
            if path.is_file():
                if not os.access(path, os.X_OK):
                    path.chmod(path.stat().st_mode | stat.S_IXUSR)
                return str(path)
    return shutil.which("ptxas")


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
    argv = [
        mojo,
        "run",
        "-I",
        str(KERNELS.parent),
        "-D",
        f"MLA_KPOOL_ARCH={arch}",
        str(DRIVER),
        str(out_dir),
    ]
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        raise ToolError(f"compiling for {arch} took over {timeout} s") from e
    if proc.returncode != 0:
        errors = [
            line for line in proc.stderr.splitlines() if "error" in line
        ] or proc.stderr.strip().splitlines()[-1:]
        last = errors[0] if errors else f"exit status {proc.returncode}"
        raise ToolError(f"compiling the kernels for {arch} failed: {last}")


def run_ptxas(ptxas: str, arch: str, ptx_file: Path) -> str:
    """``ptxas -arch=<arch> -v`` of one PTX file: its info output.

    Raises:
        ToolError: If ptxas refuses the file.
    """
    proc = subprocess.run(
        [ptxas, f"-arch={arch}", "-v", str(ptx_file), "-o", os.devnull],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        first = (proc.stderr.strip().splitlines() or ["?"])[0]
        raise ToolError(f"ptxas failed on {ptx_file.name}: {first}")
    return proc.stdout + proc.stderr
