"""docs/API.md's complete ``index_top_k`` example runs as written.

The section's last two Python blocks are one script, as a reader pasting
them into one session would run them: the graph, then a whole call (the
cache sized and filled, ``q`` and ``q_s`` made, the model executed) checked
against the oracle by ``reference.check_selection``, which raises on a
wrong row. What the call prints is checked against what its comment
promises.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

API = (Path(__file__).resolve().parents[2] / "docs" / "API.md").read_text()


def section(heading: str) -> str:
    """The text of the ``### heading`` section, up to the next heading."""
    start = API.index(f"### {heading}\n")
    end = re.compile(r"^##", re.M).search(API, start + 1)
    return API[start : end.start() if end else None]


def test_the_index_top_k_example_runs_and_checks_against_the_oracle():
    text = section("`index_top_k`")
    blocks = re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)
    assert len(blocks) == 4, [b.splitlines()[0] for b in blocks]
    graph, call = blocks[2:]
    assert "graph.output(ids)" in graph and "check_selection" in call
    namespace: dict = {"__name__": "api_doc"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(graph, "API.md index_top_k graph", "exec"), namespace)
        exec(compile(call, "API.md index_top_k call", "exec"), namespace)
    promised = re.search(r"^print\(.*\)  # (.*)$", call, re.M).group(1)
    assert printed.getvalue() == promised + "\n"
    report = namespace["report"]
    # Request 0's two rows see 600 pools: the top 512 is a real selection.
    assert (report.rows, report.cut_rows) == (102, 2)
