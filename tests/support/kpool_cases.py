"""Configurations and helpers shared by the kernel test files.

Every distinct (kind, dtype, kpool, head_dim, ring length, index dtypes)
is one more op to compile, and every graph costs a MAX compile (15-40 s cold
on a 2-core VM alone, minutes beside other compiles), so the suite draws
its kernel configurations from the short lists below, shares one
:class:`mla_kpool.runner.Runner` per device and compiles each test
module's models as one graph (conftest's ``runners`` fixture, the
module's ``COMPILED_TOGETHER``).
Add a configuration only when a test needs a combination none of these has.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import ml_dtypes
import numpy as np
import pytest

from mla_kpool.reference import tolerance
from mla_kpool.runner import ModelKey, model_key

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)

#: Tolerance against the float64 oracle, relative to the magnitude of the
#: pooled members: the package's one rule (:func:`mla_kpool.reference.
#: tolerance`), whose values tests/cli/test_cli.py pins.
TOLERANCE = {dtype: tolerance(dtype) for dtype in (F32, F16, BF16)}


#: What Mojo's Python interop sets in the C-level environment (not in
#: ``os.environ``) when ``max.nn`` or ``max.nn.kernels`` is first imported:
#: ``PYTHONEXECUTABLE`` (the first ``python3`` on ``PATH``), ``PYTHONPATH``
#: and ``MOJO_PYTHON_LIBRARY``. A later subprocess started without ``env=``
#: would inherit them and run outside this virtual environment.
INTEROP_VARIABLES = ("PYTHONEXECUTABLE", "PYTHONPATH", "MOJO_PYTHON_LIBRARY")


def restore_environment() -> None:
    """Puts :data:`INTEROP_VARIABLES` back to what ``os.environ`` says."""
    for name in INTEROP_VARIABLES:
        if name in os.environ:
            os.putenv(name, os.environ[name])
        else:
            os.unsetenv(name)


@functools.cache
def max_nn_kernels() -> ModuleType:
    """MAX's own ``max.nn.kernels``, imported on first use.

    Not at collection: the import starts Mojo's Python interop, so the
    environment is restored (:func:`restore_environment`) right after it.
    """
    from max.nn import kernels

    restore_environment()
    return kernels


def bits(a: np.ndarray) -> np.ndarray:
    """An array's raw bits, one unsigned integer per element.

    For bitwise comparisons of any dtype: NaN equals NaN (same payload),
    -0.0 differs from +0.0, and indices into the result are element
    indices of ``a``.
    """
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}")


@dataclass(frozen=True)
class Config:
    """One compiled writer configuration."""

    dtype: np.dtype
    kpool: int
    head_dim: int

    @property
    def id(self) -> str:
        """Readable pytest id, e.g. ``bfloat16-k4-d128``."""
        return f"{self.dtype.name}-k{self.kpool}-d{self.head_dim}"


#: The configuration most tests use: float32, GLM-5-Next's indexer shape.
MAIN = Config(F32, 4, 128)

#: Step models (the fused op) the suite compiles. Together they cover every
#: dtype, kpool 1, 2, 3, 4, 16, 128 and head_dim 1, 32, 64, 96, 128, 1089
#: (above the 1024-thread GPU block limit).
STEP_CONFIGS = [
    MAIN,
    Config(BF16, 4, 128),
    Config(F16, 16, 32),
    Config(F32, 1, 32),
    Config(F32, 3, 32),
    Config(BF16, 128, 32),
    Config(F32, 2, 64),
    Config(F16, 4, 96),
    Config(F32, 4, 1),
    Config(BF16, 2, 1089),
]


def step_keys(configs: list[Config]) -> list[ModelKey]:
    """The fused step's model key of each configuration on a one-pool ring.

    uint32 index operands and ``kpool`` ring entries: what a test module
    lists in ``COMPILED_TOGETHER`` for the steps it runs (see the
    ``runners`` fixture in conftest.py).
    """
    return [
        model_key(
            "step",
            c.kpool,
            dtype=c.dtype,
            head_dim=c.head_dim,
            ring_len=c.kpool,
        )
        for c in configs
    ]


def random_rows(
    rng: np.random.Generator,
    tokens: int,
    head_dim: int,
    dtype: np.dtype,
    gate_scale: float = 4.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Random ``(k, gate)`` rows; gates spread wide so members differ."""
    k = rng.standard_normal((tokens, head_dim)).astype(dtype)
    gate = (gate_scale * rng.standard_normal((tokens, head_dim))).astype(dtype)
    return k, gate


def random_ape(
    rng: np.random.Generator, kpool: int, head_dim: int, scale: float = 2.0
) -> np.ndarray:
    """A float32 ape wide enough that a wrong ape row changes the answer."""
    return (scale * rng.standard_normal((kpool, head_dim))).astype(np.float32)


def assert_pooled_close(
    actual: np.ndarray,
    expected: np.ndarray,
    dtype: np.dtype,
    scale: float,
    what: str = "pooled",
) -> None:
    """Asserts kernel output matches the float64 oracle within tolerance.

    Args:
        actual: Kernel output (any float dtype).
        expected: Oracle output, float64.
        dtype: The key dtype the kernel ran in (picks the tolerance).
        scale: Largest member magnitude (``max |k|`` over the inputs).
        what: Name for the failure message.
    """
    tol = TOLERANCE[np.dtype(dtype)]
    np.testing.assert_allclose(
        np.asarray(actual, dtype=np.float64),
        expected,
        rtol=tol,
        atol=tol * max(scale, 1e-30),
        err_msg=f"{what} ({np.dtype(dtype).name}) differs from the oracle",
    )


ROOT = Path(__file__).resolve().parents[2]


def mojo_command() -> str | None:
    """The ``mojo`` beside this interpreter (the venv's), else on ``PATH``."""
    beside = Path(sys.executable).parent / "mojo"
    return str(beside) if beside.exists() else shutil.which("mojo")


#: Set (to anything but ``""`` or ``"0"``) where the Mojo tests must run, as
#: ``.ci/run`` does: a missing ``mojo`` then fails them instead of skipping.
REQUIRE_MOJO = "MLA_KPOOL_REQUIRE_MOJO"


def mojo_required() -> bool:
    """Whether :data:`REQUIRE_MOJO` is set."""
    return os.environ.get(REQUIRE_MOJO, "") not in ("", "0")


def skip_without_mojo() -> bool:
    """Whether the tests that run ``mojo`` skip: it is not found and
    :data:`REQUIRE_MOJO` is not set (set, they run and fail)."""
    return mojo_command() is None and not mojo_required()


#: The mark of every test that runs ``mojo`` (the only way such a test
#: skips; tests/docs_and_layout/test_kernel_constants.py keeps it so).
needs_mojo = pytest.mark.skipif(
    skip_without_mojo(),
    reason=f"the mojo command is not found (and {REQUIRE_MOJO} is not set)",
)


def require_mojo() -> str:
    """The ``mojo`` command; fails the calling test where there is none."""
    mojo = mojo_command()
    if mojo is None:
        pytest.fail(
            f"the mojo command is not found ({REQUIRE_MOJO} is"
            f" {os.environ.get(REQUIRE_MOJO)!r})"
        )
    return mojo


def mojo_run(
    test_file: str,
    *args: str,
    root: Path = ROOT,
    defines: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """``mojo run -D define... -I root root/test_file args...``, its output
    captured."""
    flags = [f for d in defines for f in ("-D", d)]
    return subprocess.run(
        [
            require_mojo(),
            "run",
            *flags,
            "-I",
            str(root),
            str(root / test_file),
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "MODULAR_DEBUG": "stack-trace-on-error"},
        timeout=600,
    )


def run_mojo_file(
    test_file: str, root: Path = ROOT, defines: tuple[str, ...] = ()
) -> tuple[int, str]:
    """:func:`mojo_run` of ``test_file``: its exit status and output."""
    proc = mojo_run(test_file, root=root, defines=defines)
    return proc.returncode, proc.stdout + proc.stderr


@functools.cache
def _mojo_suite(
    test_file: str, defines: tuple[str, ...] = ()
) -> tuple[str, dict[str, str]]:
    """One run of a ``tests/mojo`` suite: its output, and each test's
    result (``PASS``, ``FAIL`` or ``SKIP``) by name; run once per process,
    so a suite's hardware tests are read from the run that checked the
    rest."""
    status, output = run_mojo_file(test_file, defines=defines)
    results = dict(
        (name, result)
        for result, name in re.findall(
            r"^\s*(PASS|FAIL|SKIP) \[[^]]*\] (\w+)", output, re.M
        )
    )
    assert status == 0 or "FAIL" in results.values(), output
    return output, results


def run_mojo_suite(
    test_file: str,
    may_skip: tuple[str, ...] = (),
    defines: tuple[str, ...] = (),
) -> str:
    """Runs a ``tests/mojo`` file's ``TestSuite``; asserts every test passed.

    The suite must report as many tests as the file defines (its
    top-level ``def test_...`` functions), so a test that was not
    discovered cannot pass unseen, and no count is kept by hand. Only the
    tests named in ``may_skip`` (hardware comparisons, which the suite
    skips where their GPU is absent) may report a skip; the caller counts
    each through :func:`mojo_hardware_test`.

    Args:
        test_file: Path relative to the repository root.
        may_skip: Tests the suite may skip.
        defines: ``-D`` names the suite is compiled with.

    Returns:
        The suite's output.
    """
    defined = re.findall(
        r"^def (test_\w+)\(", (ROOT / test_file).read_text(), re.M
    )
    output, results = _mojo_suite(test_file, defines)
    summary = re.search(
        r"(\d+) tests run: (\d+) passed , (\d+) failed , (\d+) skipped",
        output,
    )
    assert summary, output
    assert int(summary[1]) == len(defined) > 0, output
    assert sorted(results) == sorted(defined), output
    wrong = {
        name: result
        for name, result in results.items()
        if result != "PASS" and not (result == "SKIP" and name in may_skip)
    }
    assert not wrong, f"{wrong}\n{output}"
    return output


def mojo_hardware_test(test_file: str, name: str, needs: str) -> None:
    """Counts a suite's hardware test as pytest counts tests: a skip where
    the suite skipped it (no ``needs`` GPU here), else its pass or fail.

    Args:
        test_file: The suite, as for :func:`run_mojo_suite`.
        name: The Mojo test.
        needs: The GPU it needs, for the skip's reason.
    """
    output, results = _mojo_suite(test_file)
    if results.get(name) == "SKIP":
        pytest.skip(f"{name} needs {needs}; the Mojo suite skipped it")
    assert results.get(name) == "PASS", output
