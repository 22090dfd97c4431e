"""The GPU run's kernel timing (mla_kpool.bench.kernel_times) and MAX's select.

The GPU script (benchmarks/gpu_run.sh) is only run on a GPU; what it rests
on is checked here: profiler events cut into calls and summed per launch
(made-up traces whose sums are known), the cost model's constants from
their kernels' times and the chase's cycle, the check of MAX's select
against a sort of the rows (it must refuse a tie in the wrong order), and
the peer
op ``mla_kpool.max_select`` (benchmarks/peers): it loads in a graph, says
on a CPU that it needs a GPU, and on a GPU selects what a sort selects.
"""

from __future__ import annotations

import numpy as np
import pytest
from max import driver
from max.graph import DeviceRef

from mla_kpool.bench.kernel_times import (
    BARRIER_ROUNDS,
    CHASE_STEPS,
    CONSTANT_KERNELS,
    CONSTANTS,
    COPY_BYTES,
    call_kernel_us,
    chase_chain,
    check_select,
    constants_from_us,
    max_select_graph,
    phase_us,
    split_calls,
)
from mla_kpool.runner import Runner
from support.kpool_cases import needs_mojo

#: One call's launches (name, microseconds) in a made-up trace.
LAUNCHES = [
    ("mla_kpool_index_plan_kernel", 2.0),
    ("mla_kpool_index_wgmma_score_kernel", 5.0),
    ("mla_kpool_index_select_kernel", 7.5),
]


def _trace(calls: int) -> list[dict]:
    """``calls`` calls of LAUNCHES, call ``c``'s times scaled by ``c + 1``,
    with a copy and a CPU event between (not kernels)."""
    events, ts = [], 0.0
    for c in range(calls):
        for name, us in LAUNCHES:
            events.append(
                {"cat": "kernel", "name": name, "ts": ts, "dur": us * (c + 1)}
            )
            ts += 100
        events.append({"cat": "gpu_memcpy", "name": "copy", "ts": ts, "dur": 9})
        events.append({"cat": "cpu_op", "name": "execute", "ts": ts, "dur": 50})
        ts += 100
    # Out of order in the file: the cut follows the start times.
    return events[::-1]


def test_calls_are_cut_by_count_and_summed_per_launch():
    per_call = split_calls(_trace(3), 3)
    assert [[name for name, _ in call] for call in per_call] == [
        [name for name, _ in LAUNCHES]
    ] * 3
    # Calls take 14.5, 29 and 43.5 us: the median is the second.
    assert call_kernel_us(per_call) == pytest.approx(29.0)
    assert phase_us(per_call, "index_plan") == pytest.approx(4.0)
    assert phase_us(per_call, "select") == pytest.approx(15.0)
    assert phase_us(per_call, "no such kernel") == 0.0


@pytest.mark.parametrize("calls", [2, 4])
def test_calls_that_launched_differently_are_refused(calls):
    with pytest.raises(ValueError, match="9 kernels recorded over"):
        split_calls(_trace(3), calls)


def test_a_trace_without_kernels_is_refused():
    with pytest.raises(ValueError, match="0 kernels recorded over 3 calls"):
        split_calls([{"cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}], 3)


def test_constants_come_from_their_kernels_times_with_units():
    us = dict.fromkeys(CONSTANT_KERNELS, 1.0)
    us.update(
        copy=200.0,
        chase=30_000.0,
        bank_free=10.0,
        bank_conflict=250.0,
        atomic_same=64.0,
        atomic_distinct=2.0,
        barrier_on=50.0,
        barrier_off=9.04,
    )
    got = constants_from_us(us)
    assert list(got) == list(CONSTANTS)
    assert got["dram_bandwidth"]["value"] == pytest.approx(
        2 * COPY_BYTES / 200e-6 / 1e9
    )
    assert got["dram_bandwidth"]["unit"].startswith("GB/s")
    assert got["l2_latency"]["value"] == pytest.approx(30e6 / CHASE_STEPS)
    assert got["smem_bank_conflict_32way"]["value"] == pytest.approx(25.0)
    assert got["atomic_same_address_32lanes"]["value"] == pytest.approx(32.0)
    assert got["block_barrier"]["value"] == pytest.approx(
        40.96e3 / BARRIER_ROUNDS
    )
    assert all(c["unit"] for c in got.values())


def test_a_constant_without_its_kernels_is_left_out():
    assert constants_from_us({"copy": 0.0, "chase": 10.0}) == {
        "l2_latency": {
            "value": pytest.approx(1e4 / CHASE_STEPS),
            "unit": CONSTANTS["l2_latency"],
        }
    }


def test_the_chase_visits_every_line_once_around():
    words = 32 * 257
    chain = chase_chain(words)
    at, seen = 0, []
    for _ in range(257):
        seen.append(at)
        at = int(chain[at])
    assert at == 0
    assert sorted(seen) == list(range(0, words, 32))
    # Not the lines in order: no prefetcher may guess the next address.
    assert seen != sorted(seen)


def _sorted_top(scores: np.ndarray, bounds: np.ndarray, k: int) -> np.ndarray:
    """Each row's best ``k`` ids by a plain Python sort, then -1."""
    out = np.full((len(bounds), k), -1, np.int32)
    for r, bound in enumerate(bounds):
        ids = sorted(range(bound), key=lambda j: (-scores[r, j], j))[:k]
        out[r, : len(ids)] = ids
    return out


def _tied_rows() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    scores = rng.integers(0, 4, size=(6, 40)).astype(np.float32)
    return scores, np.array([40, 0, 3, 8, 39, 17])


def test_check_select_accepts_the_contract_order():
    scores, bounds = _tied_rows()
    check_select(_sorted_top(scores, bounds, 8), scores, bounds, 8)


def test_check_select_refuses_a_tie_in_id_order_reversed():
    scores, bounds = _tied_rows()
    got = _sorted_top(scores, bounds, 8)
    row = got[0]
    # Two places of equal score: swapping them breaks only the tie rule.
    i = next(i for i in range(7) if scores[0, row[i]] == scores[0, row[i + 1]])
    row[[i, i + 1]] = row[[i + 1, i]]
    with pytest.raises(AssertionError, match="row 0 differs"):
        check_select(got, scores, bounds, 8)


@needs_mojo
def test_max_select_loads_and_says_it_needs_a_gpu_on_a_cpu():
    runner = Runner("cpu")
    model = runner.load(max_select_graph(4, DeviceRef.CPU()))
    scores, bounds = _tied_rows()
    with pytest.raises(Exception, match="MAX's select runs on a GPU"):
        model.execute(
            runner.to_device(scores), runner.to_device(bounds.astype(np.int32))
        )


@pytest.mark.gpu
@pytest.mark.skipif(
    driver.accelerator_count() == 0,
    reason="no accelerator (max.driver.accelerator_count() == 0)",
)
def test_max_select_on_a_gpu_selects_what_a_sort_does():
    runner = Runner("gpu")
    model = runner.load(max_select_graph(8, DeviceRef.GPU()))
    scores, bounds = _tied_rows()
    got = runner.read(
        model.execute(
            runner.to_device(scores), runner.to_device(bounds.astype(np.int32))
        )[0]
    )
    np.testing.assert_array_equal(got, _sorted_top(scores, bounds, 8))
