"""The product does not depend on its oracle, and the oracle barely on it.

:mod:`mla_kpool.reference` is written from the contract to check the
product; a product module importing it would let a bug in the oracle
become the product's behaviour (and the other way round). Read from each
module's AST: imports in functions and ``from . import reference`` count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mla_kpool

PACKAGE = Path(mla_kpool.__file__).resolve().parent

#: Folders whose modules may import the oracle: the oracle itself and the
#: scaffolding that checks the product against it.
MAY_IMPORT_REFERENCE = ("reference", "demo", "bench")
#: Single modules that may: the package's ``__init__`` re-exports it as
#: ``mla_kpool.reference`` (public API) and uses nothing of it.
REEXPORTS = {"__init__.py"}

#: What the oracle may import from the rest of the package: leaf modules
#: that import nothing of the package and hold no contract logic.
REFERENCE_MAY_IMPORT = {
    # Plain constants the contract states (the top-k limit), checked
    # against the kernels by tests/docs_and_layout/test_kernel_constants.py.
    "mla_kpool._limits",
    # Pure NumPy call plumbing (a call's operands, the pools it made),
    # shared by the runner, the demo and the oracle's fused step.
    "mla_kpool.calls",
    # The rule for a renamed keyword (old name warned for a release),
    # shared by the runner and the oracle.
    "mla_kpool._renamed",
}


def module_name(path: Path) -> str:
    """``mla_kpool.x.y`` of a file under the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (``from . import x`` counts
    ``pkg.x``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                root = ".".join(base + ([node.module] if node.module else []))
            else:
                root = node.module or ""
            found.add(root)
            found.update(f"{root}.{a.name}" for a in node.names)
    return found


def _modules() -> list[Path]:
    return sorted(
        p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts
    )


def _is_reference(module: str) -> bool:
    return module == "mla_kpool.reference" or module.startswith(
        "mla_kpool.reference."
    )


def test_the_import_reader_resolves_relative_imports():
    got = imported_modules(PACKAGE / "demo" / "checked_run.py")
    assert "mla_kpool.reference" in got
    assert "mla_kpool.reference.tolerance" in got
    assert "mla_kpool.calls.CallInputs" in got


def test_no_product_module_imports_the_reference():
    offenders = {}
    for path in _modules():
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in MAY_IMPORT_REFERENCE or str(rel) in REEXPORTS:
            continue
        bad = sorted(m for m in imported_modules(path) if _is_reference(m))
        if bad:
            offenders[str(rel)] = bad
    assert offenders == {}


def test_the_reference_imports_only_leaf_modules_of_the_package():
    offenders = {}
    for path in sorted((PACKAGE / "reference").rglob("*.py")):
        bad = {
            m
            for m in imported_modules(path)
            if m.startswith("mla_kpool.") and not _is_reference(m)
        }
        bad = {
            m
            for m in bad
            if not any(
                m == ok or m.startswith(ok + ".") for ok in REFERENCE_MAY_IMPORT
            )
        }
        if bad:
            offenders[path.name] = sorted(bad)
    assert offenders == {}


def test_the_allowed_leaf_modules_import_nothing_of_the_package():
    for leaf in REFERENCE_MAY_IMPORT:
        path = PACKAGE / (leaf.removeprefix("mla_kpool.") + ".py")
        ours = {m for m in imported_modules(path) if m.startswith("mla_kpool")}
        assert ours == set(), (leaf, ours)
