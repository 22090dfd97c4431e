"""pixi.toml agrees with the repository and with pyproject.toml.

pixi itself is not available where the suite runs, so this reads the
manifest and checks what would break a ``pixi run``: every task runs a
command that exists here (a ``python -m mla_kpool`` subcommand with its
module, a file, or an executable that a dependency of the task's
environment installs), each task is found in one environment, and the
conda dependencies name the same packages, with the same version
specifiers, as pyproject.toml: the default environment its runtime list,
feature ``test`` its ``test`` extra, feature ``lint`` the rest of its
``dev`` extra. Packages only pixi needs are allowed by name
(:data:`PIXI_ONLY`). The activation keeps the user's ``PYTHONPATH``.
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
from packaging.version import Version

from mla_kpool.__main__ import COMMANDS

REPO = Path(__file__).resolve().parents[2]
STABLE_CHANNEL = "https://conda.modular.com/max/"
MOJO_TREES = [
    "kernels",
    "python/mla_kpool/bench_noop",
    "python/mla_kpool/gpu_report",
    "python/mla_kpool/gpu_profile",
    "benchmarks/peers",
]

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

#: Tasks the README promises.
TASKS = ["test", "demo", "bench", "example", "quickstart", "lint", "format"]

#: Feature (``None``: the default one) -> packages pixi needs there that
#: pyproject.toml does not list: the interpreter itself, and ``pip``, which
#: a pip install has by definition but conda-forge's python does not bring
#: (tests/docs_and_layout/test_packaging.py runs ``python -m pip``).
PIXI_ONLY = {None: {"python"}, "test": {"pip"}, "lint": set()}

#: The first pixi that reads ``requires-pixi``.
REQUIRES_PIXI_SINCE = Version("0.44.0")


def _load(name: str) -> dict[str, Any]:
    with open(REPO / name, "rb") as f:
        return tomllib.load(f)


PIXI = _load("pixi.toml")
PYPROJECT = _load("pyproject.toml")


def _normalize(name: str) -> str:
    """PEP 503 name normalization (``ml_dtypes`` == ``ml-dtypes``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _feature(name: str | None) -> dict[str, Any]:
    """A feature's table; ``None`` is the default feature (top level)."""
    return PIXI if name is None else PIXI["feature"][name]


def _task_features() -> dict[str, str | None]:
    """Every task -> the feature that defines it (``None``: default)."""
    owners: dict[str, str | None] = {}
    for feature in [None, *PIXI.get("feature", {})]:
        for task in _feature(feature).get("tasks", {}):
            assert task not in owners, f"task {task} is defined twice"
            owners[task] = feature
    return owners


def _steps(task: str) -> list[list[str]]:
    """A task's command split into its ``&&``-chained steps."""
    spec = _feature(_task_features()[task])["tasks"][task]
    command = spec if isinstance(spec, str) else spec["cmd"]
    return [shlex.split(step) for step in command.split("&&")]


def _pixi_specs(feature: str | None) -> dict[str, SpecifierSet]:
    specs = {}
    for name, spec in _feature(feature).get("dependencies", {}).items():
        version = spec if isinstance(spec, str) else spec.get("version", "*")
        specs[_normalize(name)] = SpecifierSet(
            "" if version == "*" else version
        )
    return specs


def _pyproject_specs(part: str | None) -> dict[str, SpecifierSet]:
    """The runtime list (``None``) or an extra, as name -> specifier."""
    project = PYPROJECT["project"]
    if part is None:
        requirements = project["dependencies"]
    else:
        requirements = project["optional-dependencies"][part]
    specs = {}
    for text in requirements:
        req = Requirement(text)
        if _normalize(req.name) == _normalize(project["name"]):
            continue  # `mla-kpool[test]` in dev: the extra, not a package
        specs[_normalize(req.name)] = req.specifier
    return specs


def _environments() -> dict[str, list[str | None]]:
    """Environment -> its features, the default one (``None``) first."""
    envs: dict[str, list[str | None]] = {"default": [None]}
    for name, spec in PIXI.get("environments", {}).items():
        features = spec if isinstance(spec, list) else spec["features"]
        default = isinstance(spec, list) or not spec.get(
            "no-default-feature", False
        )
        envs[name] = ([None] if default else []) + list(features)
    return envs


def _module_file(module: str) -> Path:
    """The source of ``module``: its ``__init__.py`` if it is a package."""
    base = REPO / "python" / module.replace(".", "/")
    package = base / "__init__.py"
    return package if package.is_file() else base.with_suffix(".py")


def _task_environment(task: str) -> str:
    """The environment ``pixi run task`` picks: the default one if it has
    the task, else the only one that does."""
    feature = _task_features()[task]
    if feature is None:
        return "default"
    (env,) = [e for e, fs in _environments().items() if feature in fs]
    return env


@pytest.mark.parametrize("task", TASKS)
def test_task_runs_something_that_exists(task: str):
    assert task in _task_features(), f"pixi.toml has no `{task}` task"
    deps: set[str] = set()
    for feature in _environments()[_task_environment(task)]:
        deps |= set(_pixi_specs(feature))
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


def test_each_task_has_one_environment():
    """A task outside the default feature is in exactly one environment, so
    ``pixi run <task>`` needs no ``-e``; the test and lint tools stay out of
    the default environment."""
    envs = _environments()
    assert set(envs) == {"default", "test", "lint"}
    for feature in PIXI["feature"]:
        holders = [e for e, fs in envs.items() if feature in fs]
        assert holders == [feature], (feature, holders)
    assert _task_environment("test") == "test"
    assert _task_environment("lint") == "lint"
    default = set(_pixi_specs(None))
    assert not default & {"pytest", "pytest-xdist", "ruff", "pip"}
    groups = {spec["solve-group"] for spec in PIXI["environments"].values()}
    assert groups == {"default"}


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


@pytest.mark.parametrize(
    ("feature", "part"), [(None, None), ("test", "test"), ("lint", "dev")]
)
def test_dependencies_match_pyproject(feature: str | None, part: str | None):
    pixi = _pixi_specs(feature)
    pyproject = _pyproject_specs(part)
    if part == "dev":  # dev = the test extra + the lint tools
        dev = PYPROJECT["project"]["optional-dependencies"]["dev"]
        assert "mla-kpool[test]" in dev
        for name in _pyproject_specs("test"):
            pyproject.pop(name, None)
    extra = set(pixi) - set(pyproject)
    assert extra == PIXI_ONLY[feature], f"pixi-only packages: {extra}"
    assert set(pyproject) <= set(pixi), set(pyproject) - set(pixi)
    for name, spec in pyproject.items():
        assert pixi[name] == spec, f"{name}: pixi {pixi[name]} vs {spec}"


def test_python_versions_agree():
    python = _pixi_specs(None)["python"]
    requires = SpecifierSet(PYPROJECT["project"]["requires-python"])
    assert set(requires) <= set(python), f"python {python} vs {requires}"
    # pixi runs what CI runs: Python 3.11.
    assert "3.11.9" in python and "3.12.0" not in python
    assert "3.11.0" in requires and "3.10.14" not in requires


def test_requires_pixi_admits_only_versions_that_read_it():
    spec = SpecifierSet(PIXI["workspace"]["requires-pixi"])
    assert REQUIRES_PIXI_SINCE in spec
    assert Version("0.43.0") not in spec


def test_license_matches_pyproject():
    license_ = PYPROJECT["project"]["license"]
    assert license_ == "Apache-2.0 WITH LLVM-exception"
    assert PIXI["workspace"]["license"] == license_
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    assert PIXI["workspace"]["license-file"] == "LICENSE"
    assert (REPO / "LICENSE").is_file()


def test_activation_keeps_the_users_pythonpath():
    """The checkout's python/ comes first and the user's PYTHONPATH stays,
    instead of being replaced."""
    value = PIXI["activation"]["env"]["PYTHONPATH"]
    assert value == "$PIXI_PROJECT_ROOT/python:$PYTHONPATH"
    assert (REPO / "python" / "mla_kpool" / "__init__.py").is_file()
    for feature in PIXI["feature"].values():
        assert "activation" not in feature


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
