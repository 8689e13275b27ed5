"""`dhelix simulate`: play a plan file on the event simulator (DESIGN §1.5).

The layer and cost source come from the plan's meta (written by ``dhelix plan``) unless the
shape flags or ``--table``/``--cluster`` are given. Prints makespan, peak memory and lane busy
times against the trivial plan, and writes a timeline PNG and a Chrome trace.
"""
from __future__ import annotations

import json
import os

from dhelix.planner.cli import (CliError, _add_cost_args, _add_shape_args, _cost_str,
                                _expected_errors, _fail, _shape_from_args, _shape_given,
                                fmt_bytes, fmt_time, layer_for_shape, load_costs, shape_str)


def _default_beside(plan_path: str, suffix: str) -> str:
    root, ext = os.path.splitext(plan_path)
    return (root if ext.lower() == ".json" else plan_path) + suffix


def cmd_simulate(a, argv) -> int:
    from dhelix.planner.opspec import LayerOps
    from dhelix.planner.plan import Plan, PlanError, trivial_plan, validate
    from dhelix.planner.simulate import plot_timeline, simulate, to_chrome_trace
    try:
        plan = Plan.load(a.plan)
        meta = plan.meta or {}
        meta_shape = meta.get("shape") if isinstance(meta.get("shape"), dict) else None
        if _shape_given(a):
            shape = _shape_from_args(a)
            layer = layer_for_shape(shape)
            layer_from = "the shape flags"
        elif isinstance(meta.get("layer"), dict):
            try:
                layer = LayerOps.from_json(meta["layer"])
            except (KeyError, TypeError) as e:
                raise PlanError(f"{a.plan}: meta.layer is not a layer description ({e}); "
                                f"give the shape flags (--config, ...)")
            shape = meta_shape
            layer_from = "the plan file"
        elif meta_shape:
            shape = dict(meta_shape)
            layer = layer_for_shape(shape)
            layer_from = "the plan's shape"
        else:
            raise CliError(f"{a.plan} does not record its layer (no meta.layer; not written by "
                           f"`dhelix plan`): give the shape flags --config, "
                           f"--tensor-model-parallel-size, --sequence-parallel, --seq-length, "
                           f"--micro-batch-size, --bf16, --lane as for `dhelix plan`")
        validate(plan, layer, source=a.plan)
        table, cluster, force = a.table, a.cluster, a.force
        if not table and not cluster:
            src = meta.get("cost_source")
            if not isinstance(src, dict) or src.get("kind") not in ("table", "cluster"):
                raise CliError(f"{a.plan} does not record its cost source: give --table PATH "
                               f"or --cluster NAME")
            if src["kind"] == "table":
                table = src.get("path")
                force = force or bool(src.get("forced"))     # forced when planned
            else:
                cluster = src.get("path") if src.get("path") and os.path.isfile(src["path"]) \
                    else src.get("name")
        costs, src = load_costs(layer, shape, table, cluster, force)
        res = simulate(layer, plan, costs, force=force)
        triv = simulate(layer, trivial_plan(layer), costs, force=force)
    except _expected_errors() as e:
        return _fail("simulate", e)

    print(f"dhelix simulate: {a.plan}  ({len(plan.steps)} steps, {plan.num_paired()} paired; "
          f"layer from {layer_from})")
    if shape:
        print(f"shape: {shape_str(shape)}")
    print(f"costs: {_cost_str(src)}")
    speed = triv.makespan / res.makespan if res.makespan > 0 else 1.0
    print(f"makespan:      {fmt_time(res.makespan)}  (trivial plan {fmt_time(triv.makespan)}, "
          f"speedup {speed:.3f}x)")
    if isinstance(meta.get("predicted_s"), (int, float)):
        print(f"planner said:  {fmt_time(meta['predicted_s'])}")
    print(f"peak memory:   {fmt_bytes(res.peak_bytes)}  (trivial plan "
          f"{fmt_bytes(triv.peak_bytes)})")
    busy = res.lane_busy()
    span = res.makespan if res.makespan > 0 else 1.0
    print("lane busy:     " + ", ".join(f"{lane} {fmt_time(v)} ({v / span * 100:.0f}%)"
                                        for lane, v in busy.items()))
    png = a.png or _default_beside(a.plan, ".png")
    trace = a.trace or _default_beside(a.plan, ".trace.json")
    try:
        plot_timeline(res, png, title=f"{os.path.basename(a.plan)}: makespan "
                                      f"{fmt_time(res.makespan)} (trivial "
                                      f"{fmt_time(triv.makespan)}), peak "
                                      f"{fmt_bytes(res.peak_bytes)}")
        with open(trace, "w") as f:
            json.dump(to_chrome_trace(res), f)
    except OSError as e:
        return _fail("simulate", CliError(f"cannot write output: {e}"))
    print(f"wrote {png} (timeline) and {trace} (Chrome trace: chrome://tracing or Perfetto)")
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("simulate", help="play a plan on the event simulator: makespan, peak "
                                        "memory, timeline PNG, Chrome trace",
                       description="Simulate a plan file on the three-lane executor replay "
                                   "(README: Planner and simulator). The layer and cost "
                                   "source come from the plan's meta (written by `dhelix "
                                   "plan`) unless given here.")
    s.add_argument("plan", metavar="PLAN", help="plan JSON file")
    _add_shape_args(s, required=False)
    _add_cost_args(s, required=False)
    s.add_argument("--png", default=None, metavar="PATH",
                   help="timeline chart (default: PLAN with .png)")
    s.add_argument("--trace", default=None, metavar="PATH",
                   help="Chrome trace JSON (default: PLAN with .trace.json)")
    s.set_defaults(func=cmd_simulate)
