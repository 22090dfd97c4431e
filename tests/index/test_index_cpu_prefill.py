"""The CPU prefill scorer's parts, unit-tested in Mojo.

``tests/mojo/test_index_cpu_prefill.mojo`` checks the key sort and the
radix select of rank keys against ``sort``, the bounded pool's kept keys
against the heap's bit for bit, the register-blocked head blocks (keys
transposed, heads padded to whole blocks, a NaN key) against the row
scorer, and the bfloat16 pair blocks against the float32 blocks.
``tests/mojo/test_index_cpu_amx.mojo`` checks the AMX tile block against the
float32 blocks, where the CPU has AMX-BF16.
"""

from __future__ import annotations

import subprocess

import pytest

from mla_kpool._sysinfo import cpu_flags
from support.kpool_cases import ROOT, needs_mojo, require_mojo, run_mojo_suite


@needs_mojo
def test_prefill_scorer_parts() -> None:
    run_mojo_suite("tests/mojo/test_index_cpu_prefill.mojo")


@needs_mojo
@pytest.mark.skipif(
    not {"amx_tile", "amx_bf16"} <= cpu_flags(),
    reason="the CPU has no AMX-BF16: the op never takes the AMX block here",
)
def test_amx_block() -> None:
    run_mojo_suite("tests/mojo/test_index_cpu_amx.mojo")


@needs_mojo
def test_cpu_path_builds_for_arm(tmp_path) -> None:
    # The CPU path, x86 inline assembly and AVX-512 intrinsics included,
    # still builds for an Arm server (Graviton 3's core): those blocks are
    # compiled only where the target has them. An object file is enough:
    # nothing runs.
    done = subprocess.run(
        [
            require_mojo(),
            "build",
            "-I",
            str(ROOT),
            "--target-triple",
            "aarch64-unknown-linux-gnu",
            "--target-cpu",
            "neoverse-v1",
            "--emit",
            "object",
            str(ROOT / "benchmarks/cpu_isa/index_cpu.mojo"),
            "-o",
            str(tmp_path / "index_cpu.o"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "index_cpu.o").stat().st_size > 0
