"""Megatron's activation recomputation flags (--recompute-granularity/-method/-num-layers)."""
from __future__ import annotations

from dhelix.models.config import ConfigError


def check_recompute(cfg, m, layout) -> None:
    if cfg.recompute_granularity or cfg.recompute_method or cfg.recompute_num_layers:
        raise ConfigError("--recompute-granularity/--recompute-method/--recompute-num-layers:"
                          " not built yet in dhelix train")
