"""index_top_k on a real GPU: this package's GPU path, and MAX's builtin.

Skipped without an accelerator. Every test of tests/index/test_index_top_k.py
runs again on the GPU with this package's GPU path forced (``gpu_op="ours"``,
whatever the GPU), against the same float64 oracle, within the bound of the
scorer ``"auto"`` picks. Each scorer the GPU has (FP32 everywhere, the tensor
one of its architecture: ``wgmma`` on sm_90, ``mfma`` on gfx942) runs every
case again, twice, against the oracle within its own bound and bitwise equal
run to run. Then, for each case of a shape MAX's own op scores on this GPU
(``kpool == 1`` everywhere, pooled keys on Blackwell and MI355), MAX's op and
ours both pass the oracle's check and select the same set up to ids whose
scores lie within the float32 tolerance of the row's k-th score.
"""

from __future__ import annotations

import numpy as np
import pytest
from max import driver
from test_index_top_k import *  # noqa: F403 (the tests, run again here)

from mla_kpool import reference as ref
from support import index_cases
from support.index_cases import CASES, build, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        driver.accelerator_count() == 0,
        reason="no accelerator (max.driver.accelerator_count() == 0)",
    ),
]


@pytest.fixture(scope="module")
def runner(runners):
    """Where the op runs: a real GPU."""
    return runners("gpu")


@pytest.fixture(autouse=True)
def _our_gpu_path(monkeypatch):
    """Every call of a case goes to this package's GPU path, whose
    ``"auto"`` scorer may be a tensor-core one: checks take that bound."""
    plain = index_cases.Call.run_kwargs
    plain_check = index_cases.Call.check

    def ours(self):
        return {**plain(self), "gpu_op": "ours"}

    def check(self, got, scorer=None):
        return plain_check(self, got, scorer=scorer or _auto_scorer())

    monkeypatch.setattr(index_cases.Call, "run_kwargs", ours)
    monkeypatch.setattr(index_cases.Call, "check", check)


@pytest.mark.parametrize("scorer", ["simt", "wgmma", "mfma"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_scorer_matches_the_oracle(runner, case, scorer):
    from mla_kpool._index_op import gpu_scorers

    if scorer not in gpu_scorers():
        pytest.skip(f"this GPU has no {scorer} scorer")
    call = build(case)
    got = run(runner, call, scorer=scorer)
    assert call.check(got, scorer=scorer).rows == len(call.q)
    np.testing.assert_array_equal(run(runner, call, scorer=scorer), got)


def _auto_scorer() -> str:
    """The error model of the scorer ``"auto"`` runs on this GPU: its
    tensor scorer, if it has one."""
    from mla_kpool._index_op import gpu_scorers

    return gpu_scorers()[-1] if gpu_scorers() else "simt"


def _same_set_up_to_ties(call, a: np.ndarray, b: np.ndarray) -> None:
    """Rows of ``a`` (ours, ``"auto"``) and ``b`` (MAX's) differ only in ids
    tied at the k-th score, within our scorer's bound."""
    args, kwargs = call.oracle_args()
    rows = ref.index_scores(*args, **kwargs, scorer=_auto_scorer())
    for t, row in enumerate(rows):
        left, right = set(a[t].tolist()), set(b[t].tolist())
        if row is None or left == right:
            assert left == right, f"row {t}"
            continue
        m = min(call.shape.top_k, row.bound)
        kth = np.sort(row.scores)[::-1][m - 1]
        for j in (left ^ right) - {-1}:
            assert abs(row.scores[j] - kth) <= 2 * row.tol[j], (
                f"row {t}: id {j} (score {row.scores[j]!r}) is in one set"
                f" only, away from the k-th score {kth!r}"
            )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_ours_and_maxs_agree_where_max_scores(runner, case, monkeypatch):
    from mla_kpool.indexer import max_scores

    if not max_scores(case.shape.kpool):
        pytest.skip(f"MAX does not score kpool {case.shape.kpool} on this GPU")
    call = build(case)
    ours = run(runner, call)
    call.check(ours)
    monkeypatch.undo()  # the wrapper's choice: MAX's op here
    theirs = run(runner, call)
    # MAX promises the set, not an order: check its rows in score order.
    call.check(_in_score_order(call, theirs))
    _same_set_up_to_ties(call, ours, theirs)


def _in_score_order(call, got: np.ndarray) -> np.ndarray:
    """``got``'s rows with their valid ids sorted by the oracle's score
    (descending, ties by ascending id), ``-1`` after them."""
    args, kwargs = call.oracle_args()
    out = np.full_like(got, -1)
    for t, row in enumerate(ref.index_scores(*args, **kwargs)):
        ids = got[t][got[t] >= 0]
        if row is None or len(ids) == 0 or ids.max() >= row.bound:
            out[t] = got[t]  # the check reports it as it is
            continue
        scores = np.nan_to_num(row.scores[ids], nan=-np.inf)
        out[t, : len(ids)] = ids[np.lexsort((ids, -scores))]
    return out
