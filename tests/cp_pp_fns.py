"""Rank functions of tests/test_cp_pp.py (context or expert parallel with pipelines)."""
import zlib

from dhelix.train.trainer import TrainConfig, train


def _named_init(chunks):
    """Every parameter from a generator seeded by its global name (the unfolded model's,
    `build.global_names`), its TP rank if TP splits it and, for an expert, its EP rank
    (replicated parameters get one value on every rank that holds them): the same weights
    whatever the pipeline placement, with no checkpoint (one launch fewer). Norm weights
    keep megatron's init (ones)."""
    import torch
    from megatron.core import parallel_state
    from dhelix.train.build import named_parameters_global
    tp = parallel_state.get_tensor_model_parallel_rank()
    ep = parallel_state.get_expert_model_parallel_rank()
    with torch.no_grad():
        for name, p in named_parameters_global(chunks):
            if "norm" in name:
                continue
            key = name + (f"|tp{tp}" if getattr(p, "tensor_model_parallel", False) else "")
            if not getattr(p, "allreduce", True):        # an expert: one per EP rank
                key += f"|ep{ep}"
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.02)


def train_named_init(**kw):
    """`train` with every parameter initialised by its global name (`_named_init`)."""
    import dhelix.train.build as build_mod
    orig = build_mod.build

    def build(*a, **k):
        built = orig(*a, **k)
        _named_init(built.chunks)
        return built
    build_mod.build = build
    try:
        kw.setdefault("quiet", True)
        return train(TrainConfig(**kw))
    finally:
        build_mod.build = orig


def train_named_init_many(runs):
    """`train_named_init` for each keyword dict of `runs`, in one launch of the ranks."""
    return [train_named_init(**kw) for kw in runs]
