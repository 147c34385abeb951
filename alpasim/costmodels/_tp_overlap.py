"""Tensor-parallel collectives overlapped with GEMMs (Transformer Engine's userbuffers).

Megatron-core's `--tp-comm-overlap` hands the tensor-parallel collectives of each
transformer block to Transformer Engine's comm-GEMM overlap, configured per GEMM by
`initialize_ub` (transformer_engine/pytorch/module/base.py; the same methods in NeMo's
H100 configs, nemo/collections/llm/recipes/tp_overlap_configs/userbuffers.py):

* `ring_exchange` (the all-gathers before the QKV and FC1 forward GEMMs, and of the
  output gradient before the projection's and FC2's data-gradient GEMMs): the GEMM
  works on the chunk a rank holds while the next arrives from its neighbour, in
  `tp` steps (`num_splits` defaults to the tensor-parallel size);
* `pipeline` (the reduce-scatters after the projection and FC2 forward GEMMs): the GEMM
  is cut in `num_splits` = 4 chunks, each chunk's reduce-scatter running behind the
  next chunk's GEMM;
* `bulk` (the backward's other collectives): the whole collective runs beside the
  other GEMM of the same layer's backward (the input's all-gather beside the
  data-gradient GEMM, the data gradient's reduce-scatter beside the weight-gradient
  GEMM), on a few SMs of its own.

The closed forms here, for a collective of C seconds cut in k chunks beside GEMMs of G
seconds (each the two streams' chunk queue, `tests/costmodels/test_tp_overlap.py`):

* `pipeline` (the collective of a GEMM chunk starts when the chunk is done): the last
  chunk's collective runs after the GEMM, and what the GEMM cannot cover waits too:
  exposed = max(C - G, 0) + min(C, G) / k;
* `ring` (the GEMM starts on the chunk a rank holds, each further chunk arrives while
  the one before computes): only the arrivals the GEMM outruns wait:
  exposed = max(C - G (k - 1) / k, 0);
* `bulk`: exposed = max(C - G, 0).

Several collectives beside one GEMM share its time in proportion to their own. Not
priced: the SMs a `pipeline` or `bulk` collective takes from the GEMM beside it (TE's
default reserves none: `set_sm_margin` off), and each chunk's launch latency.
"""

from __future__ import annotations

from collections.abc import Sequence

# TE's `pipeline` method cuts its GEMM in this many chunks (initialize_ub's default
# `num_splits` for it; NeMo's H100 configs keep 4).
PIPELINE_SPLITS = 4
METHODS = ("pipeline", "ring", "bulk")


def exposed_tp_s(collectives: Sequence[tuple[float, str, int]], gemm_s: float) -> float:
    """Seconds of `collectives` ((seconds, method, chunks) each, method one of
    `METHODS`) left exposed beside GEMMs of `gemm_s` seconds (module doc)."""
    if gemm_s < 0 or any(c < 0 or k < 1 or m not in METHODS for c, m, k in collectives):
        raise ValueError(f"collectives take >= 0 seconds in >= 1 chunks by one of {METHODS}, beside GEMMs of "
                         f">= 0 seconds; got {list(collectives)!r}, {gemm_s!r}")
    total = sum(c for c, _, _ in collectives)
    if total == 0:
        return 0.0
    exposed = 0.0
    for c, method, k in collectives:
        g = gemm_s * c / total                      # this collective's share of the GEMMs
        if method == "ring":
            exposed += max(c - g * (k - 1) / k, 0.0)
        else:
            exposed += max(c - g, 0.0) + (min(c, g) / k if method == "pipeline" else 0.0)
    return exposed
