import pytest

from alpasim.costmodels import PRESETS, UnknownPresetError, get_cluster, list_presets

GIB = 2**30


def test_preset_names():
    assert list_presets() == ["aws-p3.16xlarge", "dgx-a100", "dgx-h100", "gb200-nvl72"]
    assert set(PRESETS) == set(list_presets())
    assert all(PRESETS[n].name == n for n in PRESETS)


def test_p3_16xlarge_matches_alpa_testbed():
    c = get_cluster("aws-p3.16xlarge")
    assert (c.nodes, c.devices_per_node, c.num_devices) == (8, 8, 64)
    d = c.device
    assert d.memory_bytes == 16 * GIB  # binary: a "16 GB" V100 has 16 GiB of HBM2
    assert d.peak_flops_per_s("float16") == 125e12
    assert d.peak_flops_per_s("float32") == 15.7e12
    assert d.memory_bandwidth_bytes_per_s == 900e9
    assert c.intra_node.bytes_per_s == 130e9
    assert c.inter_node.bandwidth_gbps == 25.0 and c.nics_per_node == 1
    # One 25 Gbps card shared by 8 GPUs.
    assert c.inter_node_per_device.bandwidth_gbps == pytest.approx(25.0 / 8)


def test_dgx_a100():
    c = get_cluster("dgx-a100")
    d = c.device
    assert d.memory_bytes == 80 * GIB
    assert d.peak_flops_per_s("float16") == d.peak_flops_per_s("bfloat16") == 312e12
    assert d.peak_flops_per_s("float32") == 19.5e12
    assert d.memory_bandwidth_bytes_per_s == 2039e9
    assert c.intra_node.bytes_per_s == 300e9
    assert c.inter_node.bandwidth_gbps == 200.0 and c.nics_per_node == 8
    assert c.inter_node_per_device.bandwidth_gbps == 200.0


def test_dgx_h100():
    c = get_cluster("dgx-h100")
    d = c.device
    assert d.memory_bytes == 80 * GIB
    assert d.peak_flops_per_s("bfloat16") == 989e12
    assert d.peak_flops_per_s("float32") == 67e12
    assert d.memory_bandwidth_bytes_per_s == 3.35e12
    assert c.intra_node.bytes_per_s == 450e9
    assert c.inter_node_per_device.bandwidth_gbps == 400.0


def test_intra_node_faster_than_inter_node():
    for c in PRESETS.values():
        assert c.intra_node.bytes_per_s > c.inter_node_per_device.bytes_per_s
        assert c.intra_node.latency_s < c.inter_node.latency_s


def test_get_cluster_overrides():
    c = get_cluster("aws-p3.16xlarge", nodes=2, inter_node_gbps=100)
    assert c.num_devices == 16
    assert c.inter_node_per_device.bandwidth_gbps == pytest.approx(100 / 8)
    assert get_cluster("aws-p3.16xlarge").nodes == 8  # presets stay untouched
    with pytest.raises(TypeError):
        get_cluster("dgx-a100", colour="red")


def test_unknown_preset_lists_valid_names():
    with pytest.raises(UnknownPresetError) as err:
        get_cluster("p4d")
    message = str(err.value)
    assert "'p4d'" in message
    assert all(name in message for name in list_presets())
    assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)
