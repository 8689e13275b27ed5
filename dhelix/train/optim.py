"""The optimizer of `dhelix train`: megatron-core's (`get_megatron_optimizer`), Adam on
fp32 master weights, with megatron's flags: --use-distributed-optimizer (state sharded
over DP), --overlap-param-gather, --clip-grad, --weight-decay, --adam-beta1/2/eps."""
from __future__ import annotations

from dhelix.models.config import ConfigError


def check_optimizer(cfg, layout) -> None:
    """Megatron's own rules for the optimizer flags, before any rank starts."""
    if cfg.overlap_param_gather:
        if not cfg.use_distributed_optimizer:
            raise ConfigError("--overlap-param-gather shards nothing without the distributed "
                              "optimizer: add --use-distributed-optimizer")
        if not cfg.overlap_grad_reduce:
            raise ConfigError("--overlap-param-gather needs --overlap-grad-reduce (megatron's "
                              "rule: the gathers reuse the grad buckets' overlap machinery)")
    for flag, v in (("--lr", cfg.lr), ("--adam-eps", cfg.adam_eps)):
        if v <= 0:
            raise ConfigError(f"{flag} {v}: must be positive")
    for flag, v in (("--adam-beta1", cfg.adam_beta1), ("--adam-beta2", cfg.adam_beta2)):
        if not 0 <= v < 1:
            raise ConfigError(f"{flag} {v}: must be in [0, 1)")
    if cfg.weight_decay < 0 or cfg.clip_grad < 0:
        raise ConfigError("--weight-decay and --clip-grad must be >= 0")
