"""Stage memory of Megatron-LM GPT plans against a closed form written from the paper.

The closed form is Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models"), section 4 and Table 2, adapted to our op set, plus the precision
recipe's bytes per parameter. Per transformer layer, with s = sequence, b = microbatch
per data-parallel replica, h = hidden, a = heads, t = tensor-parallel degree (bytes,
fp16 activations):

* Without recomputation a layer keeps sbh(34 + 5as/h) bytes of activations (their
  Table 2 with t = 1). Our graphs have no dropout, so its masks (sbh for attention's
  output, sbh for the MLP's and as^2b on the attention probabilities) go, and the
  attention applies its probabilities directly (no dropped copy, 2as^2b): what is
  left is 32 sbh + 2 as^2b. Under tensor parallelism the two layer-norm inputs, the
  input of the QKV projection and of the first MLP matmul (8 sbh) stay replicated and
  the rest is split: sbh(8 + 24/t) + 2as^2b/t.
* With full recomputation a layer keeps its input, 2sbh (replicated over t).
* The microbatch that runs holds one layer's working set on top of the stashes. A
  stage's backward is one program and the stashes are its arguments, so all of them
  stay live until it returns (`costmodels._stage_memory`). The paper stops at "one
  layer's activations"; we write out the points of a GPT layer's backward where it
  peaks: the first backward op (the recomputed stash less fc1's recomputed bias output,
  8sbh/t, which lives only inside the kernel that fuses the recomputed GeLU with GeLU's
  gradient (`costmodels._fusion`), the incoming cotangent 2sbh,
  fc2's input gradient 8sbh/t, fc2's weight gradient 8h^2/t); the softmax backward
  (with recomputation: layer input, its norm, Q and K, the probabilities, the residual
  cotangent, dProbs, dV and dScores, sbh(6 + 6/t) + 6as^2b/t; without it the held
  stash s_nr + sbh(2 + 2/t) + 4as^2b/t); without recomputation K's input gradient
  (s_nr, the residual cotangent, V's and K's input gradients, dQ and dK: s_nr +
  sbh(6 + 4/t), + 2sbh of K's unreduced partial for t > 1, K's projection contracting
  the split heads); and, with recomputation, the end of the recomputed forward (+ the
  cotangent and fc2's replicated output, 4sbh; for t > 1 fc2 is row-parallel, so at
  fc2 its unreduced partial output, 2sbh, is live next to the all-reduced one:
  s_nr + 6sbh).
* The zoo's first layer also holds the embedding: its token ids (4sb), and at the end
  of its backward the dense fp16 table gradient 2Vh/t next to the incoming cotangent
  and the held stash; under recomputation the embedding is recomputed with the layer,
  so the layer stashes only the ids. The last layer also holds the head: the final
  norm's input and output, the vocab-split logits 2sbV/t and the labels (all held;
  under remat less the block's recomputed output 2sbh, which lives only inside the
  kernel that fuses the residual add with the recomputed final norm and its gradient);
  its peak is at the loss backward (+ dLogits, 2sbV/t: the vocabulary-parallel loss
  keeps it split as the logits are), at the logits' weight gradient (+ dLogits, the input
  gradient and the table's 2Vh/t), for t > 1 at the logits' input gradient, which
  contracts the vocabulary split over t (its unreduced partial 2sbh is live next to
  the all-reduced 2sbh), or in its block's backward, with the table's gradient held
  until the layer's backward ends (and the logits and labels already dead).
* The stage: persistent states + w stashes (w = min(stages from this one, B), 1F1B) +
  the largest working set of one layer beyond its own stash, and with one stage
  holding both ends of the tied embedding, the head's table gradient held until the
  embedding's backward adds it.

Model states: embedding Vh/t (vocab-parallel) + sh; per layer 12h^2/t + 7h/t + 6h
(column- and row-parallel weights and the biases that follow them, replicated norms
and output biases); the last stage holds its own copy of the table (Megatron-LM
splits tied embeddings that way) and the final norm; x 18 (mixed-fp32grad) or 16
(mixed) bytes.
"""

from __future__ import annotations

import pytest

from alpasim.costmodels import get_cluster
from alpasim.graphs import get_recipe, resolve_model
from alpasim.solvers import DiskCache, MegatronConfig, plan_with_method

MODEL = "gpt3:hidden=512,layers=8,heads=8,seq=256,vocab=4096,batch=256"
TOLERANCE = 0.03


def _block(h, a, s, b, t, remat):
    sbh, as2b = s * b * h, a * s * s * b
    s_nr = sbh * (8 + 24 / t) + 2 * as2b / t
    # With remat the recomputed fc1 bias output (8sbh/t) is never allocated: it is read
    # only by the recomputed GeLU and by GeLU's gradient, which fuse into one kernel.
    recomputed = s_nr - (8 * sbh / t if remat else 0.0)
    first_backward = recomputed + sbh * (2 + 8 / t) + 8 * h * h / t
    if remat:   # the layer input (held), its recomputed norm, Q, K and probabilities
        softmax_backward = sbh * (6 + 6 / t) + 6 * as2b / t
    else:       # the whole held stash + the residual cotangent, dV, dProbs and dScores
        softmax_backward = s_nr + sbh * (2 + 2 / t) + 4 * as2b / t
    # K's input gradient: the held stash, the residual cotangent, V's input gradient, K's
    # (and for t > 1 its unreduced partial), dQ and dK; with remat these are freed sooner.
    qkv_input_grad = 0.0 if remat else s_nr + sbh * (6 + 4 / t) + (2 * sbh if t > 1 else 0.0)
    end_of_recompute = recomputed + 4 * sbh + (2 * sbh if t > 1 else 0.0) if remat else 0.0
    return s_nr, (2 * sbh if remat else s_nr), max(first_backward, softmax_backward, end_of_recompute,
                                                     qkv_input_grad)


def closed_form(cfg, tp, pp, mbs, remat, bytes_per_param, microbatches, stage):
    """Per-device bytes of Megatron stage `stage` (the module docstring's derivation)."""
    h, a, s, V = cfg.hidden, cfg.heads, cfg.seq, cfg.vocab
    b, t = mbs, tp
    sbh, ids = s * b * h, 4 * s * b
    L = cfg.layers // pp
    first, last = stage == 0, stage == pp - 1
    s_nr, stash, peak = _block(h, a, s, b, t, remat)
    layers = [(stash, peak)] * L
    table_grad = 2 * V * h / t
    if first:
        first_stash = ids + (0 if remat else s_nr)
        layers[0] = (first_stash, ids + max(peak, first_stash - ids + 2 * sbh + table_grad))
    if last:
        logits = 2 * s * b * V / t
        head_stash = logits + ids + (2 * sbh if remat else s_nr + 4 * sbh)
        # With remat: recomputed, then held to the head's grads, less the block's
        # recomputed output (2sbh), which the recomputed final norm and its gradient
        # read inside the kernel that fuses them with the residual add.
        held = s_nr - (2 * sbh if remat else 0.0) + logits + ids
        head_peak = max(held + 4 * sbh + logits,
                        held + 6 * sbh + logits + table_grad,
                        held + 8 * sbh + logits if t > 1 else 0.0,
                        # the block's backward, the table grad held; the logits and labels
                        # died with the loss's and the logits' gradients before it
                        head_stash - stash + peak + table_grad - logits - ids)
        layers[-1] = (head_stash, head_peak)
    carry = table_grad if first and last else 0.0
    stashes = sum(s_j for s_j, _ in layers)       # every stash is held through the backward
    one_microbatch = stashes + max(p_j - s_j + (carry if j < len(layers) - 1 else 0.0)
                                   for j, (s_j, p_j) in enumerate(layers))
    params = L * (12 * h * h / t + 7 * h / t + 6 * h)
    if first:
        params += V * h / t + s * h
    if last:
        params += 2 * h + (0 if first else V * h / t)
    inflight = min(pp - stage, microbatches)
    return params * bytes_per_param + inflight * stashes + (one_microbatch - stashes)


# Every (tp, pp, dp) of the grid, each with a microbatch size, recomputation and recipe
# drawn in turn so that all values of each occur against every degree.
GRID = [(tp, pp, dp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4) for dp in (1, 2, 8)]
CASES = [(tp, pp, dp, (1, 2, 4, 8, 16)[i % 5], remat, ("mixed-fp32grad", "mixed")[(i // 2) % 2])
         for i, (tp, pp, dp) in enumerate(GRID) for remat in (True, False)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return DiskCache(root=tmp_path_factory.mktemp("closed-form-cache"))


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp, dp, mbs, remat, precision", CASES)
def test_megatron_stage_memory_matches_korthikanti(cache, tp, pp, dp, mbs, remat, precision):
    n = tp * pp * dp
    cluster = get_cluster("dgx-a100", nodes=max(1, n // 8), devices_per_node=min(8, n), memory_gb=1e5)
    _, cfg = resolve_model(MODEL)
    plan = plan_with_method("megatron", MODEL, cluster, megatron=MegatronConfig(tp, pp, dp, mbs), remat=remat,
                            precision=precision, cache=cache)
    assert plan.feasible, plan.notes
    per_param = get_recipe(precision).bytes_per_param(cfg.dtype)
    for stage in sorted({0, pp - 1}):
        got = plan.stages[stage].memory_bytes
        want = closed_form(cfg, tp, pp, mbs, remat, per_param, plan.microbatches, stage)
        assert got == pytest.approx(want, rel=TOLERANCE), (stage, plan.stages[stage].memory)
        assert plan.stages[stage].memory["total_bytes"] == pytest.approx(got)


def test_tied_embedding_copy_is_counted_once_per_stage_and_has_its_own_states(cache):
    """Megatron-LM's split: the last stage holds the table with its own gradient and Adam
    states; a single stage holding both ends counts it once."""
    _, cfg = resolve_model(MODEL)
    table = cfg.vocab * cfg.hidden
    per_param = get_recipe(None).bytes_per_param(cfg.dtype)

    def states(st):
        return sum(st.memory[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes"))

    two = plan_with_method("megatron", MODEL, get_cluster("dgx-a100", nodes=1, devices_per_node=2, memory_gb=1e5),
                           megatron=MegatronConfig(1, 2, 1, 4), cache=cache)
    one = plan_with_method("megatron", MODEL, get_cluster("dgx-a100", nodes=1, devices_per_node=1, memory_gb=1e5),
                           megatron=MegatronConfig(1, 1, 1, 4), cache=cache)
    assert one.stages[0].memory["params_bytes"] == pytest.approx(2 * one.model.params)
    assert states(one.stages[0]) == pytest.approx(per_param * one.model.params)
    assert sum(states(st) for st in two.stages) == pytest.approx(per_param * (one.model.params + table))


@pytest.mark.parametrize("tp, mbs", [(1, 4), (2, 2), (4, 1), (8, 2)])
def test_selective_recompute_stashes_korthikantis_selective_activations(cache, tp, mbs):
    """Korthikanti et al. 2022, Table 2, "selective activation recomputation":
    sbh(10 + 24/t) a layer, the 5as^2b/t of the attention core recomputed instead of
    stashed; without dropout (its two sbh masks) that is sbh(8 + 24/t), the "none"
    stash less the probabilities 2as^2b/t. The first stage also stashes the token ids."""
    _, cfg = resolve_model(MODEL)
    cluster = get_cluster("dgx-a100", nodes=1, devices_per_node=tp * 2, memory_gb=1e5)
    h, a, s, b, t = cfg.hidden, cfg.heads, cfg.seq, mbs, tp
    sbh, as2b, layers = s * b * h, a * s * s * b, cfg.layers // 2
    got = {}
    for policy in ("selective", "none"):
        plan = plan_with_method("megatron", MODEL, cluster, megatron=MegatronConfig(tp, 2, 1, mbs), remat=False,
                                recompute=policy, cache=cache)
        assert plan.feasible and plan.model.recompute == policy
        got[policy] = plan.stages[0].memory["stash_bytes"]
    assert got["selective"] == pytest.approx(4 * s * b + layers * sbh * (8 + 24 / t), rel=1e-9)
    assert got["none"] - got["selective"] == pytest.approx(layers * 2 * as2b / t, rel=1e-9)


@pytest.mark.parametrize("tp, mbs", [(2, 2), (4, 1), (8, 2)])
@pytest.mark.parametrize("policy", ["none", "selective"])
def test_sequence_parallel_stashes_korthikantis_activations(cache, tp, mbs, policy):
    """Korthikanti et al. 2022, Table 2, "tensor + sequence parallel": sbh(34/t +
    5as/(ht)) a layer, everything split over t; without dropout (its 2sbh and as^2b of
    masks) and with the probabilities applied directly, sbh(32/t) + 2as^2b/t, and with
    selective recomputation ("... + selective") 32sbh/t. The first stage also stashes
    the token ids, whole (the vocabulary-parallel embedding reads all of them)."""
    _, cfg = resolve_model(MODEL)
    cluster = get_cluster("dgx-a100", nodes=1, devices_per_node=tp * 2, memory_gb=1e5)
    h, a, s, b, t = cfg.hidden, cfg.heads, cfg.seq, mbs, tp
    sbh, as2b, layers = s * b * h, a * s * s * b, cfg.layers // 2
    plan = plan_with_method("megatron", MODEL, cluster, remat=False, recompute=policy, cache=cache,
                            megatron=MegatronConfig(tp, 2, 1, mbs, sequence_parallel=True))
    assert plan.feasible and plan.search.megatron["sequence_parallel"]
    per_layer = 32 * sbh / t + (2 * as2b / t if policy == "none" else 0.0)
    assert plan.stages[0].memory["stash_bytes"] == pytest.approx(4 * s * b + layers * per_layer, rel=1e-9)


def test_distributed_optimizer_keeps_adam_states_on_one_dp_slice(cache):
    """Megatron-core's distributed optimizer: the same configuration with it holds the
    same weights but 1/dp of the master weights and Adam moments (every parameter of
    this model has a dimension dp divides), and its gradient reduce-scatter plus weight
    all-gather take what the all-reduce took."""
    cluster = get_cluster("dgx-a100", nodes=2, devices_per_node=8, memory_gb=1e5)
    plans = {flag: plan_with_method("megatron", MODEL, cluster, megatron=MegatronConfig(2, 2, 4, 2, flag),
                                    cache=cache) for flag in (False, True)}
    assert plans[True].search.megatron["distributed_optimizer"] is True
    for whole, sliced in zip(plans[False].stages, plans[True].stages, strict=True):
        assert sliced.memory["params_bytes"] == pytest.approx(whole.memory["params_bytes"], rel=1e-9)
        # Megatron's gradient buffer is whole; ours is for every contraction's gradient
        # (accumulated unreduced), a little less for the norms' and biases'.
        assert whole.memory["grads_bytes"] / 4 < sliced.memory["grads_bytes"] <= whole.memory["grads_bytes"]
        assert sliced.memory["optimizer_bytes"] == pytest.approx(whole.memory["optimizer_bytes"] / 4, rel=1e-9)
    assert plans[True].predicted.iteration_s == pytest.approx(plans[False].predicted.iteration_s, rel=0.05)
