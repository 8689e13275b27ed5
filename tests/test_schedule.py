"""`--dhelix`: the node schedule trains exactly like megatron's own schedule.

Every comparison is of two whole training runs from the same seed and data: the losses,
a checksum of every parameter's gradient at every step (megatron DDP's main_grad, after
the data-parallel reduction) and of the final weights, on every rank, fp32. The math is
the same as megatron's, so every number must be equal bit for bit (`compare.same_runs`
with tolerance 0: `==` on every loss and checksum, a NaN fails).
"""
import argparse
import functools
import json

import pytest

from dhelix.testing import run_ranks
from compare import same_runs
from train_fns import train_result

STEPS = 20


@functools.lru_cache(maxsize=None)
def _baseline(world, frozen):
    return run_ranks(train_result, world, timeout=600, checksums=True, **dict(frozen))


def _runs(world, dhelix, **kw):
    base = _baseline(world, tuple(sorted(kw.items())))
    dh = run_ranks(train_result, world, timeout=600, checksums=True, dhelix=dhelix, **kw)
    return base, dh


def _random_plan(tmp_path, config, seed, mbs):
    from train_fns import write_random_plan
    plan = str(tmp_path / f"random{seed}.json")
    run_ranks(write_random_plan, 2, plan, config, seed, mbs, timeout=200)
    return plan


@pytest.mark.parametrize("nmb", [1, 3, 4])
def test_tp2_sp_matches_baseline(nmb):
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=STEPS, micro_batch_size=2, global_batch_size=2 * nmb, eval_iters=2)
    base, dh = _runs(2, {"enabled": True}, **kw)
    assert dh[0]["config"]["schedule"] == "dhelix"
    assert base[0]["config"]["schedule"] == "megatron"
    assert dh[0]["config"]["num_microbatches"] == nmb
    assert same_runs(dh, base) == 0.0
    assert dh[0]["eval_loss"] == base[0]["eval_loss"]


@pytest.mark.parametrize("nmb,plan_seed", [(1, None), (3, 1), (4, 2)])
def test_tp2_dp2_matches_baseline(tmp_path, nmb, plan_seed):
    """4 ranks; the built-in paired plan, or a random legal plan from a file."""
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=STEPS, micro_batch_size=1, global_batch_size=2 * nmb)
    opts = {"enabled": True}
    if plan_seed is not None:
        opts["plan"] = _random_plan(tmp_path, "tiny", plan_seed, 1)
    base, dh = _runs(4, opts, **kw)
    assert dh[0]["config"]["data_parallel_size"] == 2
    assert same_runs(dh, base) == 0.0


def test_overlap_grad_reduce_untied_llama_is_bit_identical(tmp_path):
    """tiny-llama (untied embeddings, SwiGLU, GQA, RoPE) at TP=2 × DP=2 with DDP's
    overlapped grad reduce: every number equal, bit for bit."""
    kw = dict(config="tiny-llama", tensor_model_parallel_size=2, sequence_parallel=False,
              train_iters=STEPS, micro_batch_size=1, global_batch_size=6,
              overlap_grad_reduce=True)
    base, dh = _runs(4, {"enabled": True}, **kw)
    assert same_runs(dh, base) == 0.0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_plans_train_like_baseline(tmp_path, seed):
    kw = dict(config="tiny-llama", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=STEPS, global_batch_size=6)
    plan = _random_plan(tmp_path, "tiny-llama", seed, 2)
    base, dh = _runs(2, {"enabled": True, "plan": plan}, **kw)
    assert same_runs(dh, base) == 0.0


def test_node_schedule_invariants():
    """The invariant whose breach deadlocked CUDA: a --dhelix step starts no Python
    thread, and every node backward (layers, pre-process) is entered outside any
    autograd backward (current graph task id -1). The strict lanes' workers (streams,
    moving data only) are the one exception, and they are there."""
    r = run_ranks(_invariant_probe_run, 2, timeout=300)
    for res in r:
        assert res["threads_started"] == 0
        assert res["lane_threads"] >= 1
        # 3 iterations × 3 micro-batches × (2 layer nodes + 1 pre-process node)
        assert len(res["task_ids"]) == 3 * 3 * 3
        assert set(res["task_ids"]) == {-1}


def _invariant_probe_run():
    from train_fns import invariant_probe
    return invariant_probe()


def test_node_backward_inside_autograd_is_refused():
    """The check itself can fail: a node backward called from inside autograd (what the
    old thread design did) raises instead of deadlocking."""
    from train_fns import node_backward_inside_autograd
    msg = run_ranks(node_backward_inside_autograd, 1, timeout=200)[0]
    assert "entered from inside an autograd backward" in msg


def test_plan_file_and_trace(tmp_path):
    """A plan file from disk is used, and the trace shows it: with the paired plan every
    layer step pairs α's ops with β's; with the trivial plan none do. A plan for another
    model stops before training."""
    from train_fns import write_plan_for
    good = str(tmp_path / "good.json")
    bad = str(tmp_path / "bad.json")
    run_ranks(write_plan_for, 2, good, "tiny", timeout=200)
    run_ranks(write_plan_for, 2, bad, "small", timeout=200)
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=3, global_batch_size=4)
    trace = str(tmp_path / "paired.json")
    base = run_ranks(train_result, 2, timeout=300, **kw)[0]
    dh = run_ranks(train_result, 2, timeout=300,
                   dhelix={"enabled": True, "plan": good, "trace": trace}, **kw)[0]
    assert base["losses"] == dh["losses"]
    triv = str(tmp_path / "trivial.json")
    run_ranks(train_result, 2, timeout=300,
              dhelix={"enabled": True, "plan": "trivial", "trace": triv}, **kw)
    from dhelix.planner.plan import Plan
    plan = Plan.load(good)
    paired_steps = sum(1 for s in plan.steps if s.fwd and s.bwd)
    assert paired_steps > 0
    # one co-executed layer step per layer (tiny: 2) for F2 ∥ B1
    assert _co_steps(trace) == 2 * paired_steps
    assert _co_steps(triv) == 0
    from dhelix.testing import RankError
    with pytest.raises(RankError, match=r"bad.json: rule 'layer-shape'"):
        run_ranks(train_result, 2, timeout=300, dhelix={"enabled": True, "plan": bad}, **kw)


def _co_steps(path):
    """Executor steps of the trace that hold ops of both strands."""
    ev = [e for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"]
    by_step = {}
    for e in ev:
        by_step.setdefault(e["args"]["step"], set()).add(e["args"]["strand"])
    return sum(1 for s in by_step.values() if s == {"α", "β"})


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
    with pytest.raises(DHelixArgError, match="--dhelix-fold folds the layers over pipeline "
                                             "stages: give --pipeline-model-parallel-size 2"):
        check_dhelix_args(p.parse_args(["--dhelix", "--dhelix-fold"]))
