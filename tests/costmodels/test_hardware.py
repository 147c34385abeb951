import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from alpasim.costmodels import CLUSTER_SCHEMA, Cluster, ClusterError, Device, Link


def _cluster(**kw) -> Cluster:
    fields = dict(name="c", nodes=2, devices_per_node=4,
                  device=Device("d", {"float32": 1e12}, 2**30, 1e11),
                  intra_node=Link("in", 800.0, 1e-6), inter_node=Link("out", 100.0, 1e-5))
    fields.update(kw)
    return Cluster(**fields)


def test_link_bytes_per_s():
    assert Link("eth", 25.0, 0.0).bytes_per_s == 3.125e9
    assert Link("nvl", 1040.0, 0.0).bytes_per_s == 130e9


@pytest.mark.parametrize(("field", "value"), [("nodes", 0), ("devices_per_node", 0), ("nodes", -3),
                                              ("nics_per_node", 0), ("nodes", 1.5)])
def test_cluster_rejects_impossible_counts(field, value):
    with pytest.raises(ClusterError, match=rf"{field}.*{value}"):
        _cluster(**{field: value})


@pytest.mark.parametrize("bw", [0.0, -10.0, float("nan"), float("inf")])
def test_link_rejects_bad_bandwidth(bw):
    with pytest.raises(ClusterError, match=r"bandwidth_gbps.*" + repr(bw)):
        Link("l", bw, 0.0)


def test_link_rejects_negative_latency():
    with pytest.raises(ClusterError, match=r"latency_s.*-1"):
        Link("l", 1.0, -1.0)


@pytest.mark.parametrize("mem", [0, -1])
def test_device_rejects_bad_memory(mem):
    with pytest.raises(ClusterError, match=rf"memory_bytes.*{mem}"):
        Device("d", {"float32": 1e12}, mem, 1e11)


def test_device_rejects_bad_peaks():
    with pytest.raises(ClusterError, match="float32"):
        Device("d", {"float16": 1e12}, 1, 1.0)
    with pytest.raises(ClusterError, match="int8"):
        Device("d", {"float32": 1e12, "int8": 1e12}, 1, 1.0)
    with pytest.raises(ClusterError, match=r"peak_flops\['float16'\].*0"):
        Device("d", {"float32": 1e12, "float16": 0}, 1, 1.0)
    with pytest.raises(ClusterError, match="memory_bandwidth_bytes_per_s"):
        Device("d", {"float32": 1e12}, 1, 0.0)


def test_device_peak_lookup_and_hashable():
    d = Device("d", {"float32": 2e12, "float16": 8e12}, 1, 1.0)
    assert d.peak_flops_per_s("float16") == 8e12
    assert d.peak_flops_per_s("int32") == 2e12  # integers fall back to the fp32 units
    assert d == Device("d", {"float16": 8e12, "float32": 2e12}, 1, 1.0)
    assert len({d, Device("d", {"float16": 8e12, "float32": 2e12}, 1, 1.0)}) == 1


def test_nics_default_to_one_per_device_and_share():
    c = _cluster()
    assert c.nics_per_node == 4
    assert c.inter_node_per_device.bandwidth_gbps == 100.0
    shared = _cluster(nics_per_node=1)
    assert shared.inter_node_per_device.bandwidth_gbps == 25.0
    # A device drives at most one card, so spare cards do not speed it up.
    assert _cluster(nics_per_node=8).inter_node_per_device.bandwidth_gbps == 100.0


def test_with_overrides_returns_new_validated_cluster():
    c = _cluster()
    d = c.with_overrides(nodes=4, devices_per_node=8, inter_node_gbps=400, memory_gb=32)
    assert (d.nodes, d.devices_per_node, d.num_devices) == (4, 8, 32)
    assert d.inter_node.bandwidth_gbps == 400.0 and d.inter_node.latency_s == c.inter_node.latency_s
    assert d.device.memory_bytes == 32 * 2**30
    assert c.nodes == 2 and c.device.memory_bytes == 2**30  # the original is untouched
    assert c.with_overrides() == c
    with pytest.raises(ClusterError, match=r"nodes.*0"):
        c.with_overrides(nodes=0)
    with pytest.raises(ClusterError, match=r"bandwidth_gbps.*-1"):
        c.with_overrides(inter_node_gbps=-1)
    with pytest.raises(ClusterError, match=r"memory_gb.*0"):
        c.with_overrides(memory_gb=0)


def test_node_of():
    c = _cluster()
    assert [c.node_of(i) for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(ClusterError, match="8"):
        c.node_of(8)


def test_json_round_trip_through_text():
    c = _cluster(nics_per_node=1)
    data = c.to_json()
    assert data["schema"] == CLUSTER_SCHEMA == "alpasim.cluster/1"
    assert Cluster.from_json(json.loads(json.dumps(data))) == c


finite = st.floats(min_value=1e-3, max_value=1e18, allow_nan=False)


@given(nodes=st.integers(1, 1024), dpn=st.integers(1, 16), nics=st.integers(1, 16), bw=finite, lat=st.floats(0, 1),
       mem=st.integers(1, 2**40), peak=finite)
def test_json_round_trip_property(nodes, dpn, nics, bw, lat, mem, peak):
    c = Cluster("h", nodes, dpn, Device("d", {"float32": peak, "bfloat16": 2 * peak}, mem, bw),
                Link("a", bw, lat), Link("b", bw / 3, lat), nics)
    assert Cluster.from_json(json.loads(json.dumps(c.to_json()))) == c


def _broken(mutate) -> dict:
    data = json.loads(json.dumps(_cluster().to_json()))
    mutate(data)
    return data


@pytest.mark.parametrize(("mutate", "names"), [
    (lambda d: d.pop("nodes"), "cluster.nodes"),
    (lambda d: d.update(nodes="eight"), "cluster.nodes"),
    (lambda d: d.update(nodes=True), "cluster.nodes"),
    (lambda d: d.update(schema="alpasim.cluster/0"), "schema"),
    (lambda d: d.pop("schema"), "cluster.schema"),
    (lambda d: d["device"].update(memory_bytes="16GB"), "cluster.device.memory_bytes"),
    (lambda d: d["device"].pop("peak_flops"), "cluster.device.peak_flops"),
    (lambda d: d["inter_node"].pop("latency_s"), "cluster.inter_node.latency_s"),
    (lambda d: d["intra_node"].update(bandwidth_gbps=0), "bandwidth_gbps"),
    (lambda d: d.update(device=[1, 2]), "cluster.device"),
    (lambda d: d.pop("intra_node"), "cluster.intra_node"),
    (lambda d: d.update(colour="red"), "cluster.colour"),
    (lambda d: d["device"].update(hbm="x"), "cluster.device.hbm"),
])
def test_malformed_json_names_the_field(mutate, names):
    with pytest.raises(ClusterError, match=names.replace(".", r"\.")):
        Cluster.from_json(_broken(mutate))


def test_from_json_rejects_non_mapping():
    with pytest.raises(ClusterError, match="object"):
        Cluster.from_json(["not", "a", "dict"])
    assert issubclass(ClusterError, ValueError)


def test_cluster_is_frozen_and_hashable():
    c = _cluster()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.nodes = 3  # type: ignore[misc]
    assert hash(c) == hash(_cluster())
