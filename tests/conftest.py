"""Shared fixtures: the devices every kernel test runs on."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import max.nn  # noqa: F401  (imported first on purpose, see below)
import pytest
from max import driver
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph

from mla_kpool.runner import Runner
from support.kpool_cases import restore_environment

# Importing max.nn sets variables in the C-level environment that a later
# subprocess would inherit (kpool_cases.INTEROP_VARIABLES); put them back to
# what os.environ says, once, for the suite.
restore_environment()

#: pytester for the plugin's own test; compile_notice says on the terminal
#: that a cold run compiles, and names a test while it compiles.
pytest_plugins = ("pytester", "support.compile_notice")

_HAS_GPU = driver.accelerator_count() > 0

#: Most xdist workers ``-n auto`` starts. The suite's time is graph compiles,
#: each mostly on one core and 1-2 GB of memory, and workers that share a
#: model compile it once each unless the disk cache already has it.
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per core, at most :data:`MAX_WORKERS`."""
    return min(MAX_WORKERS, os.cpu_count() or 1)


#: The files whose cold run takes longest (the ``--durations`` of a cold
#: ``.ci/run``), slowest first, by file name (unique across the area
#: folders under tests/). Workers take whole files in collection
#: order (``--no-loadscope-reorder`` in pyproject.toml keeps xdist from
#: handing out the files with the most tests first), so these go first: a
#: long file handed out last would leave the other workers idle while it
#: finishes.
SLOW_FILES = (
    "test_gpu_compile.py",
    "test_step_fused.py",
    "test_streaming.py",
    "test_spec_decode.py",
    "test_gpu_emulation.py",
    "test_example.py",
    "test_cli.py",
    "test_index_top_k_emulated.py",
    "test_ring_close.py",
    "test_expand_topk.py",
    "test_index_top_k.py",
    "test_gpu_report.py",
    "test_pool_row_offsets.py",
    "test_bench.py",
    "test_gpu_kernels.py",
    "test_packaging.py",
)


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list
) -> None:
    """Runs :data:`SLOW_FILES` first, in that order; the rest as collected."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


#: Parametrization for tests that run on every device: the CPU always, the
#: first accelerator when there is one (a visible skip otherwise, so a CPU-only
#: run says what it did not cover).
DEVICES = [
    pytest.param(DeviceRef.CPU(), id="cpu"),
    pytest.param(
        DeviceRef.GPU(),
        id="gpu",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not _HAS_GPU,
                reason="no accelerator (max.driver.accelerator_count() == 0)",
            ),
        ],
    ),
]


#: Devices by name, for :class:`mla_kpool.runner.Runner`: the CPU kernels,
#: the GPU kernels run over an emulated grid on the host (every machine, so
#: every run executes the GPU code), and a real accelerator when present.
DEVICE_NAMES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu-emulated", id="gpu-emulated", marks=pytest.mark.emulated),
    pytest.param("gpu", id="gpu", marks=DEVICES[1].marks),
]


#: Where workers take turns to compile a graph (one lock file per graph).
COMPILE_LOCKS = Path(tempfile.gettempdir(), f"mla-kpool-{os.getuid()}-compiles")


@pytest.fixture(scope="session", autouse=True)
def one_compile_per_graph() -> Iterator[None]:
    """Workers that load the same graph at once compile it once.

    MAX caches compiled graphs on disk, but two workers that start the
    same graph at the same time (a graph that several files build) would
    both compile it. Each graph's load holds an exclusive lock named
    by the hash of the graph's text, so the second worker waits for the
    first and then loads the cached model.
    """
    COMPILE_LOCKS.mkdir(exist_ok=True)
    load = InferenceSession.load

    @functools.wraps(load)
    def load_in_turn(self, model, *args, **kwargs):
        if not isinstance(model, Graph):
            return load(self, model, *args, **kwargs)
        digest = hashlib.sha256(str(model).encode()).hexdigest()[:24]
        with open(COMPILE_LOCKS / digest, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return load(self, model, *args, **kwargs)

    InferenceSession.load = load_in_turn
    yield
    InferenceSession.load = load


@pytest.fixture(params=DEVICES)
def device_ref(request: pytest.FixtureRequest) -> DeviceRef:
    """The graph device of the current parametrization."""
    return request.param


@pytest.fixture
def driver_device(device_ref: DeviceRef) -> driver.Device:
    """The ``max.driver`` device matching :func:`device_ref`."""
    if device_ref.is_cpu():
        return driver.CPU()
    return driver.Accelerator()


@pytest.fixture(scope="session")
def session_runners() -> Callable[[str], Runner]:
    """The session's one :class:`Runner` per device name, made on first use.

    Each runner caches the models it compiles, so every test on a device
    shares them.
    """
    return functools.cache(Runner)


@pytest.fixture(scope="module")
def runners(
    request: pytest.FixtureRequest,
    session_runners: Callable[[str], Runner],
) -> Callable[[str], Runner]:
    """``device -> Runner``: the session's runners, the module's models ready.

    A test module that names its models in ``COMPILED_TOGETHER`` (a
    function ``device -> [ModelKey | IndexKey, ...]``) has them compiled
    as one graph (:meth:`Runner.compile_together`) the first time it asks
    for a host device's runner: MAX's compile costs about 15 s per graph
    on a 2-core VM alone (several times that beside other compiles) and
    1-8 s per op in it. A real GPU's runner compiles one graph per
    model. Tests that put the device into their own parametrization call
    this; the rest take :func:`runner`.
    """
    together = getattr(request.module, "COMPILED_TOGETHER", None)
    done: set[str] = set()

    def get(device: str) -> Runner:
        runner = session_runners(device)
        if together is not None and device != "gpu" and device not in done:
            done.add(device)
            runner.compile_together(together(device))
        return runner

    return get


@pytest.fixture(params=DEVICE_NAMES)
def runner(
    request: pytest.FixtureRequest, runners: Callable[[str], Runner]
) -> Runner:
    """A compile-once runner on each device (GPU skipped without one)."""
    return runners(request.param)
