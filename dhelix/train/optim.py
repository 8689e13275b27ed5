"""The optimizer of `dhelix train`: megatron-core's (`get_megatron_optimizer`), Adam on
fp32 master weights, with megatron's flags: --use-distributed-optimizer (state sharded
over DP), --overlap-param-gather, --clip-grad, --weight-decay, --adam-beta1/2/eps, and
megatron-core's learning-rate scheduler."""
from __future__ import annotations

from dhelix.models.config import ConfigError

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


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
    if cfg.fp16 and cfg.bf16:
        raise ConfigError("--fp16 and --bf16: give one")
    if (cfg.loss_scale is not None or cfg.initial_loss_scale != 2.0 ** 32) and not cfg.fp16:
        raise ConfigError("--loss-scale/--initial-loss-scale scale an fp16 loss: add --fp16")
    if (cfg.loss_scale is not None and cfg.loss_scale <= 0) or cfg.initial_loss_scale <= 0:
        raise ConfigError("--loss-scale and --initial-loss-scale must be positive")
    if cfg.weight_decay < 0 or cfg.clip_grad < 0:
        raise ConfigError("--weight-decay and --clip-grad must be >= 0")
    if not 0 <= cfg.min_lr <= cfg.lr:
        raise ConfigError(f"--min-lr {cfg.min_lr}: must be in [0, --lr {cfg.lr}]")
    if cfg.lr_warmup_iters < 0 or (cfg.lr_decay_iters is not None and cfg.lr_decay_iters < 1):
        raise ConfigError("--lr-warmup-iters must be >= 0 and --lr-decay-iters >= 1")
    if cfg.lr_decay_style not in LR_DECAY_STYLES:
        raise ConfigError(f"--lr-decay-style {cfg.lr_decay_style}: one of "
                          f"{', '.join(LR_DECAY_STYLES)}")


def _step_device(group: dict, p):
    """Where torch's Adam keeps a parameter's `step` tensor."""
    return p.device if group.get("capturable") or group.get("fused") else "cpu"


class TrainOptimizer:
    """megatron-core's optimizer and its learning-rate scheduler, stepped as Megatron-LM's
    train_step steps them: the scheduler advances only after a step that was applied."""

    def __init__(self, optimizer, scheduler, samples_per_step: int = 1):
        self.optimizer, self.scheduler = optimizer, scheduler
        self.samples_per_step = samples_per_step    # the scheduler counts samples

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self):
        """(applied, the gradient norm megatron computed before clipping). Not applied:
        with --fp16 an overflow (the loss scale is lowered), otherwise a non-finite
        gradient."""
        from dhelix.compat.cpu import cuda_type_names
        with cuda_type_names():       # megatron's grad-norm code checks the type too, on CPU
            ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=self.samples_per_step)
        return ok, grad_norm

    def state_bytes(self) -> int:
        """Bytes of the optimizer's own tensors on this rank: Adam's moments (and main
        parameter copies where it keeps them apart from the model's), not the scalar step."""
        seen, total = set(), 0
        for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for st in o.optimizer.state.values():
                for t in st.values():
                    if hasattr(t, "untyped_storage") and t.dim() and \
                            t.untyped_storage().data_ptr() not in seen:
                        seen.add(t.untyped_storage().data_ptr())
                        total += t.untyped_storage().nbytes()
        return total

    def has_state(self) -> bool:
        """Whether Adam holds any state yet (not before the first applied step)."""
        return any(o.optimizer.state for o in getattr(self.optimizer, "chained_optimizers",
                                                      [self.optimizer]))

    def _torch_adams(self):
        """The distributed optimizers of this one that run torch's Adam (megatron-core
        without Apex/TE), whose checkpoint code mishandles Adam's `step`: see below."""
        from megatron.core.optimizer import distrib_optimizer as dopt
        if dopt.HAVE_APEX_OR_TE:
            return []
        return [o for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])
                if isinstance(o, dopt.DistributedOptimizer)]

    def before_load(self) -> None:
        """megatron-core 0.16 (torch Adam): the distributed optimizer's state_dict, which
        its checkpoint load calls first, asserts one `step` over Adam's per-parameter
        state, which a fresh optimizer has not made yet: give every main parameter the
        state of step 0, for the load to overwrite."""
        import torch
        for o in self._torch_adams():
            for group in o.optimizer.param_groups:
                for p in group["params"]:
                    st = o.optimizer.state[p]
                    if not st:     # `step` where torch's Adam keeps it: on the host
                        # unless capturable or fused (then on the parameter's device)
                        st.update(step=torch.tensor(0.0, device=_step_device(group, p)),
                                  exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))

    def after_load(self) -> None:
        """...and the load restores the saved step into the param groups, then copies each
        parameter's local (step-0) state over Adam's: set it from the group, else Adam's
        bias correction restarts."""
        import torch
        for o in self._torch_adams():
            for group in o.optimizer.param_groups:
                if group.get("step") is None:
                    continue
                for p in group["params"]:
                    if "step" in o.optimizer.state[p]:
                        o.optimizer.state[p]["step"] = torch.tensor(
                            float(group["step"]), device=_step_device(group, p))

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @property
    def loss_scale(self) -> float:
        return float(self.optimizer.get_loss_scale())


def build_optimizer(cfg, chunks, samples_per_step: int = 1) -> TrainOptimizer:
    """megatron-core's Adam over the DDP-wrapped chunks, with Megatron-LM's standard
    parameter groups (no weight decay on biases and 1-D parameters) and its scheduler
    (--lr-warmup-iters, --lr-decay-style, --lr-decay-iters, --min-lr), counting samples
    as Megatron-LM's does (`samples_per_step` per iteration: the global batch), so that a
    checkpoint's scheduler state means the same in both. With
    --fp16 megatron's grad scaler, and the chunks' schedules scale the loss by it."""
    import torch
    from megatron.core.optimizer import (OptimizerConfig, get_megatron_optimizer,
                                         get_standard_config_overrides)
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from dhelix.compat.cpu import cuda_type_names
    config = OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad, bf16=cfg.bf16, fp16=cfg.fp16, loss_scale=cfg.loss_scale,
        initial_loss_scale=cfg.initial_loss_scale,
        params_dtype=torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else
        torch.float32,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        overlap_param_gather=cfg.overlap_param_gather)
    with cuda_type_names():
        optimizer = get_megatron_optimizer(config, list(chunks),
                                           get_standard_config_overrides(config))
    if cfg.fp16:         # megatron's schedules multiply the loss by it before backward
        for c in chunks:
            c.config.grad_scale_func = optimizer.scale_loss
    decay = cfg.lr_decay_iters or max(cfg.train_iters, 1)
    n = samples_per_step
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if cfg.lr_warmup_iters else cfg.lr, max_lr=cfg.lr,
        min_lr=cfg.min_lr, lr_warmup_steps=cfg.lr_warmup_iters * n,
        lr_decay_steps=max(decay, cfg.lr_warmup_iters + 1) * n,
        lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay, wd_incr_steps=decay * n, wd_incr_style="constant")
    return TrainOptimizer(optimizer, scheduler, n)
