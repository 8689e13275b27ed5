"""MoE (issue 12, first part): megatron-core's MoE block trained by `dhelix train` with
expert parallelism over gloo, CPU compat (f), (g), refusals. The DHelix MoE layer (the
all-to-alls as planned ops) is not built yet: `--dhelix` with experts is refused."""
import pytest

from dhelix.models.config import ConfigError, load_model_config
from dhelix.testing import run_ranks
from dhelix.train.trainer import TrainConfig, check_layout, model_of
from train_fns import train_losses

MOE = dict(config="tiny-moe", data="synthetic", micro_batch_size=2, global_batch_size=16)


def test_expert_parallel_trains_and_tp_sp_does_not_change_it():
    """EP=2 on 2 ranks: the loss falls. TP=2+SP × EP=2 on 4 ranks (experts not TP-split,
    --expert-tensor-parallel-size 1) trains to the same losses: the same experts on the
    same EP ranks, the attention split over TP."""
    ep = run_ranks(train_losses, 2, timeout=300, train_iters=10,
                   expert_model_parallel_size=2, **MOE)[0]
    assert ep[-1] < ep[0] - 0.05, ep
    tp = run_ranks(train_losses, 4, timeout=400, train_iters=10,
                   expert_model_parallel_size=2, tensor_model_parallel_size=2,
                   sequence_parallel=True, expert_tensor_parallel_size=1, **MOE)[0]
    for i, (a, b) in enumerate(zip(ep, tp)):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {i + 1}: EP {a} vs TP×EP {b}"


def test_unbalanced_routing_runs():
    """Router weights zero: all tokens tie and go to the same two experts, both on one EP
    rank; the all-to-alls carry empty splits; the output is finite, that rank's experts
    get gradients, the other rank's none."""
    import moe_fns
    r = run_ranks(moe_fns.unbalanced_moe_layer, 2, timeout=200)
    assert all(x["finite"] and x["x_grad"] > 0 for x in r)
    busy = [all(v > 0 for v in x["grads"].values()) for x in r]
    idle = [all(v == 0 for v in x["grads"].values()) for x in r]
    assert sorted(busy) == [False, True] and sorted(idle) == [False, True], r


def test_moe_flags_and_refusals():
    m = model_of(TrainConfig(config="tiny-moe", num_experts=8, moe_router_topk=1))
    assert (m.num_experts, m.moe_router_topk) == (8, 1)
    assert check_layout(TrainConfig(expert_model_parallel_size=2, **MOE), m, 2).ep == 2
    cases = [
        (dict(config="tiny", expert_model_parallel_size=2), "tiny has no experts"),
        (dict(MOE, expert_model_parallel_size=4), "must divide the data-parallel size 2"),
        (dict(MOE, num_experts=3, expert_model_parallel_size=2), "--num-experts 3 is not "
                                                                 "divisible"),
        (dict(MOE, moe_router_topk=5), "'moe_router_topk' \\(5\\) must be between 1 and "
                                       "num_experts \\(4\\)"),
        (dict(MOE, expert_model_parallel_size=2, save="ckpt"), "--save/--load with "
                                                               "--expert-model-parallel"),
        (dict(MOE, dhelix={"enabled": True}), "the DHelix MoE layer.*is not built yet"),
    ]
    for kw, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            cfg = TrainConfig(**kw)
            check_layout(cfg, model_of(cfg), 2)
    assert load_model_config("phi-3.5-moe").num_experts == 16
