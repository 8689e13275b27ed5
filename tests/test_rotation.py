"""Rotated plans (`Plan.rotation`): β's chain of a layer step starts inside a node. The
plan file, the validator's rules, the simulator's prices of a co-step, and the planner's
choice of rotation (C++ and Python alike). The runs that train with rotated plans bit for
bit like megatron are in test_schedule.py (`test_many_random_plans_*`, odd seeds, and
`test_halves_with_a_rotated_plan`)."""
import json
import random

import pytest

from dhelix.planner import dp
from dhelix.planner.enumerate import random_legal_plan
from dhelix.planner.example_layer import random_layer, random_table, tp_sp_layer
from dhelix.planner.plan import Plan, PlanError, Step, node_order, rotated_backward, validate
from dhelix.planner.simulate import LaneModel, plan_indices, simulate
from dhelix.planner.whole_step import co_step_layers, plan_steps_alone


def _layer():
    return tp_sp_layer(hidden=1024, ffn=4096, seq=1024, batch=1, heads=16, tp=4)


def test_rotated_plans_validate_and_keep_their_rotation_in_the_file():
    layer = _layer()
    m = len(layer.backward)
    rng = random.Random(3)
    digests = set()
    for k in range(200):
        r = rng.randrange(m)
        p = random_legal_plan(layer, rng, rotation=r)
        q = Plan.from_json(json.loads(json.dumps(p.to_json())))
        assert q.rotation == r and q.steps == p.steps and q.digest() == p.digest()
        validate(q, layer)
        # a node alone runs its own order: every op once, each non-wgrad in chain order
        order = node_order(p)
        assert sorted(order) == sorted(o.name for o in layer.backward)
        chain = [o.name for o in layer.backward if not o.wgrad]
        assert [n for n in order if n in chain] == chain
        digests.add((p.digest(), r))
    assert len({r for _, r in digests}) > m // 2
    d = _unrotated_steps_plan(layer).to_json()
    assert "rotation" not in d                         # files of before read the same
    assert Plan.from_json(d).rotation == 0


def _unrotated_steps_plan(layer, r=0):
    steps = [Step([o.name for o in layer.forward], [])] + \
        [Step([], [o.name for o in rotated_backward(layer.backward, r)])]
    return Plan(layer.signature(), [o.name for o in layer.forward],
                [o.name for o in layer.backward], steps, {}, r)


def test_rotation_rules_name_the_step_and_the_fix():
    layer = _layer()
    r = 3
    validate(_unrotated_steps_plan(layer, r), layer)
    # the unrotated order under a rotation: the chain order is broken
    p = _unrotated_steps_plan(layer)
    p.rotation = r
    with pytest.raises(PlanError, match="chain-order"):
        validate(p, layer)
    # a wgrad of the node above moved behind an op of the node below
    names = [o.name for o in rotated_backward(layer.backward, r)]
    wgrad = next(o.name for o in layer.backward[r:] if o.wgrad)
    bad = [n for n in names if n != wgrad] + [wgrad]
    p = _unrotated_steps_plan(layer, r)
    p.steps[1] = Step([], bad)
    with pytest.raises(PlanError, match="rotation-order.*of the layer above"):
        validate(p, layer)
    d = _unrotated_steps_plan(layer).to_json()
    for v in (-1, len(layer.backward), "3", True):
        d["rotation"] = v
        with pytest.raises(PlanError, match="field 'rotation' must be an integer"):
            Plan.from_json(d, source="x.json")


def test_co_step_prices_a_rotated_plan_as_the_schedule_runs_it():
    """`co_step_layers`: unrotated, L plan makespans; rotated, the first node's first r ops
    alone + (L−1) rotated pairs + α's last layer beside the last node's rest. The alone
    backward of a rotated plan is the node's own order."""
    rng = random.Random(5)
    for case in range(30):
        layer = random_layer(rng, n_fwd=rng.randint(3, 7), n_bwd=rng.randint(4, 9))
        table = random_table(layer, rng)
        m = len(layer.backward)
        r = rng.randrange(1, m)
        p = random_legal_plan(layer, rng, rotation=r)
        model = LaneModel(layer, table, rotation=r)
        pair = model.run(plan_indices(model, p))[0]
        assert simulate(layer, p, table).makespan == pair
        one = co_step_layers(model, p, 1)
        assert co_step_layers(model, p, 5) == pytest.approx(one + 4 * pair, rel=1e-12)
        tail = m - r
        head = model.step([], [k for _, b in plan_indices(model, p) for k in b if k >= tail])[0]
        assert one > head
        q = random_legal_plan(layer, rng)
        m0 = LaneModel(layer, table)
        assert co_step_layers(m0, q, 4) == 4 * m0.run(plan_indices(m0, q))[0]
        b_alone = plan_steps_alone(m0, p)[1]
        bpos = {n: k for k, n in enumerate(m0.b_names)}
        assert b_alone == m0.step([], [bpos[n] for n in node_order(p)])[0]


def test_planner_picks_the_rotation_whose_co_step_ends_first(cpp_core):
    """dp.plan(rotate=True): the same plan in C++ and Python; its co-step is the least of
    every rotation's planned co-step, never above the unrotated plan's."""
    rng = random.Random(9)
    rotated = 0
    for case in range(12):
        layer = random_layer(rng, n_fwd=rng.randint(3, 6), n_bwd=rng.randint(4, 7))
        table = random_table(layer, rng)
        L = rng.randint(2, 8)
        a = dp.plan(layer, table, rotate=True, num_layers=L, backend="python")
        b = dp.plan(layer, table, rotate=True, num_layers=L, backend="cpp")
        assert (a.rotation, a.steps) == (b.rotation, b.steps), case
        assert a.meta["predicted_s"] == b.meta["predicted_s"]
        validate(a, layer)
        best = min(co_step_layers(LaneModel(layer, table, rotation=r),
                                  dp._plan_at(layer, table, None, None, None, "cpp", False, r)[0],
                                  L) for r in range(len(layer.backward)))
        assert a.meta["co_step_predicted_s"] == best
        unrot = dp.plan(layer, table, num_layers=L)
        assert best <= L * unrot.meta["predicted_s"]
        rotated += a.rotation > 0
    assert rotated > 0


def test_rotation_is_not_tried_under_a_memory_budget_or_a_cost_function():
    layer = _layer()
    table = random_table(layer, random.Random(1))
    p = dp.plan(layer, table, rotate=True, memory_budget_bytes=1e15)
    assert p.rotation == 0
    p = dp.plan(layer, step_cost=lambda f, b: len(f) + len(b) + 1.0, rotate=True)
    assert p.rotation == 0
