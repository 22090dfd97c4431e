"""The operand structs' layout check fails the build, not a run.

Each op's operand struct is copied byte for byte into a GPU kernel's
argument buffer, which is right only while every field is an 8-byte
pointer, ``Int`` or ``Int64``. ``check_kernel_layout``
(kernels/grid/operands.mojo) enforces that at compile time.
``tests/mojo/test_operand_layout.mojo`` checks the real structs pass and an
all-word struct launches;
``tests/mojo/operand_layout_refused.mojo`` launches the same way a struct
with an ``Int32`` field, whose build must fail with the check's message.
"""

from __future__ import annotations

import subprocess

from support.kpool_cases import ROOT, needs_mojo, require_mojo, run_mojo_suite

#: The compile-time message of ``check_kernel_layout``.
MESSAGE = (
    "KernelOperands: an operand struct must hold only 8-byte pointers,"
    " Int or Int64 fields"
)


@needs_mojo
def test_all_word_structs_pass_the_layout_check() -> None:
    run_mojo_suite("tests/mojo/test_operand_layout.mojo")


@needs_mojo
def test_struct_with_a_4_byte_field_fails_the_build() -> None:
    proc = subprocess.run(
        [
            require_mojo(),
            "run",
            "-I",
            str(ROOT),
            str(ROOT / "tests/mojo/operand_layout_refused.mojo"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert MESSAGE in output, output
    assert "constraint failed" in output, output
    # The build failed: the program's own print never ran.
    assert "function instantiation failed" in output, output
