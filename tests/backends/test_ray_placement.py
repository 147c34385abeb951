"""Where `run --runtime ray` puts its mesh actors: GPUs when the Ray cluster has them
(one per device of the mesh), virtual CPU devices otherwise or when asked; a mesh
larger than the cluster's GPUs is refused up front, naming both numbers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from alpasim.backends._ray_runtime import PLATFORMS, RayRuntimeError, _actor_options, actor_platform
from alpasim.experiments import RAY_PLATFORMS


def fake_ray(gpus: int):
    return SimpleNamespace(cluster_resources=lambda: {"CPU": 16.0, **({"GPU": float(gpus)} if gpus else {})})


def plan_of(*mesh_sizes: int):
    start, stages = 0, []
    for n in mesh_sizes:
        stages.append(SimpleNamespace(devices=tuple(range(start, start + n))))
        start += n
    return SimpleNamespace(stages=stages)


def test_auto_takes_gpus_where_the_cluster_has_them():
    assert actor_platform(fake_ray(8), plan_of(4, 4), "auto") == "gpu"
    assert actor_platform(fake_ray(0), plan_of(4, 4), "auto") == "cpu"
    assert actor_platform(fake_ray(8), plan_of(4, 4), "cpu") == "cpu"


def test_gpu_refuses_a_mesh_larger_than_the_clusters_gpus():
    assert actor_platform(fake_ray(4), plan_of(4, 4), "gpu") == "gpu"
    with pytest.raises(RayRuntimeError, match="needs 8 GPUs; the Ray cluster has 4"):
        actor_platform(fake_ray(4), plan_of(8), "gpu")
    with pytest.raises(RayRuntimeError, match="choose one of"):
        actor_platform(fake_ray(4), plan_of(8), "tpu")


def test_actor_options_per_platform(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    gpu = _actor_options(4, "gpu")
    assert gpu["num_gpus"] == 4 and gpu["runtime_env"]["env_vars"] == {"JAX_PLATFORMS": "cuda"}
    cpu = _actor_options(4, "cpu")
    assert "num_gpus" not in cpu and cpu["num_cpus"] == 0
    assert cpu["runtime_env"]["env_vars"] == {"XLA_FLAGS": "--xla_force_host_platform_device_count=4",
                                              "JAX_PLATFORMS": "cpu"}


def test_the_drivers_xla_flags_reach_every_actor_with_its_device_count(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/d --xla_force_host_platform_device_count=8 "
                                    "--xla_backend_optimization_level=0")
    cpu = _actor_options(2, "cpu")["runtime_env"]["env_vars"]
    assert cpu["XLA_FLAGS"] == ("--xla_dump_to=/d --xla_backend_optimization_level=0 "
                                "--xla_force_host_platform_device_count=2")
    gpu = _actor_options(2, "gpu")["runtime_env"]["env_vars"]
    assert gpu["XLA_FLAGS"] == "--xla_dump_to=/d --xla_backend_optimization_level=0"


def test_the_cli_checks_the_same_names():
    assert RAY_PLATFORMS == PLATFORMS
