"""A content-addressed disk cache for results that took long (stage costs, plans).

Keys are SHA-256 digests of a JSON description of everything the result depends on
(the layer's canonical structure, the mesh and its links, the device, the solver
settings and `CACHE_VERSION`), so a stale entry can never be read for a changed
problem. Values are JSON files — data only, never pickle. The directory is
`$ALPASIM_CACHE_DIR`, else `~/.cache/alpasim`; `enabled=False` (the CLI's `--no-cache`)
bypasses it entirely.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# 14: Megatron-LM's layout of the Llama and fine-grained MoE parameters; 15: its
# distributed optimizer's tied copy; 16: GShard MoE's router replicated again under it;
# 17: one resharding per tensor, phase and spec, shared by its readers (every plan), and
# sequence parallelism; 18: each option's weight-gradient collectives (bytes by kind and
# axes) for the overlapped buckets; 19: the input-gradient collectives their weight
# gradients hide; 20/21: the weight-gradient pass (zero-bubble schedules); 22: Megatron-
# core's flat-buffer sharding of the optimizer states its layouts cannot slice; 23: batch
# loops found back from readers (RoPE's broadcast tables); 24: a mesh axis's message link
# (all-to-all, send/recv) in the key; 25: GEMM curves fitted per device and measured HBM
# bandwidth (`costmodels._gemm`); 26: batch loops found back in the forward pass only;
# 30: measured collective sweeps of NVSwitch links (`costmodels._bus_sweeps`), in the key;
# 31: selective recomputation redraws dropout masks and zeros with attention's core;
# 32: the loss's class axis splits (vocab-parallel cross-entropy); 33: each option's
# after-step parameter gathers (`LayerOption.param_gather_s`), the loss's collectives
# per kernel; 34: weight gradients reduced on the recipe's accumulator bytes (fp32
# under mixed-fp32grad), the distributed optimizer's flat buffer reduce-scatters
# gradients and gathers weights where an all-reduce stood, and the gathers' bytes by
# axes (`LayerOption.gather_groups`); 35: a distributed optimizer's weight gradient that
# cannot be scattered evenly keeps its all-reduce layouts; 36: every weight gradient a
# distributed optimizer's layout all-reduces over dp priced as the flat buffer's
# reduce-scatter (a sliced step's gather is its loop-back); 37: and one it sums over tp
# too (a sequence-parallel norm's) as that scatter plus an all-reduce over tp; 38:
# Megatron's stage inputs split on their batch over dp (`_megatron_inputs`); 39: the
# per-microbatch gradient scatters of sharded-gradient baselines (`LayerOption.grad_scatter_s`);
# 40: not the tied copies' gradient inputs, and no TE overlap of the weight gradients' scatters;
# 41: the tied embedding gradient in the parameter's layout; 42: the precision recipe in the
# key (how it accumulates and reduces gradients: `graphs.PrecisionRecipe`); 43: GEMMs priced
# by their shard's shape where the device has a measured grid (`costmodels._gemm.SHAPE_TABLES`);
# 44: the grid's times hold the launch; BF16_Optimizer's pass in the W pass too; 45: each
# option's collective bytes by kind (`LayerOption.collective_bytes`), which plans record;
# 46: and each op's strategy name (`LayerOption.strategy_names`).
# The restriction
# tables are code, not part of a key: a change to them bumps this.
CACHE_VERSION = "stage-costs/46"


def cache_dir() -> Path:
    return Path(os.environ.get("ALPASIM_CACHE_DIR") or Path.home() / ".cache" / "alpasim")


def digest(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class DiskCache:
    """get/put of JSON values by key description; silently off when disabled or unwritable.

    Values also stay in memory for the object's life, so one process (a Megatron grid,
    a sweep) never solves a layer twice even with the disk off (`--no-cache`)."""

    def __init__(self, enabled: bool = True, root: Path | None = None, namespace: str = "stages") -> None:
        self.enabled = enabled
        self.root = (root or cache_dir()) / namespace
        self.hits = 0
        self.misses = 0
        self.invalid = 0
        self._memory: dict[str, Any] = {}

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str, read: Callable[[Any], Any] | None = None) -> Any | None:
        """The value stored under `key`, passed through `read` (the caller's validating
        parser), or None. A file that is not JSON, or that `read` refuses (ValueError,
        TypeError, KeyError, IndexError: wrong fields, negative sizes), is a miss, and is
        counted in `invalid`: a damaged or foreign entry is solved again, never used."""
        if key in self._memory:
            self.hits += 1
            value = self._memory[key]
            return value if read is None else read(value)
        if not self.enabled:
            return None
        path = self._path(key)
        try:
            value = json.loads(path.read_text())
            if read is not None:
                value = read(value)
        except OSError:
            self.misses += 1
            return None
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError, TypeError, KeyError, IndexError):
            self.misses += 1
            self.invalid += 1
            return None
        self.hits += 1
        return value

    def put(self, key: str, value: Any) -> None:
        self._memory[key] = value
        if not self.enabled:
            return
        path = self._path(key)
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Write then rename, so a crash or a concurrent reader never sees half a file.
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(value, f)
            os.replace(tmp, path)
        except OSError:
            self.enabled = False  # a read-only home must not break planning
            _remove(tmp)
        except BaseException:     # an interrupt mid-write: no half file, no stray temporary
            _remove(tmp)
            raise


def _remove(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
