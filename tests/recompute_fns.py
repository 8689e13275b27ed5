"""Rank functions of tests/test_recompute.py (importable by spawned processes)."""
from dhelix.train.trainer import TrainConfig, train


def train_many(runs, **common):
    """Several whole training runs in ONE process group (one spawn): `train()` once per
    (name, flags) of `runs`, each from the same seed and data (`train` re-initialises
    megatron's parallel state and seeds). A flag `dropout` (a float) trains the config
    with that hidden and attention dropout (the model configs have none), so that the
    recomputed dropout masks are checked too. Returns {name: result}."""
    import dataclasses

    import dhelix.train.trainer as trainer
    from dhelix.train.config import model_of
    out = {}
    for name, flags in runs:
        flags = dict(common, **flags)
        p = flags.pop("dropout", 0.0)
        flags.setdefault("quiet", True)
        flags.setdefault("checksums", True)
        orig = trainer.model_of
        if p:
            trainer.model_of = lambda cfg: dataclasses.replace(
                model_of(cfg), hidden_dropout=p, attention_dropout=p)
        try:
            out[name] = train(TrainConfig(**flags))
        finally:
            trainer.model_of = orig
    return out
