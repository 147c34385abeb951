"""Eight virtual CPU devices for the backend tests, set before anything imports jax
(`make test` sets the same flag; this makes `pytest tests/backends` work alone)."""

import os
import sys

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
