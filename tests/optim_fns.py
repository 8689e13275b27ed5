"""Rank functions of tests/test_optimizer.py: megatron-core's optimizer in `dhelix train`,
the distributed optimizer, and a parameter all-gather delayed on purpose."""
import math

import torch

from dhelix.train.trainer import TrainConfig, train


class DelayedGather:
    """megatron's overlapped parameter all-gather, made as late as it can be: dispatching
    a bucket group's gather fills every other rank's part of its parameters with NaN and
    gathers nothing; the real (synchronous) all-gather runs only when someone waits for
    the handle — megatron's forward pre-hooks, DHelix's layer guard. An op that reads a
    weight whose gather nobody waited for reads NaN."""

    def __init__(self):
        from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
        self.cls = _ParamAndGradBucketGroup
        self.real = _ParamAndGradBucketGroup.start_param_sync
        self.delayed = 0

    def __enter__(self):
        real, me = self.real, self

        def start_param_sync(group, force_sync: bool = False):
            if force_sync or not group.ddp_config.overlap_param_gather:
                return real(group, force_sync=force_sync)
            assert group.param_gather_handle is None
            for bucket in group.buckets:
                data = bucket.param_data
                n = group.intra_distributed_optimizer_instance_size
                r = group.intra_distributed_optimizer_instance_rank
                shard = data.numel() // n
                mine = data[r * shard:(r + 1) * shard].clone()
                data.fill_(math.nan)
                data[r * shard:(r + 1) * shard] = mine
            group.param_gather_handle = _Late(group, real)
            group.param_gather_dispatched = True
            me.delayed += 1
        self.cls.start_param_sync = start_param_sync
        return self

    def __exit__(self, *exc):
        self.cls.start_param_sync = self.real


class _Late:
    def __init__(self, group, real):
        self.group, self.real = group, real

    def wait(self):
        self.group.param_gather_handle = None
        self.real(self.group, force_sync=True)     # the all-gather, now


def train_delayed(guard: bool = True, **kw):
    """`train` with every overlapped parameter gather delayed; without `guard`, DHelix's
    layer wait (megatron/param_gather.py) is switched off, to show what it prevents."""
    kw.setdefault("quiet", True)
    if not guard:
        from dhelix.megatron import param_gather
        param_gather.guard_param_gather = lambda *a, **k: 0
    with DelayedGather() as d:
        result = train(TrainConfig(**kw))
    assert d.delayed > 0, "no parameter gather was dispatched: the test tests nothing"
    result["delayed_gathers"] = d.delayed
    return result


def layers_guarded(**kw):
    """How many DHelix layers the guard waits for on this rank."""
    from dhelix.megatron.param_gather import guard_param_gather
    from dhelix.train.build import build
    from dhelix.train.config import check_layout, model_of
    from dhelix.train.trainer import setup_megatron
    from dhelix.strand.layer import DHelixLayer
    import torch.distributed as dist
    cfg = TrainConfig(**kw)
    m = model_of(cfg)
    layout = check_layout(cfg, m, dist.get_world_size())
    tconfig = setup_megatron(cfg, m, layout)
    built = build(cfg, m, tconfig, layout, torch.device("cpu"), DHelixLayer)
    return guard_param_gather(built.chunks), guard_param_gather(built.chunks)


def param_group_decay(**kw):
    """(name, weight decay of its param group) for every parameter, after the scheduler
    set them; megatron's standard groups leave biases and 1-D parameters undecayed."""
    from dhelix.strand.layer import DHelixLayer
    from dhelix.train.build import build
    from dhelix.train.config import check_layout, model_of
    from dhelix.train.optim import build_optimizer
    from dhelix.train.trainer import setup_megatron
    import torch.distributed as dist
    cfg = TrainConfig(**kw)
    m = model_of(cfg)
    layout = check_layout(cfg, m, dist.get_world_size())
    tconfig = setup_megatron(cfg, m, layout)
    built = build(cfg, m, tconfig, layout, torch.device("cpu"), DHelixLayer)
    opt = build_optimizer(cfg, built.chunks)
    decay = {id(p): g["weight_decay"] for g in opt.optimizer.param_groups for p in g["params"]}
    return {n: (tuple(p.shape), decay[id(p)]) for n, p in built.chunks[0].named_parameters()}


def train_many(runs):
    """Several `train` runs one after another in one launch of the ranks (the process
    start and megatron's import are most of a small run): `runs` is a list of
    (delayed, TrainConfig keywords); returns their results, in order."""
    out = []
    for delayed, kw in runs:
        kw = dict(kw, quiet=True)
        out.append(train_delayed(**kw) if delayed else train(TrainConfig(**kw)))
    return out


def train_counting_ready(**kw):
    """`train`, counting for each parameter how often megatron DDP is told its gradient
    is ready (`register_grad_ready` outside no_sync, which readies its bucket): once per
    step in megatron's own schedule. Returns (train's result, the counts seen)."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    real, counts = _ParamAndGradBucketGroup.register_grad_ready, {}

    def register_grad_ready(group, param, *a, **k):
        if group.is_last_microbatch:
            counts[id(param)] = counts.get(id(param), 0) + 1
        return real(group, param, *a, **k)
    _ParamAndGradBucketGroup.register_grad_ready = register_grad_ready
    try:
        result = train(TrainConfig(**dict(kw, quiet=True)))
    finally:
        _ParamAndGradBucketGroup.register_grad_ready = real
    return result, sorted(set(counts.values()))
