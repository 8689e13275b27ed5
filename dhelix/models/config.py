"""Model shapes as plain dataclasses, read from `configs/models/*.yaml`."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Optional

import yaml

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "configs")
CONFIG_DIR = os.path.join(CONFIGS, "models")


class ConfigError(ValueError):
    """Bad configuration; the message names the file or flag, the field and the fix."""


@dataclass
class ModelConfig:
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int = 512
    num_query_groups: Optional[int] = None        # GQA; None = multi-head attention
    max_position_embeddings: int = 4096
    normalization: str = "LayerNorm"               # "LayerNorm" | "RMSNorm"
    activation: str = "gelu"                       # "gelu" | "swiglu"
    position_embedding_type: str = "learned_absolute"   # or "rope"
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = False
    num_experts: Optional[int] = None              # MoE: experts per MoE layer (every layer)
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 1e-2               # megatron's load-balancing loss weight
    moe_shared_expert_intermediate_size: Optional[int] = None   # shared experts' FFN size
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    shapes_only: bool = False                      # published shapes: plan/simulate, not train
    source: str = ""                               # where the shape comes from

    @property
    def kv_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def check(self, where: str) -> None:
        def bad(field, msg):
            raise ConfigError(f"{where}: field '{field}' {msg}")
        if self.hidden_size % self.num_attention_heads:
            bad("hidden_size", f"({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})")
        if self.num_attention_heads % self.kv_groups:
            bad("num_query_groups", f"({self.kv_groups}) must divide num_attention_heads "
                f"({self.num_attention_heads})")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            bad("normalization", f"is {self.normalization!r}; use LayerNorm or RMSNorm")
        if self.activation not in ("gelu", "swiglu"):
            bad("activation", f"is {self.activation!r}; use gelu or swiglu")
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            bad("position_embedding_type", f"is {self.position_embedding_type!r}; "
                "use learned_absolute or rope")
        for f in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                  "vocab_size"):
            if getattr(self, f) <= 0:
                bad(f, "must be positive")
        if self.num_experts is not None:
            if self.num_experts < 1:
                bad("num_experts", "must be positive")
            if not 1 <= self.moe_router_topk <= self.num_experts:
                bad("moe_router_topk", f"({self.moe_router_topk}) must be between 1 and "
                    f"num_experts ({self.num_experts})")


def find_named_yaml(name_or_path: str, folder: str, flag: str, what: str,
                    error=None) -> str:
    """An existing file is taken as given; `name` means configs/<folder>/<name>.yaml.
    Otherwise `error` (default ConfigError) names the flag and the known names."""
    if os.path.isfile(name_or_path):
        return name_or_path
    d = os.path.join(CONFIGS, folder)
    candidate = os.path.join(d, name_or_path + ".yaml")
    if os.path.isfile(candidate):
        return candidate
    known = sorted(f[:-5] for f in os.listdir(d) if f.endswith(".yaml")) \
        if os.path.isdir(d) else []
    raise (error or ConfigError)(
        f"{flag}: {what} file '{name_or_path}' not found; give a path to a YAML file or one "
        f"of: {', '.join(known) or '-'}")


def resolve_config_path(name_or_path: str) -> str:
    """`tiny` -> configs/models/tiny.yaml; a path is taken as given."""
    return find_named_yaml(name_or_path, "models", "--config", "model config")


def load_model_config(name_or_path: str) -> ModelConfig:
    path = resolve_config_path(name_or_path)
    with open(path) as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({e})")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of model fields")
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown config key(s) {', '.join(unknown)}; "
                          f"known keys: {', '.join(sorted(known))}")
    raw.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    missing = [f for f in ("num_layers", "hidden_size", "num_attention_heads",
                           "ffn_hidden_size") if f not in raw]
    if missing:
        raise ConfigError(f"{path}: missing field(s) {', '.join(missing)}")
    cfg = ModelConfig(**raw)
    cfg.check(path)
    return cfg
