"""The trivial plan instead of a near tie (`dp.plan(min_gain=...)`).

A plan whose co-step is predicted to gain less than `MIN_GAIN` over the trivial plan's
(nothing paired) is not run: a gain that small lies inside the simulator's error between
two plans, while the trivial plan's cost is known (about megatron's). `dhelix train
--dhelix`, `dhelix plan` (`--min-gain`), the bench's predictions and the paced-compute
plan use it; docs/planner.md.
"""
from __future__ import annotations

from typing import Optional

from dhelix.planner.costs import CostTable
from dhelix.planner.opspec import LayerOps
from dhelix.planner.plan import Plan, new_plan, trivial_plan

MIN_GAIN = 0.02     # a share: 2%


def keep_trivial(best: Plan, layer: LayerOps, table: CostTable, min_gain: float,
                 base_bytes: Optional[float] = None, force: bool = False) -> Plan:
    """`best`, or the trivial plan when `best`'s co-step of the model's layers is predicted
    under (1 + min_gain) times faster than the trivial plan's; the trivial plan's meta
    says so (`kept_trivial`: the best plan's prediction, its gain, the threshold)."""
    from dhelix.planner.simulate import simulate
    m = best.meta
    L = m.get("co_step_layers", 1)
    triv_t = m["trivial_predicted_s"]
    best_co = m.get("co_step_predicted_s", L * m["predicted_s"])
    gain = (L * triv_t) / best_co - 1.0 if best_co > 0 else 0.0
    if gain >= min_gain:
        return best
    triv = trivial_plan(layer)
    sim = simulate(layer, triv, table, base_bytes=base_bytes, force=force)
    keep = ("made_by", "backend", "table_provenance", "co_step_layers", "planning_time_s")
    meta = {k: m[k] for k in keep if k in m}
    meta.update(predicted_s=triv_t, trivial_predicted_s=triv_t, speedup_vs_trivial=1.0,
                co_step_predicted_s=L * triv_t, predicted_peak_bytes=sim.peak_bytes,
                num_steps=len(triv.steps),
                kept_trivial={"best_co_step_s": best_co, "gain": gain,
                              "min_gain": min_gain})
    return new_plan(layer, triv.steps, meta)
