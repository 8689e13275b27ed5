"""Strand interleaving core: the DHelix layer against megatron-core's TransformerLayer."""
import json

import pytest

from dhelix.planner.example_layer import tp_sp_layer
from dhelix.planner.enumerate import random_legal_plan
from dhelix.planner.plan import (Plan, PlanError, Step, paired_plan, trivial_plan,
                                 validate)
from dhelix.testing import RankError, run_ranks
import layer_fns

CONFIGS = [("tiny", True), ("tiny", False), ("tiny-llama", True), ("tiny-llama", False)]
IDS = ["gelu-mha-tp2-sp", "gelu-mha-tp2", "swiglu-gqa-rope-tp2-sp", "swiglu-gqa-rope-tp2"]


# random legal plans per configuration, on top of the trivial, paired and earliest-wgrad
RANDOM_PLANS = 50
RANDOM_PLANS_TP1 = 50


@pytest.mark.parametrize("config,sp", CONFIGS, ids=IDS)
def test_random_plans_match_megatron(config, sp):
    """On both TP ranks, every plan: α's output, β's input grad and every parameter grad
    equal megatron's layer bit for bit (`compare.same_tensors`, tolerance 0), and equal
    the trivial plan's; the random plans all differ."""
    for res in run_ranks(layer_fns.check_plans, 2, timeout=300, config=config, tp=2,
                         sp=sp, nplans=RANDOM_PLANS):
        assert res["nplans"] == RANDOM_PLANS + 3 and res["distinct"] == RANDOM_PLANS + 3
        assert res["ngrads"] >= 6          # SwiGLU/RMSNorm without biases: 6
        assert res["multi_comm"] >= 10     # steps with several comms of one group run too
        assert res["reordered"] >= 10      # and β's node in other legal orders


@pytest.mark.parametrize("config,chunks", [("tiny", 2), ("tiny-llama", 4)])
def test_chunked_mlp_matches_megatron(config, chunks):
    """The MLP's forward in token chunks (`--dhelix-mlp-chunks`: each chunk's all-gather,
    GEMMs and reduce-scatter): still megatron's layer bit for bit under every plan, with
    biases (GeLU) and gated units (SwiGLU), and the chunks' collectives in the chains."""
    for res in run_ranks(layer_fns.check_plans, 2, timeout=300, config=config, tp=2,
                         sp=True, nplans=RANDOM_PLANS // 2, mlp_chunks=chunks):
        assert res["nplans"] == RANDOM_PLANS // 2 + 3 and res["distinct"] == res["nplans"]
        # every chunk adds fc1, act, fc2 and both collectives; the backward is unchanged
        assert res["num_ops"][0] == 14 + 5 * (chunks - 1) and res["num_ops"][1] == 20


@pytest.mark.parametrize("config,chunks,keep", [("tiny", 1, True), ("tiny-llama", 1, True),
                                               ("tiny", 2, True), ("tiny-llama", 1, "mlp"),
                                               ("tiny", 2, "attn")])
def test_kept_gathers_match_megatron(config, chunks, keep):
    """`--dhelix-keep-gathered [PARTS]`: the wgrads read the forward's gathered inputs,
    the backward gathers nothing again for the parts kept (all: no `ag_attn_w`, and no
    `ag_mlp_w` unless the MLP's forward gathers in chunks; "mlp" or "attn": that part's
    only), and every plan is still megatron's layer bit for bit."""
    for res in run_ranks(layer_fns.check_plans, 2, timeout=300, config=config, tp=2,
                         sp=True, nplans=RANDOM_PLANS // 2, mlp_chunks=chunks,
                         keep_gathered=keep):
        assert res["nplans"] == RANDOM_PLANS // 2 + 3 and res["distinct"] == res["nplans"]
        assert res["num_ops"][1] == (18 if chunks == 1 and keep is True else 19)
        assert res["reordered"] >= 5


def test_kept_gathers_cost_what_the_planner_says():
    """Keeping the gathered inputs holds, after a layer's forward, (TP−1)/TP of a gathered
    input more per kept linear (the norm's output becomes the kept tensor's own rows):
    measured (saved-tensor accounting) and in the planner's estimate alike; one linear's
    worth when one part is kept (`--dhelix-keep-gathered mlp`)."""
    for config, parts, linears in (("tiny", True, 2), ("tiny-llama", True, 2),
                                   ("tiny-llama", "mlp", 1)):
        plain, keep = (run_ranks(layer_fns.kept_after_forward, 2, timeout=200, config=config,
                                 keep_gathered=k)[0] for k in (False, parts))
        extra = linears * keep["full"] // 2           # TP=2
        assert keep["measured"] - plain["measured"] == extra, (config, plain, keep)
        assert keep["estimated"] - plain["estimated"] == extra, (config, plain, keep)


def test_tp1_matches_megatron():
    res = run_ranks(layer_fns.check_plans, 1, timeout=200, config="tiny-llama", tp=1,
                    sp=False, nplans=RANDOM_PLANS_TP1)[0]
    # without TP comm nothing floats earlier than the chain has it: the earliest-wgrad
    # plan is the trivial plan there
    assert res["nplans"] == RANDOM_PLANS_TP1 + 3 and res["distinct"] == res["nplans"] - 1
    assert res["reordered"] >= 10


@pytest.mark.parametrize("config,sp,tiles", [("tiny", True, 1), ("tiny-llama", False, 1),
                                             ("tiny-llama", True, 2)])
def test_layer_node_matches_megatron(config, sp, tiles):
    """Node forward + explicit backward, both ranks: output, input grad and every
    parameter's .grad equal megatron's bit for bit. tiles=2 (the intra-batch peer's two
    batch halves): a weight's grad is the sum of the halves' grads, added in another order
    than one GEMM over the whole batch adds them, so ≤1e-6 relative there."""
    tol = 0.0 if tiles == 1 else 1e-6
    worst = run_ranks(layer_fns.check_node_path, 2, timeout=200, config=config, sp=sp,
                      tiles=tiles, tol=tol)
    assert all(w <= tol for w in worst), worst


def test_state_dict_moves_both_ways():
    """Both ranks (each holds other shards): megatron's keys and shapes, and every tensor
    back bit for bit after DHelix -> megatron -> DHelix (see `state_dict_roundtrip`)."""
    n = run_ranks(layer_fns.state_dict_roundtrip, 2, timeout=200)
    assert n[0] == n[1] and n[0] > 8


def test_ranks_with_different_plans_fail_clearly():
    with pytest.raises(RankError, match="same-plan-on-all-ranks"):
        run_ranks(layer_fns.different_plans_on_ranks, 2, timeout=120)


# ---- the validator ---------------------------------------------------------------------------

LAYER = tp_sp_layer(hidden=64, ffn=256, seq=16, batch=2, heads=4, tp=2, dtype_bytes=4)


def _plan(steps):
    return Plan(LAYER.signature(), [o.name for o in LAYER.forward],
                [o.name for o in LAYER.backward], steps)


def test_builtin_plans_are_legal():
    validate(trivial_plan(LAYER), LAYER)
    p = paired_plan(LAYER)
    validate(p, LAYER)
    assert p.num_paired() > 0


def test_wrong_order_rejected():
    f = [o.name for o in LAYER.forward]
    b = [o.name for o in LAYER.backward]
    steps = [Step(fwd=[f[1]]), Step(fwd=[f[0]])] + [Step(fwd=[n]) for n in f[2:]] + \
        [Step(bwd=[n]) for n in b]
    with pytest.raises(PlanError, match=r"step 0: rule 'chain-order': forward op 'ag_attn' "
                                        r"comes before 'ln_attn'"):
        validate(_plan(steps), LAYER, "p.json")


def test_several_comms_of_one_group_in_a_step_are_legal():
    """A step may hold several comm ops of one group (the lanes run them first-in
    first-out in the executor's one order); the random plans draw such steps."""
    import random
    from layer_fns import multi_comm_steps
    f = [o.name for o in LAYER.forward]
    b = [o.name for o in LAYER.backward]
    # α's ag_attn with β's first backward segment, which holds ag_mlp_b (both on 'tp')
    steps = [Step(fwd=["ln_attn"]), Step(fwd=["ag_attn"], bwd=["bda_mlp_b", "ag_mlp_b"])]
    p = _plan(steps + [Step(fwd=[n]) for n in f[2:]] + [Step(bwd=[n]) for n in b[2:]])
    validate(p, LAYER)
    assert multi_comm_steps(p, LAYER) == 1
    rng = random.Random(0)
    plans = [random_legal_plan(LAYER, rng) for _ in range(50)]
    assert sum(multi_comm_steps(q, LAYER) > 0 for q in plans) >= 10


def test_missing_and_repeated_ops_rejected():
    t = trivial_plan(LAYER)
    missing = Plan(t.signature, t.forward, t.backward, t.steps[:-1])
    with pytest.raises(PlanError, match=r"rule 'each-op-once': ops missing from the plan: "
                                        r".*ln_attn_b"):
        validate(missing, LAYER)
    rep = Plan(t.signature, t.forward, t.backward, t.steps + [Step(fwd=["qkv"])])
    with pytest.raises(PlanError, match=r"step \d+: rule 'each-op-once': fwd op 'qkv' "
                                        r"repeated"):
        validate(rep, LAYER)


def test_wgrad_before_dgrad_rejected():
    b = [o.name for o in LAYER.backward]
    i = b.index("fc2_wgrad")
    b[i - 1], b[i] = b[i], b[i - 1]
    steps = [Step(fwd=[o.name]) for o in LAYER.forward] + [Step(bwd=[n]) for n in b]
    with pytest.raises(PlanError, match=r"rule 'wgrad-after-dgrad': 'fc2_wgrad' runs before "
                                        r"its dgrad 'fc2_dgrad'"):
        validate(_plan(steps), LAYER)


def test_plan_for_another_shape_rejected():
    other = tp_sp_layer(hidden=128, ffn=256, seq=16, batch=2, heads=4, tp=2, dtype_bytes=4)
    with pytest.raises(PlanError, match=r"other.json: rule 'layer-shape'.*re-run "
                                        r"`dhelix plan`"):
        validate(trivial_plan(other), LAYER, "other.json")


def test_plan_file_roundtrip_and_corruption(tmp_path):
    p = paired_plan(LAYER)
    path = tmp_path / "plan.json"
    p.save(str(path))
    q = Plan.load(str(path))
    assert q.digest() == p.digest()
    validate(q, LAYER)
    path.write_text(path.read_text()[:40])
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(str(path))
    path.write_text(json.dumps({"format": "dhelix.plan", "version": 99}))
    with pytest.raises(PlanError, match="field 'version' is 99"):
        Plan.load(str(path))
    with pytest.raises(PlanError, match="plan file not found"):
        Plan.load(str(tmp_path / "none.json"))


def test_lane_follows_node_membership():
    same = run_ranks(layer_fns.comm_lanes, 2, timeout=120, env={"DHELIX_NODE_IDS": "0,0"})
    split = run_ranks(layer_fns.comm_lanes, 2, timeout=120, env={"DHELIX_NODE_IDS": "0,1"})
    assert same[0] == ["intra"] and split[0] == ["inter"]


def test_local_grad_is_autograds_grad():
    """`traced.local_grad` (autograd's engine called directly) gives `torch.autograd.grad`'s
    gradients bit for bit, None for an unused input only when allowed, and refuses a grad
    of another shape than its output's; the activation meter counts a storage once while
    a token names it and releases it when the last token is collected."""
    import torch
    from dhelix.base.memory import METER
    from dhelix.strand.traced import local_grad, traced
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    unused = torch.randn(3, requires_grad=True)

    def graph():
        x = torch.randn(4, 8).requires_grad_()
        return x, traced(lambda a: torch.nn.functional.gelu(a @ w).tanh(), x)
    x, y = graph()
    g = torch.randn_like(y)
    want = torch.autograd.grad(y, [x, w], g, retain_graph=True)
    got = local_grad((y,), [x, w], (g,))
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    x, y = graph()
    assert local_grad((y,), [x, unused], (g,), allow_unused=True)[1] is None
    x, y = graph()
    with pytest.raises(RuntimeError):
        local_grad((y,), [x, unused], (g,))
    x, y = graph()
    with pytest.raises(RuntimeError, match="shape"):
        local_grad((y,), [x], (torch.randn(4, 7),))
    before = METER.current
    t = torch.randn(16, 16)
    tokens = [METER.hold(t), METER.hold(t[:4])]       # one storage, counted once
    assert METER.current == before + t.numel() * 4
    tokens.pop()
    assert METER.current == before + t.numel() * 4
    tokens.pop()
    assert METER.current == before


def test_bias_dropout_add_backward_skips_the_engine():
    """Without dropout a bias-dropout-add's backward is written out (the identity and the
    bias's token sum), not run through autograd's engine, whose every call is a hand-off
    to the device thread on a GPU: one layer's backward makes 4 engine calls (the two
    norms, the attention core, the activation) instead of 6, bit for bit with megatron
    (biases included); with dropout both bias-dropout-adds still go through the engine."""
    plain = run_ranks(layer_fns.engine_calls, 2, timeout=120, config="tiny", dropout=0.0)
    dropped = run_ranks(layer_fns.engine_calls, 2, timeout=120, config="tiny", dropout=0.1)
    assert plain == [4, 4] and dropped == [6, 6]
