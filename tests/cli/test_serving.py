"""The demo's serving model and a call's outputs, checked by hand (no kernels).

Pool assembly from a step's outputs, the latest-row rule of speculative
decoding, the ring restore on admission, the call packer, and the
scheduler's client aborts, empty rows, variable drafts and pinned slots.
Expected values are written out here from the pool rule (pool ``p`` is
positions ``[p*kpool, (p+1)*kpool)``), not taken from the module.
"""

from __future__ import annotations

import numpy as np
import pytest

from mla_kpool import calls, reference
from mla_kpool.demo import checked_run, checks, scheduling, workload


def _outputs():
    """A two-request step's outputs, kpool 4, head_dim 2.

    Request 0: c = 6, n = 7 -> ring_close closes pool 1 (positions 4-7),
    compress builds pools 2 (8-11) at row 0. Request 1: c = 0, n = 9 ->
    no ring_close, compress builds pools 0, 1 at rows 1, 2.
    """
    ring_closed = np.array([1, -1], np.int32)
    ring_pooled = np.array([[10.0, 11.0], [0.0, 0.0]])
    pooled = np.array([[20.0, 21.0], [30.0, 31.0], [40.0, 41.0], [0, 0]])
    row_offsets = np.array([0, 1, 3], np.uint32)
    first = calls.first_pool_ids([6, 0], 4)
    return ring_closed, ring_pooled, pooled, row_offsets, first


def test_first_pool_ids_round_up():
    assert calls.first_pool_ids([0, 1, 4, 5, 8], 4).tolist() == [
        0,
        1,
        1,
        2,
        2,
    ]


def test_pools_of_call_names_each_pool_and_writer():
    got = calls.pools_of_call(*_outputs())
    assert [sorted(g) for g in got] == [[1, 2], [0, 1]]
    assert got[0][1].writer == calls.RING_CLOSE
    assert got[0][1].key.tolist() == [10.0, 11.0]
    assert got[0][2].writer == calls.COMPRESS
    assert got[0][2].key.tolist() == [20.0, 21.0]
    assert [got[1][p].key.tolist() for p in (0, 1)] == [[30, 31], [40, 41]]
    assert {row.writer for row in got[1].values()} == {calls.COMPRESS}


@pytest.mark.parametrize(
    "offsets", [[0, 2, 1], [0, 1, 5]], ids=["decreasing", "past_the_rows"]
)
def test_pools_of_call_rejects_rows_outside_the_output(offsets):
    closed, ring_pooled, pooled, _, first = _outputs()
    with pytest.raises(ValueError, match="batch row 1: pool_row_offsets"):
        calls.pools_of_call(
            closed, ring_pooled, pooled, np.array(offsets), first
        )


def test_pools_of_call_rejects_a_pool_from_both_writers():
    closed, ring_pooled, pooled, offsets, _ = _outputs()
    first = np.array([1, 0])  # compress would rebuild pool 1 of request 0
    with pytest.raises(ValueError, match="pool 1 from both"):
        calls.pools_of_call(closed, ring_pooled, pooled, offsets, first)


def test_oracle_step_closes_compresses_and_seeds():
    # kpool 2, one request at c = 1 (position 0 in ring slot 1), n = 4:
    # ring_close pool 0 = {0, 1}, compress pool 1 = {2, 3}, seed 4.
    rng = np.random.default_rng(0)
    seq = rng.standard_normal((5, 3))
    gates = rng.standard_normal((5, 3))
    ape = rng.standard_normal((2, 3)).astype(np.float32)
    ring = np.full((2, 2, 2, 3), np.nan)
    checked_run.restore_prefix(ring, 1, 1, seq, gates, 2)
    call = calls.CallInputs(seq[1:], gates[1:], [0, 4], [1], [1])
    pools, after = reference.step(ring, call, ape, 2)
    want = reference.pool_sequence(seq[:4], gates[:4], ape, 2)
    assert sorted(pools[0]) == [0, 1]
    assert pools[0][0].writer == calls.RING_CLOSE
    np.testing.assert_allclose(pools[0][0].key, want[0], rtol=1e-13)
    np.testing.assert_allclose(pools[0][1].key, want[1], rtol=1e-13)
    np.testing.assert_array_equal(after[1, 0, 0], seq[4])
    assert np.isnan(ring[1, 0, 1]).all()  # the input ring is not modified


def test_keep_latest_replaces_only_rows_holding_drafts():
    key = np.zeros(2)
    kept: dict[int, checks.PoolRecord] = {}
    row = calls.PoolRow(key, calls.COMPRESS)
    # Call 0 keeps positions up to 5: pool 0 (0-3) is final, pool 1 (4-7)
    # holds drafts.
    assert checks.keep_latest(kept, {0: row, 1: row}, 0, 5, 4) == (0, [])
    assert kept[0].accepted and not kept[1].accepted
    # Call 1 produces pool 1 again from kept tokens: a rewrite.
    assert checks.keep_latest(kept, {1: row}, 1, 8, 4) == (1, [])
    assert kept[1].call == 1 and kept[1].accepted
    # A final row produced again is reported and keeps the earlier row.
    assert checks.keep_latest(kept, {0: row, 1: row}, 2, 8, 4) == (0, [0, 1])
    assert kept[0].call == 0 and kept[1].call == 1


@pytest.mark.parametrize("ring_len", [4, 8])
def test_restore_prefix_writes_the_pending_members_at_pos_mod_ring(ring_len):
    k = np.arange(11.0)[:, None] * np.ones((1, 2))
    gate = -k
    ring = np.zeros((3, 2, ring_len, 2))
    checked_run.restore_prefix(ring, 2, 11, k, gate, 4)  # pending: 8, 9, 10
    written = {8 % ring_len, 9 % ring_len, 10 % ring_len}
    for index in range(ring_len):
        want = 8 + (index - 8) % ring_len if index in written else 0.0
        assert ring[2, 0, index, 0] == want and ring[2, 1, index, 0] == -want
    assert not ring[:2].any()


def test_pack_call_concatenates_rows_in_batch_order():
    a, b = np.ones((3, 2)), 2 * np.ones((2, 2))
    packed = calls.pack_call(
        [([a, b], [a, b], 7, 3), ([], [], 2, 0), ([b], [b], 0, 1)],
        2,
        np.float64,
    )
    assert packed.input_row_offsets.tolist() == [0, 5, 5, 7]
    assert packed.cache_lengths.tolist() == [7, 2, 0]
    assert packed.slot_idx.tolist() == [3, 0, 1]
    assert packed.k[:, 0].tolist() == [1, 1, 1, 2, 2, 2, 2]
    assert packed.input_row_offsets.dtype == np.uint32
    empty = calls.pack_call([], 2, np.float32)
    assert empty.k.shape == (0, 2) and empty.input_row_offsets.tolist() == [0]


def test_aborted_request_stops_at_abort_at_and_frees_its_slot():
    requests = [
        workload.Request(20, 10, abort_at=13),
        workload.Request(9, 3, cached_prefix=2),
        workload.Request(5),
    ]
    assert requests[0].end == 13 and requests[0].new_tokens == 13
    rng = np.random.default_rng(1)
    calls = scheduling.schedule(
        requests, rng, token_budget=6, max_running=2, chunk=4, idle_prob=0.3
    )
    plan = scheduling.plan(requests, calls, 2, rng)
    fed = [r.cached_prefix for r in requests]
    idle = 0
    for call in plan.calls:
        for e in call:
            assert e.cache_length == fed[e.request]
            fed[e.request] += e.tokens
            idle += e.tokens == 0
            assert e.finished == (fed[e.request] == requests[e.request].end)
    assert fed == [13, 12, 5]
    assert idle > 0
    # Request 2 can only start once request 0 or 1 has left.
    assert plan.slot_reuses == 1


def test_variable_drafts_span_the_range():
    requests = [workload.Request(3, 200)]
    rng = np.random.default_rng(2)
    calls = scheduling.schedule(
        requests, rng, spec_tokens=5, min_spec_tokens=0, max_running=1
    )
    verify = [n for call in calls[1:] for _, n, _ in call]
    assert set(verify) == set(range(1, 7))


def test_plan_pins_slots_and_refuses_a_held_one():
    requests = [workload.Request(4), workload.Request(4)]
    calls = [[(0, 2), (1, 2)], [(0, 2), (1, 2)]]
    rng = np.random.default_rng(0)
    plan = scheduling.plan(requests, calls, 6, rng, slots={0: 5, 1: 0})
    assert [(e.request, e.slot) for e in plan.calls[0]] == [(0, 5), (1, 0)]
    with pytest.raises(workload.ScheduleError, match="slot 5, which is not"):
        scheduling.plan(requests, calls, 6, rng, slots={0: 5, 1: 5})
