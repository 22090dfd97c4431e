"""A plain (non-editable) install carries the Mojo kernels and runs them.

The wheel is built the way a user's ``pip install .`` builds it, but from a
clean copy of the checkout (a stale ``build/`` in the repository would
otherwise leak old files into it) and without build isolation or an index,
so the test needs no network: setuptools >= 77 in this environment is
enough (it is in the ``test`` extra). The wheel is then installed into a
bare target directory, and a subprocess whose ``PYTHONPATH`` holds only that
directory (MAX still comes from this environment) checks that
``mla_kpool.KERNELS`` points inside it and that a graph built with it
compiles and matches the oracle. That graph is the suite's MAIN
configuration (float32, kpool 4, head_dim 128), one compile. The wheel's
metadata (license, version, ``py.typed``) and its console script are
checked without compiling anything.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import numpy as np
import pytest

from mla_kpool import reference as ref
from support.kpool_cases import (
    MAIN,
    assert_pooled_close,
    random_ape,
    random_rows,
)

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

#: What a clean checkout does not have: build outputs, caches, environments.
_NOT_SOURCES = shutil.ignore_patterns(
    ".git",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".pixi",
    ".venv",
    "venv",
)

#: (directory in the checkout, directory inside the wheel) of Mojo sources:
#: the two Mojo packages and gpu-report's driver program.
MOJO_TREES = [
    pytest.param("kernels", "mla_kpool/kernels", id="kernels"),
    pytest.param(
        "python/mla_kpool/bench_noop", "mla_kpool/bench_noop", id="bench_noop"
    ),
    pytest.param(
        "python/mla_kpool/gpu_report",
        "mla_kpool/gpu_report",
        id="gpu_report",
    ),
]


def _pip(*args: str, cwd: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"pip {' '.join(args)} failed ({proc.returncode}); building "
            "offline needs setuptools>=77 here (pip install -e '.[test]')\n"
            f"{proc.stdout}\n{proc.stderr}"
        )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel ``pip wheel`` builds from a clean copy of the checkout."""
    tmp = tmp_path_factory.mktemp("packaging")
    shutil.copytree(REPO, tmp / "src", ignore=_NOT_SOURCES)
    _pip(
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-w",
        str(tmp / "dist"),
        "./src",
        cwd=tmp,
    )
    wheels = sorted((tmp / "dist").glob("mla_kpool-*.whl"))
    assert len(wheels) == 1, f"expected one wheel, got {wheels}"
    return wheels[0]


@pytest.fixture(scope="module")
def site(wheel: Path) -> Path:
    """A directory the wheel is installed into, and nothing else."""
    target = wheel.parent.parent / "site"
    _pip(
        "install",
        "--no-deps",
        "--no-index",
        "--target",
        str(target),
        str(wheel),
        cwd=wheel.parent,
    )
    return target


@pytest.mark.parametrize(("source", "dest"), MOJO_TREES)
def test_wheel_carries_mojo_sources(wheel: Path, source: str, dest: str):
    root = REPO / source
    sources = sorted(root.rglob("*.mojo"))
    assert sources
    if not source.endswith("gpu_report"):
        # The package and each of its folders (kernels/grid, ...).
        folders = {p.parent for p in sources}
        assert all(f / "__init__.mojo" in sources for f in folders), folders
    names = {p: f"{dest}/{p.relative_to(root).as_posix()}" for p in sources}
    with zipfile.ZipFile(wheel) as zf:
        shipped = {
            n
            for n in zf.namelist()
            if n.startswith(dest + "/") and n.endswith(".mojo")
        }
        assert shipped == set(names.values())
        for path, name in names.items():
            assert zf.read(name) == path.read_bytes(), path


def test_wheel_carries_every_python_module(wheel: Path):
    modules = {p.name for p in (REPO / "python/mla_kpool").glob("*.py")}
    modules.add("py.typed")  # PEP 561: the package is typed
    with zipfile.ZipFile(wheel) as zf:
        shipped = {
            n.split("/", 1)[1]
            for n in zf.namelist()
            if n.startswith("mla_kpool/") and n.count("/") == 1
        }
        entry_points = next(
            zf.read(n).decode()
            for n in zf.namelist()
            if n.endswith(".dist-info/entry_points.txt")
        )
    assert shipped == modules
    assert "mla-kpool = mla_kpool.__main__:main" in entry_points


def test_installed_wheel_compiles_and_runs(site: Path, tmp_path: Path):
    """KERNELS points into the install, and its ring_close is right.

    Four requests in ring slots that are not their batch index: two close
    their pending pool 1 (c=5 with 3 new tokens, c=7 with 4), one has
    nothing pending (c=8), one does not bring enough tokens (c=2, n=1).
    """
    seed = 6
    rng = np.random.default_rng(seed)
    dtype, kpool, head_dim = MAIN.dtype, MAIN.kpool, MAIN.head_dim
    cache = np.array([5, 8, 2, 7], dtype=np.uint32)
    new_tokens = [3, 2, 1, 4]
    slots = np.array([2, 0, 3, 1], dtype=np.uint32)
    offsets = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.uint32)
    k, gate = random_rows(rng, int(offsets[-1]), head_dim, dtype)
    # Every slot holds distinct values, so reading a wrong slot shows.
    tail = rng.standard_normal((4, 2, kpool, head_dim)).astype(dtype)
    ape = random_ape(rng, kpool, head_dim)
    inputs = tmp_path / "inputs.npz"
    outputs = tmp_path / "outputs.npz"
    np.savez(
        inputs,
        tail=tail,
        k=k,
        gate=gate,
        ape=ape,
        offsets=offsets,
        cache=cache,
        slots=slots,
    )

    env = dict(os.environ, PYTHONPATH=str(site))
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "support" / "packaging_probe.py"),
            str(inputs),
            str(outputs),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"probe failed:\n{proc.stdout}{proc.stderr}"
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(found["module"]).is_relative_to(site / "mla_kpool"), found
    kernels = Path(found["kernels"])
    assert kernels == site / "mla_kpool" / "kernels", found
    assert (kernels / "__init__.mojo").is_file()

    got = np.load(outputs)
    want_pooled, want_closed = ref.ring_close(
        tail, k, gate, ape, offsets, cache, slots, kpool
    )
    assert want_closed.tolist() == [1, -1, -1, 1]
    scale = float(max(np.abs(k).max(), np.abs(tail[:, 0]).max()))
    for prefix, what in (("", "mla_kpool.ring_close"), ("max_", "MAX's")):
        where = f"{what} wrapper, seed {seed}"
        np.testing.assert_array_equal(
            got[prefix + "closed"], want_closed, err_msg=where
        )
        assert_pooled_close(
            got[prefix + "pooled"], want_pooled, dtype, scale, where
        )


def _dist_info(zf: zipfile.ZipFile, name: str) -> str:
    (path,) = [n for n in zf.namelist() if n.endswith(f".dist-info/{name}")]
    return zf.read(path).decode()


def test_wheel_declares_license_version_and_typing(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        metadata = _dist_info(zf, "METADATA")
        license_text = _dist_info(zf, "licenses/LICENSE")
        assert zf.read("mla_kpool/py.typed") == b""
    headers = metadata.split("\n\n", 1)[0].splitlines()
    assert "License-Expression: Apache-2.0 WITH LLVM-exception" in headers
    assert "License-File: LICENSE" in headers
    assert "Classifier: Typing :: Typed" in headers
    assert "Requires-Python: >=3.11" in headers
    assert f"Version: {PROJECT['version']}" in headers
    assert license_text == (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text
    assert "---- LLVM Exceptions to the Apache 2.0 License ----" in license_text


def _run_installed(site: Path, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(site))
    return subprocess.run(
        argv,
        cwd=site.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_installed_console_script_names_itself(site: Path):
    """``mla-kpool`` says ``mla-kpool``; ``python -m`` says that."""
    script = site / "bin" / "mla-kpool"
    runs = {
        "mla-kpool": [sys.executable, str(script)],
        "python -m mla_kpool": [sys.executable, "-m", "mla_kpool"],
    }
    for prog, argv in runs.items():
        proc = _run_installed(site, *argv, "--version")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == f"{prog} {PROJECT['version']}\n", proc.stdout
        proc = _run_installed(site, *argv, "--help")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"usage: {prog} [-h] [--version]"), (
            proc.stdout
        )
        proc = _run_installed(site, *argv, "bench", "--help")
        assert proc.stdout.startswith(f"usage: {prog} bench [-h]"), proc.stdout
    # The version comes from the wheel's own metadata in the install.
    proc = _run_installed(
        site,
        sys.executable,
        "-c",
        "import mla_kpool, importlib.metadata as m;"
        "print(mla_kpool.__file__, mla_kpool.__version__,"
        " m.distribution('mla-kpool').locate_file(''))",
    )
    module, found, location = proc.stdout.split()
    assert Path(module).is_relative_to(site) and Path(location) == site
    assert found == PROJECT["version"]


def test_version_falls_back_to_the_checkout(monkeypatch: pytest.MonkeyPatch):
    """Used from the source tree and not installed (pixi), the checkout's
    pyproject.toml gives the version; elsewhere it is "0+unknown"."""
    import mla_kpool

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    from_checkout = (
        Path(mla_kpool.__file__).resolve().parents[2] / "pyproject.toml"
    ).is_file()
    assert mla_kpool._find_version() == (
        PROJECT["version"] if from_checkout else "0+unknown"
    )
