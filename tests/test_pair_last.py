"""`--dhelix-pair-last`: the last two backwards paired, B(N−1) ∥ B(N), bit for bit with
megatron's schedule, and the flags that refuse it.

The schedule runs F(1); F(2); [F(k+2) ∥ B(k)]; B(N−1) ∥ B(N). What could go wrong:
B(N−1)'s gradients reaching megatron DDP outside no_sync (readying its buckets as the
last micro-batch's do), a parameter's two parts added in the other order (the sum rounds
differently), the tied embedding's held part lost, the edge of two micro-batches (no
co-step at all). The runs use megatron's distributed optimizer with overlapped grad
reduce and parameter gather."""
import pytest

from compare import same_runs
from dhelix.models.config import ConfigError
from dhelix.testing import run_ranks
from dhelix.train.config import TrainConfig, preflight
from optim_fns import train_counting_ready, train_many

# tiny (tied embeddings), TP=2+SP × DP=2 on 4 ranks, the distributed optimizer overlapped
DIST = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
            micro_batch_size=2, train_iters=4, checksums=True,
            use_distributed_optimizer=True, overlap_grad_reduce=True,
            overlap_param_gather=True)


def _plans(tmp_path, config, seeds):
    from test_schedule import _random_plan
    return [_random_plan(tmp_path, config, seed, 2, rotation) for seed, rotation in seeds]


def _by_run(results):
    return [list(r) for r in zip(*results)]


@pytest.mark.parametrize("nmb", [2, 4])
def test_pair_last_matches_megatron_for_random_plans(tmp_path, nmb):
    """tiny TP=2+SP × DP=2, the distributed optimizer with overlapped reduce and gather,
    `nmb` micro-batches per rank (2: no co-step, the tail alone), one launch of 4 ranks:
    megatron's schedule, then `--dhelix-pair-last` with the built-in paired plan and two
    random legal plans (one rotated by 3): every run bit for bit (`same_runs` at
    tolerance 0: losses, every step's gradient checksums, final weights). The schedule
    is the paired tail's: its peak activation memory holds one micro-batch more than
    DHelix's own schedule's (run last, same launch)."""
    kw = dict(DIST, global_batch_size=2 * 2 * nmb)
    plans = _plans(tmp_path, "tiny", [(20 + nmb, 0), (30 + nmb, 3)])
    runs = [(False, kw)] + [
        (False, dict(kw, dhelix=dict({"enabled": True, "pair_last": True},
                                     **({"plan": p} if p else {}))))
        for p in [None] + plans] + [(False, dict(kw, dhelix={"enabled": True}))]
    base, *paired, plain = _by_run(run_ranks(train_many, 4, runs, timeout=900))
    for dh in paired:
        assert dh[0]["config"]["schedule"] == "dhelix"
        assert same_runs(dh, base) == 0.0
    assert same_runs(plain, base) == 0.0
    # F(1) and F(2) both held before the first backward (DHelix's own: about one)
    assert paired[0][0]["peak_memory_bytes"] > 1.3 * plain[0]["peak_memory_bytes"]


def test_pair_last_readies_each_gradient_once():
    """B(N−1)'s gradients go to megatron DDP inside its no_sync, as in megatron's own
    schedule: each parameter readies its bucket once a step (B(N)'s part), not twice.
    (megatron-core would reduce the right sums either way: it learns each parameter's
    ready count on the first step; held, the count is the one its own schedule makes.)"""
    kw = dict(DIST, global_batch_size=12, checksums=False)
    for dh in ({"enabled": True, "pair_last": True}, None):
        for _, counts in run_ranks(train_counting_ready, 4, timeout=600,
                                   **dict(kw, dhelix=dh) if dh else kw):
            assert counts == [kw["train_iters"]]


def test_pair_last_untied_llama_matches_megatron(tmp_path):
    """tiny-llama (untied embeddings, SwiGLU, GQA, RoPE), TP=2+SP on 2 ranks, 3
    micro-batches, a random plan rotated by 2: bit for bit with megatron's schedule."""
    kw = dict(config="tiny-llama", tensor_model_parallel_size=2, sequence_parallel=True,
              micro_batch_size=2, global_batch_size=6, train_iters=4, checksums=True)
    plan, = _plans(tmp_path, "tiny-llama", [(41, 2)])
    base, dh = _by_run(run_ranks(train_many, 2, [
        (False, kw), (False, dict(kw, dhelix={"enabled": True, "pair_last": True,
                                              "plan": plan}))], timeout=600))
    assert same_runs(dh, base) == 0.0


@pytest.mark.parametrize("extra,match", [
    (dict(dhelix={"enabled": True, "pair_last": True, "halves": True}),
     "pair-last .*--dhelix-halves"),
    (dict(dhelix={"pair_last": True}), "add --dhelix"),
    (dict(dhelix={"enabled": True, "pair_last": True}, recompute_granularity="full",
          recompute_method="uniform", recompute_num_layers=1), "--recompute-granularity"),
    (dict(dhelix={"enabled": True, "pair_last": True, "fold": True},
          pipeline_model_parallel_size=2), "--dhelix-fold"),
])
def test_pair_last_refused_where_not_built(extra, match):
    """`dhelix train --dhelix-pair-last` with what it is not built for stops before any
    rank starts, naming the flag."""
    kw = dict(config="tiny", tensor_model_parallel_size=1, micro_batch_size=2,
              global_batch_size=8)
    kw.update(extra)
    with pytest.raises((ConfigError, ValueError), match=match):
        preflight(TrainConfig(**kw), 4)


def test_pair_last_in_megatron_lm_arguments():
    """pretrain_gpt.py's arguments: `--dhelix-pair-last` needs --dhelix, runs with CP, and
    is refused with experts, recompute and the halves, each by name."""
    import argparse
    from dhelix.megatron.args import DHelixArgError, add_dhelix_args, check_dhelix_args

    def args(*flags, **kw):
        p = argparse.ArgumentParser()
        add_dhelix_args(p)
        ns = p.parse_args(list(flags))
        for k, v in {**dict(micro_batch_size=2, pipeline_model_parallel_size=1,
                            context_parallel_size=1, num_experts=None,
                            recompute_granularity=None), **kw}.items():
            setattr(ns, k, v)
        return ns
    check_dhelix_args(args("--dhelix", "--dhelix-pair-last"))
    check_dhelix_args(args("--dhelix", "--dhelix-pair-last", context_parallel_size=2))
    with pytest.raises(DHelixArgError, match="--dhelix-pair-last needs --dhelix"):
        check_dhelix_args(args("--dhelix-pair-last"))
    for flags, kw, name in ((("--dhelix-halves",), {}, "--dhelix-halves"),
                            ((), dict(num_experts=4), "--num-experts"),
                            ((), dict(recompute_granularity="full"),
                             "--recompute-granularity")):
        with pytest.raises(DHelixArgError, match=name):
            check_dhelix_args(args("--dhelix", "--dhelix-pair-last", *flags, **kw))


def test_the_emulated_prediction_knows_the_paired_tail(tmp_path):
    """The bench's prediction at emulated time (`bench.emulated.predictions`) for the
    published llama-8b row (TP4, DP traffic priced at DP16 on A40): `dhelix-last` is the
    whole-step simulator's paired tail, and the DP gradient buckets reduce behind its
    tail — one layer of two backwards — so less of them is exposed than behind B(N)
    alone (`StageDP.exposed` with the tail's layer time)."""
    from dhelix.bench.emulated import predictions, stage_dp
    from dhelix.bench.published import ROWS, TableOptions, bench_options
    from dhelix.models.config import load_model_config
    from dhelix.planner import dp as planner
    from dhelix.planner.costs import StepExtras
    from dhelix.planner.whole_step import simulate_step
    from dhelix.train.emulate import emulated_layer, parse
    row = next(r for r in ROWS if r.key == "llama-8b")
    b = bench_options(row, TableOptions(), str(tmp_path))
    emu = parse(b.compute, b.emulate)
    pred = predictions(b, b.configs, emu)
    plan, last = pred["dhelix-plan"], pred["dhelix-last"]
    assert last["reduce_s"] < plan["reduce_s"]
    assert last["gather_s"] == pytest.approx(plan["gather_s"])     # F(1) alone in both
    big, ops, table, cluster = emulated_layer(emu, tp=row.tp, sp=True, cp=1, ep=1,
                                              seq_length=b.seq_length, micro_batch_size=1)
    L = load_model_config(b.configs).num_layers
    w = simulate_step(ops, planner.plan(ops, table), table, L, b.num_microbatches,
                      StepExtras(0, 0, 0, 0, 0, 0, L), pair_last=True)
    assert last["layers_s"] == pytest.approx(w.total_s)
    dp_comm = stage_dp(b, big, cluster, [L], [(True, True)])[0]
    assert last["reduce_s"] == pytest.approx(
        dp_comm.exposed(w.layer_forward_s, w.layer_tail_s)[0])


@pytest.mark.parametrize("tp,cp,seeds", [(1, 2, [1, 2]), (2, 2, [3])])
def test_pair_last_with_context_parallel_matches_the_cp_baseline(tmp_path, tp, cp, seeds):
    """Context parallel (DHelix's ring attention), tiny-llama, 3 micro-batches, random
    plans (even seeds rotated, which may cut the ring): `--dhelix-pair-last` bit for bit
    with the CP baseline (megatron's layer running the same ring op after op)."""
    from test_context_parallel import _random_plan as cp_plan
    from train_fns import train_result
    kw = dict(config="tiny-llama", train_iters=4, seq_length=64, micro_batch_size=2,
              data="synthetic", global_batch_size=6, tensor_model_parallel_size=tp,
              sequence_parallel=tp > 1, context_parallel_size=cp, checksums=True)
    base = run_ranks(train_result, tp * cp, timeout=600, **kw)
    for seed in seeds:
        plan = cp_plan(tmp_path, seed, tp, tp > 1, cp)
        dh = run_ranks(train_result, tp * cp, timeout=600, **kw,
                       dhelix={"enabled": True, "pair_last": True, "plan": plan})
        assert same_runs(dh, base) == 0.0
