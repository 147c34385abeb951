"""The model zoo: the paper's evaluated models by name, custom sizes by spec string.

Configurations follow the paper's Table 4 and Alpa's benchmark suites (GPT-3: seq
1024, vocab 51200, global batch 1024; MoE: seq 1024, vocab 32000, expert group 2048,
top-2 gating; Wide-ResNet: 224x224 images, 1024 classes, global batch 1536), and
today's models: Llama 3 (8B, 70B, 405B; `_llama`), Mixtral 8x7B and a
DeepSeek-V2-Lite-like MoE (`_topk_moe`).
A model is named as

* a zoo name: ``gpt3-1.3b``, ``moe-2.4b``, ``wresnet-2b``, ``llama3-70b`` (case-insensitive);
* a family spec: ``gpt3:hidden=4096,layers=32,heads=32,seq=1024,vocab=51200,batch=1024``
  (keys not given take the family's defaults);
* a zoo name with overrides: ``gpt3-1.3b:batch=16,layers=2``;
* a JSON file: a model spec ``{"family": "gpt3", "hidden": ...}`` or a graph saved by
  `save_graph` (schema ``alpasim.graph/1``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

from ._jsonfile import read_json_file
from ._llama import LlamaConfig, llama_lm
from ._resnet import WResNetConfig, wide_resnet
from ._topk_moe import TopKMoEConfig, topk_moe_lm
from ._transformer import GPTConfig, MoEConfig, transformer_lm
from ._types import OpGraph

ModelConfig = Union[GPTConfig, MoEConfig, WResNetConfig, LlamaConfig, TopKMoEConfig]
FAMILIES: dict[str, type] = {"gpt3": GPTConfig, "moe": MoEConfig, "wresnet": WResNetConfig, "llama": LlamaConfig,
                             "topk-moe": TopKMoEConfig}
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt3": {"hidden": 1024, "layers": 24, "heads": 16},
    "moe": {"hidden": 768, "layers": 8, "heads": 16, "experts": 8},
    "wresnet": {"channels": 160, "width": 2},
    "llama": {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "ffn": 14336},
    "topk-moe": {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "experts": 8, "top_k": 2,
                 "expert_ffn": 14336},
}

# name -> (family, config fields). GPT-3 and MoE from Alpa's benchmark suites
# (seq, hidden, layers, heads, vocab[, experts]); Wide-ResNet as (depth, channels, width).
ZOO: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt3-350m": ("gpt3", {"hidden": 1024, "layers": 24, "heads": 16}),
    "gpt3-760m": ("gpt3", {"hidden": 1536, "layers": 24, "heads": 16}),
    "gpt3-1.3b": ("gpt3", {"hidden": 2048, "layers": 24, "heads": 32}),
    "gpt3-2.6b": ("gpt3", {"hidden": 2560, "layers": 32, "heads": 32}),
    "gpt3-6.7b": ("gpt3", {"hidden": 4096, "layers": 32, "heads": 32}),
    "gpt3-15b": ("gpt3", {"hidden": 5120, "layers": 48, "heads": 40}),
    "gpt3-39b": ("gpt3", {"hidden": 8192, "layers": 48, "heads": 64}),
    "moe-380m": ("moe", {"hidden": 768, "layers": 8, "heads": 16, "experts": 8}),
    "moe-690m": ("moe", {"hidden": 768, "layers": 8, "heads": 16, "experts": 16}),
    "moe-1.3b": ("moe", {"hidden": 768, "layers": 16, "heads": 16, "experts": 16}),
    "moe-2.4b": ("moe", {"hidden": 1024, "layers": 16, "heads": 16, "experts": 16}),
    "moe-7.1b": ("moe", {"hidden": 1280, "layers": 16, "heads": 16, "experts": 32}),
    "moe-10b": ("moe", {"hidden": 1536, "layers": 16, "heads": 16, "experts": 32}),
    "moe-27b": ("moe", {"hidden": 2048, "layers": 16, "heads": 16, "experts": 48}),
    "moe-70b": ("moe", {"hidden": 2048, "layers": 32, "heads": 16, "experts": 64}),
    "wresnet-250m": ("wresnet", {"depth": 50, "channels": 160, "width": 2}),
    "wresnet-500m": ("wresnet", {"depth": 50, "channels": 224, "width": 2}),
    "wresnet-1b": ("wresnet", {"depth": 50, "channels": 320, "width": 2}),
    "wresnet-2b": ("wresnet", {"depth": 50, "channels": 448, "width": 2}),
    "wresnet-4b": ("wresnet", {"depth": 50, "channels": 640, "width": 2}),
    "wresnet-6.8b": ("wresnet", {"depth": 50, "channels": 320, "width": 16}),
    "wresnet-13b": ("wresnet", {"depth": 101, "channels": 320, "width": 16}),
    # Llama 3 (Dubey et al. 2024, Table 3): hidden, layers, heads, KV heads, SwiGLU size;
    # vocabulary 128,256, RoPE base 500,000, 8,192-token sequences.
    "llama3-8b": ("llama", {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "ffn": 14336}),
    "llama3-70b": ("llama", {"hidden": 8192, "layers": 80, "heads": 64, "kv_heads": 8, "ffn": 28672}),
    "llama3-405b": ("llama", {"hidden": 16384, "layers": 126, "heads": 128, "kv_heads": 8, "ffn": 53248}),
    # Fine-grained MoE (`_topk_moe`): Mixtral 8x7B (Jiang et al. 2024) and DeepSeek-V2-Lite
    # (DeepSeek-AI 2024, its latent attention as plain multi-head attention).
    "mixtral-8x7b": ("topk-moe", {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "experts": 8,
                                  "top_k": 2, "expert_ffn": 14336}),
    "deepseek-v2-lite": ("topk-moe", {"hidden": 2048, "layers": 27, "heads": 16, "kv_heads": 16, "experts": 64,
                                      "top_k": 6, "expert_ffn": 1408, "shared_experts": 2, "dense_layers": 1,
                                      "dense_ffn": 10944, "vocab": 102400, "normalize_topk": 0,
                                      "rope_theta": 10000}),
}
ALIASES = {"gpt3-2.7b": "gpt3-2.6b", "gpt-1.3b": "gpt3-1.3b"}
# Weak-scaling pairing of the paper (model -> GPUs it is evaluated on).
PAPER_GPUS: dict[str, int] = {
    **dict(zip([n for n in ZOO if n.startswith("gpt3")], [1, 2, 4, 8, 16, 32, 64])),
    **dict(zip(["moe-380m", "moe-690m", "moe-1.3b", "moe-2.4b", "moe-10b", "moe-27b", "moe-70b"],
               [1, 2, 4, 8, 16, 32, 64])),
    **dict(zip([n for n in ZOO if n.startswith("wresnet")], [1, 2, 4, 8, 16, 32, 64])),
}


class UnknownModelError(KeyError):
    """A model name that is neither in the zoo nor a family spec nor a file."""

    def __str__(self) -> str:
        return str(self.args[0])


class ModelSpecError(ValueError):
    """A malformed spec string or JSON model description."""


def model_names() -> list[str]:
    return list(ZOO)


# Config fields that hold names, not sizes (`dtype` has aliases of its own), and those
# that hold fractions.
STRING_FIELDS = ("dtype", "attention")
FLOAT_FIELDS = ("dropout",)


def _parse_value(family: str, key: str, raw: str, field_type: Any) -> Any:
    if key == "dtype":
        aliases = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
        return aliases.get(raw, raw)
    if key in STRING_FIELDS:
        return raw
    if key in FLOAT_FIELDS:
        try:
            return float(raw)
        except ValueError:
            raise ModelSpecError(f"{family} spec: key {key!r} needs a number, got {raw!r}") from None
    try:
        return int(raw)
    except ValueError:
        raise ModelSpecError(f"{family} spec: key {key!r} needs an integer, got {raw!r}") from None


# The deepest model a spec may ask for: the graph builds every layer's ops, so a typo
# of 10**9 layers would fill memory before anything failed. The deepest published
# dense models have ~126 layers (Llama-3 405B); 4,096 leaves room for studies.
MAX_LAYERS = 4096


def _make_config(family: str, fields: Mapping[str, Any], where: str) -> ModelConfig:
    cls = FAMILIES[family]
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key in fields:
        if key not in known:
            raise ModelSpecError(f"{where}: unknown key {key!r} for family {family!r}; "
                                 f"valid keys: {', '.join(known)}")
    merged = {**FAMILY_DEFAULTS[family], **fields}
    for key in ("layers", "dense_layers"):
        value = merged.get(key)
        if isinstance(value, int) and value > MAX_LAYERS:
            raise ModelSpecError(f"{where}: {key}={value} is more than alpasim builds (at most {MAX_LAYERS} "
                                 "layers: the graph holds every layer's ops)")
    try:
        return cls(**merged)
    except (TypeError, ValueError) as e:
        raise ModelSpecError(f"{where}: {e}") from None


def _parse_pairs(text: str, family: str, where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cls_fields = {f.name: f.type for f in dataclasses.fields(FAMILIES[family])}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise ModelSpecError(f"{where}: expected key=value, got {item!r}")
        key, raw = (s.strip() for s in item.split("=", 1))
        if key not in cls_fields:
            raise ModelSpecError(f"{where}: unknown key {key!r} for family {family!r}; "
                                 f"valid keys: {', '.join(cls_fields)}")
        if not raw:
            raise ModelSpecError(f"{where}: key {key!r} has no value")
        if key in out:
            raise ModelSpecError(f"{where}: key {key!r} is given twice ({key}={out[key]} and {key}={raw})")
        out[key] = _parse_value(family, key, raw, cls_fields[key])
    return out


def resolve_model(spec: str | ModelConfig) -> tuple[str, ModelConfig]:
    """(display name, config) for a zoo name, family spec, or JSON model-spec file."""
    if isinstance(spec, (GPTConfig, MoEConfig, WResNetConfig, LlamaConfig, TopKMoEConfig)):
        return spec.family, spec
    text = spec.strip()
    head, sep, tail = text.partition(":")
    key = ALIASES.get(head.lower(), head.lower())
    if key in ZOO:
        family, fields = ZOO[key]
        if sep:
            fields = {**fields, **_parse_pairs(tail, family, f"model spec {text!r}")}
        return (key if not sep else text), _make_config(family, fields, f"model {text!r}")
    if key in FAMILIES:
        return text, _make_config(key, _parse_pairs(tail, key, f"model spec {text!r}"), f"model spec {text!r}")
    if text.endswith(".json") or Path(text).is_file():
        data = _read_json(text)
        if data.get("schema", "").startswith("alpasim.graph/"):
            raise ModelSpecError(f"{text}: is a saved graph, not a model spec; give it as a command's --model "
                                 f"(graphs.model_source reads it)")
        return Path(text).stem, model_from_json(data, text)
    raise UnknownModelError(f"unknown model {spec!r}; valid names: {', '.join(ZOO)} "
                            f"(or a spec such as 'gpt3:hidden=4096,layers=32,heads=32', or a .json file)")


def _read_json(path: str) -> dict:
    data = read_json_file(path, ModelSpecError)
    if not isinstance(data, dict):
        raise ModelSpecError(f"{path}: top level must be a JSON object, got {type(data).__name__}")
    return data


def model_from_json(data: Mapping[str, Any], where: str = "model JSON") -> ModelConfig:
    """A config from ``{"family": ..., <fields>}`` (optionally ``"schema": "alpasim.model/1"``)."""
    schema = data.get("schema", "alpasim.model/1")
    if schema != "alpasim.model/1":
        raise ModelSpecError(f"{where}: field 'schema' is {schema!r}, expected 'alpasim.model/1'")
    family = data.get("family")
    if family not in FAMILIES:
        raise ModelSpecError(f"{where}: field 'family' is {family!r}, expected one of {', '.join(FAMILIES)}")
    fields = {k: v for k, v in data.items() if k not in ("schema", "family", "name")}
    for k, v in fields.items():
        if k in STRING_FIELDS:
            fields[k] = _parse_value(family, k, str(v), str)
        elif k in FLOAT_FIELDS:
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ModelSpecError(f"{where}: field {k!r} must be a number, got {v!r}")
        elif not isinstance(v, int) or isinstance(v, bool):
            raise ModelSpecError(f"{where}: field {k!r} must be an integer, got {v!r}")
    return _make_config(family, fields, where)


def model_to_json(cfg: ModelConfig) -> dict[str, Any]:
    return {"schema": "alpasim.model/1", "family": cfg.family, **dataclasses.asdict(cfg)}


def forward_graph(spec: str | ModelConfig, *, name: str | None = None) -> OpGraph:
    """The forward graph (ending in the scalar loss) of a model from the zoo or a spec."""
    resolved, cfg = resolve_model(spec)
    name = name or resolved
    if isinstance(cfg, WResNetConfig):
        return wide_resnet(cfg, name)
    if isinstance(cfg, LlamaConfig):
        return llama_lm(cfg, name)
    if isinstance(cfg, TopKMoEConfig):
        return topk_moe_lm(cfg, name)
    return transformer_lm(cfg, name)
