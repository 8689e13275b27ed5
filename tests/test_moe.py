"""MoE: the DHelix MoE layer ≡ megatron's MoE layer under random legal plans, --dhelix
training ≡ the baseline with expert parallelism over gloo, CPU compat (f), (g), the
planner's MoE chains, refusals."""
import pytest

from dhelix.models.config import ConfigError, load_model_config
from dhelix.testing import run_ranks
from dhelix.train.config import TrainConfig, check_layout, model_of
from compare import same_numbers, same_runs
from train_fns import train_losses, train_result

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
    same_numbers(tp, ep, 1e-5, "TP×EP vs EP losses")    # TP splits attention's GEMMs


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
        (dict(MOE, dhelix={"peer": "intra-batch"}), "--dhelix-peer with a MoE model"),
        (dict(MOE, tensor_model_parallel_size=2, sequence_parallel=True,
              dhelix={"enabled": True}), "add --expert-tensor-parallel-size 1"),
    ]
    for kw, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            cfg = TrainConfig(**kw)
            check_layout(cfg, model_of(cfg), 2)
    assert load_model_config("phi-3.5-moe").num_experts == 16


MOE_PLANS = 30       # random legal plans per MoE layout, on top of the trivial and paired


@pytest.mark.parametrize("world,tp,plans,zero,shared", [
    (2, 1, MOE_PLANS, False, None), (4, 2, MOE_PLANS, False, None),
    (2, 1, MOE_PLANS, True, None), (2, 1, MOE_PLANS, False, 96), (4, 2, MOE_PLANS, False, 96)],
    ids=["ep2", "ep2-tp2sp", "ep2-all-to-one-rank", "ep2-shared", "ep2-tp2sp-shared"])
def test_dhelix_moe_layer_matches_megatron(world, tp, plans, zero, shared):
    """On every rank: output, input grad and every parameter grad (router, every local
    expert, norms, attention) equal megatron's MoE layer bit for bit for the trivial,
    paired and 30 random legal plans (all different); a fresh DHelix MoE layer has
    megatron's state-dict keys and shapes and sharded keys."""
    import moe_fns
    rs = run_ranks(moe_fns.moe_layer_matches, world, timeout=400, tp=tp, ep=2, plans=plans,
                   zero_router=zero, shared=shared)
    for r in rs:
        assert r["plans"] == r["distinct"] == plans + 2
        assert r["n_grads"] >= 6 and len(r["a2a"]) == 4


@pytest.mark.parametrize("shared", [None, 96], ids=["routed", "with-shared-experts"])
def test_dhelix_moe_training_matches_the_baseline(shared):
    """10 steps, EP=2 on 2 ranks: --dhelix's losses, every step's per-parameter gradient
    checksums and the final weights equal megatron's (with and without shared experts)."""
    kw = dict(MOE, train_iters=10, expert_model_parallel_size=2, checksums=True,
              moe_shared_expert_intermediate_size=shared)
    base = run_ranks(train_result, 2, timeout=300, **kw)
    dh = run_ranks(train_result, 2, timeout=300, dhelix={"enabled": True}, **kw)
    assert dh[0]["config"]["schedule"] != base[0]["config"]["schedule"]
    assert same_runs(dh, base) == 0.0


BIAS_PLANS = 12     # random legal plans for the MoE layer with expert biases


@pytest.mark.parametrize("zero", [False, True], ids=["ep2", "ep2-all-to-one-rank"])
def test_dhelix_moe_layer_with_expert_biases_matches_megatron(zero):
    """Expert biases (add_bias_linear, as GPT-OSS; random values, megatron initialises
    them to zero): fc1's before the activation, fc2's times the routing weight. EP=2 on
    2 ranks: output, input grad and every parameter grad (each expert's fc1 and fc2
    bias, the router's through the routing weights, the attention's biases) equal
    megatron's MoE layer bit for bit for the trivial, paired and random legal plans;
    with every token routed to one EP rank, the other rank's experts (no tokens) get
    zero bias grads on both sides."""
    import moe_fns
    rs = run_ranks(moe_fns.moe_layer_matches, 2, timeout=400, tp=1, ep=2, plans=BIAS_PLANS,
                   zero_router=zero, model="tiny-moe-bias")
    for r in rs:
        assert r["plans"] == r["distinct"] == BIAS_PLANS + 2
    # 2 local experts per rank, each with an fc1 and an fc2 bias, all with nonzero grads
    # (with every token on one rank: that rank's only)
    assert sorted(r["bias_grads"] for r in rs) == ([0, 4] if zero else [4, 4])


def test_dhelix_moe_training_with_expert_biases_matches_the_baseline():
    """10 steps of tiny-moe-bias, EP=2 on 2 ranks: --dhelix's losses, every step's
    per-parameter gradient checksums (the experts' biases among them) and the final
    weights equal megatron's bit for bit; the biases move off their zero init."""
    kw = dict(MOE, config="tiny-moe-bias", train_iters=10, expert_model_parallel_size=2,
              checksums=True)
    base = run_ranks(train_result, 2, timeout=300, **kw)
    dh = run_ranks(train_result, 2, timeout=300, dhelix={"enabled": True}, **kw)
    assert dh[0]["config"]["schedule"] != base[0]["config"]["schedule"]
    for r in dh:
        names = [k for k in r["grad_checksums"][-1] if "local_experts" in k and
                 k.endswith(".bias")]
        assert len(names) == 8, names        # 2 layers × 2 local experts × fc1, fc2
        # [sum, sum of squares]: zero-initialised, moved by training
        assert all(r["weight_checksums"][k][1] > 0 for k in names), names
    assert same_runs(dh, base) == 0.0


def test_megatron_lm_moe_flags_refused_before_training():
    """Megatron-LM's pretrain_gpt.py with --dhelix and --num-experts: every MoE setting
    the DHelix MoE layer refuses when it is built is refused by `check_dhelix_args`
    before any rank trains, naming the flag and the fix; the flags are megatron's (its
    arguments are generated from the config fields); without --dhelix nothing is refused;
    `dhelix train`'s namespace (no dispatcher or capacity flags) passes."""
    import argparse
    import dataclasses
    from megatron.core.transformer.transformer_config import TransformerConfig
    from dhelix.cli.train import add_train_args
    from dhelix.megatron.args import DHelixArgError, add_dhelix_args, check_dhelix_args

    ok = dict(num_experts=4, moe_token_dispatcher_type="alltoall", context_parallel_size=1,
              tensor_model_parallel_size=2, expert_tensor_parallel_size=1,
              moe_shared_expert_intermediate_size=None, moe_shared_expert_overlap=False,
              moe_shared_expert_gate=False, moe_expert_capacity_factor=None,
              moe_pad_expert_input_to_capacity=False, moe_apply_probs_on_input=False)
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert not set(ok) - fields - {"num_experts"}, set(ok) - fields

    def args(*argv, **over):
        p = argparse.ArgumentParser()
        add_dhelix_args(p)
        a = p.parse_args(list(argv))
        for k, v in dict(ok, **over).items():
            setattr(a, k, v)
        return a
    check_dhelix_args(args("--dhelix"))
    check_dhelix_args(args("--dhelix", moe_shared_expert_gate=True))   # no shared experts
    check_dhelix_args(args("--dhelix", add_bias_linear=True))          # expert biases
    shared = dict(moe_shared_expert_intermediate_size=96)
    cases = [
        (dict(moe_token_dispatcher_type="allgather"), r"--moe-token-dispatcher-type "
         r"allgather: .* pass --moe-token-dispatcher-type alltoall"),
        (dict(moe_token_dispatcher_type="flex"), r"--moe-token-dispatcher-type flex"),
        (dict(expert_tensor_parallel_size=None), r"experts split over 2 tensor-parallel "
         r"ranks \(--expert-tensor-parallel-size, which defaults to "
         r"--tensor-model-parallel-size\).*add --expert-tensor-parallel-size 1"),
        (dict(expert_tensor_parallel_size=2), r"add --expert-tensor-parallel-size 1"),
        (dict(shared, moe_shared_expert_overlap=True), r"shared experts and "
         r"--moe-shared-expert-overlap: .*drop --moe-shared-expert-overlap$"),
        (dict(shared, moe_shared_expert_gate=True), r"drop --moe-shared-expert-gate$"),
        (dict(moe_expert_capacity_factor=1.5), r"--moe-expert-capacity-factor 1.5: .*drop "
                                               r"--moe-expert-capacity-factor$"),
        (dict(moe_pad_expert_input_to_capacity=True, moe_expert_capacity_factor=1.0),
         r"drop --moe-expert-capacity-factor and --moe-pad-expert-input-to-capacity$"),
        (dict(context_parallel_size=2), r"--context-parallel-size 2: .*drop "
                                        r"--context-parallel-size"),
        (dict(moe_apply_probs_on_input=True), r"drop --moe-apply-probs-on-input"),
    ]
    for over, msg in cases:
        with pytest.raises(DHelixArgError, match=msg):
            check_dhelix_args(args("--dhelix", **over))
        check_dhelix_args(args(**over))                          # megatron's own run
        check_dhelix_args(args("--dhelix", **dict(over, num_experts=None)))   # dense
    # dhelix train's namespace: its own MoE flags only (it sets the dispatcher itself)
    p = argparse.ArgumentParser()
    add_train_args(p)
    add_dhelix_args(p)
    check_dhelix_args(p.parse_args(["--config", "tiny-moe-bias", "--num-experts", "4",
                                    "--dhelix"]))
    with pytest.raises(DHelixArgError, match="add --expert-tensor-parallel-size 1"):
        check_dhelix_args(p.parse_args(["--num-experts", "4", "--dhelix",
                                        "--tensor-model-parallel-size", "2"]))


def test_moe_chains_put_the_all_to_alls_on_the_ep_group():
    from dhelix.planner.chains import layer_chains
    f, b = layer_chains(2, True, "intra", moe=True, ep_lane="inter")
    a2a = [o for o in f + b if o.collective == "all_to_all"]
    assert [o.name for o in a2a] == ["a2a_dispatch", "a2a_combine", "a2a_combine_b",
                                     "a2a_dispatch_b"]
    assert all(o.group == "ep" and o.lane == "inter" for o in a2a)
    names = [o.name for o in f]
    assert names.index("router") < names.index("permute") < names.index("a2a_dispatch") < \
        names.index("experts_fc1") < names.index("a2a_combine") < names.index("unpermute")
    assert not any(o.name in ("fc1", "ag_mlp", "rs_mlp") for o in f)   # no dense MLP
    wg = {o.name: o.after for o in b if o.wgrad}
    assert wg["experts_fc2_wgrad"] == "experts_fc2_dgrad"
    assert wg["experts_fc1_wgrad"] == "experts_act_b"
    dense_f, dense_b = layer_chains(2, True, "intra")
    assert [o.name for o in dense_f][:7] == names[:7]                 # attention unchanged


def test_phi_moe_is_planned_as_moe():
    """phi-3.5-moe at EP=8 on A40: the all-to-alls are priced by the ring formula at the
    balanced expectation (local tokens × top-k × hidden), and the plan hides some of them
    behind the other strand's compute."""
    from dhelix.models.config import load_model_config
    from dhelix.planner import dp
    from dhelix.planner.problem import layer_for_shape, load_costs
    from dhelix.planner.costmodel import load_cluster
    shape = {"config": "phi-3.5-moe", "tp": 1, "sp": False, "seq": 4096, "mbs": 1,
             "bf16": True, "lane": "intra", "ep": 8}
    layer = layer_for_shape(shape)
    assert layer.shape["routing"] == "balanced expectation"
    a2a = next(o for o in layer.forward if o.name == "a2a_dispatch")
    m = load_model_config("phi-3.5-moe")
    assert a2a.comm_bytes == 4096 * 1 * m.moe_router_topk * m.hidden_size * 2
    costs, _ = load_costs(layer, shape, None, "a40", False)
    c = load_cluster("configs/clusters/a40.yaml")["intra_node"]
    bw = c["bandwidth_GBps"] * 1e9 * c.get("efficiency", 1.0)
    expect = 7 / 8 * a2a.comm_bytes / bw + 7 * c["latency_us"] * 1e-6
    assert abs(costs.alone_f["a2a_dispatch"] - expect) <= 1e-9 + 1e-6 * expect
    p = dp.plan(layer, costs)
    assert p.meta["speedup_vs_trivial"] > 1.0
    assert any(set(s.fwd) & {"a2a_dispatch", "a2a_combine"} and s.bwd or
               set(s.bwd) & {"a2a_combine_b", "a2a_dispatch_b"} and s.fwd for s in p.steps)
    with pytest.raises(ConfigError, match="needs sequence parallelism"):
        layer_for_shape(dict(shape, tp=2))
    with pytest.raises(ConfigError, match="EP=2 for a model without experts"):
        layer_for_shape(dict(shape, config="llama-8b", ep=2))


def test_bench_expert_parallel_rows(tmp_path):
    """`dhelix bench --expert-model-parallel-size 2`: megatron, DHelix trivial and DHelix
    with the planner's plan (from a MoE table profiled just before, twice in rank
    processes of their own and merged to each entry's smallest median), the same losses."""
    import os
    from bench_fns import run_bench
    from dhelix.planner.costs import CostTable
    rows, _, work = run_bench(tmp_path, "tiny-moe", "--expert-model-parallel-size", "2",
                              "--micro-batch-size", "2", "--profile-runs", "2")
    runs = [CostTable.load(os.path.join(work, f"table-tiny-moe-none.run{k}.json"))
            for k in (1, 2)]
    merged = CostTable.load(os.path.join(work, "table-tiny-moe-none.json"))
    assert merged.provenance["runs"] == 2
    assert merged.alone_b == {k: min(r.alone_b[k] for r in runs) for k in runs[0].alone_b}
    assert [x["method"] for x in rows] == ["megatron", "dhelix-trivial", "dhelix-plan"]
    assert len({x["final_loss"] for x in rows}) == 1
    assert rows[0]["layer_comm_s"] > 0           # the all-to-alls are in the trace


def test_dhelix_moe_plans_from_a_cluster_file():
    """`--dhelix --dhelix-cluster a800` on a MoE model: the analytical table sizes the EP
    group too (it once named only tp, and the run failed), and the planned run trains
    to megatron's losses."""
    kw = dict(MOE, train_iters=3, expert_model_parallel_size=2)
    base = run_ranks(train_losses, 2, timeout=300, **kw)[0]
    dh = run_ranks(train_losses, 2, timeout=300,
                   dhelix={"enabled": True, "cluster": "a800"}, **kw)[0]
    assert same_numbers(dh, base, 0.0, "losses") == 0.0
