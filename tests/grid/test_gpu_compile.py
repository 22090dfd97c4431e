"""The whole op compiles for GPUs, on a machine without one.

Each target runs ``tests/support/gpu_compile_check.py`` in its own process:
MAX's virtual-device settings are process-global and must precede any device, so
they cannot share the test process (which already holds a CPU device). The
three compiles start together on first use and each test waits for its own.
A test passes when the process printed the script's marker line, which it
does only after MAX returned the compiled model; on failure the assertion
shows the process's output. Checked by hand that it can fail: a copy of the
kernels whose GPU ring_close kernel took an ``Int`` argument (passed as the
script's ``KERNELS_DIR``) failed for sm_90a with "Int and UInt do not
conform to DevicePassable", while that copy still compiled and ran on CPU.

The whole-op graph also holds this package's ``mla_kpool.index_top_k`` at
GLM-5-Next's indexer shape, so its GPU path (plan, score and the phased
select with its barriers and shared memory) compiles for every target.

A fourth compile, for cuda/sm_90a only, puts a ``kpool_step`` and an
``index_top_k`` on each of two virtual GPUs in one graph (a sharded indexer
runs one replica of the ops per GPU). It runs by itself after the three
above.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.gpu_compile_check import MARKER

SCRIPT = Path(__file__).resolve().parents[1] / "support/gpu_compile_check.py"

#: A cold compile is about 30 s alone; under load from parallel compiles
#: on a small machine it has taken 150 s.
TIMEOUT_S = 900


@dataclass(frozen=True)
class Target:
    """A virtual GPU: the driver API and the architecture to compile for."""

    api: str
    arch: str

    @property
    def id(self) -> str:
        """Readable pytest id, e.g. ``cuda-sm_90a``."""
        return f"{self.api}-{self.arch}"


TARGETS = [
    Target("cuda", "sm_90a"),
    Target("cuda", "sm_100a"),
    Target("hip", "gfx942"),
]


def _child_env() -> dict[str, str]:
    """This process's environment as Python sees it, minus Mojo's additions.

    Importing ``max.nn`` anywhere in the test run (another test module, say)
    sets ``PYTHONEXECUTABLE`` (the first ``python3`` on ``PATH``),
    ``MOJO_PYTHON_LIBRARY`` and ``PYTHONPATH=:`` in the C-level environment.
    A child inherits that by default, starts as that interpreter outside
    this virtual environment and cannot import ``max`` (seen in a full run).
    ``os.environ`` is Python's own copy, which does not have them; the two
    names are dropped from it too in case they ever reach it.
    """
    env = dict(os.environ)
    for name in ("PYTHONEXECUTABLE", "MOJO_PYTHON_LIBRARY"):
        env.pop(name, None)
    return env


def _start(args: list[str], log: Path) -> subprocess.Popen:
    """Starts the check script with ``args``, its output going to ``log``."""
    with log.open("wb") as sink:
        return subprocess.Popen(
            [sys.executable, str(SCRIPT), *args],
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=SCRIPT.parent,
            env=_child_env(),
        )


def _finish(process: subprocess.Popen, log: Path, name: str, marker: str):
    """Waits for a started check and asserts it printed ``marker``.

    A non-zero exit *after* the marker is tolerated: with a virtual sm_100a
    device MAX 26.7's teardown has aborted after a successful compile
    ("terminate called without an active exception", or a fatal
    PyGILState_Release error). The script exits before teardown to avoid
    it, so a non-zero status is reported here but does not fail the test.
    """
    try:
        status = process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"{name}: no result after {TIMEOUT_S} s")
    output = log.read_text(errors="replace")
    shown = f"{name} exited {status}; output:\n{output[-8000:]}"
    # The marker is printed only after MAX returned the compiled model.
    assert marker in output, shown
    if status != 0:
        print(f"{name}: exit status {status} after a successful compile")


@pytest.fixture(scope="module")
def compiles(tmp_path_factory: pytest.TempPathFactory):
    """Starts every target's compile at once: ``{id: (process, log)}``."""
    logs = tmp_path_factory.mktemp("gpu_compile")
    started = {}
    for target in TARGETS:
        log = logs / f"{target.id}.log"
        started[target.id] = (_start([target.api, target.arch], log), log)
    yield started
    for process, _ in started.values():
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.id)
def test_whole_op_compiles_for_gpu(compiles, target: Target) -> None:
    process, log = compiles[target.id]
    _finish(process, log, target.id, f"{MARKER} {target.api} {target.arch}")


#: The one target the two-GPU graph is compiled for (one compile is enough:
#: the per-target kernels are covered above).
REPLICA_TARGET = Target("cuda", "sm_90a")


def test_kpool_step_compiles_on_two_gpus(tmp_path: Path) -> None:
    """A ``kpool_step`` on ``GPU(0)`` and another on ``GPU(1)`` compile."""
    target, devices = REPLICA_TARGET, 2
    name = f"{target.id} x{devices}"
    log = tmp_path / f"{target.id}-x{devices}.log"
    args = [target.api, target.arch, "--devices", str(devices)]
    marker = f"{MARKER} {target.api} {target.arch} devices={devices}"
    _finish(_start(args, log), log, name, marker)
