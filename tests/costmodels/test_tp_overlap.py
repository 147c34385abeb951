"""Tensor-parallel collectives beside GEMMs: the closed form against the chunk queue it
summarises, and the bounds any overlap must respect."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpasim.costmodels import exposed_tp_s

seconds = st.floats(0.0, 10.0, allow_nan=False)


def chunk_queue_exposed(comm_s: float, gemm_s: float, chunks: int, method: str) -> float:
    """Two streams, event by event; exposed = the end of both minus the GEMM's own end.
    `pipeline`: the GEMM in `chunks` pieces one after another, piece j's collective
    (comm_s / chunks) starting once piece j is computed and the stream is free.
    `ring`: an all-gather of `chunks` pieces, the first already local, the others
    arriving one after another (comm_s / (chunks - 1) each); piece j computes
    (gemm_s / chunks) once it has arrived and piece j - 1 is done."""
    if method == "pipeline":
        compute_end = comm_end = 0.0
        for _ in range(chunks):
            compute_end += gemm_s / chunks
            comm_end = max(comm_end, compute_end) + comm_s / chunks
        return max(comm_end, compute_end) - gemm_s
    compute_end = 0.0
    for j in range(chunks):
        arrived = j * comm_s / (chunks - 1) if chunks > 1 else 0.0
        compute_end = max(compute_end, arrived) + gemm_s / chunks
    end = max(compute_end, comm_s if chunks > 1 else 0.0)
    return end - gemm_s


@settings(max_examples=300, deadline=None)
@given(seconds, seconds, st.integers(2, 16), st.sampled_from(["pipeline", "ring"]))
def test_one_collective_is_its_chunk_queue(comm_s, gemm_s, chunks, method):
    assert exposed_tp_s([(comm_s, method, chunks)], gemm_s) == pytest.approx(
        chunk_queue_exposed(comm_s, gemm_s, chunks, method), rel=1e-9, abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(seconds, st.sampled_from(["pipeline", "ring", "bulk"]), st.sampled_from([1, 2, 4, 8])),
                min_size=1, max_size=5), seconds, seconds)
def test_overlap_hides_at_most_the_gemms_and_never_adds(collectives, gemm_s, more_s):
    total = sum(c for c, _, _ in collectives)
    exposed = exposed_tp_s(collectives, gemm_s)
    assert max(total - gemm_s, 0.0) - 1e-12 <= exposed <= total + 1e-12
    assert exposed_tp_s(collectives, gemm_s + more_s) <= exposed + 1e-12     # more GEMM never exposes more


def test_each_method_leaves_what_its_queue_cannot_cover():
    assert exposed_tp_s([(1.0, "bulk", 1)], 3.0) == 0.0
    assert exposed_tp_s([(3.0, "bulk", 1)], 1.0) == pytest.approx(2.0)
    assert exposed_tp_s([(1.0, "pipeline", 4)], 3.0) == pytest.approx(1.0 / 4)   # the last chunk after the GEMM
    assert exposed_tp_s([(1.0, "ring", 8)], 3.0) == 0.0                          # the first chunk is local
    assert exposed_tp_s([(2.0, "ring", 2)], 2.0) == pytest.approx(1.0)           # the second waits
    assert exposed_tp_s([(1.0, "pipeline", 4), (1.0, "bulk", 1)], 4.0) == pytest.approx(1.0 / 4)
    assert exposed_tp_s([], 1.0) == 0.0
    with pytest.raises(ValueError, match=">= 1 chunks"):
        exposed_tp_s([(1.0, "ring", 0)], 1.0)
    with pytest.raises(ValueError, match="pipeline"):
        exposed_tp_s([(1.0, "magic", 2)], 1.0)
