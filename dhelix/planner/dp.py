"""The DP planner of DESIGN §1.3, at op granularity.

State (i, j): the first i forward ops and the first j backward ops (in ``layer.backward``
order, each wgrad right after its dgrad) are done.  A transition is one step: the next
forward segment F[i:i'] alone, the next backward segment B[j:j'] alone, or both together;
any segments make a legal step (several comm ops of one group included: the lanes run
them first-in first-out, in the executor's one order), and under a memory budget a step
is allowed when its simulated peak stays within the budget.  Because steps end at
barriers, and the planner chooses where they go (a longer step has fewer), a plan's time is the sum of its steps' times, so

    T(i', j') = min over legal (i, j) -> (i', j') of T(i, j) + cost(F[i:i'], B[j:j'])

finds the optimum exactly in O(n²m²) step evaluations.  The memory level at a step
boundary depends only on (i, j) (forward ops allocate, backward ops free), so the budget
is a per-transition constraint and the constrained optimum is exact too.

Tie-breaking (shared with csrc/planner.cpp): states are filled for i' ascending, then j'
ascending; the candidates of a state are scanned for i ascending, then j ascending, and
a candidate replaces the best only when strictly cheaper.  So among equal-cost plans the
one whose last step starts earliest (longest segments at the end) wins.

The executor runs a plan's steps back to back (a comm waited for by its reader only), so
a plan's real time is at most its barrier sum. The carried DP (`_carry_dp`) prices steps
that way — each state keeps the carried lane state of the best way found to reach it, a
greedy rule — and `plan` keeps whichever plan, the barrier DP's or the carried DP's, ends
first run back to back (no memory budget: under one, the barrier DP's); its
``predicted_s`` is that back-to-back makespan.

Backends: ``"cpp"`` (dhelix._planner_core, built from csrc/planner.cpp), ``"python"``
(this file, the reference) or ``"auto"`` (C++ when importable).  Both give the same plan.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Tuple

from dhelix.planner.costs import CostTable
from dhelix.planner.opspec import COMM, LayerOps, OpSpec
from dhelix.planner.plan import (Plan, PlanError, Step, new_plan, ordered_backward,
                                 rotated_backward, trivial_plan, validate)
from dhelix.planner.simulate import LaneModel, plan_indices

try:  # the compiled core is optional
    from dhelix import _planner_core as _core  # type: ignore
except ImportError:  # pragma: no cover - depends on the build
    _core = None

from dhelix.planner.enumerate import INF, StepCost, StepIdx, legal_order  # noqa: E402
from dhelix.planner.min_gain import keep_trivial  # noqa: E402


def cpp_available() -> bool:
    return _core is not None


# ---- the state space --------------------------------------------------------------------

class _Legality:
    """The DP's state space: n forward ops, m backward ops. Every pair of segments is a
    legal step: a step may hold several comm ops of one process group, since the executor
    issues them in one deterministic order on every rank (a memory budget still forbids
    steps, through the cost)."""

    def __init__(self, layer: LayerOps):
        self.n, self.m = len(layer.forward), len(layer.backward)


# ---- the Python reference DP ---------------------------------------------------------------

class _PyProblem:
    """Mirror of the C++ `Problem`: table-based step costs and the DP over op positions."""

    def __init__(self, model: LaneModel, legality: _Legality):
        self.model = model
        self.L = legality
        n, m = legality.n, legality.m
        self.n, self.m = n, m
        self.f_pre = [0.0] * (n + 1)
        for k in range(n):
            self.f_pre[k + 1] = self.f_pre[k] + model.f_saved[k]
        self.b_pre = [0.0] * (m + 1)
        for k in range(m):
            self.b_pre[k + 1] = self.b_pre[k] + model.b_saved[k]
        self._memo: Dict[StepIdx, Tuple[float, float]] = {}

    def level(self, i: int, j: int) -> float:
        return (self.model.base + self.f_pre[i]) - self.b_pre[j]

    def step(self, i1: int, i2: int, j1: int, j2: int) -> Tuple[float, float]:
        key = (i1, i2, j1, j2)
        r = self._memo.get(key)
        if r is None:
            t, peak, _ = self.model.step(range(i1, i2), range(j1, j2), mem0=self.level(i1, j1))
            r = self._memo[key] = (t, peak)
        return r

    def solve(self, budget: float = INF):
        step = self.step
        return _dp(self.L, lambda i1, i2, j1, j2: _within(step(i1, i2, j1, j2), budget))

    def solve_carry(self):
        return _carry_dp(self.model, self.n, self.m)


def _carry_dp(model: LaneModel, n: int, m: int):
    """The DP over carried states (mirrored by csrc/planner.cpp, Problem::solve_carry): a
    plan's steps run back to back (`simulate.Carry`), so a step's time depends on what is
    still in flight from the steps before it, not on (i, j) alone. State (i, j) keeps the
    carry of the best way found to reach it — earliest end of everything issued, then
    earliest thread time; the candidates scanned as in `_dp`, strict '<' — and each
    transition simulates one step from it. Greedy per state, so not exact (unlike `_dp`
    for its barrier sum); `plan` keeps whichever of the two plans ends first. Returns
    (makespan, steps)."""
    from dhelix.planner.simulate import Carry
    best: Dict[Tuple[int, int], Carry] = {(0, 0): Carry()}
    arg: Dict[Tuple[int, int], Tuple[int, int]] = {}
    for i2, j2, preds in _states(n, m):
        got = None
        for i1, j1 in preds:
            prev = best[(i1, j1)]
            c = Carry(prev.t, list(prev.lane_free), list(prev.comms), prev.end)
            model.step(range(i1, i2), range(j1, j2), carry=c)
            if got is None or c.end < got.end or (c.end == got.end and c.t < got.t):
                got, arg[(i2, j2)] = c, (i1, j1)
        best[(i2, j2)] = got
    return best[(n, m)].end, _backtrack(lambda i, j: arg[(i, j)], n, m)


def _run(model: LaneModel, steps) -> float:
    """The makespan of the steps (i1, i2, j1, j2) run back to back (`LaneModel.run`)."""
    return model.run([(list(range(i1, i2)), list(range(j1, j2)))
                      for (i1, i2, j1, j2) in steps])[0]


def _within(tp: Tuple[float, float], budget: float) -> float:
    return tp[0] if tp[1] <= budget else INF


def _states(n: int, m: int):
    """The DPs' order (shared with csrc/planner.cpp, so ties break alike): each state
    (i2, j2) but (0, 0), i2 then j2 ascending, with its predecessors (i1, j1), i1 then j1
    ascending."""
    for i2 in range(n + 1):
        for j2 in range(m + 1):
            if i2 or j2:
                yield i2, j2, [(i1, j1) for i1 in range(i2 + 1) for j1 in range(j2 + 1)
                               if i1 != i2 or j1 != j2]


def _dp(L: _Legality, cost: Callable[[int, int, int, int], float]):
    """The DP; returns (total, [(i, i', j, j'), ...]) or (inf, []) when (n, m) is out of
    reach.  `cost` returns inf for a transition that is not allowed."""
    n, m = L.n, L.m
    T = [[INF] * (m + 1) for _ in range(n + 1)]
    arg = [[(-1, -1)] * (m + 1) for _ in range(n + 1)]
    T[0][0] = 0.0
    for i2, j2, preds in _states(n, m):
        best = INF
        bi = bj = -1
        for i1, j1 in preds:
            prev = T[i1][j1]
            if prev == INF:
                continue
            v = prev + cost(i1, i2, j1, j2)
            if v < best:
                best, bi, bj = v, i1, j1
        T[i2][j2] = best
        arg[i2][j2] = (bi, bj)
    if T[n][m] == INF:
        return INF, []
    return T[n][m], _backtrack(lambda i, j: arg[i][j], n, m)


def _backtrack(pred: Callable[[int, int], Tuple[int, int]], n: int, m: int) -> List[StepIdx]:
    """The steps from (0, 0) to (n, m), following each state's predecessor `pred`."""
    steps: List[StepIdx] = []
    i2, j2 = n, m
    while i2 or j2:
        i1, j1 = pred(i2, j2)
        steps.append((i1, i2, j1, j2))
        i2, j2 = i1, j1
    steps.reverse()
    return steps


def _dense_costs(L: _Legality, cost: Callable[[int, int, int, int], float]) -> List[float]:
    """Flat array cost[((i*(n+1)+i')*(m+1)+j)*(m+1)+j'] (inf where illegal), for the C++
    dense DP when the step cost is a Python function."""
    n, m = L.n, L.m
    out = [INF] * ((n + 1) * (n + 1) * (m + 1) * (m + 1))
    for i2 in range(n + 1):
        for j2 in range(m + 1):
            for i1 in range(i2 + 1):
                for j1 in range(j2 + 1):
                    if i1 == i2 and j1 == j2:
                        continue
                    out[((i1 * (n + 1) + i2) * (m + 1) + j1) * (m + 1) + j2] = \
                        float(cost(i1, i2, j1, j2))
    return out


def _cpp_problem(model: LaneModel, L: _Legality):
    flat_S = [v for row in model.S for v in row]
    return _core.Problem(model.f_lane, model.b_lane, model.f_T, model.b_T, model.f_saved, model.b_saved, model.f_temp, model.b_temp, flat_S,
                         model.base, model.f_reader, model.b_reader, model.f_H, model.b_H)


def _problem(model: LaneModel, L: _Legality, use_cpp: bool):
    """The DP's problem on a lane model: the C++ core's, or the Python one."""
    return _cpp_problem(model, L) if use_cpp else _PyProblem(model, L)


def _min_peak(L: _Legality, step) -> float:
    """The lowest peak any plan reaches (bottleneck DP over the same transitions)."""
    n, m = L.n, L.m
    M = [[INF] * (m + 1) for _ in range(n + 1)]
    M[0][0] = -INF
    for i2, j2, preds in _states(n, m):
        best = INF
        for i1, j1 in preds:
            v = max(M[i1][j1], step(i1, i2, j1, j2)[1])
            if v < best:
                best = v
        M[i2][j2] = best
    return M[n][m]


# ---- public API ----------------------------------------------------------------------------

def make_step_cost(layer: LayerOps, table: CostTable, force: bool = False) -> StepCost:
    """The default step cost: the simulated time of the two segments run as one step."""
    model = LaneModel(layer, table, force=force)
    fpos = {n: k for k, n in enumerate(model.f_names)}
    bpos = {n: k for k, n in enumerate(model.b_names)}
    memo: Dict[Tuple[Tuple[int, ...], Tuple[int, ...]], float] = {}

    def step_cost(fwd_ops: List[OpSpec], bwd_ops: List[OpSpec]) -> float:
        key = (tuple(fpos[o.name] for o in fwd_ops), tuple(bpos[o.name] for o in bwd_ops))
        v = memo.get(key)
        if v is None:
            v = memo[key] = model.step(key[0], key[1])[0]
        return v

    return step_cost


def plan_cost(plan: Plan, layer: LayerOps, step_cost: StepCost) -> float:
    """Sum of ``step_cost`` over the plan's steps (in order, as the DP adds them)."""
    fs = {o.name: o for o in layer.forward}
    bs = {o.name: o for o in layer.backward}
    total = 0.0
    for s in plan.steps:
        total = total + step_cost([fs[n] for n in s.fwd], [bs[n] for n in s.bwd])
    return total


def plan(layer: LayerOps, table: Optional[CostTable] = None, *,
         step_cost: Optional[StepCost] = None, memory_budget_bytes: Optional[float] = None,
         base_bytes: Optional[float] = None, backend: str = "auto",
         force: bool = False, rotate: bool = False, reorder: bool = False,
         num_layers: Optional[int] = None, min_gain: float = 0.0) -> Plan:
    """The cheapest legal plan for ``layer`` (backward as a chain, wgrad after its dgrad).

    Costs: ``step_cost(fwd_ops, bwd_ops)`` if given, else the simulated step time from
    ``table``.  With ``memory_budget_bytes`` (needs ``table`` for the simulated memory),
    only steps whose simulated peak stays within the budget are used; if no plan fits,
    PlanError says by how much the lowest-peak plan exceeds the budget.
    ``backend``: "auto" | "cpp" | "python".

    ``reorder``: also plan β's node in another legal order (`Plan.backward`: re-gathers
    and wgrads moved, `_climb_order`) where its plan ends first.
    ``rotate``: also plan β's chain rotated by each r (`Plan.rotation`) and keep the plan
    whose co-step of ``num_layers`` layer pairs ends first (`whole_step.co_step_layers`:
    the rotated pairs, the last α layer beside the last tail, the first head alone);
    the layer count defaults to the table's step extras', else 1. Both only without a
    budget or a step-cost function: the other orders and rotations are priced by the table.
    ``min_gain`` (with them): the trivial plan instead when the best co-step is predicted
    to gain less than this share over the trivial plan's (`keep_trivial`).
    """
    t_start = time.perf_counter()
    p, model = _plan_at(layer, table, step_cost, memory_budget_bytes, base_bytes, backend,
                        force, 0)
    if not (rotate or reorder) or model is None or step_cost is not None or \
            memory_budget_bytes is not None or len(layer.backward) < 2:
        return p
    from dhelix.planner.whole_step import co_step_layers
    L = num_layers or (table.step_extras.num_layers if table.step_extras else 1)
    L = max(int(L), 1)
    orders = [None]
    if reorder:
        order, _ = _climb_order(layer, table, base_bytes, backend, force)
        if order is not None:
            orders.append(order)
    best, best_t, chain_t = None, INF, INF
    for order in orders:
        for r in range(len(layer.backward) if rotate else 1):
            q, m = (p, model) if order is None and r == 0 else \
                _plan_at(layer, table, None, None, base_bytes, backend, force, r, order)
            t = co_step_layers(m, q, L)
            if t < best_t:
                best, best_t = q, t
        if order is None:
            chain_t = best_t
    meta = best.meta
    if reorder:
        meta["chain_order_co_step_s"] = chain_t      # the best in the chain's order
    meta["unrotated_predicted_s"] = p.meta["predicted_s"]    # chain order, unrotated
    meta["co_step_layers"] = L
    meta["co_step_predicted_s"] = best_t
    meta["trivial_predicted_s"] = p.meta["trivial_predicted_s"]
    meta["speedup_vs_trivial"] = p.meta["trivial_predicted_s"] / meta["predicted_s"] \
        if meta["predicted_s"] > 0 else 1.0
    meta["planning_time_s"] = time.perf_counter() - t_start
    return keep_trivial(best, layer, table, min_gain, base_bytes, force) if min_gain > 0 \
        else best


def _climb_order(layer: LayerOps, table: CostTable, base_bytes, backend: str,
                 force: bool) -> Tuple[Optional[List[str]], float]:
    """β's node order whose (unrotated) plan ends first, by hill climbing from the chain's:
    each floating op (`wgrad`: a wgrad or a re-gather) tried at every position its rules
    allow (`plan.check_order`) that follows a comm op (where it can run beside that
    comm) or its `after` op, or starts or ends the node (a heuristic: the places between
    two compute ops are skipped; on small16's table and the A40/A800/H100 tables of a
    Llama-3-8B layer it finds the order the full scan finds in a third of the tries, on
    A800's one 0.4% slower) — and the move whose order the carried DP plans to
    end first kept (best improvement, strictly earlier), until no move helps. An order is
    priced by the carried DP alone (half a full `_plan_at`; the barrier DP's plan is
    weighed once the order is chosen). Deterministic (a fixed scan order, strict
    improvement), so every rank and both backends find the same order. Returns (order,
    its time), or (None, the chain's) when no move helps."""
    use_cpp = _core is not None and backend != "python"
    legality = _Legality(layer)

    def carried(order):
        model = LaneModel(layer, table, base_bytes=base_bytes, force=force, order=order)
        return _problem(model, legality, use_cpp).solve_carry()[0]

    spec = {o.name: o for o in layer.backward}
    floating = [o.name for o in layer.backward if o.wgrad]
    order = [o.name for o in layer.backward]
    best_t, moved = carried(order), False
    while True:
        step_best, step_order = best_t, None
        for name in floating:
            rest = [n for n in order if n != name]
            for pos in range(len(rest) + 1):
                if 0 < pos < len(rest) and spec[rest[pos - 1]].kind != COMM and \
                        rest[pos - 1] != spec[name].after:
                    continue
                cand = rest[:pos] + [name] + rest[pos:]
                if cand == order or not legal_order(layer, cand):
                    continue
                t = carried(cand)
                if t < step_best:
                    step_best, step_order = t, cand
        if step_order is None:
            break
        best_t, order, moved = step_best, step_order, True
    return (order if moved else None), best_t


def _plan_at(layer: LayerOps, table: Optional[CostTable], step_cost: Optional[StepCost],
             memory_budget_bytes: Optional[float], base_bytes: Optional[float],
             backend: str, force: bool, rotation: int,
             order: Optional[List[str]] = None) -> Tuple[Plan, Optional[LaneModel]]:
    """`plan` for one rotation of β's chain in one node order (`order`, None: the layer's
    chain): the plan, and the lane model it was priced on (None without a table). The
    trivial plan's time is the unrotated one's only."""
    if backend not in ("auto", "cpp", "python"):
        raise ValueError(f"backend must be 'auto', 'cpp' or 'python', not {backend!r}")
    if backend == "cpp" and _core is None:
        raise PlanError("backend 'cpp' asked for, but dhelix._planner_core is not built "
                        "(pip install -e . builds it from csrc/planner.cpp)")
    use_cpp = _core is not None and backend != "python"
    if table is None and step_cost is None:
        raise PlanError("plan: give a cost table or a step_cost function")
    if memory_budget_bytes is not None and table is None:
        raise PlanError("plan: a memory budget needs a cost table (the simulator's memory "
                        "model runs on it)")
    t_start = time.perf_counter()
    L = _Legality(layer)
    F, B = list(layer.forward), rotated_backward(ordered_backward(layer, order), rotation)
    budget = INF if memory_budget_bytes is None else float(memory_budget_bytes)

    problem = None
    if table is not None:
        model = LaneModel(layer, table, base_bytes=base_bytes, force=force,
                          rotation=rotation, order=order)
        problem = _problem(model, L, use_cpp)

    if step_cost is None:
        idx_cost = lambda i1, i2, j1, j2: problem.step(i1, i2, j1, j2)[0]
        total, steps = problem.solve(budget)
    else:
        memo: Dict[StepIdx, float] = {}

        def idx_cost(i1, i2, j1, j2):
            key = (i1, i2, j1, j2)
            v = memo.get(key)
            if v is None:
                v = memo[key] = float(step_cost(F[i1:i2], B[j1:j2]))
            return v

        if problem is not None and budget != INF:
            cost = lambda i1, i2, j1, j2: (idx_cost(i1, i2, j1, j2)
                                           if problem.step(i1, i2, j1, j2)[1] <= budget else INF)
        else:
            cost = idx_cost
        if use_cpp:
            total, steps = _core.solve_dense(L.n, L.m, _dense_costs(L, cost))
        else:
            total, steps = _dp(L, cost)

    if total != INF and problem is not None and step_cost is None and budget == INF:
        # the executor runs a plan's steps back to back: keep the barrier DP's plan or the
        # carried DP's, whichever ends first that way (the barrier DP's on a tie)
        c_total, c_steps = problem.solve_carry()
        if c_total < _run(model, steps):
            steps = [tuple(s) for s in c_steps]

    if total == INF:
        if budget != INF:
            lowest = _min_peak(L, problem.step)
            raise PlanError(
                f"memory budget {budget:.0f} bytes cannot be met: the lowest-peak plan peaks at "
                f"{lowest:.0f} bytes, {lowest - budget:.0f} bytes "
                f"({(lowest - budget) / max(budget, 1.0) * 100:.1f}%) over the budget")
        raise PlanError("no legal plan: a single op is not a legal step (should not happen)")

    out_steps = [Step([o.name for o in F[i1:i2]], [o.name for o in B[j1:j2]])
                 for (i1, i2, j1, j2) in steps]
    if problem is not None:
        # what the executor runs: the steps back to back (the DP's barrier sum bounds it)
        total = _run(model, steps)
    meta = {
        "made_by": "dhelix.planner.dp",
        "backend": "cpp" if use_cpp else "python",
        "predicted_s": total,
        "num_steps": len(out_steps),
    }
    if not rotation and order is None:            # the trivial plan, with the same costs
        triv = trivial_plan(layer)
        if problem is not None:
            triv_t = model.run(plan_indices(model, triv))[0]
        else:
            fpos = {o.name: k for k, o in enumerate(F)}
            bpos = {o.name: k for k, o in enumerate(B)}
            triv_t = 0.0
            for s in triv.steps:
                if s.fwd:
                    i1 = fpos[s.fwd[0]]
                    triv_t = triv_t + idx_cost(i1, i1 + len(s.fwd), 0, 0)
                else:
                    j1 = bpos[s.bwd[0]]
                    triv_t = triv_t + idx_cost(L.n, L.n, j1, j1 + len(s.bwd))
        meta["trivial_predicted_s"] = triv_t
        meta["speedup_vs_trivial"] = (triv_t / total) if total > 0 else 1.0
    meta["planning_time_s"] = time.perf_counter() - t_start
    if problem is not None:
        peak = -INF
        for (i1, i2, j1, j2) in steps:
            p = problem.step(i1, i2, j1, j2)[1]
            if p > peak:
                peak = p
        meta["predicted_peak_bytes"] = peak
        meta["table_provenance"] = dict(table.provenance)
    if memory_budget_bytes is not None:
        meta["memory_budget_bytes"] = float(memory_budget_bytes)
    p = new_plan(layer, out_steps, meta, rotation, order)
    validate(p, layer)
    return p, (model if problem is not None else None)


# ---- brute force and random plans (tests, validation runs) ---------------------------------
