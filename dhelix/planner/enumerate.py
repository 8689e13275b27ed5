"""Enumeration over legal plans: brute force (the DP's referee in tests), the legal
backward orders, and random legal plans (for equivalence tests and model validation)."""
from __future__ import annotations

import random
from typing import Callable, Dict, List, Optional, Tuple

from dhelix.planner.opspec import LayerOps, OpSpec
from dhelix.planner.plan import (Plan, PlanError, Step, check_order, new_plan, ordered_backward,
                                 rotated_backward, validate)
INF = float("inf")
StepCost = Callable[[List[OpSpec], List[OpSpec]], float]
StepIdx = Tuple[int, int, int, int]      # (i, i', j, j'): F[i:i'] with B[j:j']

class BruteResult:
    def __init__(self, best_cost: float, best_plan: Optional[Plan], count: int):
        self.best_cost, self.best_plan, self.count = best_cost, best_plan, count

    def __iter__(self):               # best_cost, best_plan, count = brute_force(...)
        return iter((self.best_cost, self.best_plan, self.count))


def backward_orders(layer: LayerOps) -> List[List[OpSpec]]:
    """Every order of the backward ops that `validate` allows: the non-wgrad ops in chain
    order, each wgrad op anywhere after its `after` op (anywhere without one) and before
    its `reader`.  Exponential; tiny layers only."""
    chain = [o for o in layer.backward if not o.wgrad]
    wg = [o for o in layer.backward if o.wgrad]
    orders: List[List[OpSpec]] = [chain]
    for w in wg:
        nxt = []
        for order in orders:
            pos = next((k for k, o in enumerate(order) if o.name == w.after), -1)
            for ins in range(pos + 1, len(order) + 1):
                nxt.append(order[:ins] + [w] + order[ins:])
        orders = nxt
    return [o for o in orders if legal_order(layer, [x.name for x in o])]


def legal_order(layer: LayerOps, order: List[str]) -> bool:
    """`order` is a node order `plan.check_order` allows."""
    try:
        check_order(layer, order)
    except PlanError:
        return False
    return True


def random_order(layer: LayerOps, rng=None) -> List[str]:
    """A random legal node order of β (`Plan.backward`): each floating op (a wgrad or a
    re-gather) moved to a random position its rules allow."""
    r = _as_random(rng)
    order = [o.name for o in layer.backward]
    for name in [o.name for o in layer.backward if o.wgrad]:
        rest = [n for n in order if n != name]
        cands = [rest[:k] + [name] + rest[k:] for k in range(len(rest) + 1)]
        order = r.choice([c for c in cands if legal_order(layer, c)])
    return order


def brute_force(layer: LayerOps, step_cost: StepCost, deferred_wgrad: bool = False,
                limit: int = 5_000_000) -> BruteResult:
    """Enumerate every legal plan (backward in ``layer.backward`` order, or with
    ``deferred_wgrad`` every order `validate` allows) and return the cheapest, costs summed
    step by step in plan order.  For tiny layers (tests)."""
    F = list(layer.forward)
    orders = backward_orders(layer) if deferred_wgrad else [list(layer.backward)]
    best = [INF, None]
    count = [0]
    for B in orders:
        n, m = len(F), len(B)
        memo: Dict[StepIdx, float] = {}

        def c(i1, i2, j1, j2):
            k = (i1, i2, j1, j2)
            if k not in memo:
                memo[k] = float(step_cost(F[i1:i2], B[j1:j2]))
            return memo[k]

        def rec(i, j, acc, path):
            if i == n and j == m:
                count[0] += 1
                if count[0] > limit:
                    raise PlanError(f"brute_force: more than {limit} plans; layer too large")
                if acc < best[0]:
                    best[0] = acc
                    best[1] = [Step([o.name for o in F[a:b]], [o.name for o in B[x:y]])
                               for (a, b, x, y) in path]
                return
            for i2 in range(i, n + 1):
                for j2 in range(j, m + 1):
                    if i2 == i and j2 == j:
                        continue
                    path.append((i, i2, j, j2))
                    rec(i2, j2, acc + c(i, i2, j, j2), path)
                    path.pop()

        rec(0, 0, 0.0, [])
    p = None
    if best[1] is not None:
        p = new_plan(layer, best[1], {"made_by": "dhelix.planner.enumerate.brute_force",
                                      "predicted_s": best[0]})
    return BruteResult(best[0], p, count[0])


def _as_random(rng) -> random.Random:
    if isinstance(rng, random.Random):
        return rng
    if rng is None or isinstance(rng, int):
        return random.Random(rng)
    if hasattr(rng, "integers"):          # numpy Generator
        return random.Random(int(rng.integers(0, 2**63 - 1)))
    raise TypeError(f"rng must be an int seed, random.Random or numpy Generator, not {type(rng)}")


def _repair_order(B: List[OpSpec], done_before=frozenset()) -> List[OpSpec]:
    """Keep the order of B, but hold back each floating op until the op it must follow
    (its `after`, which may itself be a floating op that moved) has been placed; an op
    in `done_before` follows one of a layer step before (a rotated chain)."""
    out: List[OpSpec] = []
    placed = set()
    waiting: Dict[str, List[OpSpec]] = {}

    def emit(o):
        out.append(o)
        placed.add(o.name)
        for d in waiting.pop(o.name, []):
            emit(d)

    for o in B:
        if o.wgrad and o.after is not None and o.after not in placed and \
                o.name not in done_before:
            waiting.setdefault(o.after, []).append(o)
        else:
            emit(o)
    return out


def random_legal_plan(layer: LayerOps, rng=None, defer_prob: float = 0.5,
                      pair_prob: float = 0.6, rotation: int = 0,
                      reorder_prob: float = 0.5) -> Plan:
    """A random legal plan: random segment cuts, random pairing, and (with probability
    ``defer_prob``) some wgrad ops moved later than right after their dgrad. With
    probability ``reorder_prob`` β's node runs in a random legal order (`random_order`,
    `Plan.backward`). With ``rotation`` r, a plan of β's node order rotated by r
    (`Plan.rotation`): a wgrad moves within its node's part only."""
    r = _as_random(rng)
    F = list(layer.forward)
    order = random_order(layer, r) if reorder_prob and r.random() < reorder_prob else None
    node = ordered_backward(layer, order)
    head = {o.name for o in node[:rotation]}
    B = rotated_backward(node, rotation)
    if r.random() < defer_prob:
        for w in [o for o in B if o.wgrad and o.after is not None]:
            if r.random() < 0.5:
                continue
            cur = B.index(w)            # after its dgrad already: only move it later
            B.remove(w)
            part = [k for k, o in enumerate(B) if (o.name in head) == (w.name in head)]
            end = part[-1] + 1 if part else cur
            # (a later place keeps it before its reader: a wgrad reads, none reads it)
            B.insert(r.randint(cur + 1, end) if cur + 1 <= end else cur, w)
        B = _repair_order(B, {o.name for o in B if o.after is not None
                              and (o.after in head) != (o.name in head)})
    n, m = len(F), len(B)

    steps: List[Step] = []
    i = j = 0
    while i < n or j < m:
        if i < n and j < m:
            u = r.random()
            action = "fb" if u < pair_prob else ("f" if u < pair_prob + (1 - pair_prob) / 2
                                                 else "b")
        else:
            action = "f" if i < n else "b"
        fseg: List[OpSpec] = []
        bseg: List[OpSpec] = []
        if action in ("f", "fb"):
            k = r.randint(1, min(n - i, 1 + int(r.expovariate(0.3))))
            fseg = F[i:i + k]
        if action in ("b", "fb"):
            k = r.randint(1, min(m - j, 1 + int(r.expovariate(0.3))))
            bseg = B[j:j + k]
        steps.append(Step([o.name for o in fseg], [o.name for o in bseg]))
        i += len(fseg)
        j += len(bseg)
    p = new_plan(layer, steps, {"made_by": "dhelix.planner.dp.random"}, rotation, order)
    validate(p, layer)
    return p
