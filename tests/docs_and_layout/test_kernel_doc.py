"""docs/kernels.md's example is the shipped code, word for word.

Each Mojo block of the page must occur verbatim in the file under
``kernels/`` that the page names for it, so the example cannot drift from
the kernel the suite runs (the step's scan, which the emulated step tests
check against the CPU path bit for bit).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "kernels.md").read_text()


def test_every_mojo_block_is_in_the_kernel_it_quotes():
    blocks = re.findall(r"^```mojo\n(.*?)^```$", PAGE, re.M | re.S)
    assert blocks, "no Mojo example on the page"
    source = (ROOT / "kernels" / "writers" / "step.mojo").read_text()
    missing = [b.splitlines()[0] for b in blocks if b not in source]
    assert not missing, missing


def test_every_layer_the_page_names_exists():
    named = set(re.findall(r"`(kernels/[\w/]+\.mojo)`", PAGE))
    assert named, "the page names no file"
    assert not [n for n in sorted(named) if not (ROOT / n).is_file()]
