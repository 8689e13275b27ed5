"""The whole training step (planner/whole_step.py): F(1), the co-steps, B(N) and the
measured extras, against the lane model; tables with step extras; `dhelix simulate
--num-microbatches`."""
import json
import random

import pytest

from dhelix.planner import enumerate as enumerate_
from dhelix.planner.costs import CostTable, StepExtras, TableError
from dhelix.planner.example_layer import random_layer, random_table
from dhelix.planner.plan import Plan, trivial_plan
from dhelix.planner.simulate import LaneModel, simulate
from dhelix.planner.whole_step import (extras_of, plan_makespan, plan_steps_alone, predict,
                                       simulate_megatron_step, simulate_step, thread_floor)
from sim_fns import paired, table_for, two_op_layer


EXTRAS = StepExtras(pre_fwd_s=0.011, pre_bwd_s=0.013, post_fwd_s=0.017, post_bwd_s=0.019,
                    optimizer_s=0.23, finalize_s=0.029, num_layers=3, zero_grad_s=0.007)


def test_whole_step_arithmetic_on_a_two_op_layer():
    """compute f (1 s) beside comm b (2 s), launched together 2.75 s (2.5 s after the
    noise margin, a quarter of the 1 s compute): F(1) is L forwards, B(N) L backwards,
    every co-step L pairs of 2.5 s; the extras once per micro-batch and once per step."""
    layer = two_op_layer("compute", "intra")
    table = table_for(layer, 1.0, 2.0, 2.75)
    plan = paired(layer)
    mb = 0.011 + 0.013 + 0.017 + 0.019
    st = 0.23 + 0.029 + 0.007
    one = simulate_step(layer, plan, table, 3, 1, EXTRAS)        # N = 1: no co-step
    assert (one.forwards_alone, one.backwards_alone, one.co_steps) == (1, 1, 0)
    assert one.co_steps_s == 0.0
    assert one.forward_alone_s == pytest.approx(3 * 1.0)
    assert one.backward_alone_s == pytest.approx(3 * 2.0)
    assert one.total_s == pytest.approx(3 * 3.0 + mb + st)
    four = simulate_step(layer, plan, table, 3, 4, EXTRAS)
    assert four.co_steps == 3 and four.layer_pair_s == pytest.approx(2.5)
    assert four.co_steps_s == pytest.approx(3 * 3 * 2.5)
    assert four.microbatch_extras_s == pytest.approx(4 * mb)
    assert four.step_extras_s == pytest.approx(st)
    assert four.total_s == pytest.approx(3 * 3.0 + 3 * 3 * 2.5 + 4 * mb + st)
    assert sum(v for _, v in four.phases()) == pytest.approx(four.total_s)
    meg = simulate_megatron_step(layer, table, 3, 4, EXTRAS)
    assert (meg.forwards_alone, meg.backwards_alone, meg.co_steps) == (4, 4, 0)
    assert meg.total_s == pytest.approx(4 * 3 * 3.0 + 4 * mb + st)
    assert sum(v for _, v in meg.phases()) == pytest.approx(meg.total_s)
    # pairing pays off here (2.5 s for a pair, 3 s apart): DHelix's step is shorter
    assert four.total_s < meg.total_s
    assert four.to_json()["total_s"] == four.total_s


def test_whole_step_is_the_sum_of_lane_model_steps_on_random_plans():
    """F(1) and B(N) play their own strand's ops in the plan's order as one step (no
    barrier without a partner), a co-step the whole plan; with the trivial plan DHelix's
    step is megatron's order, less what the forward's last comm overlaps of the backward
    after it (a co-step's steps run back to back)."""
    rng = random.Random(11)
    for _ in range(60):
        layer = random_layer(rng)
        table = random_table(layer, rng)
        plan = enumerate_.random_legal_plan(layer, rng)
        L, N = rng.randint(1, 5), rng.randint(1, 6)
        model = LaneModel(layer, table)
        fpos = {n: k for k, n in enumerate(model.f_names)}
        bpos = {n: k for k, n in enumerate(model.b_names)}
        f = model.step([fpos[n] for s in plan.steps for n in s.fwd], [])[0]
        b = model.step([], [bpos[n] for s in plan.steps for n in s.bwd])[0]
        p = simulate(layer, plan, table).makespan
        w = simulate_step(layer, plan, table, L, N, EXTRAS)
        assert w.layer_forward_s == pytest.approx(f) and w.layer_backward_s == pytest.approx(b)
        assert w.layer_pair_s == pytest.approx(p)
        assert w.total_s == pytest.approx(L * (f + b) + L * (N - 1) * p +
                                          N * EXTRAS.per_microbatch() + EXTRAS.per_step())
        triv = trivial_plan(layer)
        tf = model.step(list(range(len(layer.forward))), [])[0]
        tb = model.step([], list(range(len(layer.backward))))[0]
        meg = simulate_megatron_step(layer, table, L, N, EXTRAS)
        assert meg.total_s == pytest.approx(N * L * (tf + tb) + N * EXTRAS.per_microbatch()
                                            + EXTRAS.per_step())
        tw = simulate_step(layer, triv, table, L, N, EXTRAS).total_s
        assert tw <= meg.total_s + 1e-9
        assert tw == pytest.approx(meg.total_s - L * (N - 1) * (
            tf + tb - simulate(layer, triv, table).makespan))
        assert plan_steps_alone(model, triv) == pytest.approx((tf, tb))
        assert plan_makespan(model, plan) == pytest.approx(p)


def test_thread_floor_is_the_threads_own_work_and_no_plan_goes_below_it():
    """The thread floor: every compute op's in-step time plus every comm op's host time
    (summed by hand here), per layer and for the whole step; on 60 random layers with host
    times and random plans (rotated and reordered too), the plan's layer pair, its layers
    alone and both whole steps never go below it, and the trivial plan's alone steps
    reach it where no comm's wire time is exposed."""
    rng = random.Random(5)
    for _ in range(60):
        layer = random_layer(rng)
        table = random_table(layer, rng, host=True)
        plan = enumerate_.random_legal_plan(layer, rng)
        L, N = rng.randint(1, 5), rng.randint(1, 6)
        fl = thread_floor(layer, table, L, N, EXTRAS)

        def own(ops, T, H):
            return sum(T.get(o.name, 0.0) if o.lane == "compute" else H.get(o.name, 0.0)
                       for o in ops)
        f = own(layer.forward, {**table.alone_f, **table.in_step_f}, table.host_f)
        b = own(layer.backward, {**table.alone_b, **table.in_step_b}, table.host_b)
        assert fl.layer_forward_s == pytest.approx(f)
        assert fl.layer_backward_s == pytest.approx(b)
        assert fl.pair_s == pytest.approx(f + b)
        assert fl.step_s == pytest.approx(L * N * (f + b) + N * EXTRAS.per_microbatch() +
                                          EXTRAS.per_step())
        w = simulate_step(layer, plan, table, L, N, EXTRAS)
        meg = simulate_megatron_step(layer, table, L, N, EXTRAS)
        assert w.layer_pair_s >= fl.pair_s - 1e-12
        assert w.layer_forward_s >= f - 1e-12 and w.layer_backward_s >= b - 1e-12
        assert w.total_s >= fl.step_s - 1e-9 and meg.total_s >= fl.step_s - 1e-9
    # a compute op beside a comm whose wire time is within its host time: at the floor
    layer = two_op_layer("compute", "intra")
    table = table_for(layer, 1.0, 2.0, 2.5)
    table.host_b = {"b": 2.0}
    fl = thread_floor(layer, table, 3, 1, EXTRAS)
    assert (fl.layer_forward_s, fl.layer_backward_s) == (1.0, 2.0)
    assert simulate_step(layer, trivial_plan(layer), table, 3, 1, EXTRAS).total_s == \
        pytest.approx(fl.step_s)


def test_whole_step_alone_cost_is_swappable_and_counts_are_checked():
    layer = two_op_layer("compute", "intra")
    table = table_for(layer, 1.0, 2.0, 2.5)
    w = simulate_step(layer, paired(layer), table, 2, 3, EXTRAS,
                      alone=lambda model, plan: (0.25, 0.5))
    assert w.forward_alone_s == pytest.approx(2 * 0.25)
    assert w.backward_alone_s == pytest.approx(2 * 0.5)
    pair = simulate(layer, paired(layer), table).makespan
    assert w.co_steps_s == pytest.approx(2 * 2 * pair)     # the co-steps are untouched
    for L, N in ((0, 2), (2, 0)):
        with pytest.raises(ValueError, match="must be >= 1"):
            simulate_step(layer, paired(layer), table, L, N, EXTRAS)


def test_table_round_trip_with_step_extras(tmp_path):
    layer = two_op_layer("compute", "intra")
    t = table_for(layer, 1.0, 2.0, 2.5)
    t.step_extras = EXTRAS
    path = str(tmp_path / "t.json")
    t.save(path)
    back = CostTable.load(path, layer=layer, pairs="concurrent")
    assert back.step_extras == EXTRAS
    assert back.signature == t.signature == layer.signature()   # the layer check is as before
    d = json.load(open(path))
    assert d["step_extras"]["num_layers"] == 3 and d["step_extras"]["optimizer_s"] == 0.23
    # the whole step from the loaded table: the extras' layer count by default
    dh, mg = predict(layer, paired(layer), back, 4, source=path)
    assert dh.num_layers == mg.num_layers == 3
    assert dh.total_s == pytest.approx(simulate_step(layer, paired(layer), t, 3, 4,
                                                     EXTRAS).total_s)
    assert predict(layer, paired(layer), back, 4, num_layers=7)[0].num_layers == 7
    # an old table (no field) loads, with no extras, and writes no field back
    del d["step_extras"]
    old = str(tmp_path / "old.json")
    json.dump(d, open(old, "w"))
    t_old = CostTable.load(old, layer=layer, pairs="concurrent")
    assert t_old.step_extras is None and "step_extras" not in t_old.to_json()
    # corrupt extras name the file and the entry
    for bad, words in (({"pre_fwd_s": 1.0}, "lacks"),
                       ({**EXTRAS.to_json(), "optimizer_s": -1.0}, r"step_extras\[optimizer_s\]"),
                       ({**EXTRAS.to_json(), "num_layers": 0}, r"step_extras\[num_layers\]"),
                       ([1, 2], "must be an object")):
        d["step_extras"] = bad
        json.dump(d, open(old, "w"))
        with pytest.raises(TableError, match=words) as e:
            CostTable.load(old)
        assert old in str(e.value)


def test_old_table_has_no_step_extras_error():
    layer = two_op_layer("compute", "intra")
    t = table_for(layer, 1.0, 2.0, 2.5)
    with pytest.raises(TableError) as e:
        extras_of(t, "/some/where/table.json")
    assert "/some/where/table.json" in str(e.value) and "dhelix profile" in str(e.value)
    with pytest.raises(TableError, match="dhelix profile"):
        predict(layer, paired(layer), t, 4, source="t.json")


def test_simulate_cli_whole_step(tmp_path, capsys):
    """`dhelix profile` on 2 ranks writes the step extras; `dhelix simulate PLAN
    --num-microbatches N` prints the whole step they give; a table without them, or the
    analytical model, is a one-line error naming the fix."""
    import subprocess
    import sys

    from dhelix.base.units import fmt_time
    from dhelix.cli import main
    from dhelix.models.config import load_model_config
    from dhelix.planner.shapes import layer_ops_for_shape

    shape = ["--config", "tiny", "--tensor-model-parallel-size", "2", "--sequence-parallel",
             "--seq-length", "32", "--micro-batch-size", "2"]
    table = str(tmp_path / "table.json")
    r = subprocess.run([sys.executable, "-m", "dhelix.cli", "profile", *shape, "--warmup",
                        "0", "--repeats", "1", "--out", table, "--nproc", "2", "--timeout",
                        "400"], capture_output=True, text=True, timeout=430)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "step extras (2 layers" in r.stdout
    t = CostTable.load(table)
    x = t.step_extras
    assert x is not None and x.num_layers == load_model_config("tiny").num_layers == 2
    assert x.data_parallel_size == 1
    assert all(getattr(x, k) > 0 for k in StepExtras.SECONDS)

    plan = str(tmp_path / "plan.json")
    assert main(["plan", *shape, "--table", table, "--out", plan]) == 0
    capsys.readouterr()
    assert main(["simulate", plan, "--num-microbatches", "4"]) == 0
    out = capsys.readouterr().out
    layer = layer_ops_for_shape(load_model_config("tiny"), 2, True, 32, 2)
    dh, mg = predict(layer, Plan.load(plan), t, 4)
    assert "whole step: 2 layers, 4 micro-batches" in out
    assert "3 co-steps" in out and "B(4)" in out and "4 forwards" in out
    assert f"predicted step: DHelix {fmt_time(dh.total_s)}, megatron {fmt_time(mg.total_s)}" \
        in out
    assert f"speedup {mg.total_s / dh.total_s:.3f}x" in out
    # --pair-last: the paired tail's phases and its prediction
    assert main(["simulate", plan, "--num-microbatches", "4", "--pair-last"]) == 0
    last, _ = predict(layer, Plan.load(plan), t, 4, pair_last=True)
    got = capsys.readouterr().out
    assert "2 co-steps F(k+2) ∥ B(k)" in got and "B(3) ∥ B(4)" in got
    assert f"predicted step: DHelix {fmt_time(last.total_s)}" in got
    fl = thread_floor(layer, t, 2, 4, x)
    assert f"thread floor (every compute op's time in a layer step + every comm op's host " \
        f"work, nothing waited for): layer pair {fmt_time(fl.pair_s)}" in out
    assert f"whole step {fmt_time(fl.step_s)}: no schedule of these ops on one thread beats " \
        f"megatron's order by more than {mg.total_s / fl.step_s:.3f}x" in out

    # a table from before the extras: one line naming the table and the fix
    d = json.load(open(table))
    del d["step_extras"]
    old = str(tmp_path / "old.json")
    json.dump(d, open(old, "w"))
    assert main(["simulate", plan, "--table", old, "--num-microbatches", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dhelix simulate: error:") and err.count("\n") == 1
    assert old in err and "re-run `dhelix profile`" in err and "Traceback" not in err
    # without --num-microbatches the old table simulates the layer as before
    assert main(["simulate", plan, "--table", old]) == 0
    assert "whole step" not in capsys.readouterr().out
    # the analytical model has no extras either
    assert main(["simulate", plan, "--cluster", "a800", "--num-microbatches", "4"]) == 2
    err = capsys.readouterr().err
    assert "analytical" in err and "dhelix profile" in err

    # --host-scale F: the comm ops' host times x F, in the plan (its meta records F),
    # replayed by simulate, overridden there; the floor moves by exactly that share
    assert t.host_f and t.host_b
    half = str(tmp_path / "half.json")
    assert main(["plan", *shape, "--table", table, "--host-scale", "0.5", "--out", half]) == 0
    assert "comm host times x 0.5" in capsys.readouterr().out
    assert Plan.load(half).meta["cost_source"]["host_scale"] == 0.5
    scaled = _host_scaled(t, 0.5)
    for argv, T in (([], scaled), (["--host-scale", "1"], t), (["--host-scale", "0.5"], scaled)):
        assert main(["simulate", half, "--num-microbatches", "4", *argv]) == 0
        out = capsys.readouterr().out
        fl = thread_floor(layer, T, 2, 4, x)
        assert f"layer pair {fmt_time(fl.pair_s)}" in out
        dh, mg = predict(layer, Plan.load(half), T, 4)
        assert f"predicted step: DHelix {fmt_time(dh.total_s)}" in out
        assert ("comm host times x 0.5" in out) == (T is scaled)
    zero = thread_floor(layer, _host_scaled(t, 0.0), 2, 4, x)
    host = sum(t.host_f.values()) + sum(t.host_b.values())
    assert fl.pair_s - zero.pair_s == pytest.approx(0.5 * host)
    # bad scales, the analytical model, a table without host times: one line each
    nohost = str(tmp_path / "nohost.json")
    d = json.load(open(table))
    del d["host_f"], d["host_b"]
    json.dump(d, open(nohost, "w"))
    for argv, msg in ((["--table", table, "--host-scale", "-1"], "must be >= 0"),
                      (["--cluster", "a800", "--host-scale", "0"], "analytical model has none"),
                      (["--table", nohost, "--host-scale", "0"], "no comm host times")):
        assert main(["plan", *shape, *argv, "--out", str(tmp_path / "x.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dhelix plan: error: --host-scale") and msg in err
        assert err.count("\n") == 1
    assert "nohost.json" in err and "dhelix profile" in err

    # scripts/speedup_vs_ratio.py --host-scales: a row per (F, k), each its table's floor
    import importlib.util
    import sys
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "speedup_vs_ratio", Path(__file__).parent.parent / "scripts" / "speedup_vs_ratio.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows_json = tmp_path / "sweep.json"
    argv = sys.argv
    try:
        sys.argv = ["speedup_vs_ratio.py", "--table", table, "--config", "tiny",
                    "--seq-length", "32", "--micro-batch-size", "2", "--num-microbatches", "4",
                    "--scales", "1,2", "--host-scales", "1,0", "--json", str(rows_json),
                    "--png", str(tmp_path / "sweep.png")]
        mod.main()
        sys.argv[sys.argv.index("1,0")] = "-1"
        with pytest.raises(SystemExit, match="--host-scale -1: must be >= 0"):
            mod.main()
    finally:
        sys.argv = argv
    rows = json.load(open(rows_json))["rows"]
    assert [(r["host_scale"], r["scale"]) for r in rows] == [(1, 1), (1, 2), (0, 1), (0, 2)]
    for r in rows:
        T = mod.scaled(_host_scaled(t, r["host_scale"]), layer, r["scale"])
        mg_s = simulate_megatron_step(layer, T, 2, 4, x).total_s
        assert r["megatron_s"] == pytest.approx(mg_s)
        assert r["floor"] == pytest.approx(mg_s / thread_floor(layer, T, 2, 4, x).step_s)
        assert r["speedup"] <= r["floor"] * (1 + 1e-9)
    assert rows[2]["floor"] > rows[0]["floor"]        # no host work: a higher floor
    assert (tmp_path / "sweep.png").stat().st_size > 0


def _host_scaled(t, f):
    """`t` with its comm host times x f."""
    import dataclasses
    return dataclasses.replace(t, host_f={k: v * f for k, v in t.host_f.items()},
                               host_b={k: v * f for k, v in t.host_b.items()})


def _three_op_layer():
    """forward: compute fc (1 s), comm fm (1 s); backward: compute c1 (1 s), comm m (2 s)
    read by compute c2 (1 s); every pair overlaps for free (stretch 1)."""
    from dhelix.planner.opspec import COMM, COMPUTE, LayerOps, OpSpec
    layer = LayerOps([OpSpec("fc", COMPUTE, "compute"), OpSpec("fm", COMM, "intra", group="tp")],
                     [OpSpec("c1", COMPUTE, "compute"), OpSpec("m", COMM, "intra", group="tp"),
                      OpSpec("c2", COMPUTE, "compute")])
    t = CostTable.empty(layer)
    t.alone_f.update(fc=1.0, fm=1.0)
    t.alone_b.update(c1=1.0, m=2.0, c2=1.0)
    t.pair.update({("fc", "m"): 2.0, ("fm", "c1"): 1.0, ("fm", "c2"): 1.0})
    return layer, t


def test_halves_price_the_round_robin_of_two_half_chains():
    """B(N) as two batch halves (`run_tiles`), each op half as long: a:c1 0–0.5; a:m on
    the link 0.5–1.5 beside b:c1 0.5–1.0; b:m issued at 1.0 waits for the link, 1.5–2.5,
    while a:c2 reads a:m, 1.5–2.0; b:c2 2.5–3.0. So 3.0 s against 4.0 s whole (c1, m, c2
    in a row). The forward likewise: 1.5 s against 2.0 s."""
    from dhelix.planner.tiles import tiles_makespan
    from dhelix.planner.whole_step import halves_alone
    layer, t = _three_op_layer()
    assert tiles_makespan(layer, t, "bwd") == pytest.approx(3.0)
    assert tiles_makespan(layer, t, "fwd") == pytest.approx(1.5)
    whole = plan_steps_alone(LaneModel(layer, t), trivial_plan(layer))
    assert whole == pytest.approx((2.0, 4.0))
    extras = StepExtras(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, num_layers=3)
    plain = simulate_step(layer, trivial_plan(layer), t, 3, 4, extras)
    halved = simulate_step(layer, trivial_plan(layer), t, 3, 4, extras,
                           alone=halves_alone(layer, t))
    # only B(N) changes: L layers of 3.0 s instead of 4.0 s
    assert halved.forward_alone_s == plain.forward_alone_s
    assert halved.co_steps_s == plain.co_steps_s
    assert halved.backward_alone_s == pytest.approx(3 * 3.0)
    assert plain.backward_alone_s == pytest.approx(3 * 4.0)
    assert halved.halves and not plain.halves
    assert "two halves" in halved.phases()[2][0]


def test_pair_last_prices_two_backwards_round_robin():
    """`--dhelix-pair-last`: B(N−1) ∥ B(N), two whole backward chains round-robin: a:c1
    0–1; a:m on the link 1–3 beside b:c1 1–2; b:m waits for the link, 3–5, while a:c2
    reads a:m, 3–4; b:c2 5–6. So 6.0 s a layer against 2 × 4.0 s alone. The step: F(1)
    and F(2) alone, N−2 co-steps, the tail; with one micro-batch, nothing to pair."""
    from dhelix.planner.tiles import tiles_makespan
    layer, t = _three_op_layer()
    assert tiles_makespan(layer, t, "bwd", share=1.0) == pytest.approx(6.0)
    extras = StepExtras(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, num_layers=3)
    plain = simulate_step(layer, trivial_plan(layer), t, 3, 4, extras)
    last = simulate_step(layer, trivial_plan(layer), t, 3, 4, extras, pair_last=True)
    assert (last.forwards_alone, last.backwards_alone, last.co_steps) == (2, 0, 2)
    assert last.layer_tail_s == pytest.approx(6.0) and last.tail_s == pytest.approx(18.0)
    assert last.total_s == pytest.approx(plain.total_s + 3 * 2.0 - 3 * plain.layer_pair_s
                                         + 18.0 - 3 * 4.0)
    assert last.layers_s == pytest.approx(last.total_s)
    assert "B(3) ∥ B(4)" in last.phases()[2][0]
    one = simulate_step(layer, trivial_plan(layer), t, 3, 1, extras, pair_last=True)
    assert one.total_s == simulate_step(layer, trivial_plan(layer), t, 3, 1, extras).total_s
    with pytest.raises(ValueError, match="halves"):
        from dhelix.planner.whole_step import halves_alone
        simulate_step(layer, trivial_plan(layer), t, 3, 4, extras, pair_last=True,
                      alone=halves_alone(layer, t))


def test_halves_never_beat_the_link_or_the_thread():
    """On random layers and tables, two halves of a chain take at least the chain's whole
    comm time on each lane and its whole compute time (halving moves no work away)."""
    from dhelix.planner.tiles import tiles_makespan
    rng = random.Random(5)
    for _ in range(40):
        layer = random_layer(rng)
        table = random_table(layer, rng)
        for kind, chain, alone in (("fwd", layer.forward, table.alone_f),
                                   ("bwd", layer.backward, table.alone_b)):
            t = tiles_makespan(layer, table, kind)
            per_lane = {}
            for o in chain:
                per_lane[o.lane] = per_lane.get(o.lane, 0.0) + alone[o.name]
            assert t >= max(per_lane.values()) * (1 - 1e-9)


def test_simulate_cli_halves_needs_a_whole_step(tmp_path, capsys):
    from dhelix.cli import main
    layer, t = _three_op_layer()
    plan = tmp_path / "plan.json"
    trivial_plan(layer).save(str(plan))
    for flags, name in ((["--halves"], "--halves"), (["--pair-last"], "--pair-last"),
                        (["--halves", "--pair-last", "--num-microbatches", "4"],
                         "give one of them")):
        assert main(["simulate", str(plan), *flags]) == 2
        assert name in capsys.readouterr().err
