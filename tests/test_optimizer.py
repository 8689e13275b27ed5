"""megatron-core's optimizer in `dhelix train`: the distributed optimizer with overlapped
grad reduce and parameter gather, DHelix against megatron bit for bit, and a parameter
gather delayed on purpose (DHelix's ops read weights past megatron's module hooks:
`dhelix/megatron/param_gather.py` is what keeps them waiting)."""
import pytest

from compare import same_numbers, same_runs
from dhelix.models.config import ConfigError
from dhelix.testing import RankError, run_ranks
from dhelix.train.config import TrainConfig, preflight
from optim_fns import layers_guarded, train_delayed, train_many
from train_fns import train_result

# tiny, TP=2+SP × DP=2 on 4 ranks, 4 micro-batches per step
TP2_DP2 = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
               micro_batch_size=2, global_batch_size=16, train_iters=3, checksums=True,
               use_distributed_optimizer=True, overlap_grad_reduce=True,
               overlap_param_gather=True, clip_grad=1.0, weight_decay=0.01)


def _by_run(results):
    """run_ranks(train_many) gives each rank's list of runs: each run's list of ranks."""
    return [list(r) for r in zip(*results)]


def test_distributed_optimizer_dhelix_matches_megatron():
    """--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather, TP=2+SP ×
    DP=2 (one launch of 4 ranks, four runs):
    - --dhelix equals megatron's schedule bit for bit (losses, every step's gradient shard
      checksums, final weights);
    - every overlapped parameter gather delayed until someone waits for it (the other
      ranks' parts NaN until then): the --dhelix run is bit-identical to the undelayed one;
    - the layout trains like the plain optimizer (losses ≤1e-5: a reduce-scatter then an
      all-gather adds in another order than an all-reduce).
    With DHelix's layer wait switched off the delayed run reads NaN weights and fails —
    megatron's own hooks do not cover DHelix's ops."""
    dh = {"enabled": True}
    plain = {**TP2_DP2, "use_distributed_optimizer": False, "overlap_param_gather": False}
    base, ref, late, flat = _by_run(run_ranks(train_many, 4, [
        (False, TP2_DP2), (False, dict(TP2_DP2, dhelix=dh)),
        (True, dict(TP2_DP2, dhelix=dh)), (False, plain)], timeout=900))
    assert ref[0]["config"]["schedule"] == "dhelix"
    assert same_runs(ref, base) == 0.0
    assert all(r["delayed_gathers"] >= 3 for r in late)
    assert same_runs(late, ref) == 0.0
    assert same_numbers(flat[0]["losses"], base[0]["losses"], 1e-5,
                        "losses, plain vs distributed optimizer") <= 1e-5
    with pytest.raises(RankError, match="nan|NaN|non-finite"):
        run_ranks(train_delayed, 4, timeout=300, guard=False, dhelix=dh, **TP2_DP2)


def test_guard_covers_every_layer_once():
    """The guard is put on each DHelix layer of a chunk that overlaps its gathers, once."""
    kw = {k: v for k, v in TP2_DP2.items() if k != "checksums"}
    for first, again in run_ranks(layers_guarded, 2, timeout=300, **{
            **kw, "tensor_model_parallel_size": 1, "sequence_parallel": False,
            "global_batch_size": 8}):
        assert first == 2 and again == 0          # tiny has 2 layers


@pytest.mark.parametrize("flags, message", [
    (dict(overlap_param_gather=True, overlap_grad_reduce=True), "--use-distributed-optimizer"),
    (dict(overlap_param_gather=True, use_distributed_optimizer=True), "--overlap-grad-reduce"),
    (dict(adam_beta2=1.0), "--adam-beta2"),
    (dict(adam_eps=0.0), "--adam-eps"),
])
def test_optimizer_flags_checked_before_ranks_start(flags, message):
    with pytest.raises(ConfigError, match=message):
        preflight(TrainConfig(config="tiny", **flags), 2)


def test_bf16_dhelix_matches_megatron():
    """--bf16 (every parameter bf16, as megatron's Float16Module casts them; fp32 main
    params and grads in megatron's distributed optimizer), TP=2+SP: --dhelix equals
    megatron bit for bit, and the loss falls."""
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True, bf16=True,
              micro_batch_size=2, global_batch_size=8, train_iters=3, checksums=True,
              use_distributed_optimizer=True)
    base, dh = _by_run(run_ranks(train_many, 2, [(False, kw), (False, dict(
        kw, dhelix={"enabled": True}))], timeout=600))
    assert same_runs(dh, base) == 0.0
    assert base[0]["losses"][-1] < base[0]["losses"][0]


def test_megatron_parameter_groups_and_schedule():
    """Megatron-LM's standard groups: weight decay on matrices, none on biases and norms;
    the learning rate follows megatron's scheduler (linear warmup, then cosine to
    --min-lr over --train-iters), one value per step in the result."""
    from optim_fns import param_group_decay
    groups = run_ranks(param_group_decay, 1, timeout=300, config="tiny", weight_decay=0.1)[0]
    assert any(n.endswith(".bias") for n in groups)
    for name, (shape, wd) in groups.items():
        want = 0.0 if len(shape) == 1 or name.endswith(".bias") else 0.1
        assert wd == want, (name, shape, wd)
    r = run_ranks(train_result, 1, timeout=300, config="tiny", train_iters=6, lr=1e-3,
                  min_lr=1e-4, lr_warmup_iters=2, lr_decay_style="cosine")[0]
    import math
    want = [0.0, 5e-4] + [1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * (i - 2) / 4))
                          for i in range(2, 6)]
    assert same_numbers(r["learning_rates"], want, 1e-12, "learning rates") <= 1e-12


def test_fold_with_distributed_optimizer_and_delayed_gather(tmp_path):
    """The fold (PP=2 × DP=2, 4 ranks) with --use-distributed-optimizer
    --overlap-grad-reduce --overlap-param-gather and every parameter gather delayed,
    against megatron's 1F1B with the same optimizer, undelayed, from one checkpoint:
    losses ≤1e-5 and final weights ≤1e-3 merged by global name (the fold's tolerances,
    tests/test_folding.py; the gradient shards differ: each layout buckets other
    parameters)."""
    from compare import merge_stages
    ckpt = str(tmp_path / "init")
    common = dict(config="tiny-llama4", micro_batch_size=1)
    run_ranks(train_result, 1, timeout=300, train_iters=0, save=ckpt, **common)
    kw = dict(common, train_iters=3, load=ckpt, finetune=True, global_batch_size=8,
              pipeline_model_parallel_size=2, checksums=True, use_distributed_optimizer=True,
              overlap_grad_reduce=True, overlap_param_gather=True)
    base, fold = _by_run(run_ranks(train_many, 4, [(False, kw), (True, dict(
        kw, dhelix={"enabled": True, "fold": True}))], timeout=900))
    assert fold[0]["config"]["schedule"] == "dhelix-fold"
    got, want = merge_stages(fold), merge_stages(base)
    assert same_runs(got, want, 1e-5, keys=("losses",)) <= 1e-5
    assert same_runs(got, want, 1e-3, keys=("weight_checksums",)) <= 1e-3


@pytest.mark.parametrize("scale, iters", [(2.0 ** 32, 2), (2.0 ** 12, 6)],
                         ids=["overflowing", "training"])
def test_fp16_loss_scaling_dhelix_matches_megatron(scale, iters):
    """--fp16 with megatron's dynamic loss scale: from 2^32 every step overflows and is
    skipped (megatron's grad scaler lowers the scale, the weights stay); from 2^12 the loss
    falls. --dhelix scales its loss the same way (the schedule's grad_scale_func) and
    equals megatron bit for bit, skipped steps included."""
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True, fp16=True,
              micro_batch_size=2, global_batch_size=8, train_iters=iters, checksums=True,
              initial_loss_scale=scale)
    base, dh = _by_run(run_ranks(train_many, 2, [(False, kw), (False, dict(
        kw, dhelix={"enabled": True}))], timeout=600))
    overflow = scale == 2.0 ** 32     # its gradients are inf/NaN by design: not compared
    assert same_runs(dh, base, keys=("losses", "weight_checksums") if overflow else
                     ("losses", "grad_checksums", "weight_checksums")) == 0.0
    assert dh[0]["skipped_iters"] == base[0]["skipped_iters"]
    if overflow:
        assert base[0]["skipped_iters"] == list(range(1, iters + 1))
    else:
        assert base[0]["losses"][-1] < base[0]["losses"][0]


@pytest.mark.parametrize("flags, message", [
    (dict(fp16=True, bf16=True), "give one"),
    (dict(loss_scale=128.0), "add --fp16"),
])
def test_fp16_flags_checked(flags, message):
    with pytest.raises(ConfigError, match=message):
        preflight(TrainConfig(config="tiny", **flags), 2)
