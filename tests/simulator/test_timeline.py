"""Timeline outputs: metrics JSON, Chrome trace and the two PNGs."""

from __future__ import annotations

import json

import pytest

from alpasim.costmodels import get_cluster
from alpasim.simulator import simulate, synthetic_plan

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def timeline(two_nodes):
    plan = synthetic_plan([0.01] * 4, [0.02] * 4, 6, cluster=two_nodes, params_bytes=1e9, activation_bytes=1e8,
                          sync_s=0.01, hidden_shape=(1024, 1024), specs=("RR", "RR"))
    return simulate(plan, "1f1b")


def test_metrics_add_up(timeline):
    T = timeline.iteration_s
    for m in timeline.mesh_stats():
        assert m["busy_s"] == pytest.approx(m["compute_s"] + m["sync_s"])
        assert m["busy_s"] + m["comm_s"] + m["idle_s"] == pytest.approx(T)
        assert m["compute_s"] == pytest.approx(6 * 0.03)
    busy = sum(m["busy_s"] for m in timeline.mesh_stats())
    assert timeline.bubble_fraction == pytest.approx(1 - busy / (4 * T))
    idle = sum(e.duration_s for e in timeline.idle_events())
    assert idle == pytest.approx(sum(m["idle_s"] for m in timeline.mesh_stats()))
    d = json.loads(json.dumps(timeline.to_json()))
    for key in ("iteration_s", "bubble_fraction", "peak_memory_bytes", "meshes", "cross_mesh_bytes",
                "predicted_iteration_s", "schedule"):
        assert key in d
    assert len(d["peak_memory_bytes"]) == 4 and d["schedule"] == "1f1b"
    assert {"devices", "busy_s", "comm_s", "idle_s"} <= set(d["meshes"][0])
    assert "events" not in d and len(timeline.to_json(events=True)["events"]) == len(timeline.events)


def test_chrome_trace_is_valid_and_complete(timeline, tmp_path):
    path = timeline.chrome_trace(tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    compute = [e for e in events if e.get("ph") == "X" and e["cat"] == "compute"]
    assert len(compute) == 4 * 6 * 2  # S * B * (forward + backward)
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0 and {"pid", "tid", "name"} <= set(e)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"device 0 (mesh 0)", "node0 nic0 out", "node1 nic0 in"} <= names
    assert {e["pid"] for e in compute} == {0, 1}  # a process per node
    assert any(e["ph"] == "X" and e["cat"] == "send" for e in events)
    assert any(e["ph"] == "C" for e in events)  # memory counters


def test_pngs_are_written(timeline, tmp_path):
    for write, name in ((timeline.gantt_png, "gantt.png"), (timeline.memory_png, "memory.png")):
        path = write(tmp_path / name)
        data = path.read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_MAGIC)


def test_interleaved_trace_labels_chunks(tmp_path):
    tl = simulate(synthetic_plan([1.0] * 2, [2.0] * 2, 2), "interleaved", chunks=2, free_communication=True)
    trace = json.loads(tl.chrome_trace(tmp_path / "t.json").read_text())
    labels = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "compute"}
    assert {"F0.0", "F0.1", "B1.1"} <= labels


def test_chrome_trace_has_a_track_per_device(tmp_path):
    # Two stages of 8 devices each: stage 0 fills node 0, stage 1 node 1.
    cluster = get_cluster("aws-p3.16xlarge", nodes=2)
    plan = synthetic_plan([0.01] * 2, [0.02] * 2, 3, devices_per_stage=8, cluster=cluster)
    trace = json.loads(simulate(plan, "1f1b").chrome_trace(tmp_path / "t.json").read_text())
    events = trace["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    for d in range(16):
        assert names[(d // 8, d)] == f"device {d} (mesh {d // 8})"
    compute = [e for e in events if e.get("ph") == "X" and e["cat"] == "compute"]
    assert len(compute) == 16 * 3 * 2          # every device shows its mesh's S * B runs
    assert {(e["pid"], e["tid"]) for e in compute} == {(d // 8, d) for d in range(16)}
