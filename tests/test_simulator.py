"""The event simulator: calibration to the pair table, lane rules, work conservation,
steps back to back, memory, outputs, and bit-parity of the C++ one-step simulation (the
whole training step: test_whole_step.py)."""
import json
import random
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dhelix.planner import dp
from dhelix.planner import enumerate as enumerate_
from dhelix.planner.costmodel import load_cluster
from dhelix.planner.costs import CostTable, TableError
from dhelix.planner.example_layer import random_layer, random_table, tp_sp_layer
from dhelix.planner.opspec import COMM, COMPUTE, LayerOps, OpSpec
from dhelix.planner.plan import Plan, Step, trivial_plan
from dhelix.planner.simulate import (ALPHA, BETA, PAIR_NOISE, LaneModel, plot_timeline,
                                     simulate, to_chrome_trace)

from sim_fns import paired, table_for, two_op_layer  # noqa: E402

EPS = 1e-9


@settings(max_examples=200, deadline=None)
@given(tf=st.floats(0.01, 10), tb=st.floats(0.01, 10), oef=st.floats(-0.5, 1.0),
       comm_first=st.booleans())
def test_pair_launched_together_takes_P(tf, tb, oef, comm_first):
    """Calibration: a compute op and the other strand's comm op launched together end
    after the measured P less the noise margin (`PAIR_NOISE` × the shorter op: launch
    cost and noise, not a slowed compute) — clamped to [max(T), T_f + T_b]: a compute op
    can at worst stall for the whole comm, and P below the longer op (after the margin)
    means no slow-down."""
    layer = two_op_layer(*(("intra", "compute") if comm_first else ("compute", "intra")))
    p = tf + tb - oef * min(tf, tb)
    r = simulate(layer, paired(layer), table_for(layer, tf, tb, p))
    want = p - PAIR_NOISE * min(tf, tb)
    assert r.makespan == pytest.approx(min(max(want, tf, tb), tf + tb), rel=1e-9)


def test_a_pair_a_hair_above_the_comm_does_not_stretch_the_compute():
    """A 0.2 ms norm beside a 1.7 ms all-gather measured together at 1.72 ms (the paced
    link's tables: the comm's launch, noise) is a norm at full speed under the gather, not
    one stretched to the gather's length; a pair that did serialize (the norm
    made no progress: 1.95 ms, 1.9 after the margin) is still one."""
    layer = two_op_layer("compute", "intra")
    for p, norm_ends in ((1.72e-3, 0.2e-3), (1.95e-3, 1.9e-3)):
        r = simulate(layer, paired(layer), table_for(layer, 0.2e-3, 1.7e-3, p))
        end = max(e for strand, op, lane, s, e in r.events if lane == "compute")
        assert end == pytest.approx(norm_ends, rel=1e-9), p


def test_same_lane_serializes_alpha_first():
    layer = two_op_layer("compute", "compute")
    r = simulate(layer, paired(layer), table_for(layer, 1.0, 2.0, 1.5))
    assert r.makespan == 3.0                       # serialized whatever the table says
    (s1, n1, l1, a1, e1), (s2, n2, l2, a2, e2) = sorted(r.events, key=lambda e: e[3])
    assert (s1, n1, a1, e1) == (ALPHA, "f", 0.0, 1.0) and (s2, n2, a2, e2) == (BETA, "b", 1.0, 3.0)
    layer = two_op_layer("intra", "intra")
    assert simulate(layer, paired(layer), table_for(layer, 1.0, 2.0, 2.0)).makespan == 3.0


def test_executor_order_is_replayed():
    # α: comm(1) then compute(1) reading it; β: compute(2) then compute(1). The executor
    # starts with α (its comm comes first), switches to β after launching the comm, and
    # comes back to α only when β has launched a comm or is done: β's two ops run first,
    # then α's fb, although fb's input was ready at t=1.
    F = [OpSpec("fa", COMM, "intra", group="tp"), OpSpec("fb", COMPUTE, "compute")]
    B = [OpSpec("ba", COMPUTE, "compute"), OpSpec("bb", COMPUTE, "compute")]
    layer = LayerOps(F, B)
    t = CostTable.empty(layer)
    t.alone_f.update(fa=1.0, fb=1.0)
    t.alone_b.update(ba=2.0, bb=1.0)
    for f in F:
        for b in B:
            t.pair[(f.name, b.name)] = max(t.alone_f[f.name], t.alone_b[b.name])
    plan = Plan(layer.signature(), ["fa", "fb"], ["ba", "bb"], [Step(["fa", "fb"], ["ba", "bb"])])
    r = simulate(layer, plan, t)
    ev = {e[1]: e for e in r.events}
    assert ev["fa"][3:] == (0.0, 1.0) and ev["ba"][3:] == (0.0, 2.0)
    assert ev["bb"][3:] == (2.0, 3.0) and ev["fb"][3:] == (3.0, 4.0) and r.makespan == 4.0


def _dgrad_rs_wgrad():
    """β: dgrad, its reduce-scatter (3 s), the wgrad beside it, an op reading it; then α's
    one op alone: (layer, table, plan)."""
    B = [OpSpec("dgrad", COMPUTE, "compute"), OpSpec("rs", COMM, "intra", group="tp"),
         OpSpec("wgrad", COMPUTE, "compute", wgrad=True, after="dgrad"),
         OpSpec("ln_b", COMPUTE, "compute")]
    layer = LayerOps([OpSpec("f", COMPUTE, "compute")], B)
    t = CostTable.empty(layer)
    t.alone_f["f"] = 1.0
    t.alone_b.update(dgrad=1.0, rs=3.0, wgrad=1.0, ln_b=1.0)
    for b in B:
        t.pair[("f", b.name)] = max(1.0, t.alone_b[b.name])
    plan = Plan(layer.signature(), ["f"], [b.name for b in B],
                [Step([], [b.name for b in B]), Step(["f"], [])])
    return layer, t, plan


def test_comm_overlaps_the_compute_of_its_own_strand():
    """A comm op runs beside the next ops of its own strand that do not read it (a wgrad
    beside the grad reduce-scatter), and the op that reads it waits for it."""
    layer, t, plan = _dgrad_rs_wgrad()
    r = simulate(layer, plan, t)
    ev = {e[1]: e for e in r.events}
    assert ev["rs"][3:] == (1.0, 4.0) and ev["wgrad"][3:] == (1.0, 2.0)
    assert ev["ln_b"][3:] == (4.0, 5.0)                  # reads rs: waits for it
    assert r.step_times == [5.0, 1.0]


def test_trivial_plan_is_sum_of_alone_times_and_memory():
    layer = tp_sp_layer(hidden=1024, ffn=4096, seq=2048, batch=1, heads=16, tp=4)
    from dhelix.planner.costmodel import analytical_table
    import pathlib
    c = load_cluster(str(pathlib.Path(__file__).resolve().parents[1] / "configs/clusters/a800.yaml"))
    t = analytical_table(layer, c, {"tp": 4})
    r = simulate(layer, trivial_plan(layer), t)
    total = sum(t.alone_f.values()) + sum(t.alone_b.values())
    # the trivial plan's segments overlap a comm with the compute after it that does not
    # read it (this layer's rs_mlp_b with ln_mlp_b's predecessor, ...), never more
    assert max(sum(v for k, v in t.alone_f.items()), sum(t.alone_b.values())) <= r.makespan
    assert r.makespan <= total
    base = sum(o.saved_bytes for o in layer.backward)
    fsaved = sum(o.saved_bytes for o in layer.forward)
    assert fsaved == base                      # backward frees what forward saved
    # memory by hand: this layer's trivial plan runs one op at a time (every comm op is
    # read by the op after it), so it is the module doc's rule applied op by op from the
    # base (β's activations): a forward op holds its saved + temp bytes while it runs and
    # keeps its saved bytes; a backward op holds its temp bytes and frees them with its
    # saved bytes. The peak, 51.5625 MiB, is reached at fc2's start (β's 24.03 MiB, the
    # 19.53 MiB α saved before fc2, fc2's 4 MiB saved and 4 MiB temp) and again in the
    # backward (ag_mlp_b's 4 MiB temp on top of α's activations less bda_mlp_b's), so the
    # whole curve is compared too, not only its top.
    evs = sorted(r.events, key=lambda e: e[3])
    assert all(y[3] >= x[4] > x[3] for x, y in zip(evs, evs[1:]))   # one op at a time
    mem = float(base)
    curve = []                                 # bytes after each allocation and free
    for o in layer.forward:
        curve += [mem + o.saved_bytes + o.temp_bytes, mem + o.saved_bytes]
        mem += o.saved_bytes
    for o in layer.backward:
        curve += [mem + o.temp_bytes, mem - o.saved_bytes]
        mem -= o.saved_bytes
    assert mem == base                         # ends at the base level
    assert max(curve) == 51.5625 * 2**20
    assert r.peak_bytes == max(curve), (r.peak_bytes / 2**20, max(curve) / 2**20)
    # pairing lets β free before α allocates: the DP plan's peak is not above the trivial
    # one for this layer (43.5625 MiB when written), and both plans end at the base level
    dplan = dp.plan(layer, t, backend="python")
    rd = simulate(layer, dplan, t)
    assert rd.makespan < r.makespan
    assert rd.peak_bytes <= r.peak_bytes, (rd.peak_bytes / 2**20, r.peak_bytes / 2**20)
    model = LaneModel(layer, t)
    pos = ({n: k for k, n in enumerate(model.f_names)},
           {n: k for k, n in enumerate(model.b_names)})
    for plan, result in ((trivial_plan(layer), r), (dplan, rd)):
        mem, trace = model.base, []
        for stp in plan.steps:
            mem = model.step([pos[0][n] for n in stp.fwd], [pos[1][n] for n in stp.bwd],
                             mem0=mem, memory=trace)[2]
        assert mem == base, (plan.steps, mem, base)
        assert max(b for _, b in trace) == result.peak_bytes
        if result is r:
            assert [b for _, b in trace] == curve
    # also: cluster instead of a table
    r2 = simulate(layer, trivial_plan(layer), cluster=c, group_sizes={"tp": 4})
    assert r2.makespan == r.makespan


def _check_events(layer, plan, table, r):
    model = LaneModel(layer, table)
    # every op exactly once
    names = [(e[0], e[1]) for e in r.events]
    assert sorted(names) == sorted([(ALPHA, o.name) for o in layer.forward] +
                                   [(BETA, o.name) for o in layer.backward])
    alone = {(ALPHA, o.name): table.alone_f[o.name] for o in layer.forward}
    alone.update({(BETA, o.name): table.alone_b[o.name] for o in layer.backward})
    all_comm = sum(a for (st_, n), a in alone.items() if n in
                   {o.name for o in list(layer.forward) + list(layer.backward)
                    if o.lane != "compute"})
    lane_total = defaultdict(float)
    for (strand, op, lane, s, e) in r.events:
        d = e - s
        a = alone[(strand, op)]
        if lane == "compute":      # slowed at most by stalling through the others' comm
            assert a - EPS <= d <= a + all_comm + EPS, (op, d, a)
        else:                      # a comm op keeps its alone time
            assert d == pytest.approx(a, abs=EPS), (op, d, a)
        lane_total[lane] += a
    # conservation
    busiest = max(lane_total.values())
    assert r.makespan >= busiest - EPS
    assert r.makespan <= sum(e - s for (_, _, _, s, e) in r.events) + EPS
    # lanes never hold two ops at once
    by_lane = defaultdict(list)
    for ev in r.events:
        by_lane[ev[2]].append(ev)
    for evs in by_lane.values():
        evs.sort(key=lambda e: (e[3], e[4]))
        for x, y in zip(evs, evs[1:]):
            assert y[3] >= x[4] - EPS
    # steps run back to back: ops of a step start at or after the step's start on the
    # thread, its compute is done before the next step starts (a comm may run on past it);
    # within a strand ops start in chain order, and an op starts after the comm op it
    # reads, in whichever step that was issued
    from dhelix.planner.simulate import comm_readers
    readers = {ALPHA: comm_readers(layer.forward), BETA: comm_readers(layer.backward)}
    t0 = 0.0
    at = {(e[0], e[1]): e for e in r.events}
    for k, stp in enumerate(plan.steps):
        t1 = t0 + r.step_times[k]
        for strand, names in ((ALPHA, stp.fwd), (BETA, stp.bwd)):
            prev_start = t0
            for n in names:
                e = at[(strand, n)]
                assert t0 - EPS <= e[3] and (e[2] != "compute" or e[4] <= t1 + EPS)
                assert e[3] >= prev_start - EPS               # issue order in a strand
                prev_start = e[3]
        t0 = t1
    for strand, chain in ((ALPHA, layer.forward), (BETA, layer.backward)):
        for c, o in enumerate(chain):
            if readers[strand][c] >= 0:
                reader = chain[readers[strand][c]].name
                assert at[(strand, reader)][3] >= at[(strand, o.name)][4] - EPS
    assert r.makespan == pytest.approx(t0, rel=1e-12)
    assert r.makespan == pytest.approx(max(e[4] for e in r.events), rel=1e-12)


def test_work_conservation_random_plans():
    rng = random.Random(1)
    for _ in range(150):
        layer = random_layer(rng)
        table = random_table(layer, rng)
        plan = enumerate_.random_legal_plan(layer, rng)
        r = simulate(layer, plan, table)
        _check_events(layer, plan, table, r)
        assert r.peak_bytes >= sum(o.saved_bytes for o in layer.backward)


def test_steps_back_to_back_never_slower_than_barriers():
    """A plan's steps with the carry (a comm waited for by its reader only) end no later
    than the same steps each ended at a barrier (the DP planner's sum of step costs), and
    a one-step plan is the same either way."""
    from dhelix.planner.simulate import LaneModel, plan_indices
    rng = random.Random(5)
    fewer = 0
    for _ in range(150):
        layer = random_layer(rng)
        table = random_table(layer, rng)
        plan = enumerate_.random_legal_plan(layer, rng)
        model = LaneModel(layer, table)
        steps = plan_indices(model, plan)
        barriers = sum(model.step(f, b)[0] for f, b in steps)
        carried = simulate(layer, plan, table).makespan
        assert carried <= barriers + 1e-9
        fewer += carried < barriers - 1e-9
        one = [[k for f, _ in steps for k in f], [k for _, b in steps for k in b]]
        assert model.run([one])[0] == model.step(*one)[0]
    assert fewer > 0          # and it does pay on some plans


def test_memory_accounting():
    layer = two_op_layer("compute", "intra")
    t = table_for(layer, 1.0, 1.0, 1.0)
    r = simulate(layer, paired(layer), t)
    # base 40 (β's saved), α starts: +10 temp +100 saved, β starts: +5 -> 155
    assert r.peak_bytes == 155.0
    r = simulate(layer, paired(layer), t, base_bytes=0.0)
    assert r.peak_bytes == 115.0
    # β alone first frees its 40 before α allocates
    seq = Plan(layer.signature(), ["f"], ["b"], [Step([], ["b"]), Step(["f"], [])])
    assert simulate(layer, seq, t).peak_bytes == 40 + 10 + 100 - 40
    seq = Plan(layer.signature(), ["f"], ["b"], [Step(["f"], []), Step([], ["b"])])
    assert simulate(layer, seq, t).peak_bytes == max(40 + 110, 40 + 100 + 5)


def test_outputs(tmp_path):
    rng = random.Random(3)
    layer = random_layer(rng, 5, 6)
    table = random_table(layer, rng)
    r = simulate(layer, enumerate_.random_legal_plan(layer, rng), table)
    png = tmp_path / "t.png"
    plot_timeline(r, str(png))
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    tr = json.loads(json.dumps(to_chrome_trace(r)))
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(r.events)
    for e in xs:
        assert set(e) >= {"name", "ph", "ts", "dur", "pid", "tid", "args"}
        assert e["args"]["strand"] in (ALPHA, BETA) and e["dur"] >= 0
    assert sum(r.lane_busy().values()) == pytest.approx(sum(e[4] - e[3] for e in r.events))


def test_table_checks_in_simulate():
    layer = two_op_layer()
    t = table_for(layer, 1.0, 1.0, 1.5)
    del t.pair[("f", "b")]
    with pytest.raises(TableError, match=r"pair\[f, b\]"):
        simulate(layer, paired(layer), t)
    with pytest.raises(TableError, match="table or a cluster"):
        simulate(layer, paired(layer))


def test_a_comm_holds_the_thread_for_its_host_time():
    """The table's host time of a comm op (issuing it, the paced link's copies) is the
    thread's: the ops after it start that much later; the comm itself starts at issue,
    and its reader still waits for its end."""
    layer, t, plan = _dgrad_rs_wgrad()
    for host, wgrad, ln_b in ((0.5, (1.5, 2.5), (4.0, 5.0)),     # hidden under the comm
                              (3.5, (4.5, 5.5), (5.5, 6.5))):    # longer than the comm
        t.host_b = {"rs": host}
        ev = {e[1]: e for e in simulate(layer, plan, t).events}
        assert ev["rs"][3:] == (1.0, 4.0)
        assert ev["wgrad"][3:] == wgrad and ev["ln_b"][3:] == ln_b
    # a compute op's entry (none is measured) is never charged
    t.host_b = {"wgrad": 5.0}
    assert simulate(layer, plan, t).makespan == 6.0


def test_cpp_step_matches_python_bitwise(cpp_core):
    core = cpp_core
    rng = random.Random(7)
    for _ in range(300):
        layer = random_layer(rng)
        table = random_table(layer, rng, host=rng.random() < 0.5)
        model = LaneModel(layer, table)
        from dhelix.planner.dp import _Legality, _cpp_problem
        prob = _cpp_problem(model, _Legality(layer))
        plan = enumerate_.random_legal_plan(layer, rng)
        fpos = {n: k for k, n in enumerate(model.f_names)}
        bpos = {n: k for k, n in enumerate(model.b_names)}
        mem = model.base
        for s in plan.steps:
            fi, bi = [fpos[n] for n in s.fwd], [bpos[n] for n in s.bwd]
            py = model.step(fi, bi, mem0=mem)
            cc = prob.step_indices(fi, bi, mem)
            assert tuple(cc) == py
            mem = py[2]
