"""Bad input, as a new user mistypes it (issue 18): every case ends in one line on
stderr naming what is wrong, a non-zero exit, no traceback, and no work done first:
no stage priced (each command gets an empty stage cache of its own, which must stay
empty), no output path found unwritable after the work. How soon a refusal comes is
timed in the serial lane only (`test_refusals_come_within_seconds`), where the
machine is idle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alpasim.costmodels import get_cluster
from alpasim.simulator import synthetic_plan

T = "gpt3:hidden=64,layers=2,heads=2,seq=32,vocab=128,batch=8"
LIMIT_S = 5.0
UNWRITABLE = "/proc/alpasim-cannot-write-here/out.json"    # /proc takes no new files, even for root


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A valid synthetic plan and cluster file, and broken copies of each (by name)."""
    root = tmp_path_factory.mktemp("bad")
    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=4)
    plan = synthetic_plan([0.01] * 4, [0.02] * 4, 8, cluster=cluster, params_bytes=1e9, activation_bytes=1e8)
    good = plan.to_json()
    out = {"plan": root / "plan.json"}
    out["plan"].write_text(json.dumps(good))

    def broken(name: str, edit) -> None:
        data = json.loads(json.dumps(good))
        edit(data)
        out[name] = root / f"{name}.json"
        out[name].write_text(json.dumps(data))

    broken("negative_memory", lambda d: d["stages"][1].update(memory_bytes=-5.0))
    broken("negative_params", lambda d: d["stages"][1].update(params_bytes=-1.0))
    broken("overlapping_layers", lambda d: d["stages"][1].update(layers=[0, 1]))
    broken("gap_in_layers", lambda d: d["stages"][2].update(layers=[3, 3]))
    broken("string_layers", lambda d: d["stages"][1].update(layers="1-2"))
    broken("three_layers", lambda d: d["stages"][1].update(layers=[1, 1, 1]))
    broken("nonsense_schedule", lambda d: d.update(schedule="nonsense"))
    broken("huge_microbatches", lambda d: d.update(microbatches=10 ** 7))
    broken("device_42", lambda d: d["stages"][3].update(devices=[42]))
    broken("bad_param_spec", lambda d: d["stages"][0].update(param_specs={"w": "S7S7"}))
    broken("transfer_to_stage_9", lambda d: d.update(transfers=[{"tensor": "x", "nbytes": 4, "src_stage": 0,
                                                                 "dst_stage": 9}]))
    spec = cluster.to_json()
    out["cluster_huge"] = root / "huge.json"
    out["cluster_huge"].write_text(json.dumps({**spec, "nodes": 1000000}))
    out["cluster_bad_nodes"] = root / "bad_nodes.json"
    out["cluster_bad_nodes"].write_text(json.dumps({**spec, "nodes": "two"}))
    out["cluster_bad_link"] = root / "bad_link.json"
    out["cluster_bad_link"].write_text(json.dumps({**spec, "intra_node": {**spec["intra_node"], "bandwidth_gbps": -1}}))
    out["profile_bad"] = root / "profile.json"
    out["profile_bad"].write_text(json.dumps({"schema": "alpasim.profile/1", "ops": "fast"}))
    out["truncated"] = root / "truncated.json"
    out["truncated"].write_text(json.dumps(good)[:200])
    out["graph_bad"] = root / "graph.json"
    out["graph_bad"].write_text(json.dumps({"schema": "alpasim.graph/1", "name": "g", "tensors": {}, "ops": [
        {"name": "x", "prim": "no_such_prim", "inputs": [], "outputs": []}]}))
    out["a_file"] = root / "a_file.txt"
    out["a_file"].write_text("not a directory")
    out["dir"] = root
    return out


CASES = {
    # Hangs and runaway memory: refused up front, naming the limit.
    "graph with 10^9 layers": (["graph", T.replace("layers=2", "layers=1000000000")], "layers"),
    "plan on 10^6 nodes": (["plan", "--model", T, "--nodes", "1000000"], "nodes"),
    "plan on a cluster file of 10^6 nodes": (["plan", "--model", T, "--cluster", "{cluster_huge}"], "nodes"),
    "sweep over 10^6 GPUs": (["sweep", "--model", T, "--gpus", "1000000", "--inter-node-gbps", "10,25"], "16384"),
    "simulate 10^7 microbatches": (["simulate", "{huge_microbatches}"], "microbatches"),
    # Output paths: checked before any work, one line.
    "plan --out unwritable": (["plan", "--model", T, "--out", UNWRITABLE], "--out"),
    "plan --out a directory": (["plan", "--model", T, "--out", "{dir}"], "is a directory"),
    "profile --out unwritable": (["profile", "--quick", "--out", UNWRITABLE], "--out"),
    "run --trace unwritable": (["run", "{plan}", "--trace", UNWRITABLE], "--trace"),
    "run --seed -1 (numpy would refuse it after compiling)": (["run", "{plan}", "--seed", "-1"], "--seed"),
    "simulate --trace unwritable": (["simulate", "{plan}", "--trace", UNWRITABLE], "--trace"),
    "simulate --gantt a directory": (["simulate", "{plan}", "--gantt", "{dir}"], "is a directory"),
    "sweep --out unwritable": (["sweep", "--model", T, "--gpus", "2", "--inter-node-gbps", "10,25", "--out",
                                UNWRITABLE], "--out"),
    "graph --save unwritable": (["graph", T, "--save", UNWRITABLE], "--save"),
    # A path that passes the check but whose write fails (/dev/full: "no space left").
    "graph --save to a full device": (["graph", T, "--save", "/dev/full"], "--save /dev/full: cannot write"),
    "simulate --trace to a full device": (["simulate", "{plan}", "--trace", "/dev/full"], "/dev/full"),
    # Plan files: one validating loader, the field path in the message.
    "negative memory": (["simulate", "{negative_memory}"], "stages[1].memory_bytes"),
    "negative params": (["simulate", "{negative_params}"], "stages[1].params_bytes"),
    "overlapping layer ranges": (["simulate", "{overlapping_layers}"], "stages[1].layers"),
    "a gap between layer ranges": (["simulate", "{gap_in_layers}"], "stages[2].layers"),
    "layer range as a string": (["simulate", "{string_layers}"], "stages[1].layers"),
    "layer range of three": (["simulate", "{three_layers}"], "stages[1].layers"),
    "run of a string layer range": (["run", "{string_layers}"], "stages[1].layers"),
    "schedule nonsense": (["simulate", "{nonsense_schedule}"], "schedule"),
    "device outside the cluster": (["simulate", "{device_42}"], "stages[3].devices"),
    "run of a device outside the cluster": (["run", "{device_42}"], "stages[3].devices"),
    "parameter spec S7S7": (["simulate", "{bad_param_spec}"], "stages[0].param_specs"),
    "transfer to a stage that is not there": (["simulate", "{transfer_to_stage_9}"], "transfers[0]"),
    "plan file is a directory": (["simulate", "{dir}"], "is a directory"),
    # Options: validated where they enter.
    "intra --time-limit -1": (["intra", T, "--time-limit", "-1"], "--time-limit"),
    "intra --time-limit nan": (["intra", T, "--time-limit", "nan"], "--time-limit"),
    "plan --workers 0": (["plan", "--model", T, "--workers", "0"], "--workers"),
    "plan --workers -3": (["plan", "--model", T, "--workers", "-3"], "--workers"),
    "plan --epsilon nan": (["plan", "--model", T, "--epsilon", "nan"], "--epsilon nan"),
    "plan --max-stages 0": (["plan", "--model", T, "--max-stages", "0"], "--max-stages 0"),
    "plan --chunks 1": (["plan", "--model", T, "--schedule", "interleaved", "--chunks", "1"], "--chunks"),
    "an interleaved plan that cannot exist": (["plan", "--model", T, "--nodes", "1", "--devices-per-node", "1",
                                               "--schedule", "interleaved"], "needs S >= 2 meshes"),
    "plan --schedule interleaved with megatron's grid": (["plan", "--model", T, "--schedule", "interleaved",
                                                          "--method", "megatron"], "given by --tp, --pp"),
    "plan --schedule interleaved with data-parallel": (["plan", "--model", T, "--schedule", "interleaved",
                                                        "--method", "data-parallel"], "not --method data-parallel"),
    # Cluster, profile, graph files: the file and the field in the message.
    "cluster file with nodes 'two'": (["plan", "--model", T, "--cluster", "{cluster_bad_nodes}"], "nodes"),
    "cluster file with a negative link": (["plan", "--model", T, "--cluster", "{cluster_bad_link}"], "bandwidth"),
    "profile file of the wrong shape": (["plan", "--model", T, "--cost-model", "{profile_bad}"], "profile.json"),
    "truncated plan file": (["simulate", "{truncated}"], "not valid JSON"),
    "graph file with an unknown primitive": (["plan", "--model", "{graph_bad}"], "graph.json"),
    # Typer's usage errors: one line too, not a panel.
    "an option the command does not have": (["compare", "--model", T, "--out", "{dir}"], "No such option: --out"),
    "an integer option given a word": (["plan", "--model", T, "--nodes", "two"], "'--nodes'"),
    "a missing required option": (["plan"], "Missing option '--model'"),
    "an unknown command": (["plna", "--model", T], "No such command 'plna'"),
    "reproduce --out-dir a file": (["reproduce", "fig7a", "--out-dir", "{a_file}"], "--out-dir"),
    "plan --microbatches 0": (["plan", "--model", T, "--microbatches", "0"], "--microbatches 0: must be"),
    "repeated spec key": (["graph", "gpt3:hidden=64,hidden=128,layers=2,heads=2,seq=32,vocab=128"], "hidden"),
    "simulate --chunks 1000": (["simulate", "{plan}", "--schedule", "interleaved", "--chunks", "1000"], "--chunks"),
    "negative device memory": (["plan", "--model", T, "--memory-gb", "-1"], "memory_gb"),
    "a profile that is not there": (["simulate", "{plan}", "--cost-model", "{dir}/nope.json"], "nope.json: no such"),
    "heads that do not divide hidden": (["plan", "--model", T.replace("heads=2", "heads=3")], "not divisible"),
    "memory budget in readable units": (["plan", "--model", T, "--memory-gb", "0.000001"], "KiB"),
    # Known before planning: refused before any stage is priced, naming the real cause.
    "a model whose states fit no device": (["plan", "--model", "llama3-405b", "--nodes", "1", "--devices-per-node",
                                            "1"], "optimizer states (mixed-fp32grad), 6.64 TiB in all"),
    "states that fit no device, on a worker pool": (["plan", "--model", "llama3-405b", "--nodes", "1", "--workers",
                                                     "2"], "the states alone need 426 such devices"),
    "a Megatron baseline whose states fit no device": (["plan", "--model", "llama3-405b", "--nodes", "1",
                                                        "--method", "megatron"], "does not fit"),
    "a Megatron pipeline deeper than the blocks": (["plan", "--model", T, "--nodes", "1", "--method", "megatron",
                                                    "--tp", "1", "--pp", "8", "--dp", "1", "--microbatch-size", "1"],
                                                   "8 pipeline stages, but"),
    "a Megatron configuration of the wrong size": (["plan", "--model", T, "--nodes", "1", "--method", "megatron",
                                                    "--tp", "2", "--pp", "2", "--dp", "1", "--microbatch-size", "1"],
                                                   "tp x pp x dp = 4, the cluster has 8 devices"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line(name, files, cli, tmp_path):
    args, fragment = CASES[name]
    args = [a.format(**{k: str(v) for k, v in files.items()}) for a in args]
    cache = tmp_path / "stage-cache"
    proc = cli(*args, env={"ALPASIM_CACHE_DIR": str(cache)}, timeout=120)
    assert proc.returncode != 0, (name, proc.stdout[-500:], proc.stderr[-500:])
    assert "Traceback" not in proc.stderr, (name, proc.stderr[-2000:])
    assert len(proc.lines) == 1, (name, proc.lines)
    assert fragment in proc.lines[0], (name, proc.lines[0])
    assert not cache.exists() or not any(cache.rglob("*")), (name, "priced stages before refusing")


# The refusals that once came after planning (53 s for Llama 3 405B on one device), and
# the acceptance's 10 s for that one.
TIMED = {
    "a model whose states fit no device": (["plan", "--model", "llama3-405b", "--nodes", "1",
                                            "--devices-per-node", "1"], 10.0),
    "memory budget in readable units": (["plan", "--model", T, "--memory-gb", "0.000001"], LIMIT_S),
    "an interleaved plan that cannot exist": (["plan", "--model", T, "--nodes", "1", "--devices-per-node", "1",
                                               "--schedule", "interleaved"], LIMIT_S),
    "a Megatron pipeline deeper than the blocks": (["plan", "--model", T, "--nodes", "1", "--method", "megatron",
                                                    "--tp", "1", "--pp", "8", "--dp", "1", "--microbatch-size", "1"],
                                                   LIMIT_S),
}


@pytest.mark.serial
@pytest.mark.parametrize("name", list(TIMED))
def test_refusals_come_within_seconds(name, cli):
    args, limit = TIMED[name]
    proc = cli(*args, timeout=120, fresh=True)        # a new interpreter: imports count
    assert proc.returncode == 2 and len(proc.lines) == 1, (name, proc.lines)
    assert proc.seconds < limit, (name, proc.seconds)


def test_one_size_formatter():
    from alpasim.units import format_bytes

    assert [format_bytes(x) for x in (12, 1024, 1.5 * 2 ** 30, 0.01 * 2 ** 30, 3 * 2 ** 40, -2048)] == [
        "12 B", "1.00 KiB", "1.50 GiB", "10.24 MiB", "3.00 TiB", "-2.00 KiB"]
