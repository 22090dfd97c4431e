"""The demo tests' workloads: schedules as data, the demo's plan."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mla_kpool.demo import cli as demo
from mla_kpool.demo import scheduling

KPOOL = 4

#: A small bfloat16 / kpool 4 / head_dim 128 workload that covers what the
#: generated one does: a cached prefix ending mid-pool (ring restored on
#: admission), a prompt shorter than a pool, a request joining in a slot
#: another one freed (max_running 3), an entry bringing no tokens, and
#: decode steps of 1-4 tokens mixed with prefill chunks.
SMALL = {
    "kpool": KPOOL,
    "head_dim": 128,
    "dtype": "bfloat16",
    "max_running": 3,
    "requests": [
        {"prompt": 10, "generate": 5},
        {"prompt": 700, "generate": 3, "cached_prefix": 6},
        {"prompt": 3},
        {"prompt": 9, "generate": 4},
    ],
    "calls": [
        [[0, 6], [1, 512], [2, 3]],
        [[0, 4], [1, 182], [3, 5]],
        [[0, 2], [1, 2], [3, 0]],
        [[3, 4], [0, 3], [1, 1]],
        [[3, 4]],
    ],
}

#: A bfloat16 workload whose long request sees more than 512 pools (2,100
#: prompt tokens in chunks of 512, then decode), so index_top_k has to
#: choose, beside a short one.
LONG = {
    "kpool": KPOOL,
    "head_dim": 128,
    "dtype": "bfloat16",
    "max_running": 2,
    "requests": [{"prompt": 2100, "generate": 2}, {"prompt": 7, "generate": 2}],
    "calls": [
        [[0, 512], [1, 7]],
        [[0, 512], [1, 1]],
        [[0, 512], [1, 1]],
        [[0, 512]],
        [[0, 52]],
        [[0, 1]],
        [[0, 1]],
    ],
}


def write(tmp_path: Path, data: Any, name: str = "schedule.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def demo_plan(argv: list[str]) -> scheduling.Plan:
    """The demo's plan for ``argv`` (what each call brings and keeps)."""
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return demo.build_plan(parser.parse_args(argv))[1]
