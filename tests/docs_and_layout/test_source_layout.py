"""The source tree's proportions: scaffolding against product, file sizes.

The product is what a user of the package runs or trusts: the kernels, the
graph API, the caches and the oracle that defines the ops. Scaffolding is
what shows or measures it (the demo, the bench, the runners behind them,
the command line). Code is counted without comments, docstrings and blank
lines, so neither side grows by prose.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "mla_kpool"

#: Scaffolding may be at most this many times the product code.
MAX_SCAFFOLDING_RATIO = 0.75
#: No Python file under python/, tests/ or examples/ is longer.
MAX_PYTHON_LINES = 800
#: No Mojo file under kernels/ is longer: room for one algorithm with its
#: docs (a scorer, a select), not for two.
MAX_KERNEL_LINES = 700

#: Product code, paths relative to the repository root (a folder: every
#: .py and .mojo file under it), each with why it is product.
PRODUCT = {
    "kernels": "the Mojo kernels: the ops themselves",
    "python/mla_kpool/__init__.py": "the package's public names",
    "python/mla_kpool/graph.py": "the writers' graph API",
    "python/mla_kpool/indexer.py": "the indexer's graph API",
    "python/mla_kpool/_validate.py": "the graph API's operand checks",
    "python/mla_kpool/_index_op.py": "index_top_k's graph op",
    "python/mla_kpool/_metadata.py": "the graph API's metadata helpers",
    "python/mla_kpool/_argtypes.py": "operand value checks the API shares",
    "python/mla_kpool/_paths.py": "how every API graph loads the kernels",
    "python/mla_kpool/_limits.py": "index_top_k's limits, the oracle's too",
    "python/mla_kpool/_renamed.py": "the API's renamed keywords, warned",
    "python/mla_kpool/buffers.py": "host buffers and dtypes for the ops",
    "python/mla_kpool/ring.py": "the ring's slot bookkeeping for callers",
    "python/mla_kpool/index_cache.py": "the paged FP8 key cache index_top_k"
    " reads",
    "python/mla_kpool/reference": "the float64 oracle that defines the ops",
}

#: Scaffolding: code that drives, shows or times the product.
SCAFFOLDING = {
    "python/mla_kpool/demo": "the demo subcommand",
    "python/mla_kpool/bench": "the bench subcommand",
    "python/mla_kpool/bench_noop": "the bench's no-op floor kernels",
    "python/mla_kpool/runner.py": "compile-once runner for demo and bench",
    "python/mla_kpool/op_table.py": "the runner's op table",
    "python/mla_kpool/index_runner.py": "index_top_k's runner for demo and"
    " bench",
    "python/mla_kpool/calls.py": "the runner's call plumbing",
    "python/mla_kpool/__main__.py": "the command line",
    "python/mla_kpool/_progress.py": "the demo's and the bench's progress",
    "python/mla_kpool/_sysinfo.py": "where a bench run was measured",
}

#: Counted on neither side.
NEITHER = {
    "python/mla_kpool/gpu_report": "a developer tool (compiles GPU kernels)",
    "python/mla_kpool/gpu_profile": "a developer tool (emulates GPU launches)",
    "python/mla_kpool/gpu_specs.py": "published GPU peaks for that tool",
}


def _files(path: str) -> list[Path]:
    """The .py and .mojo files ``path`` names (a file, or a folder's)."""
    full = ROOT / path
    if full.is_file():
        return [full]
    return sorted(p for p in full.rglob("*") if p.suffix in (".py", ".mojo"))


def python_code_lines(source: str) -> int:
    """Lines of ``source`` holding code: no comments, docstrings or blanks.

    A docstring is a string expression opening a module, class or
    function body; its lines are dropped with the comments.
    """
    tree = ast.parse(source)
    prose: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(
            node,
            ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef,
        ):
            continue
        first = node.body[0] if node.body else None
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            prose.update(range(first.lineno, first.end_lineno + 1))
    code: set[int] = set()
    skip = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    }
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in skip:
            continue
        for line in range(tok.start[0], tok.end[0] + 1):
            if line not in prose:
                code.add(line)
    return len(code)


_MOJO_DOCSTRING = re.compile(r'""".*?"""', re.DOTALL)


def mojo_code_lines(source: str) -> int:
    """Lines of Mojo ``source`` holding code: without ``#`` comment lines,
    blank lines and triple-quoted docstrings."""
    source = _MOJO_DOCSTRING.sub(lambda m: "\n" * m.group().count("\n"), source)
    return sum(
        1
        for line in source.splitlines()
        if line.strip() and not line.strip().startswith("#")
    )


def code_lines(path: Path) -> int:
    """Code lines of a .py or .mojo file."""
    text = path.read_text()
    if path.suffix == ".py":
        return python_code_lines(text)
    return mojo_code_lines(text)


def _total(classes: dict[str, str]) -> int:
    return sum(code_lines(f) for path in classes for f in _files(path))


def scaffolding_ratio() -> float:
    """Scaffolding code lines over product code lines."""
    return _total(SCAFFOLDING) / _total(PRODUCT)


def test_code_lines_drop_docstrings_comments_and_blanks():
    python = (
        '"""Module."""\n\nimport os  # why\n\n\ndef f():\n'
        '    """Doc\n    string."""\n    # note\n    x = """a\nb"""\n'
        "    return x\n"
    )
    # import, def, x = (two lines of a string value), return.
    assert python_code_lines(python) == 5
    mojo = (
        '"""Module\ndoc."""\n\n# comment\nfn f() -> Int:\n'
        '    """Doc."""\n    return 1  # one\n'
    )
    assert mojo_code_lines(mojo) == 2


def test_every_package_file_is_classified():
    """A new file under python/mla_kpool must be put in a list here."""
    listed = [
        f
        for table in (PRODUCT, SCAFFOLDING, NEITHER)
        for p in table
        for f in _files(p)
    ]
    assert len(listed) == len(set(listed)), "a file is in two lists"
    found = {
        p
        for p in PACKAGE.rglob("*")
        if p.suffix in (".py", ".mojo") and "__pycache__" not in p.parts
    }
    assert found - set(listed) == set()
    for table in (PRODUCT, SCAFFOLDING, NEITHER):
        for path in table:
            assert _files(path), f"{path} names no file"


def test_scaffolding_is_at_most_three_quarters_of_the_product():
    ratio = scaffolding_ratio()
    assert ratio <= MAX_SCAFFOLDING_RATIO, (
        f"scaffolding is {ratio:.3f} x the product code (code lines, no"
        f" docstrings or comments), over {MAX_SCAFFOLDING_RATIO}"
    )


@pytest.mark.parametrize("folder", ["python", "tests", "examples"])
def test_no_python_file_is_too_long(folder):
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / folder).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_PYTHON_LINES
    }
    assert long == {}, f"over {MAX_PYTHON_LINES} lines"


def test_no_kernel_file_is_too_long():
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "kernels").rglob("*.mojo")
        if (n := len(p.read_text().splitlines())) > MAX_KERNEL_LINES
    }
    assert long == {}, f"over {MAX_KERNEL_LINES} lines"


def _module(path: Path) -> str:
    """The Mojo module a file under the root is (``kernels.grid.ragged``)."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _kernel_imports(path: Path) -> set[str]:
    """The kernels modules ``path`` imports (``from ..grid.x``, ``from
    .x``, ``from kernels.index.x``), as whole module names."""
    package = _module(path).split(".")[:-1]
    found = set()
    for dots, name in re.findall(
        r"^from (\.*)((?:kernels)?[\w.]*) import", path.read_text(), re.M
    ):
        if not dots:
            if name.startswith("kernels."):
                found.add(name)
            continue
        base = package[: len(package) - (len(dots) - 1)]
        found.add(".".join(base + name.split(".")))
    return found


def test_kernel_imports_have_no_cycle():
    graph = {
        _module(p): _kernel_imports(p)
        for p in (ROOT / "kernels").rglob("*.mojo")
        if p.stem != "__init__"
    }
    assert graph["kernels.index.top_k"] >= {"kernels.index.cpu.tasks"}, (
        "the parser reads nothing"
    )
    unknown = {m for deps in graph.values() for m in deps} - set(graph)
    assert unknown == set(), "an import names no kernel module"
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        if node in path:
            cycle = " -> ".join(path[path.index(node) :] + (node,))
            pytest.fail(f"import cycle: {cycle}")
        if node in done or node not in graph:
            return
        for dep in sorted(graph[node]):
            visit(dep, path + (node,))
        done.add(node)

    for node in sorted(graph):
        visit(node, ())
