"""Megatron's activation recomputation flags (--recompute-granularity/-method/-num-layers),
checked before any rank starts (docs/recompute.md).

megatron's rules: `full` recomputes whole layers and needs --recompute-method (uniform:
every --recompute-num-layers layers of a pipeline stage as one checkpoint; block: the
first --recompute-num-layers layers of the stage) and --recompute-num-layers; `selective`
recomputes the attention core and takes neither. Under megatron's schedule its
TransformerBlock does the recomputation; under `--dhelix` the layer nodes do.
"""
from __future__ import annotations

from dhelix.models.config import ConfigError


def check_recompute(cfg, m, layout) -> None:
    g, how, n = cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers
    if g is None:
        if how is not None or n is not None:
            raise ConfigError("--recompute-method/--recompute-num-layers without "
                              "--recompute-granularity: add --recompute-granularity full")
        return
    if g not in ("full", "selective"):
        raise ConfigError(f"--recompute-granularity {g}: use full or selective")
    if g == "selective":
        if how is not None or n is not None:
            raise ConfigError("--recompute-granularity selective recomputes the attention core "
                              "of every layer and takes no --recompute-method or "
                              "--recompute-num-layers: drop them (or use "
                              "--recompute-granularity full)")
    else:
        if how not in ("uniform", "block"):
            raise ConfigError(f"--recompute-granularity full needs --recompute-method uniform "
                              f"or block (got {how})")
        if n is None or n < 1:
            raise ConfigError(f"--recompute-granularity full needs --recompute-num-layers N "
                              f"≥ 1 (got {n})")
        per_chunk = m.num_layers // max(layout.pp * layout.vpp, 1)
        if how == "uniform" and per_chunk % n:
            raise ConfigError(f"--recompute-method uniform --recompute-num-layers {n}: the "
                              f"{per_chunk} layers of a model chunk are recomputed in groups "
                              f"of {n}, which must divide {per_chunk}; pick a divisor")
        if how == "block" and n > per_chunk:
            raise ConfigError(f"--recompute-method block --recompute-num-layers {n}: a model "
                              f"chunk has {per_chunk} layers; give at most {per_chunk}")
    moe = bool(m.num_experts or cfg.num_experts)
    bad = [what for what, yes in ((f"--context-parallel-size {layout.cp}", layout.cp > 1),
                                  ("a MoE model", moe)) if yes]
    dh = cfg.dhelix or {}
    if dh.get("enabled") or dh.get("peer"):
        bad += [what for what, yes in (("--dhelix-fold", bool(dh.get("fold"))),
                                       ("--dhelix-halves", bool(dh.get("halves"))),
                                       ("--dhelix-peer", bool(dh.get("peer")))) if yes]
    if bad:
        raise ConfigError(f"--recompute-granularity {g} with {', '.join(bad)}: not built (DHelix "
                          f"recomputes dense layers of its PP=1 schedule, and megatron's "
                          f"schedule is tested with dense layers without context parallel); "
                          f"drop the recompute flags or {' / '.join(bad)}")
