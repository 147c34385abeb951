"""The small pipelined plans the runtime tests share (the eight virtual CPU devices
they run on are set by `tests/conftest.py`, before anything imports jax)."""

import os
from pathlib import Path

import pytest

from alpasim.solvers import PlanOptions, SearchSpace

MODELS = {
    "gpt": "gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8,dtype=fp32",
    "gpt-dropout": "gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8,dtype=fp32,dropout=0.5",
    "moe": "moe:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8,experts=4,group_size=32,dtype=fp32",
    "wresnet": "wresnet:channels=8,width=1,image=64,classes=16,batch=8",
    # Five of the sixteen blocks (ResNet-17: every kind of block once), for the tests of
    # schedules: a third of the programs to compile. The stage-memory check is not
    # asserted on it: its first stage (the stem and two blocks) measures 1.15x the plan,
    # its backward's temporaries above the priced working set (the max-pool gradient
    # is lowered as nine shifted selects summed into a padded 18x18 buffer, a CPU
    # workspace the model leaves out by design), and on a 2x2 mesh
    # XLA:CPU keeps collective results the model does not price
    # (`test_memory.py::test_wresnet_first_stage_on_2x2`); the tests of that check keep
    # the 50-layer network, whose stages hold it.
    "wresnet-17": "wresnet:channels=8,width=1,image=64,classes=16,batch=8,depth=17",
    "llama": "llama:hidden=64,layers=2,heads=4,kv_heads=2,ffn=96,seq=16,vocab=128,batch=8,dtype=fp32,attention=fused",
    # One dense block and one routed block, each kind once (with a second routed block,
    # the pipelined-step test took a third longer).
    "topk-moe": "topk-moe:hidden=64,layers=2,heads=4,kv_heads=2,experts=4,top_k=2,expert_ffn=48,shared_experts=1,"
                "dense_layers=1,dense_ffn=96,seq=16,vocab=128,batch=8,group_size=32,dtype=fp32",
}
VIEWS = {2: [(1, 2)], 4: [(2, 2)]}


@pytest.fixture(scope="session")
def small_plan():
    """family (a key of `MODELS`) -> a plan from the planner itself, narrowed so that
    it plans in seconds and pipelines: microbatches B = 2, submeshes of 2 or 4 devices
    viewed as 1x2 and 2x2 meshes (so the stages' meshes differ in shape), at most 3
    stages on 8 devices, priced without overlap (the runtimes do not overlap; with it,
    Wide-ResNet's first stage moves to a 2x2 mesh where XLA:CPU holds forward
    temporaries the memory model does not price:
    `test_memory.py::test_wresnet_first_stage_on_2x2`); `options`
    are more `PlanOptions` fields. Cached: the runtime tests of both backends share
    them."""
    from alpasim.costmodels import get_cluster
    from alpasim.solvers import plan_pipeline

    plans = {}

    def make(family: str, **options):
        key = (family, tuple(sorted(options.items())))
        if key not in plans:
            space = SearchSpace(microbatches=2, pareto=False, shape_ok=lambda sh: sh.size in VIEWS,
                                views_of=lambda sh: VIEWS[sh.size], max_stages=3)
            plans[key] = plan_pipeline(MODELS[family], get_cluster("aws-p3.16xlarge", nodes=1), space,
                                       PlanOptions(**{"bucket_bytes": None, **options}))
        return plans[key]

    return make


@pytest.fixture(scope="session")
def reference():
    """plan -> `backends.reference_step(plan)`, computed once per test session and model:
    the single-device step depends only on the plan's `model` record and microbatch
    count, which many plans share (the runtime tests' GPT under four schedules and two
    runtimes). Kept in the session root (tests/conftest.py), so the other pytest-xdist
    worker loads what one computed; most of a reference's time is compiling the whole
    model once more."""
    import dataclasses
    import hashlib
    import json

    import numpy as np

    from alpasim.backends import Reference, reference_step

    store = Path(os.environ["ALPASIM_TEST_ROOT"]) / "references"      # the session root
    store.mkdir(exist_ok=True)

    def get(plan) -> Reference:
        # XLA's flags too: the serial lane compiles as users do, the parallel lane at O0
        # with legacy emitters.
        key = json.dumps([plan.model.to_json(), plan.microbatches, os.environ.get("XLA_FLAGS", "")], sort_keys=True)
        path = store / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.npz"
        try:
            with np.load(path) as f:
                names = json.loads(str(f["names"]))
                return Reference(**json.loads(str(f["meta"])), grads={p: f[f"g{i}"] for i, p in enumerate(names)})
        except FileNotFoundError:
            pass
        ref = reference_step(plan)
        meta = {k.name: getattr(ref, k.name) for k in dataclasses.fields(ref) if k.name != "grads"}
        part = path.with_suffix(f".{os.getpid()}.npz")
        # Arrays by index, their names beside them: a parameter's name may be anything,
        # savez's own keywords too.
        np.savez(part, meta=json.dumps(meta), names=json.dumps(list(ref.grads)),
                 **{f"g{i}": g for i, g in enumerate(ref.grads.values())})
        part.replace(path)                 # whole or absent, for the other worker
        return ref

    return get


@pytest.fixture(scope="session")
def quick_profile(tmp_path_factory, cli):
    """`alpasim profile --quick` of the 8 virtual CPU devices, run once for the session:
    (its printed JSON, the profile file, the wall time of the command)."""
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    proc = cli("profile", "--quick", "--cpu-devices", "8", "--out", out, "--json", timeout=240)
    return proc.json(), out, proc.seconds


@pytest.fixture(scope="session")
def shared_weight_graph(tmp_path_factory):
    """A JAX model whose weight `s` is read by layers 0, 1 and 3 of four: its gradient
    is summed along a chain of per-iteration transfers (3 -> 1 -> 0), and an interleaved
    plan of 2 meshes x 2 chunks puts two of its copies on one mesh. Saved as a graph file."""
    import jax
    import jax.numpy as jnp

    from alpasim.graphs import from_jax, save_graph

    def loss(params, batch):
        h = batch["x"]
        for w in ("s", "s", "a", "s"):
            h = jnp.tanh(h @ params[w])
        return jnp.mean(h * h)

    spec = jax.ShapeDtypeStruct
    shapes = ({"a": spec((64, 64), jnp.float32), "s": spec((64, 64), jnp.float32)},
              {"x": spec((8, 64), jnp.float32)})
    path = tmp_path_factory.mktemp("shared") / "shared.json"
    save_graph(from_jax(loss, *shapes, name="shared"), path)
    return path
