"""β's node order (`Plan.backward`): a plan may run a layer's backward in another legal
order than the chain's — a sequence-parallel re-gather issued early, a wgrad later — so
the link has work while both strands compute. The chains' rules, the plan file and the
validator, the simulator on such a plan, and the planner's search (C++ and Python alike).
The runs that train with reordered plans bit for bit like megatron are test_strand.py
(`reordered` of the random plans) and test_schedule.py (`test_many_random_plans_*`)."""
import json
import random

import pytest

from dhelix.planner import dp
from dhelix.planner.enumerate import legal_order, random_legal_plan, random_order
from dhelix.planner.example_layer import random_layer, random_table
from dhelix.planner.plan import Plan, PlanError, Step, check_order, validate
from dhelix.planner.problem import layer_for_shape
from dhelix.planner.simulate import LaneModel, plan_indices, simulate
from dhelix.planner.whole_step import co_step_layers

# random layers (with floating re-gathers) on which both backends plan the same order
PLANNER_CASES = 10


def _sp_layer(config="tiny-llama"):
    return layer_for_shape({"config": config, "tp": 2, "sp": True, "seq": 64, "mbs": 2,
                            "bf16": False, "lane": "intra"})


def _names(ops):
    return [o.name for o in ops]


def test_re_gathers_float_before_their_wgrad():
    """The SP layer's re-gathers have no `after` and name their wgrad as `reader`; each
    wgrad follows its dgrad. The chain itself is a legal order, and so is a re-gather
    first of all; a re-gather after its wgrad, a wgrad before its dgrad, a non-wgrad op
    out of chain order, an op missing or unknown are each refused naming the rule."""
    layer = _sp_layer()
    spec = {o.name: o for o in layer.backward}
    for part, lin in (("mlp", "fc1"), ("attn", "qkv")):
        g = spec[f"ag_{part}_w"]
        assert g.wgrad and g.after is None and g.reader == f"{lin}_wgrad"
        assert spec[f"{lin}_wgrad"].after == f"{lin}_dgrad"
    chain = _names(layer.backward)
    check_order(layer, chain)
    early = ["ag_attn_w"] + [n for n in chain if n != "ag_attn_w"]
    check_order(layer, early)

    def moved(name, before):
        rest = [n for n in chain if n != name]
        k = rest.index(before)
        return rest[:k] + [name] + rest[k:]
    bad = {
        "'qkv_wgrad' before 'ag_attn_w'": [n for n in chain if n != "ag_attn_w"] + ["ag_attn_w"],
        "'fc1_wgrad' before 'fc1_dgrad'": moved("fc1_wgrad", "fc1_dgrad"),
        "chain's order": moved("fc2_dgrad", "ag_mlp_b"),
        "missing: \\['ln_attn_b'\\]": chain[:-1],
        "unknown: \\['zz'\\]": chain[:-1] + ["zz"],
    }
    for what, order in bad.items():
        with pytest.raises(PlanError, match=f"x.json: rule 'backward-order': field "
                                            f"'backward'.*{what}"):
            check_order(layer, order, "x.json")
        assert not legal_order(layer, order)


def test_reordered_plans_keep_their_order_in_the_file_and_are_validated():
    """Random legal orders (`random_order`) validate, survive the JSON file, and change the
    digest (ranks holding two orders of one plan are told apart); a step that runs a
    wgrad before the re-gather it reads is refused (rule 'reader-after-comm'), also when
    the order says otherwise."""
    layer = _sp_layer()
    rng = random.Random(4)
    orders = set()
    for k in range(100):
        r = rng.randrange(len(layer.backward)) if k % 2 else 0
        p = random_legal_plan(layer, rng, rotation=r, reorder_prob=1.0)
        q = Plan.from_json(json.loads(json.dumps(p.to_json())))
        assert q.backward == p.backward and q.digest() == p.digest()
        validate(q, layer)
        orders.add(tuple(p.backward))
        same = Plan(p.signature, p.forward, _names(layer.backward), p.steps, {}, p.rotation)
        if p.backward != same.backward:
            assert same.digest() != p.digest()
    assert len(orders) > 50
    chain = _names(layer.backward)
    late = [n for n in chain if n != "ag_mlp_w"]
    late.insert(late.index("fc1_wgrad") + 1, "ag_mlp_w")
    p = Plan(layer.signature(), _names(layer.forward), chain,
             [Step(_names(layer.forward), []), Step([], late)], {})
    with pytest.raises(PlanError, match="rule 'reader-after-comm': 'fc1_wgrad' runs before "
                                        "the comm op it reads 'ag_mlp_w'"):
        validate(p, layer, "x.json")
    p.backward = ["ag_mlp_w"] + [n for n in chain if n != "ag_mlp_w"]
    with pytest.raises(PlanError, match="reader-after-comm"):
        validate(p, layer)


def test_simulator_plays_a_reordered_plan_in_its_order():
    """A reordered plan's makespan is the lane model's in that order (its chain the
    plan's order, rotated by the plan's rotation), as `simulate` plays it."""
    layer = _sp_layer()
    rng = random.Random(6)
    table = random_table(layer, rng)
    for k in range(20):
        r = rng.randrange(1, len(layer.backward)) if k % 2 else 0
        p = random_legal_plan(layer, rng, rotation=r, reorder_prob=1.0)
        m = LaneModel(layer, table, rotation=r, order=p.backward)
        assert m.b_names == p.backward[r:] + p.backward[:r]
        assert simulate(layer, p, table).makespan == m.run(plan_indices(m, p))[0]


def test_planner_reorders_where_it_pays_cpp_equals_python(cpp_core):
    """dp.plan(reorder=True): the same order, rotation and steps in C++ and Python, a
    co-step never longer than the best in the chain's order (recorded in the meta), and
    strictly shorter on some of the random layers with floating re-gathers."""
    rng = random.Random(11)
    better = 0
    for case in range(PLANNER_CASES):
        layer = random_layer(rng, n_fwd=rng.randint(3, 6), n_bwd=rng.randint(4, 7),
                             regathers=True)
        table = random_table(layer, rng)
        a = dp.plan(layer, table, rotate=True, reorder=True, num_layers=4, backend="python")
        b = dp.plan(layer, table, rotate=True, reorder=True, num_layers=4, backend="cpp")
        assert (a.backward, a.rotation, a.steps) == (b.backward, b.rotation, b.steps), case
        assert a.meta["co_step_predicted_s"] == b.meta["co_step_predicted_s"]
        validate(a, layer)
        m = LaneModel(layer, table, rotation=a.rotation, order=a.backward)
        assert co_step_layers(m, a, 4) == a.meta["co_step_predicted_s"]
        chain = dp.plan(layer, table, rotate=True, num_layers=4)
        assert a.meta["chain_order_co_step_s"] == chain.meta["co_step_predicted_s"]
        assert a.meta["co_step_predicted_s"] <= chain.meta["co_step_predicted_s"]
        better += a.meta["co_step_predicted_s"] < chain.meta["co_step_predicted_s"]
        assert (a.backward != _names(layer.backward)) == \
            (a.meta["co_step_predicted_s"] < chain.meta["co_step_predicted_s"])
    assert better >= 2


def test_random_orders_cover_every_floating_op():
    """`random_order` moves every floating op: over 200 draws each re-gather and wgrad of
    the SP layer is seen at several positions, and every draw is legal."""
    layer = _sp_layer("tiny")
    rng = random.Random(2)
    seen = {o.name: set() for o in layer.backward if o.wgrad}
    for _ in range(200):
        order = random_order(layer, rng)
        assert legal_order(layer, order)
        for n in seen:
            seen[n].add(order.index(n))
    assert all(len(v) >= 3 for v in seen.values()), seen
