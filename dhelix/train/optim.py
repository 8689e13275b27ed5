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


def build_optimizer(cfg, chunks, bf16: bool):
    """megatron-core's optimizer over the DDP-wrapped chunks (a constant learning rate:
    `dhelix train` has no scheduler). Weight decay as megatron applies it: not to biases
    and norms (1-D parameters)."""
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    config = OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad, bf16=bf16, fp16=False,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        overlap_param_gather=cfg.overlap_param_gather)
    from dhelix.compat.cpu import cuda_type_names
    with cuda_type_names():
        optimizer = get_megatron_optimizer(config, list(chunks))
    step = optimizer.step

    def step_checked():     # megatron's grad-norm code checks the type too, on CPU
        with cuda_type_names():
            return step()
    optimizer.step = step_checked
    return optimizer
