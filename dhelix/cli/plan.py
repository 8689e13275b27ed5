"""`dhelix plan`: plan one layer shape with the DP planner and write the plan JSON.

Reads the shape flags and a cost source (``--table`` or ``--cluster``), runs the planner
(`dhelix.planner.problem.make_plan`), prints the plan table with its predicted and trivial
step time and peak memory, and writes the plan file (with the layer, shape and cost source
in its meta) for ``dhelix simulate`` and ``dhelix train --dhelix-plan``.
"""
from __future__ import annotations

from dhelix.base.units import fmt_bytes, fmt_time, parse_bytes
from dhelix.cli.common import fail
from dhelix.cli.planner_args import (add_cost_args, add_planner_args, add_shape_args,
                                     shape_from_args)
from dhelix.planner.problem import (InputError, cost_str, expected_errors, make_plan,
                                    node_size, readable_budget_error, shape_str)


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan one layer shape (DP planner) and write the plan JSON",
                       description="Find the fastest legal plan for one layer shape: a "
                                   "dynamic program over where each strand's segments end "
                                   "and which run together (README: Planner and "
                                   "simulator); costs from a measured table or a cluster "
                                   "file.")
    add_shape_args(p, required=True)
    add_cost_args(p, required=True)
    add_planner_args(p)
    p.add_argument("--no-rotation", dest="rotate", action="store_false",
                   help="plan β's chain unrotated only (by default the planner also tries "
                        "each rotation, where a layer step's β ops start inside a node, and "
                        "keeps the one whose co-step ends first; docs/planner.md)")
    p.add_argument("--no-reorder", dest="reorder", action="store_false",
                   help="plan β's node in the chain's (megatron's) order only (by default "
                        "the planner also moves re-gathers and wgrads within the node, "
                        "e.g. a re-gather issued early to fill the link; docs/planner.md)")
    p.add_argument("--min-gain", type=float, default=None, metavar="F",
                   help="write the trivial plan when the best plan's co-step is predicted "
                        "to gain less than this share over it (default 0.02, what `dhelix "
                        "train --dhelix` uses; 0 keeps the best plan always; not with "
                        "--memory-budget)")
    p.add_argument("--out", default="plan.json", metavar="PLAN.json",
                   help="where to write the plan (default plan.json)")
    p.set_defaults(func=run)


def run(a) -> int:
    try:
        shape = shape_from_args(a)
        budget = None if a.memory_budget is None else parse_bytes(a.memory_budget, "--memory-budget")
        if a.min_gain is not None and not 0 <= a.min_gain < 1:
            raise InputError(f"--min-gain {a.min_gain}: must be in [0, 1) (a share: 0.02 "
                             f"is 2%)")
        p, layer = make_plan(shape, a.table, a.cluster, budget, a.backend, a.force,
                             rotate=a.rotate, reorder=a.reorder, min_gain=a.min_gain,
                             host_scale=1.0 if a.host_scale is None else a.host_scale)
    except expected_errors() as e:
        return fail("plan", readable_budget_error(e))
    try:
        p.save(a.out)
    except OSError as e:
        return fail("plan", InputError(f"--out {a.out}: cannot write the plan ({e.strerror})"))
    m = p.meta
    print(f"dhelix plan: {shape_str(shape, node_size(a.cluster))}")
    print(f"layer: {len(layer.forward)} forward x {len(layer.backward)} backward ops, "
          f"signature {layer.signature()}")
    print(f"costs: {cost_str(m['cost_source'])}")
    print()
    print(p.table())
    print()
    t, triv = m["predicted_s"], m["trivial_predicted_s"]
    print(f"steps:                {len(p.steps)} ({p.num_paired()} paired)")
    print(f"predicted layer step: {fmt_time(t)}  (trivial plan {fmt_time(triv)}, "
          f"speedup {triv / t if t > 0 else 1.0:.3f}x)")
    kept = m.get("kept_trivial")
    if kept:
        print(f"kept the trivial plan: the best plan's co-step ({fmt_time(kept['best_co_step_s'])}"
              f" for {m['co_step_layers']} layers) gains {kept['gain'] * 100:.1f}% over it, "
              f"under --min-gain {kept['min_gain']:g}")
    if p.rotation:
        print(f"rotation:             {p.rotation} (unrotated plan "
              f"{fmt_time(m['unrotated_predicted_s'])}; a co-step of {m['co_step_layers']} "
              f"layers {fmt_time(m['co_step_predicted_s'])})")
    if p.backward != [o.name for o in layer.backward]:
        print(f"β's node order:       {' '.join(p.backward)}")
        print(f"                      (reordered: a co-step of {m['co_step_layers']} layers "
              f"{fmt_time(m['co_step_predicted_s'])}, in the chain's order "
              f"{fmt_time(m['chain_order_co_step_s'])})")
    budget_txt = "" if budget is None else f"  (budget {fmt_bytes(budget)})"
    print(f"predicted peak mem:   {fmt_bytes(m.get('predicted_peak_bytes'))}{budget_txt}")
    print(f"planning time:        {m['planning_time_s'] * 1e3:.1f} ms (backend {m['backend']})")
    print(f"wrote {a.out}  (simulate it: dhelix simulate {a.out})")
    return 0
