"""Functions the multi-rank tests run on every rank (importable by spawned processes)."""
from dhelix.train.trainer import TrainConfig, train


def train_losses(**kw):
    kw.setdefault("quiet", True)
    return train(TrainConfig(**kw))["losses"]


def train_result(**kw):
    kw.setdefault("quiet", True)
    return train(TrainConfig(**kw))
