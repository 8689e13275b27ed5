"""`dhelix plan`: plan one layer shape with the DP planner and write the plan JSON.

Reads the shape flags and a cost source (``--table`` or ``--cluster``), runs the planner
(DESIGN §1.3), prints the plan table with its predicted and trivial step time and peak memory,
and writes the plan file (with the layer, shape and cost source in its meta) for
``dhelix simulate``.
"""
from __future__ import annotations

from typing import Optional

from dhelix.planner.cli import (CliError, _add_cost_args, _add_planner_args, _add_shape_args,
                                _cost_str, _expected_errors, _fail, _readable_budget_error,
                                _shape_from_args, fmt_bytes, fmt_time, layer_for_shape,
                                load_costs, node_size, parse_bytes, shape_str)


def make_plan(shape: dict, table: Optional[str] = None, cluster: Optional[str] = None,
              memory_budget: Optional[float] = None, backend: str = "auto",
              force: bool = False):
    """Plan one layer shape; returns (plan, layer_ops) with the CLI's extra meta filled."""
    from dhelix.planner import dp
    layer = layer_for_shape(shape, node_size(cluster))
    costs, src = load_costs(layer, shape, table, cluster, force)
    p = dp.plan(layer, costs, memory_budget_bytes=memory_budget, backend=backend, force=force)
    p.meta["layer"] = layer.to_json()
    p.meta["shape"] = dict(shape)
    p.meta["cost_source"] = src
    return p, layer


def cmd_plan(a, argv) -> int:
    try:
        shape = _shape_from_args(a)
        budget = None if a.memory_budget is None else parse_bytes(a.memory_budget)
        p, layer = make_plan(shape, a.table, a.cluster, budget, a.backend, a.force)
    except _expected_errors() as e:
        return _fail("plan", _readable_budget_error(e))
    try:
        p.save(a.out)
    except OSError as e:
        return _fail("plan", CliError(f"--out {a.out}: cannot write the plan ({e.strerror})"))
    m = p.meta
    print(f"dhelix plan: {shape_str(shape, node_size(a.cluster))}")
    print(f"layer: {len(layer.forward)} forward x {len(layer.backward)} backward ops, "
          f"signature {layer.signature()}")
    print(f"costs: {_cost_str(m['cost_source'])}")
    print()
    print(p.table())
    print()
    t, triv = m["predicted_s"], m["trivial_predicted_s"]
    print(f"steps:                {len(p.steps)} ({p.num_paired()} paired)")
    print(f"predicted layer step: {fmt_time(t)}  (trivial plan {fmt_time(triv)}, "
          f"speedup {triv / t if t > 0 else 1.0:.3f}x)")
    budget_txt = "" if budget is None else f"  (budget {fmt_bytes(budget)})"
    print(f"predicted peak mem:   {fmt_bytes(m.get('predicted_peak_bytes'))}{budget_txt}")
    print(f"planning time:        {m['planning_time_s'] * 1e3:.1f} ms (backend {m['backend']})")
    print(f"wrote {a.out}  (simulate it: dhelix simulate {a.out})")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan one layer shape (DP planner) and write the plan JSON",
                       description="Find the fastest legal plan for one layer shape: a "
                                   "dynamic program over where each strand's segments end "
                                   "and which run together (README: Planner and "
                                   "simulator); costs from a measured table or a cluster "
                                   "file.")
    _add_shape_args(p, required=True)
    _add_cost_args(p, required=True)
    _add_planner_args(p)
    p.add_argument("--out", default="plan.json", metavar="PLAN.json",
                   help="where to write the plan (default plan.json)")
    p.set_defaults(func=cmd_plan)
