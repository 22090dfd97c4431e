"""pixi.toml agrees with the repository and with pyproject.toml.

pixi itself is not available where the suite runs, so this reads the
manifest and checks what would break a ``pixi run``: every task runs a
command that exists here (a ``python -m mla_kpool`` subcommand with its
module, a file, or an executable one of the dependencies installs), and the
conda dependencies name the same packages, with the same version specifiers,
as pyproject.toml's runtime, test and dev dependencies.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from mla_kpool.__main__ import COMMANDS

REPO = Path(__file__).resolve().parents[1]
STABLE_CHANNEL = "https://conda.modular.com/max/"
MOJO_TREES = ["kernels", "python/mla_kpool/bench_noop"]

#: Executables a task may call -> the dependency that installs them.
EXECUTABLES = {
    "python": "python",
    "pytest": "pytest",
    "ruff": "ruff",
    "mblack": "mojo",
    "mojo": "mojo",
}

#: Positional arguments that are subcommands, not paths.
SUBCOMMANDS = {"ruff": {"check", "format"}, "mojo": {"format"}}

#: Tasks the README and issue 6 promise.
TASKS = ["test", "demo", "bench", "example", "lint", "format"]


def _load(name: str) -> dict[str, Any]:
    with open(REPO / name, "rb") as f:
        return tomllib.load(f)


PIXI = _load("pixi.toml")
PYPROJECT = _load("pyproject.toml")


def _normalize(name: str) -> str:
    """PEP 503 name normalization (``ml_dtypes`` == ``ml-dtypes``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _steps(task: str) -> list[list[str]]:
    """A task's command split into its ``&&``-chained steps."""
    spec = PIXI["tasks"][task]
    command = spec if isinstance(spec, str) else spec["cmd"]
    return [shlex.split(step) for step in command.split("&&")]


def _pixi_specs() -> dict[str, SpecifierSet]:
    specs = {}
    for name, spec in PIXI["dependencies"].items():
        version = spec if isinstance(spec, str) else spec.get("version", "*")
        specs[_normalize(name)] = SpecifierSet(
            "" if version == "*" else version
        )
    return specs


def _pyproject_specs() -> dict[str, SpecifierSet]:
    project = PYPROJECT["project"]
    requirements = list(project["dependencies"])
    for extra in ("test", "dev"):
        requirements += project["optional-dependencies"][extra]
    specs = {}
    for text in requirements:
        req = Requirement(text)
        if _normalize(req.name) == _normalize(project["name"]):
            continue  # `mla-kpool[test]` in dev: the extra, not a package
        specs[_normalize(req.name)] = req.specifier
    return specs


def _module_file(module: str) -> Path:
    return REPO / "python" / (module.replace(".", "/") + ".py")


@pytest.mark.parametrize("task", TASKS)
def test_task_runs_something_that_exists(task: str):
    deps = set(_pixi_specs())
    assert task in PIXI["tasks"], f"pixi.toml has no `{task}` task"
    for argv in _steps(task):
        exe, args = argv[0], argv[1:]
        assert exe in EXECUTABLES, f"{task}: unknown executable {exe!r}"
        assert EXECUTABLES[exe] in deps, f"{task}: {exe} comes from no dep"
        if exe == "python" and args[:1] == ["-m"]:
            module, rest = args[1], args[2:]
            if module == "mla_kpool":
                assert rest[0] in COMMANDS, f"{task}: no subcommand {rest[0]}"
                target = _module_file(COMMANDS[rest[0]][0])
                assert target.is_file(), f"{task}: {target} is missing"
            else:
                assert _normalize(module) in deps, f"{task}: {module}"
            continue
        positional = [a for a in args if not a.startswith("-")]
        paths = [a for a in positional if a not in SUBCOMMANDS.get(exe, ())]
        assert paths or exe != "python", f"{task}: python runs nothing"
        for path in paths:
            assert (REPO / path).exists(), f"{task}: {path} does not exist"


def test_lint_checks_python_and_mojo_and_format_applies_them():
    lint = [" ".join(argv) for argv in _steps("lint")]
    fmt = [" ".join(argv) for argv in _steps("format")]
    mojo_dirs = " ".join(MOJO_TREES)
    assert lint == [
        "ruff check .",
        "ruff format --check .",
        f"mblack --check {mojo_dirs}",
    ]
    assert fmt == [
        "ruff check --fix .",
        "ruff format .",
        f"mojo format {mojo_dirs}",
    ]


def test_ci_runs_the_same_lint_as_pixi():
    ci = (REPO / ".ci" / "run").read_text()
    for argv in _steps("lint"):
        exe, *args = argv
        assert f'"$VENV/bin/{exe}" {" ".join(args)}' in ci, argv


def test_dependencies_match_pyproject():
    pixi = _pixi_specs()
    python = pixi.pop("python")
    pyproject = _pyproject_specs()
    assert sorted(pixi) == sorted(pyproject)
    for name, spec in pyproject.items():
        assert pixi[name] == spec, f"{name}: pixi {pixi[name]} vs {spec}"
    requires = SpecifierSet(PYPROJECT["project"]["requires-python"])
    assert set(requires) <= set(python), f"python {python} vs {requires}"


def test_modular_packages_come_from_the_stable_channel():
    # The pins are stable releases; the nightly channel does not carry them.
    channels = PIXI["workspace"]["channels"]
    assert STABLE_CHANNEL in channels
    assert not any("max-nightly" in c for c in channels)
    for name in ("max", "mojo"):
        spec = PIXI["dependencies"][name]
        assert isinstance(spec, dict) and spec["channel"] == STABLE_CHANNEL


def test_platforms_are_the_ones_max_ships():
    assert set(PIXI["workspace"]["platforms"]) == {
        "linux-64",
        "linux-aarch64",
        "osx-arm64",
    }
