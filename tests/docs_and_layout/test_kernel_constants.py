"""The facts Python and the Mojo kernels both hold agree, each written once.

index_top_k's top-k limit (``mla_kpool._limits.MAX_TOP_K``, the kernels'
``TOP_K_LIMIT``), the tensor scorers' depth limit
(``_index_op.TENSOR_MAX_DEPTH``, the kernels' ``TENSOR_MAX_DEPTH``), the
scorer names and the GPU family of each tensor scorer (``_index_op.SCORERS``
and ``_TENSOR_ARCH``, the kernels' ``AUTO`` / ``GPU_SCORERS`` and
``scorer_gpu``), and the GPU path's workspace, windows and split select
(``_limits.GPU_WORKSPACE_BYTES`` / ``window_rows`` / ``select_slices``, the
bench's counts) and its grouped wgmma blocks (``wgmma_groups_rows``). The
Mojo side is read from the kernel source the package loads
(:data:`mla_kpool.KERNELS`), with no compile, except the windows, the split
and the grouping, which ``tests/mojo/window_rows_probe.mojo`` prints.
"""

from __future__ import annotations

import ast
import operator
import re
from pathlib import Path

from mla_kpool import KERNELS, _index_op, _limits
from mla_kpool.bench import bounds
from mla_kpool.reference import indexer as ref_indexer
from support.kpool_cases import mojo_run, needs_mojo

_DOCSTRING = re.compile(r'""".*?"""', re.DOTALL)
_COMMENT = re.compile(r"#[^\n]*")
_OPS = {
    ast.Add: operator.add,
    ast.Mult: operator.mul,
    ast.LShift: operator.lshift,
}


def _kernel_files() -> dict[str, Path]:
    """Every kernel module under ``kernels/``, by its path there
    (``index/operands.mojo``; the packages' ``__init__.mojo`` hold only
    docstrings)."""
    files = [p for p in KERNELS.rglob("*.mojo") if p.name != "__init__.mojo"]
    return dict(sorted((p.relative_to(KERNELS).as_posix(), p) for p in files))


def kernel_code(name: str) -> str:
    """Kernel file ``name``'s code: docstrings and comments blanked."""
    text = _kernel_files()[name].read_text()
    return _COMMENT.sub("", _DOCSTRING.sub('""', text))


def all_kernel_code() -> dict[str, str]:
    """Every kernel file's code, by its path under ``kernels/``."""
    return {name: kernel_code(name) for name in _kernel_files()}


def _int_expr(node: ast.expr) -> int:
    """An integer literal expression (``2048``, ``1 << 28``), evaluated."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_int_expr(node.left), _int_expr(node.right))
    raise ValueError(f"not an integer literal expression: {ast.dump(node)}")


def comptime_int(name: str) -> tuple[str, int]:
    """The one kernel file defining ``comptime <name> = <int expression>``,
    and its value; fails unless exactly one file defines it."""
    pattern = re.compile(rf"^comptime {name} = ([^\n]+)$", re.M)
    found = [
        (file, m)
        for file, code in all_kernel_code().items()
        for m in pattern.findall(code)
    ]
    assert len(found) == 1, f"comptime {name} defined {len(found)} times"
    file, expr = found[0]
    return file, _int_expr(ast.parse(expr.strip(), mode="eval").body)


def comptime_strings(name: str) -> dict[str, str]:
    """``comptime NAME = "text"`` definitions of ``kernels/<name>``."""
    return dict(
        re.findall(r'^comptime (\w+) = "(\w+)"$', kernel_code(name), re.M)
    )


def test_comptime_int_reads_literal_expressions():
    assert _int_expr(ast.parse("1 << 28", mode="eval").body) == 1 << 28
    assert _int_expr(ast.parse("2 * 1024 + 1", mode="eval").body) == 2049


def test_the_top_k_limit_is_defined_once_and_agrees():
    file, value = comptime_int("TOP_K_LIMIT")
    assert (file, value) == ("index/operands.mojo", _limits.MAX_TOP_K)
    # No other kernel constant repeats it (the select's pair area used to).
    others = [
        (f, m)
        for f, code in all_kernel_code().items()
        for m in re.findall(rf"^comptime (\w+) = {value}$", code, re.M)
    ]
    assert others == [("index/operands.mojo", "TOP_K_LIMIT")]
    # Python's users take the one definition, the oracle included.
    assert _index_op.MAX_TOP_K is _limits.MAX_TOP_K
    assert ref_indexer.MAX_TOP_K is _limits.MAX_TOP_K


def test_the_tensor_depth_limit_is_defined_once_and_agrees():
    file, value = comptime_int("TENSOR_MAX_DEPTH")
    assert file == "index/gpu/score.mojo"
    assert value == _index_op.TENSOR_MAX_DEPTH
    stale = [
        f
        for f, code in all_kernel_code().items()
        if re.search(r"^comptime \w+_MAX_DEPTH = ", code, re.M)
        and f != "index/gpu/score.mojo"
    ]
    assert stale == []


def _gpu_scorers(strings: dict[str, str]) -> list[str]:
    """``GPU_SCORERS``'s names, resolved through ``strings``."""
    code = kernel_code("index/scorers.mojo")
    listed = re.search(r"^comptime GPU_SCORERS = \(([^)]*)\)$", code, re.M)
    assert listed, "GPU_SCORERS not found"
    return [strings[n.strip()] for n in listed[1].split(",") if n.strip()]


def test_the_scorer_names_agree():
    strings = comptime_strings("index/scorers.mojo")
    assert tuple([strings["AUTO"], *_gpu_scorers(strings)]) == _index_op.SCORERS


def test_each_scorer_name_is_written_once_in_the_kernels():
    names = "|".join(_index_op.SCORERS)
    uses = [
        (f, m)
        for f, code in all_kernel_code().items()
        for m in re.findall(rf'"({names})"', code)
    ]
    assert sorted(uses) == sorted(
        ("index/scorers.mojo", n) for n in _index_op.SCORERS
    )


def test_the_tensor_scorers_gpus_agree():
    strings = comptime_strings("index/scorers.mojo")
    code = kernel_code("index/scorers.mojo")
    body = re.search(r"^def scorer_gpu\[.*?(?=^def )", code, re.M | re.DOTALL)
    assert body, "scorer_gpu not found"
    families = {
        strings[name]: family
        for name, family in re.findall(
            r'scorer == (\w+):\s*return "(\w+)"', body[0]
        )
    }
    assert families == {
        s: arch for s, (arch, _) in _index_op._TENSOR_ARCH.items()
    }


def test_the_gpu_workspace_agrees():
    file, value = comptime_int("GPU_WORKSPACE_BYTES")
    assert (file, value) == (
        "index/gpu/launches.mojo",
        _limits.GPU_WORKSPACE_BYTES,
    )


def test_the_bench_counts_windows_with_the_one_formula():
    index = [w for w in bounds.WORKLOADS.values() if w["op"] == "index_top_k"]
    assert index
    for w in index:
        window = _limits.window_rows(w["candidates"], w["tokens"])
        assert w["window"] == w["counts"]["window_rows"] == window
        assert w["counts"]["windows"] == -(-w["tokens"] // window)


#: (candidates, tokens): none, one, rows that all fit, rows past the
#: workspace, one row larger than the workspace.
WINDOW_CASES = [
    (0, 5),
    (1, 1),
    (1000, 7),
    (4600, 7),
    (8192, 64),
    (8192, 127),
    (32768, 4096),
    (1 << 20, 1 << 20),
    (1 << 27, 3),
]


@needs_mojo
def test_the_kernels_windows_match_python():
    cases = WINDOW_CASES + [
        (w["candidates"], w["tokens"])
        for w in bounds.WORKLOADS.values()
        if w["op"] == "index_top_k"
    ]
    proc = mojo_run(
        "tests/mojo/window_rows_probe.mojo",
        *(str(x) for case in cases for x in case),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [int(x) for x in proc.stdout.split()]
    assert lines[0] == _limits.GPU_WORKSPACE_BYTES
    windows = [_limits.window_rows(c, t) for c, t in cases]
    slices = [
        _limits.select_slices(c, t, k) for c, t in cases for k in (1, 512, 2048)
    ]
    groups = [
        int(_limits.wgmma_groups_rows(t, r))
        for _, t in cases
        for r in (0, 1, t // 2, t)
    ]
    assert lines[1:] == windows + slices + groups
    # The cases group rows and leave them one a tile.
    assert set(groups) == {0, 1}
    # The cases reach the most slices and a count below it.
    assert max(slices) == 16 and {4, 2} <= set(slices)
