"""``gpu-profile``'s driver on index_top_k's launches (20-40 s on 2 cores).

Every launch records its global memory (a launch with none would have
its estimate at the floor and nothing to show), and the plan's distinct
bytes are what its checks and rows must touch, counted here from the
driver's workloads: the offsets, the cache lengths and both lookup
tables' pages of every request read, 16 bytes of plan written a row.
"""

from __future__ import annotations

import json
import math

import pytest

from mla_kpool.gpu_profile import PROFILE_DEFINE
from support.kpool_cases import mojo_run, needs_mojo

DRIVER = "python/mla_kpool/gpu_profile/launches.mojo"

#: The driver's index_top_k workloads: (requests, cached tokens, new
#: tokens a request). A candidate is kpool rows of the cache (``spread``)
#: or one row (kpool 1); its pages hold 256 rows.
WORKLOADS = {
    "glm5-next-decode": (16, 32 * 1024 - 1, 1),
    "glm5-next-prefill": (1, 0, 4096),
    "deepseek-v3.2-decode": (16, 32 * 1024 - 1, 1),
}
PAGE_ROWS = 256


@pytest.fixture(scope="module")
def launches() -> list[dict]:
    proc = mojo_run(DRIVER, "32", "16", "index", defines=(PROFILE_DEFINE,))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line]


@needs_mojo
def test_every_launch_records_its_global_memory(launches):
    assert len(launches) == 12
    for launch in launches:
        profile = launch["profile"]
        name = f"{launch['workload']} {profile['kernel']}"
        assert profile["global"]["requests"] > 0, name
        assert profile["global"]["bytes_read"] > 0, name


@needs_mojo
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_the_plan_reads_the_metadata_and_writes_each_row(launches, workload):
    requests, cached, new = WORKLOADS[workload]
    pages = math.ceil((cached + new) / PAGE_ROWS)
    index_bytes = 4  # uint32 offsets, lengths and lookup tables
    read = index_bytes * (
        (requests + 1)  # input_row_offsets
        + requests  # cache lengths
        + 2 * requests * pages  # the key and scale lookup tables
    )
    (plan,) = [
        launch["profile"]
        for launch in launches
        if launch["workload"] == workload
        and launch["profile"]["kernel"] == "mla_kpool_index_plan_kernel"
    ]
    assert plan["global"]["bytes_read"] == read
    assert plan["global"]["bytes_written"] == 16 * requests * new
    assert plan["blocks"] == plan["grid"] == requests
