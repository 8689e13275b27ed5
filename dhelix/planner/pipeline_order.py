"""The folded pipeline's order of work on every stage (plain data, no tensors).

Work items: ("F", chunk, m) runs chunk 0 (front) or 1 (back) of micro-batch m forward,
("B", chunk, m) backward. Dependencies on stage g of G:
  F0(m): F0(m) on g-1                 (stage 0: the data)
  F1(m): F1(m) on g+1                 (stage G-1: its own F0(m), no P2P)
  B1(m): F1(m) here and B1(m) on g-1  (stage 0: the loss, computed by its F1(m))
  B0(m): F0(m) here and B0(m) on g+1  (stage G-1: its own B1(m))
A stage runs *steps*, each a forward item beside a backward item of another micro-batch
(the pair DHelix co-executes, layer by layer, by the plan) or one alone.

With N >= 2G micro-batches the order has the phases of a V-shaped pipeline (the shape of
DeepSeek's DualPipeV, without its weight-grad split): stage g runs
  1. warm-up      2(G-g-1) × F0
  2. fill         (g+1) × [F0, F1]
  3. turn         (G-g-1) × [B1, F1]
  4. steady       N-2G+g+1 × [F0 | B1, F1 | B0]    (| : one paired step)
  5. drain        (G-g-1) × [B1, F1 | B0]
  6. empty        (g+1) × [B1, B0]
  7. cool-down    (G-g-1) × B0
each kind in micro-batch order. At most 2G chunk activations are alive on a stage, the
same bytes as 1F1B's first stage (G micro-batches × L/G layers). With fewer micro-batches
a greedy play with unit costs makes the order (`greedy_order`). Either way every item's
inputs come from steps that end earlier, so the real run cannot deadlock whatever the
actual times (`play` checks it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

Item = Tuple[str, int, int]          # (kind "F"|"B", chunk 0|1, micro-batch)


@dataclass
class Step:
    fwd: Optional[Item]
    bwd: Optional[Item]
    start: float = 0.0               # in the unit-cost play
    end: float = 0.0


@dataclass
class FoldedOrder:
    stages: int
    microbatches: int
    steps: List[List[Step]] = field(default_factory=list)    # per stage

    @property
    def makespan(self) -> float:
        return max(s[-1].end for s in self.steps if s)

    def busy(self, stage: int, f: float = 1.0, b: float = 2.0) -> float:
        return sum(_cost(s, f, b) for s in self.steps[stage])

    def bubble(self, f: float = 1.0, b: float = 2.0) -> float:
        """Idle share of stage-time in the unit-cost play: 1 - busy / (stages × makespan)."""
        total = sum(self.busy(g, f, b) for g in range(self.stages))
        return 1.0 - total / (self.stages * self.makespan)

    def peak_in_flight(self, stage: int) -> int:
        """Most micro-batches with front activations alive on a stage at once."""
        live, peak = set(), 0
        for s in self.steps[stage]:
            if s.fwd and s.fwd[1] == 0:
                live.add(s.fwd[2])
                peak = max(peak, len(live))
            if s.bwd and s.bwd[1] == 0:
                live.discard(s.bwd[2])
        return peak


def _cost(s: Step, f: float, b: float) -> float:
    return (f if s.fwd else 0.0) + (b if s.bwd else 0.0)


def fold_deps(stages: int):
    """deps(g, item) -> [(stage, item)] the item waits for (the table above)."""
    G = stages

    def deps(g, it) -> List[Tuple[int, Item]]:
        kind, c, m = it
        if kind == "F" and c == 0:
            return [(g - 1, it)] if g > 0 else []
        if kind == "F":
            return [(g + 1, it)] if g < G - 1 else [(g, ("F", 0, m))]
        if c == 1:
            return [(g, ("F", 1, m))] + ([(g - 1, it)] if g > 0 else [])
        return [(g, ("F", 0, m))] + ([(g + 1, it)] if g < G - 1 else [(g, ("B", 1, m))])
    return deps


def folded_order(stages: int, microbatches: int) -> FoldedOrder:
    """Per-stage steps of the folded schedule (timed with unit costs)."""
    G, N = stages, microbatches
    if N < 2 * G:
        return greedy_order(G, N)
    order = FoldedOrder(G, N, [[] for _ in range(G)])
    for g in range(G):
        nxt = {k: 0 for k in ("F0", "F1", "B0", "B1")}

        def it(k):
            m = nxt[k]
            nxt[k] += 1
            return (k[0], int(k[1]), m)
        steps = order.steps[g]
        r = G - g - 1
        steps += [Step(it("F0"), None) for _ in range(2 * r)]
        for _ in range(g + 1):
            steps += [Step(it("F0"), None), Step(it("F1"), None)]
        for _ in range(r):
            steps += [Step(None, it("B1")), Step(it("F1"), None)]
        for _ in range(N - 2 * G + g + 1):
            steps += [Step(it("F0"), it("B1")), Step(it("F1"), it("B0"))]
        for _ in range(r):
            steps += [Step(None, it("B1")), Step(it("F1"), it("B0"))]
        for _ in range(g + 1):
            steps += [Step(None, it("B1")), Step(None, it("B0"))]
        steps += [Step(None, it("B0")) for _ in range(r)]
    return play(order, fold_deps(G), lambda i: 1.0 if i[0] == "F" else 2.0,
                lambda fw, bw: 3.0, 0.0)


def play(order: FoldedOrder, deps, item_cost, pair_cost, p2p_s: float) -> FoldedOrder:
    """Time `order`: each stage runs its steps in order; a step starts when its stage is
    free and every input has arrived (from another stage: p2p_s after it ended there).
    Raises RuntimeError if the stages would wait on each other forever."""
    G = order.stages
    timed = FoldedOrder(G, order.microbatches, [[] for _ in range(G)])
    end: Dict[Tuple[int, Item], float] = {}
    nxt, free = [0] * G, [0.0] * G
    remaining = sum(len(s) for s in order.steps)
    while remaining:
        moved = False
        for g in range(G):
            while nxt[g] < len(order.steps[g]):
                s = order.steps[g][nxt[g]]
                items = [i for i in (s.fwd, s.bwd) if i]
                need = [d for i in items for d in deps(g, i)]
                if any(d not in end for d in need):
                    break
                t = max([free[g]] + [end[d] + (p2p_s if d[0] != g else 0.0) for d in need])
                dur = pair_cost(s.fwd, s.bwd) if s.fwd and s.bwd else item_cost(items[0])
                timed.steps[g].append(Step(s.fwd, s.bwd, t, t + dur))
                for i in items:
                    end[(g, i)] = t + dur
                free[g] = t + dur
                nxt[g] += 1
                remaining -= 1
                moved = True
        if not moved:
            stuck = {g: order.steps[g][nxt[g]] for g in range(G) if nxt[g] < len(order.steps[g])}
            raise RuntimeError(f"the pipeline order deadlocks: stages wait on each other "
                               f"at {stuck}")
    return timed


def travels_down(item: Item) -> bool:
    """F0 and B1 go to higher stages (their output to g+1), F1 and B0 back up."""
    kind, c, _ = item
    return (kind == "F") == (c == 0)


def sends(order: FoldedOrder, src: int, dst: int) -> List[Item]:
    """The items whose output `src` sends to `dst` (a neighbour), in the order it sends
    them: step by step, a step's forward output before its input grad. The receiver
    posts its receives from `src` in exactly this order — NCCL matches P2P messages by
    order, not by tag, and an activation and a grad have the same shape."""
    G, out = order.stages, []
    for s in order.steps[src]:
        for it in (s.fwd, s.bwd):
            if it is None:
                continue
            if travels_down(it) and src < G - 1 and dst == src + 1:
                out.append(it)
            elif not travels_down(it) and src > 0 and dst == src - 1:
                out.append(it)
    return out


def greedy_order(stages: int, microbatches: int, depth: Optional[int] = None,
                 f: float = 1.0, b: float = 2.0) -> FoldedOrder:
    """A play with unit costs and greedy choices: the oldest ready backward first, then
    the forward that moves its micro-batch furthest, at most `depth` (default G)
    micro-batches in flight per stage."""
    G, N = stages, microbatches
    depth = depth or G
    done: Dict[Tuple[int, Item], float] = {}      # (stage, item) -> end time
    free = [0.0] * G
    started_f0 = [0] * G                          # next micro-batch to start F0 on a stage
    in_flight = [set() for _ in range(G)]
    todo = [{("F", c, m) for c in (0, 1) for m in range(N)} |
            {("B", c, m) for c in (0, 1) for m in range(N)} for _ in range(G)]
    order = FoldedOrder(G, N, [[] for _ in range(G)])

    deps = fold_deps(G)

    def ready(g, it, t) -> bool:
        return all(d in done and done[d] <= t for d in deps(g, it))

    while any(todo):
        progressed = False
        for g in sorted(range(G), key=lambda k: (free[k], k)):
            if not todo[g]:
                continue
            t = free[g]
            bs = sorted((it for it in todo[g] if it[0] == "B" and ready(g, it, t)),
                        key=lambda it: (it[2], -it[1]))
            fs = [it for it in todo[g] if it[0] == "F" and ready(g, it, t) and
                  (it[1] == 1 or (it[2] == started_f0[g] and len(in_flight[g]) < depth))]
            fs.sort(key=lambda it: (-it[1], it[2]))
            bw = bs[0] if bs else None
            fw = next((it for it in fs if bw is None or it[2] != bw[2]), None)
            if fw is None and bw is None:
                continue
            step = Step(fw, bw, t, t + _cost(Step(fw, bw), f, b))
            order.steps[g].append(step)
            for it in (fw, bw):
                if it is not None:
                    todo[g].discard(it)
                    done[(g, it)] = step.end
            if fw and fw[1] == 0:
                in_flight[g].add(fw[2])
                started_f0[g] += 1
            if bw and bw[1] == 0:
                in_flight[g].discard(bw[2])
            free[g] = step.end
            progressed = True
            break
        if not progressed:
            # nothing ready anywhere at its stage's time: move idle stages to the next end
            ends = sorted({v for v in done.values()})
            for g in range(G):
                later = [e for e in ends if e > free[g]]
                if todo[g] and later:
                    free[g] = later[0]
            if not any(free[g] < max(ends, default=0.0) for g in range(G) if todo[g]) and \
                    not any(todo[g] and any(ready(g, it, free[g]) for it in todo[g])
                            for g in range(G)):
                raise RuntimeError("folded_order: no stage can proceed (a dependency cycle)")
    return order
