"""`--dhelix`: the co-executing 1F1B schedule trains exactly like megatron's."""
import argparse
import json

import pytest

from dhelix.testing import run_ranks
from train_fns import train_result

STEPS = 20


def _both(world, **kw):
    base = run_ranks(train_result, world, timeout=600, **kw)[0]
    dh = run_ranks(train_result, world, timeout=600, dhelix={"enabled": True}, **kw)[0]
    return base, dh


def _same(a, b, tol=1e-5):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= tol * abs(x), f"step {i}: baseline {x} vs dhelix {y}"


@pytest.mark.parametrize("nmb", [1, 3, 4])
def test_tp2_sp_matches_baseline(nmb):
    base, dh = _both(2, config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
                     train_iters=STEPS, micro_batch_size=2, global_batch_size=2 * nmb,
                     eval_iters=2)
    assert dh["config"]["schedule"] == "dhelix" and base["config"]["schedule"] == "megatron"
    assert dh["config"]["num_microbatches"] == nmb
    _same(base["losses"], dh["losses"])
    assert abs(base["eval_loss"] - dh["eval_loss"]) <= 1e-5 * abs(base["eval_loss"])


@pytest.mark.parametrize("nmb", [1, 3, 4])
def test_tp2_dp2_matches_baseline(nmb):
    base, dh = _both(4, config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
                     train_iters=STEPS, micro_batch_size=1, global_batch_size=2 * nmb)
    assert dh["config"]["data_parallel_size"] == 2
    _same(base["losses"], dh["losses"])


def test_overlap_grad_reduce_and_llama_shape():
    base, dh = _both(4, config="tiny-llama", tensor_model_parallel_size=2,
                     sequence_parallel=False, train_iters=8, micro_batch_size=1,
                     global_batch_size=6, overlap_grad_reduce=True)
    _same(base["losses"], dh["losses"])


def test_plan_file_and_trace(tmp_path):
    """A plan file from disk is used; a plan for another model stops before training."""
    from train_fns import write_plan_for
    good = str(tmp_path / "good.json")
    bad = str(tmp_path / "bad.json")
    run_ranks(write_plan_for, 2, good, "tiny", timeout=200)
    run_ranks(write_plan_for, 2, bad, "small", timeout=200)
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=3, global_batch_size=4)
    base = run_ranks(train_result, 2, timeout=300, **kw)[0]
    dh = run_ranks(train_result, 2, timeout=300, dhelix={"enabled": True, "plan": good}, **kw)[0]
    _same(base["losses"], dh["losses"])
    from dhelix.testing import RankError
    with pytest.raises(RankError, match=r"bad.json: rule 'layer-shape'"):
        run_ranks(train_result, 2, timeout=300, dhelix={"enabled": True, "plan": bad}, **kw)


def test_megatron_arg_provider_parses_every_flag(tmp_path):
    from dhelix.megatron.args import DHelixArgError, add_dhelix_args, check_dhelix_args
    from dhelix.planner.plan import PlanError
    p = argparse.ArgumentParser()
    add_dhelix_args(p)
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps({"format": "dhelix.plan", "version": 1, "signature": "x",
                                "forward": [], "backward": [], "steps": []}))
    table = tmp_path / "t.json"
    table.write_text("{}")
    a = p.parse_args(["--dhelix", "--dhelix-plan", str(plan), "--dhelix-overlap-table",
                      str(table), "--dhelix-cluster", "configs/clusters/a800.yaml",
                      "--dhelix-memory-budget", "1e9", "--dhelix-trace", "t.json",
                      "--dhelix-force"])
    assert a.dhelix and a.dhelix_plan == str(plan) and a.dhelix_memory_budget == 1e9
    assert a.dhelix_force and a.dhelix_trace == "t.json" and not a.dhelix_fold
    check_dhelix_args(a)
    with pytest.raises(DHelixArgError, match="--dhelix-plan nope.json: plan file not found"):
        check_dhelix_args(p.parse_args(["--dhelix", "--dhelix-plan", "nope.json"]))
    plan.write_text("{trunc")
    with pytest.raises(PlanError, match="not valid JSON"):
        check_dhelix_args(p.parse_args(["--dhelix", "--dhelix-plan", str(plan)]))
    with pytest.raises(DHelixArgError, match="--dhelix-memory-budget -1.0: must be a positive"):
        check_dhelix_args(p.parse_args(["--dhelix", "--dhelix-memory-budget", "-1"]))
    with pytest.raises(DHelixArgError, match="needs --dhelix"):
        check_dhelix_args(p.parse_args(["--dhelix-plan", str(plan)]))
    with pytest.raises(DHelixArgError, match="--dhelix-fold .* needs "
                                             "--pipeline-model-parallel-size > 1"):
        check_dhelix_args(p.parse_args(["--dhelix", "--dhelix-fold"]))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_plans_train_like_baseline(tmp_path, seed):
    from train_fns import write_random_plan
    plan = str(tmp_path / f"random{seed}.json")
    run_ranks(write_random_plan, 2, plan, "tiny-llama", seed, timeout=200)
    kw = dict(config="tiny-llama", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=5, global_batch_size=6)
    base = run_ranks(train_result, 2, timeout=300, **kw)[0]
    dh = run_ranks(train_result, 2, timeout=300, dhelix={"enabled": True, "plan": plan}, **kw)[0]
    _same(base["losses"], dh["losses"])
