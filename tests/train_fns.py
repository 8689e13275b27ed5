"""Functions the multi-rank tests run on every rank (importable by spawned processes)."""
from dhelix.train.trainer import TrainConfig, train


def train_losses(**kw):
    kw.setdefault("quiet", True)
    return train(TrainConfig(**kw))["losses"]


def train_result(**kw):
    kw.setdefault("quiet", True)
    return train(TrainConfig(**kw))


def write_plan_for(path, config):
    """Write the paired plan of `config`'s layer (TP=2, SP, seq 64, mbs 2) to `path`."""
    from dhelix.planner.plan import paired_plan
    import layer_fns
    _, dh, _, _ = layer_fns.setup_layer(config, 2, True, 1, 64, 2)
    import torch.distributed as dist
    if dist.get_rank() == 0:
        paired_plan(dh.program.layer_ops(64, 2)).save(path)
    dist.barrier()
    return path


def write_random_plan(path, config, seed):
    """A random legal plan for `config`'s layer (TP=2, SP, seq 64, mbs 2)."""
    import random
    from dhelix.planner.enumerate import random_legal_plan
    import layer_fns
    _, dh, _, _ = layer_fns.setup_layer(config, 2, True, 1, 64, 2)
    import torch.distributed as dist
    if dist.get_rank() == 0:
        random_legal_plan(dh.program.layer_ops(64, 2), random.Random(seed)).save(path)
    dist.barrier()
    return path
