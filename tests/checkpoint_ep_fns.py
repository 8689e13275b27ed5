"""Rank functions of tests/test_checkpoint_ep.py (checkpoints with expert parallelism)."""
from dhelix.train.trainer import TrainConfig, train


def train_summary(**kw):
    """`train`, keeping what the checkpoint tests compare: losses, the eval loss, the
    final weights' checksums by global name, this rank's coordinates and expert-parallel
    rank, and the global expert names this rank holds."""
    from megatron.core import parallel_state
    kw.setdefault("quiet", True)
    r = train(TrainConfig(**kw))
    names = sorted(n for n in r.get("weight_checksums", {}) if ".local_experts." in n)
    return {k: r.get(k) for k in ("losses", "grad_checksums", "weight_checksums",
                                   "eval_loss", "coords", "config")} | {
        "ep_rank": parallel_state.get_expert_model_parallel_rank(), "expert_names": names}


def load_only(directory, **kw):
    """Build the model of `kw`'s layout and `--load directory` into it, nothing else
    (the error a bad checkpoint raises comes back to the test)."""
    from dhelix.train.checkpoint import CheckpointError
    try:
        train(TrainConfig(load=directory, train_iters=0, save=directory + "-unused",
                          quiet=True, **kw))
    except CheckpointError as e:
        return {"error": str(e)}
    return {"error": None}
