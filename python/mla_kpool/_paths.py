"""Where the Mojo kernel package lives, and how a graph gets it.

MAX 26.7 ships GPU-only builtins named ``mo.mla.kpool.*``. A graph that
calls those ops without this package loaded builds fine and then fails in
``InferenceSession.load`` on the CPU with a generic "Failed to compile the
model" that names nothing. Two routes prevent that:

- this package's wrappers call :func:`ensure_kernels` before they add an
  op, which loads :data:`KERNELS` into the graph being built if it lacks
  them, so a graph built with them never needs ``custom_extensions``;
- :func:`kernels_loaded` makes every graph created inside it load the
  kernels, which is how graphs that someone else builds (a MAX pipeline
  calling ``max.nn.kernels.mla_kpool_*``) get them without being edited.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

from max.graph import Graph, KernelLibrary, default_custom_extensions_scope

_HERE = Path(__file__).resolve().parent


def find_kernels() -> Path:
    """Returns the Mojo package directory to load as a custom extension.

    A wheel carries the sources as ``mla_kpool/kernels``; an editable install
    or a source checkout has them only at the repository's top-level
    ``kernels/``, two levels above this file (``python/mla_kpool``).
    """
    installed = _HERE / "kernels"
    if (installed / "__init__.mojo").is_file():
        return installed
    return _HERE.parents[1] / "kernels"


KERNELS: Path = find_kernels()

#: No-op kernels with the real ops' names and signatures (benchmark floor).
NOOP_KERNELS: Path = _HERE / "bench_noop"

#: An op that only this package registers (MAX ships ``mo.mla.kpool.*``
#: but nothing named like this), so a graph whose kernel library has it has
#: this package (or a copy of it, such as the benchmark's no-op stand-ins)
#: loaded. The builtin names cannot tell: MAX's are always there.
MARKER_OP = "mla_kpool.step"

#: Whether the wrappers load :data:`KERNELS` into a graph that lacks them.
#: Off only inside :func:`builtin_kernels_only`.
_AUTOLOAD: ContextVar[bool] = ContextVar("mla_kpool_autoload", default=True)

_compiled_lock = threading.Lock()
_compiled: dict[Path, Path] = {}


def compiled_kernels(package: Path = KERNELS) -> Path:
    """Returns a Mojo package directory precompiled to a ``.mojoc`` file.

    MAX precompiles a source directory every time a graph loads it (about
    4 s); this does it once per process and package, through MAX's own
    loader, so the file is the one ``custom_extensions=[package]`` produces
    (under ``$TMPDIR/.modular_<uid>/mojo_pkg/``). It is rebuilt if it
    disappears.

    Args:
        package: A Mojo package directory; :data:`KERNELS` by default.

    Raises:
        mojo.paths.MojoCompilationError: If the package does not compile.
    """
    with _compiled_lock:
        done = _compiled.get(package)
        if done is None or not done.is_file():
            library = KernelLibrary()
            library.load_paths([package])
            done = _compiled[package] = library.library_paths()[-1]
        return done


def has_kernels(graph: Graph) -> bool:
    """Whether ``graph``'s kernel library holds this package's ops.

    MAX has no public way to ask a graph which ops it can resolve, so this
    reads the graph's kernel library (``Graph._kernel_library``) for
    :data:`MARKER_OP`. If a MAX version lacks that attribute, it falls back
    to the public ``Graph.kernel_libraries_paths`` and looks for
    :func:`compiled_kernels`.
    """
    library = getattr(graph, "_kernel_library", None)
    if library is not None:
        with contextlib.suppress(TypeError):
            return MARKER_OP in library
    return compiled_kernels() in graph.kernel_libraries_paths


def _missing_kernels_message(what: str) -> str:
    return (
        f"{what} needs this package's kernels, and this graph does not"
        " load them: build it with custom_extensions=[mla_kpool.KERNELS],"
        " or inside `with mla_kpool.kernels_loaded():`"
    )


def ensure_kernels(what: str) -> None:
    """Loads :data:`KERNELS` into the graph being built if it lacks them.

    Called by every wrapper before it adds an op, so that a graph built
    with this package's API never reaches ``InferenceSession.load`` without
    the kernels. Does nothing outside a graph (the op then raises MAX's own
    error) and inside :func:`builtin_kernels_only`.

    Args:
        what: The wrapper's name, for the error message.

    Raises:
        ValueError: If the graph lacks the kernels and this MAX version has
            no way to add them to an existing graph (the private
            ``Graph._import_kernels`` is gone); the message says what to
            pass instead.
    """
    if not _AUTOLOAD.get():
        return
    try:
        graph = Graph.current
    except LookupError:
        return
    if has_kernels(graph):
        return
    # Private, but the only way MAX 26.7 offers to add a library to a graph
    # that already exists; the public routes work only at construction.
    load = getattr(graph, "_import_kernels", None)
    if load is None:
        raise ValueError(_missing_kernels_message(what))
    if hasattr(graph, "_kernel_library"):
        # MAX caches one library analysis per set of paths and hands it to
        # every graph that loads that set once it verifies an op; adding to
        # it in place would make those other graphs look as if they had
        # this package too. This graph gets a library of its own first.
        graph._kernel_library = KernelLibrary(graph.kernel_libraries_paths)
    load([compiled_kernels()])


@contextlib.contextmanager
def kernels_loaded() -> Iterator[None]:
    """Makes every MAX graph created in the block load this package's kernels.

    This is how code that builds its own graphs (a MAX pipeline calling
    ``max.nn.kernels.mla_kpool_ring_close`` and the other MAX wrappers) runs
    on these kernels unchanged, on the CPU as well as the GPU::

        with mla_kpool.kernels_loaded():
            graph = Graph("indexer", forward=..., input_types=...)
            model = InferenceSession(devices=[CPU()]).load(graph)

    Only graphs *created* inside the block are affected: a graph loads its
    kernel libraries when it is constructed, so build (or let the pipeline
    build) the graphs inside it; compiling and running them may happen
    later. It wraps ``max.graph.default_custom_extensions_scope``, which is
    process-wide (every thread) for the block's duration; it does not reach
    other processes. The first use in a process precompiles the kernels
    (a few seconds), later graphs reuse that file. Graphs built with this
    package's own wrappers do not need it: the wrappers load the kernels
    themselves.

    Yields:
        Nothing; on exit the previous defaults are restored.

    Raises:
        mojo.paths.MojoCompilationError: If the kernels do not compile.
    """
    with default_custom_extensions_scope(compiled_kernels()):
        yield


@contextlib.contextmanager
def builtin_kernels_only() -> Iterator[None]:
    """Stops the wrappers from loading :data:`KERNELS` in this context.

    For graphs meant to run MAX's own ``mo.mla.kpool.*`` builtins (GPU
    only) through this package's wrappers: the runner's ``kernels=None``
    mode, which the benchmark and the parity tests compare against.
    """
    token = _AUTOLOAD.set(False)
    try:
        yield
    finally:
        _AUTOLOAD.reset(token)
