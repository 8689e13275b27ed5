"""`--dhelix`: the node schedule trains exactly like megatron's own schedule.

Every training comparison is of two whole training runs from the same seed and data: the
losses, a checksum ([sum, sum of squares], float64) of every parameter's gradient at
every step (megatron DDP's main_grad, after the data-parallel reduction) and of the final
weights, on every rank, fp32. The math is the same as megatron's, so every number must be
equal bit for bit (`compare.same_runs` with tolerance 0: `==` on every loss and checksum,
a NaN fails).

What runs against megatron's schedule, every comparison at tolerance 0:
  - 10 steps, the built-in paired plan: tiny TP=2+SP on 2 ranks (1, 3, 4, 8 micro-batches;
    also the eval loss after training, every rank); tiny TP=2+SP × DP=2 on 4 ranks (1
    micro-batch); tiny-llama TP=2 × DP=2 with overlapped grad reduce (3 micro-batches);
  - 10 steps, 5 random legal plans from files: tiny TP=2+SP × DP=2 (seeds 1, 2 at 3, 4
    micro-batches) and tiny-llama TP=2+SP on 2 ranks (seeds 1, 2, 3, 3 micro-batches);
  - 4 steps, many random legal plans, each a whole run, all in ONE `run_ranks` spawn
    (`train_fns.train_random_plans` calls `train()` once per plan in one process group):
    16 distinct plans for tiny-llama TP=2+SP on 2 ranks and 8 distinct plans for tiny
    TP=2+SP × DP=2 on 4 ranks (3 micro-batches each); the in-process baseline is run
    twice (bit-identical) and equals the fresh-process 10-step baseline's first 4 steps;
  - evaluation apart from training (tiny and tiny-llama, TP=2+SP, 2 ranks): both
    schedules load the SAME checkpoint and evaluate 2 steps of 3 micro-batches; every
    micro-batch's eval loss on every rank is equal, and under `--dhelix` eval is checked
    to take DHelix's forward-only route (megatron's forward_backward_no_pipelining running
    the DHelix layers plainly, no layer node).
"""
import argparse
import functools
import json

import pytest

from dhelix.testing import run_ranks
from compare import Mismatch, same_checksums, same_numbers, same_runs
from train_fns import eval_from_checkpoint, train_random_plans, train_result

STEPS = 10
MANY_STEPS = 4          # steps per plan in the many-plan runs
MANY_PLANS_TP2_SP = 16  # random legal plans, tiny-llama TP=2+SP on 2 ranks
MANY_PLANS_TP2_DP2 = 8  # random legal plans, tiny TP=2+SP × DP=2 on 4 ranks


@functools.lru_cache(maxsize=None)
def _baseline(world, frozen):
    return run_ranks(train_result, world, timeout=600, checksums=True, **dict(frozen))


def _runs(world, dhelix, **kw):
    base = _baseline(world, tuple(sorted(kw.items())))
    dh = run_ranks(train_result, world, timeout=600, checksums=True, dhelix=dhelix, **kw)
    return base, dh


def _random_plan(tmp_path, config, seed, mbs, rotation=0, mlp_chunks=1, keep_gathered=False):
    from train_fns import write_random_plan
    plan = str(tmp_path / f"random{seed}.json")
    run_ranks(write_random_plan, 2, plan, config, seed, mbs, rotation, mlp_chunks,
              keep_gathered, timeout=200)
    return plan


@pytest.mark.parametrize("nmb", [1, 3, 4, 8])
def test_tp2_sp_matches_baseline(nmb):
    """tiny, TP=2+SP, 2 ranks, the built-in paired plan, 10 steps: `same_runs` at
    tolerance 0. Then 2 eval steps after training, every rank's eval loss `==`: both
    schedules evaluate with the same code (megatron's forward_backward_no_pipelining;
    a DHelix layer outside a DHelix step is megatron's TransformerLayer.forward), so with
    equal final weights this adds only that `--dhelix` left the data stream where
    megatron's schedule did. The eval path itself is checked from the same weights in
    `test_eval_from_same_weights`."""
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=STEPS, micro_batch_size=2, global_batch_size=2 * nmb, eval_iters=2)
    base, dh = _runs(2, {"enabled": True}, **kw)
    assert dh[0]["config"]["schedule"] == "dhelix"
    assert base[0]["config"]["schedule"] == "megatron"
    assert dh[0]["config"]["num_microbatches"] == nmb
    assert same_runs(dh, base) == 0.0
    assert same_numbers([r["eval_loss"] for r in dh], [r["eval_loss"] for r in base],
                        0.0, "eval loss after training, by rank") == 0.0


@pytest.mark.parametrize("nmb,rotation", [(1, 0), (3, 3), (4, 0)])
def test_mlp_chunks_train_like_baseline(tmp_path, nmb, rotation):
    """`--dhelix-mlp-chunks 2` (each layer's MLP forward in two token chunks, the chunks'
    all-gathers and reduce-scatters in the chains), tiny TP=2+SP, a random plan of the
    chunked layer (rotated by 3 at 3 micro-batches), 10 steps: megatron's run bit for bit
    (`same_runs` at tolerance 0: losses, every step's gradient checksums, final weights)."""
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=STEPS, micro_batch_size=2, global_batch_size=2 * nmb)
    plan = _random_plan(tmp_path, "tiny", 7 + nmb, 2, rotation, mlp_chunks=2)
    base, dh = _runs(2, {"enabled": True, "mlp_chunks": 2, "plan": plan}, **kw)
    assert same_runs(dh, base) == 0.0


@pytest.mark.parametrize("config,nmb,rotation,keep", [
    ("tiny", 1, 0, True), ("tiny-llama", 3, 3, True), ("tiny", 4, 0, True),
    ("tiny-llama", 8, 5, True), ("tiny-llama", 4, 2, "mlp"), ("tiny", 3, 0, "attn")])
def test_kept_gathers_train_like_baseline(tmp_path, config, nmb, rotation, keep):
    """`--dhelix-keep-gathered [PARTS]` (the forward's gathered inputs kept for the
    wgrads, no backward re-gathers, of both parts or the one named), TP=2+SP, a random
    plan of that layer (some rotated), 10 steps: megatron's run bit for bit (`same_runs`
    at tolerance 0)."""
    kw = dict(config=config, tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=STEPS, micro_batch_size=2, global_batch_size=2 * nmb)
    plan = _random_plan(tmp_path, config, 11 + nmb, 2, rotation, keep_gathered=keep)
    base, dh = _runs(2, {"enabled": True, "keep_gathered": keep, "plan": plan}, **kw)
    assert same_runs(dh, base) == 0.0


def test_kept_gathers_with_the_halves_and_chunks():
    """`--dhelix-keep-gathered` with `--dhelix-halves` and `--dhelix-mlp-chunks 2` (the
    attention's input kept, the chunked MLP's gathered again), 3 micro-batches, 10 steps:
    at the halves' tolerances."""
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=10, micro_batch_size=2, global_batch_size=6)
    base, dh = _runs(2, {"enabled": True, "halves": True, "mlp_chunks": 2,
                         "keep_gathered": True}, **kw)
    assert same_runs(dh, base, 1e-5, keys=("losses",)) <= 1e-5
    assert same_runs(dh, base, 1e-3, keys=("weight_checksums",)) <= 1e-3


def test_mlp_chunks_with_the_halves():
    """`--dhelix-mlp-chunks 2` with `--dhelix-halves` (the chunks of each batch half),
    3 micro-batches, 10 steps: at the halves' tolerances, as without chunks."""
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=10, micro_batch_size=2, global_batch_size=6)
    base, dh = _runs(2, {"enabled": True, "halves": True, "mlp_chunks": 2}, **kw)
    assert same_runs(dh, base, 1e-5, keys=("losses",)) <= 1e-5
    assert same_runs(dh, base, 1e-3, keys=("weight_checksums",)) <= 1e-3


@pytest.mark.parametrize("nmb", [1, 3, 4])
def test_halves_train_like_baseline(nmb):
    """`--dhelix-halves` (B(N) as two batch halves round-robin, F(N) op by op on both
    halves; with 1 micro-batch F(1) is F(N)), tiny TP=2+SP, 10 steps, every rank, against
    megatron: at the
    intra-batch peer's tolerances (losses ≤1e-5, gradient checksums ≤1e-4, final weights
    ≤1e-3), not bit for bit — a weight's gradient adds the halves' parts, a different
    rounding, which also shows that the halves ran (without them the runs are equal)."""
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=10, micro_batch_size=2, global_batch_size=2 * nmb)
    base, dh = _runs(2, {"enabled": True, "halves": True}, **kw)
    assert same_runs(dh, base, 1e-5, keys=("losses",)) <= 1e-5
    assert 0.0 < same_runs(dh, base, 1e-4, keys=("grad_checksums",)) <= 1e-4
    assert same_runs(dh, base, 1e-3, keys=("weight_checksums",)) <= 1e-3


def test_halves_with_a_rotated_plan(tmp_path):
    """`--dhelix-halves` with a random plan whose β chain is rotated (`Plan.rotation`):
    F(3)'s halves, op by op, beside B(2)'s rotated walk across two nodes, then B(3)'s
    halves alone. 3 micro-batches, 10 steps, at the halves' tolerances."""
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=10, micro_batch_size=2, global_batch_size=6)
    plan = _random_plan(tmp_path, "tiny", 7, 2, rotation=5)
    base, dh = _runs(2, {"enabled": True, "halves": True, "plan": plan}, **kw)
    assert same_runs(dh, base, 1e-5, keys=("losses",)) <= 1e-5
    assert same_runs(dh, base, 1e-3, keys=("weight_checksums",)) <= 1e-3


def test_halves_need_an_even_micro_batch():
    from dhelix.testing import RankError
    with pytest.raises(RankError, match="--dhelix-halves .* --micro-batch-size must be even"):
        run_ranks(train_result, 2, timeout=200, config="tiny", tensor_model_parallel_size=2,
                  train_iters=1, micro_batch_size=1, dhelix={"enabled": True, "halves": True})


@pytest.mark.parametrize("nmb,plan_seed", [(1, None), (3, 1), (4, 2)])
def test_tp2_dp2_matches_baseline(tmp_path, nmb, plan_seed):
    """tiny, TP=2+SP × DP=2 (4 ranks), 10 steps: the built-in paired plan, or a random
    legal plan from a file (seeds 1, 2); `same_runs` at tolerance 0."""
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
    """tiny-llama, TP=2+SP, 2 ranks, 3 micro-batches of 2, 10 steps, a random legal plan
    from a file (seeds 1, 2, 3): `same_runs` at tolerance 0."""
    kw = dict(config="tiny-llama", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=STEPS, global_batch_size=6)
    plan = _random_plan(tmp_path, "tiny-llama", seed, 2)
    base, dh = _runs(2, {"enabled": True, "plan": plan}, **kw)
    assert same_runs(dh, base) == 0.0


def _prefix(results, steps):
    """The first `steps` steps of each rank's losses and gradient checksums."""
    return [{"losses": r["losses"][:steps], "grad_checksums": r["grad_checksums"][:steps]}
            for r in results]


def _check_many_plans(r, n, fresh):
    """The results of `train_random_plans` (one per rank) against its own baseline: `n`
    distinct plans, each the plan its layers ran, each run `same_runs` at tolerance 0
    (every failing plan is named). The in-process baseline is repeatable (run before and
    after the plans: bit-identical) and equals the fresh-process 10-step baseline `fresh`
    over its first MANY_STEPS steps (losses and gradient checksums, tolerance 0): calling
    `train()` again in one process changes nothing."""
    base = [x["baseline"] for x in r]
    assert {x["config"]["schedule"] for x in base} == {"megatron"}
    assert same_runs([x["baseline_again"] for x in r], base) == 0.0
    assert same_runs(_prefix(base, MANY_STEPS), _prefix(fresh, MANY_STEPS),
                     keys=("losses", "grad_checksums")) == 0.0
    plans = r[0]["plans"]
    assert len(plans) == n
    assert len({p["digest"] for p in plans}) == n, "random plans repeat"
    assert sum(p["paired"] for p in plans) > 0
    assert sum(1 for p in plans if p["rotation"]) >= n // 2, "odd seeds: rotated plans"
    assert sum(1 for p in plans if p["reordered"]) >= n // 4, "β's node in other orders"
    assert all((p["rotated_steps"] > 0) == bool(p["rotation"]) for p in plans), \
        "a rotated plan's co-steps run across two β nodes, an unrotated plan's never"
    failed = []
    for i, p in enumerate(plans):
        dh = [x["plans"][i]["result"] for x in r]
        for rank, x in enumerate(r):
            assert x["plans"][i]["digest"] == p["digest"], f"rank {rank}: another plan"
            assert x["plans"][i]["used"] == [p["digest"]], f"rank {rank}: plan not run"
        assert {d["config"]["schedule"] for d in dh} == {"dhelix"}
        try:
            assert same_runs(dh, base) == 0.0
        except Mismatch as e:
            failed.append(f"plan seed {p['seed']} ({p['digest']}, {p['paired']} paired of "
                          f"{p['steps']} steps): {e}")
    assert not failed, f"{len(failed)} of {n} random plans differ from megatron's " \
                       f"schedule:\n" + "\n".join(failed)


def test_many_random_plans_tp2_sp(tmp_path):
    """tiny-llama, TP=2+SP, 2 ranks, 3 micro-batches of 2: 16 distinct random legal plans
    (seeds 100-115), each a 4-step run in one spawn, `same_runs` against megatron's
    schedule at tolerance 0."""
    kw = dict(config="tiny-llama", tensor_model_parallel_size=2, sequence_parallel=True,
              global_batch_size=6)
    seeds = range(100, 100 + MANY_PLANS_TP2_SP)
    r = run_ranks(train_random_plans, 2, str(tmp_path), list(seeds), timeout=600,
                  train_iters=MANY_STEPS, **kw)
    _check_many_plans(r, len(seeds), _baseline(2, tuple(sorted(
        dict(kw, train_iters=STEPS).items()))))


def test_many_random_plans_tp2_dp2(tmp_path):
    """tiny, TP=2+SP × DP=2, 4 ranks, 3 micro-batches of 1: 8 distinct random legal
    plans (seeds 200-207), each a 4-step run in one spawn, `same_runs` against megatron's
    schedule at tolerance 0."""
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
              micro_batch_size=1, global_batch_size=6)
    seeds = range(200, 200 + MANY_PLANS_TP2_DP2)
    r = run_ranks(train_random_plans, 4, str(tmp_path), list(seeds), timeout=600,
                  train_iters=MANY_STEPS, **kw)
    assert r[0]["baseline"]["config"]["data_parallel_size"] == 2
    _check_many_plans(r, len(seeds), _baseline(4, tuple(sorted(
        dict(kw, train_iters=STEPS).items()))))


@pytest.mark.parametrize("config", ["tiny", "tiny-llama"])
def test_eval_from_same_weights(tmp_path, config):
    """Evaluation under `--dhelix`, apart from training: megatron's schedule trains 5
    steps and saves a checkpoint; megatron's schedule and `--dhelix` each load it (TP=2+SP,
    2 ranks, 3 micro-batches of 2) and evaluate 2 steps from the same data. Every eval
    micro-batch's loss, on every rank, is equal bit for bit (`same_numbers`, tolerance 0),
    and so are the loaded weights' checksums (`same_checksums`, tolerance 0). The route:
    under `--dhelix` each forward_only call goes to megatron's
    forward_backward_no_pipelining (`unwrap_and_evaluate`) with the DHelix layers run
    plainly (2 × 3 × 2 layer forwards, no layer node); megatron's run has no DHelix layer."""
    kw = dict(config=config, tensor_model_parallel_size=2, sequence_parallel=True,
              micro_batch_size=2, global_batch_size=6, eval_iters=2, checksums=True)
    r = run_ranks(eval_from_checkpoint, 2, str(tmp_path), 5, timeout=600, **kw)
    for rank, x in enumerate(r):
        mg, dh = x["megatron"], x["dhelix"]
        assert (mg["schedule"], dh["schedule"]) == ("megatron", "dhelix")
        assert same_checksums(dh["weights"], x["saved"], 0.0,
                              f"rank {rank} dhelix's loaded weights") == 0.0
        assert same_checksums(mg["weights"], x["saved"], 0.0,
                              f"rank {rank} megatron's loaded weights") == 0.0
        assert len(mg["losses"]) == 2 * 3
        assert same_numbers(dh["losses"], mg["losses"], 0.0,
                            f"rank {rank} eval micro-batch loss") == 0.0
        assert mg["forward_only_calls"] == dh["forward_only_calls"] == 2
        assert mg["no_pipelining_calls"] == dh["no_pipelining_calls"] == 2
        assert dh["dhelix_layer_forwards"] == 2 * 3 * 2 and dh["nodes"] == 0
        assert mg["dhelix_layer_forwards"] == 0


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
    assert _co_steps(str(tmp_path / "paired.rank0.json")) == 2 * paired_steps
    assert _co_steps(str(tmp_path / "trivial.rank0.json")) == 0
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
