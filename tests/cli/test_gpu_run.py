"""The GPU script's flow (benchmarks/gpu_run.sh), end to end on a CPU.

``GPU_RUN_FAKE=1`` swaps the GPU parts (the preflight's PyTorch and GPU
checks, the tests, the compile, the timings) for fast fakes; everything
else is the script's own: the preflight's imports, the time budget, the
record written after each step and each timing item, the commit, the
output folder. A preflight failure is planted with a ``max`` package on
``PYTHONPATH`` that refuses to import. No GPU, no graph compile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from max import driver

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_run.sh"
RESULTS = ROOT / "benchmarks" / "results"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
#: Every timing item, in the order kernel_times runs them.
ITEMS = [
    "constants",
    "index.glm5next-decode",
    "index.glm5next-prefill",
    "index.dsv32-decode",
    *[
        f"{op}.b{b}"
        for op in ("ring_close", "compress", "seed_tail", "expand_topk")
        for b in (64, 4096)
    ],
    "step.b4096",
]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The script's environment: this Python, no checkout (the commit from
    ``MLA_KPOOL_COMMIT``), fakes on; ``extra`` on top."""
    env = dict(os.environ)
    env.update(
        PYTHON=sys.executable,
        GIT_DIR=str(tmp_path / "no-git"),
        MLA_KPOOL_COMMIT=COMMIT,
        GPU_RUN_FAKE="1",
        GPU_RUN_BUDGET_S="90",
    )
    env.pop("GPU_RUN_COMMAND", None)
    env.update(extra)
    return env


def _listing(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def test_a_preflight_failure_stops_the_run_with_its_reason(tmp_path):
    planted = tmp_path / "planted"
    (planted / "max").mkdir(parents=True)
    (planted / "max" / "__init__.py").write_text(
        "raise ImportError('planted: MAX is not installed')\n"
    )
    out = tmp_path / "out"
    env = _env(tmp_path, PYTHONPATH=str(planted))
    began = time.monotonic()
    done = subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "preflight: max: FAILED" in done.stderr
    assert "planted: MAX is not installed" in done.stderr
    assert time.monotonic() - began < 60
    (record,) = out.glob("*.json")
    doc = json.loads(record.read_text())
    assert list(doc["steps"]) == ["preflight"]
    assert doc["steps"]["preflight"]["ok"] is False
    assert "planted" in doc["steps"]["preflight"]["checks"]["max"]
    assert "FAILED" in doc["steps"]["preflight"]["checks"]["mla_kpool"]
    # Nothing else ran.
    assert _listing(out) == {record.name}


@pytest.mark.skipif(
    driver.accelerator_count() > 0, reason="a GPU is visible here"
)
def test_without_a_gpu_the_real_preflight_says_so(tmp_path):
    out = tmp_path / "out"
    env = _env(tmp_path)
    del env["GPU_RUN_FAKE"]
    done = subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "preflight: gpu: FAILED" in done.stderr
    assert "accelerator_count() == 0" in done.stderr


def test_the_fake_run_writes_its_record_after_each_item(tmp_path):
    out = tmp_path / "out"
    results_before = _listing(RESULTS) if RESULTS.is_dir() else set()
    env = _env(tmp_path, MLA_KPOOL_FAKE_ITEM_S="0.3")
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    record = out / f"fake-gpu-{COMMIT[:7]}.json"
    seen = []
    while proc.poll() is None:
        if record.is_file():
            doc = json.loads(record.read_text())  # always whole
            seen.append(len(doc.get("items", [])))
        time.sleep(0.05)
    output = proc.stdout.read()
    assert proc.returncode == 0, output
    doc = json.loads(record.read_text())
    # The record was on disk, and growing, between items.
    assert set(range(1, len(ITEMS))) <= set(seen), seen
    assert doc["items"] == ITEMS
    assert doc["commit"] == COMMIT and doc["dirty"] is None
    assert doc["tests"] == "3 passed in 0.01s (fake)"
    assert set(doc["constants"]) >= {
        "dram_bandwidth",
        "l2_latency",
        "smem_bank_conflict_32way",
        "atomic_same_address_32lanes",
        "block_barrier",
    }
    assert all("unit" in c for c in doc["constants"].values())
    steps = doc["steps"]
    assert set(steps) == {
        "preflight",
        "tests",
        "compile-index",
        "compile-writers",
        "timing",
    }
    for name, facts in steps.items():
        assert facts["seconds"] >= 0 and facts["timeout_s"] > 0, name
        assert not facts.get("timed_out"), name
    assert doc["total_s"] <= doc["budget_s"] == 90
    # Only the output folder was written.
    assert _listing(out) == {
        record.name,
        "tests.log",
        "compile-index.log",
        "compile-writers.log",
        "times.log",
    }
    assert (_listing(RESULTS) if RESULTS.is_dir() else set()) == results_before


def test_the_budget_bounds_every_step_and_a_kill_keeps_the_record(tmp_path):
    out = tmp_path / "out"
    budget = 30
    env = _env(
        tmp_path,
        GPU_RUN_BUDGET_S=str(budget),
        GPU_RUN_FAKE_TESTS_S="120",
        MLA_KPOOL_FAKE_ITEM_S="1.5",
    )
    began = time.monotonic()
    done = subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=budget + 60,
    )
    wall = time.monotonic() - began
    assert done.returncode == 1, done.stdout + done.stderr
    assert wall < budget + 5
    doc = json.loads((out / f"fake-gpu-{COMMIT[:7]}.json").read_text())
    steps = doc["steps"]
    # The tests overran their share and were stopped; the timing had the
    # rest of the budget and was stopped between items, its record kept.
    assert steps["tests"]["timed_out"] is True
    assert steps["tests"]["seconds"] <= steps["tests"]["timeout_s"] + 2
    assert steps["timing"]["timed_out"] is True
    assert 1 <= len(doc["items"]) < len(ITEMS)
    assert doc["items"] == ITEMS[: len(doc["items"])]
    assert doc["total_s"] <= budget
    assert "timed out: tests" in done.stdout
