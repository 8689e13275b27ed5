"""Bucketing: the K stream copies of a collective merged back into one, where it pays.

A merge trades overlap for fewer, larger messages: the bucket starts when the last tile's
input is ready and every tile waits for all of it, but it pays one latency instead of K.
Whether that pays depends on the link, the sizes and the rest of the schedule, so each
choice is scored by DHelix's simulator on the whole scheduled graph (makespan, and peak
memory against a budget: a bucket's concatenated input and output are extra buffers).

Candidates are the program's collectives whose K copies are all-gathers, reduce-scatters
or all-reduces on one group. The choice is a dynamic program over the candidates in
issue order (`choose`). A state is a set of decisions for the first i candidates; what
the rest of the program does depends on them only through the simulator's state where
the first undecided candidate's region begins (the boundary): the thread's clock, the
link's, the collectives in flight, the buffers alive, the peak so far. States with the
same program beyond the boundary, the same collectives in flight and the same buffers
alive are compared there, and one that is no sooner and no smaller in any of those is
dropped (dominated); a state whose peak before the boundary is over the budget is
dropped for good. Survivors of the last stage are whole choices, simulated in full; the
fastest that fits wins. Dropping is safe for the makespan (the simulator never ends
sooner from later clocks); for the peak it assumes earlier clocks never raise the peak
still to come, which is not proven (frees and allocations can change order), so
`exhaustive=True` simulates all 2^N subsets instead and the tests check that both choose
alike.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from dhelix.helix.tiling import Tiled

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
MERGEABLE = (c10d.all_gather_into_tensor, c10d.reduce_scatter_tensor, c10d.all_reduce)
MAX_STATES = 64                 # per stage; beyond it the slowest are dropped (reported)


def candidates(t: Tiled, k: int) -> List[str]:
    """Original collectives (names) with one copy in each of the K streams."""
    copies: Dict[str, List[fx.Node]] = {}
    for n in t.gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "overloadpacket", None) in MERGEABLE:
            copies.setdefault(t.origin[n.name], []).append(n)
    return [o for o, ns in copies.items()
            if len(ns) == k and sorted(t.stream[n.name] for n in ns) == list(range(k))]


def merge(t: Tiled, origin: str) -> None:
    """Rewrite the K copies of collective `origin` (and their waits) as one bucket; each
    stream reads its own part of the result."""
    g = t.gm.graph
    copies = sorted((n for n in g.nodes if n.op == "call_function"
                     and t.origin.get(n.name) == origin), key=lambda n: t.stream[n.name])
    waits = [next(iter(n.users)) for n in copies]
    wait_origin = t.origin[waits[0].name]
    op = copies[0].target
    kind = op.overloadpacket
    xs = [n.args[0] for n in copies]
    shape = list(xs[0].meta["val"].shape)
    k = len(copies)
    last_input = max(xs, key=lambda x: _pos(g, x))
    cursor = [last_input]                # new nodes go in order after the last input

    def add(target, args, stream, orig):
        with g.inserting_after(cursor[0]):
            node = g.call_function(target, args)
        cursor[0] = node
        t.stream[node.name] = stream
        t.origin[node.name] = orig
        return node
    bucket = f"bucket:{origin}"
    # the bucket's input: the K inputs in one buffer (rank blocks kept for a reduce-scatter)
    if kind is c10d.all_gather_into_tensor:
        n = copies[0].args[1]
        merged_in = add(aten.cat.default, (xs, 0), k - 1, bucket)
    elif kind is c10d.reduce_scatter_tensor:
        n = copies[0].args[2]
        parts = [add(aten.view.default, (x, [n, shape[0] // n] + shape[1:]), k - 1, bucket)
                 for x in xs]
        st = add(aten.stack.default, (parts, 1), k - 1, bucket)
        merged_in = add(aten.reshape.default, (st, [k * shape[0]] + shape[1:]), k - 1, bucket)
    else:
        flat = [add(aten.reshape.default, (x, [-1]), k - 1, bucket) for x in xs]
        merged_in = add(aten.cat.default, (flat, 0), k - 1, bucket)
    coll = add(op, (merged_in,) + tuple(copies[0].args[1:]), k - 1, bucket)
    w = add(c10d.wait_tensor.default, (coll,), -1, bucket)
    # each stream's part of the result, read where its own wait's result was
    for s in range(k):
        if kind is c10d.all_gather_into_tensor:
            v = add(aten.view.default, (w, [n, k] + shape), -1, bucket)
            sel = add(aten.select.int, (v, 1, s), -1, bucket)
            part = add(aten.reshape.default, (sel, [n * shape[0]] + shape[1:]), s,
                       wait_origin)
        elif kind is c10d.reduce_scatter_tensor:
            m = shape[0] // n
            part = add(aten.slice.Tensor, (w, 0, s * m, (s + 1) * m), s, wait_origin)
        else:
            size = 1
            for d in shape:
                size *= d
            sl = add(aten.slice.Tensor, (w, 0, s * size, (s + 1) * size), -1, bucket)
            part = add(aten.view.default, (sl, shape), s, wait_origin)
        waits[s].replace_all_uses_with(part)
    for wt, c in zip(waits, copies):
        g.erase_node(wt)
        g.erase_node(c)
    t.buckets[origin] = coll.name
    t.buckets[wait_origin] = w.name


def _pos(g: fx.Graph, node) -> int:
    for i, n in enumerate(g.nodes):
        if n is node:
            return i
    return -1


@dataclass
class BucketReport:
    candidates: List[str] = field(default_factory=list)
    chosen: List[str] = field(default_factory=list)
    rejected: List[str] = field(default_factory=list)
    search: str = ""
    states: List[int] = field(default_factory=list)     # kept after each stage
    tried: List[Dict] = field(default_factory=list)


@dataclass
class _State:
    merged: Tuple[str, ...]
    t: Tiled
    pred: object                        # helix.simulate.Prediction, traced
    key: tuple = ()                     # equal keys: the same future, comparable
    times: Tuple[float, ...] = ()       # clocks at the boundary (smaller is better)
    peak_before: float = 0.0


def _call_nodes(t: Tiled) -> List[fx.Node]:
    return [n for n in t.gm.graph.nodes if n.op == "call_function"]


def boundary(t: Tiled, future: List[str]) -> int:
    """Position (in issue order) where a merge of a `future` candidate may first change
    the program: its first copy or the first of the copies' inputs. (A merge puts the
    bucket after the last input and removes the copies and their waits; the round-robin
    then issues every stream up to its own input as before, and re-forms what follows.)"""
    nodes = _call_nodes(t)
    pos = {n: i for i, n in enumerate(nodes)}
    fut = set(future)
    first = len(nodes)
    for n in nodes:
        if t.origin.get(n.name) in fut and \
                getattr(n.target, "overloadpacket", None) in MERGEABLE:
            first = min(first, pos[n], pos.get(n.args[0], first))
    return first


def _checkpoint(st: _State, p: int) -> None:
    """The simulator's state at op `p` of `st`'s program (see the module doc). Streams are
    named by the order in which the rest of the program first issues them: the tiles are
    alike, so two states that differ only in which stream leads are the same state."""
    nodes = _call_nodes(st.t)
    prog, spans = st.pred.program, st.pred.spans
    ops = prog.layer.forward
    canon: Dict[int, int] = {-1: -1}
    for n in nodes[p:]:
        canon.setdefault(st.t.stream.get(n.name, -1), len(canon) - 1)
    for s_ in sorted(set(st.t.stream.values())):
        canon.setdefault(s_, len(canon) - 1)

    def name(i):
        n = nodes[i]
        return (st.t.origin.get(n.name, n.name), canon[st.t.stream.get(n.name, -1)])
    thread = max([spans[i][1] for i in range(p) if ops[i].kind != "comm"], default=0.0)
    link = max([spans[i][1] for i in range(p) if ops[i].kind == "comm"], default=0.0)
    flight = sorted((name(i), spans[i][1]) for i in range(p)
                    if ops[i].kind == "comm" and prog.readers[i] >= p)
    # buffers alive at the boundary: freed by an op still to come (when, the rest of the
    # program decides), never (graph outputs), or after an op already issued that ends
    # later (a collective reading its input: when is part of the state)
    live, freeing = [], []
    for i in range(p):
        nbytes, last = prog.lifetimes[i]
        if nbytes <= 0:
            continue
        if last < 0 or last >= p:
            live.append((name(i), nbytes))
        elif max(spans[last][1], spans[i][1]) > thread:
            freeing.append((name(i), nbytes, max(spans[last][1], spans[i][1])))
    live.sort()
    freeing.sort()
    future = tuple(name(i) + (str(nodes[i].target),) for i in range(p, len(nodes)))
    st.key = (future, tuple(o for o, _ in flight), tuple(live),
              tuple((o, b) for o, b, _ in freeing))
    st.times = (thread, link) + tuple(e for _, e in flight) + tuple(e for _, _, e in freeing)
    st.peak_before = max([b for tm, b in st.pred.memory if tm < thread], default=0.0)


def _dominates(a: _State, b: _State) -> bool:
    return a.key == b.key and a.peak_before <= b.peak_before and \
        all(x <= y for x, y in zip(a.times, b.times))


def choose(build: Callable[[Tuple[str, ...]], Tiled], simulate: Callable[[Tiled], object],
           tiles: int, budget: Optional[float],
           exhaustive: bool = False) -> Tuple[Tiled, BucketReport]:
    """The merge set with the least simulated makespan whose peak fits `budget`;
    `build(merged)` gives the scheduled graph, `simulate` its traced prediction
    (`helix.simulate.simulate_graph(..., trace=True)`)."""
    rep = BucketReport()
    made: Dict[Tuple[str, ...], _State] = {}

    def state(merged) -> _State:
        key = tuple(sorted(merged))
        if key not in made:
            t = build(tuple(merged))
            p = simulate(t)
            made[key] = _State(tuple(merged), t, p)
            rep.tried.append({"merged": list(merged), "makespan_s": p.makespan_s,
                              "peak_bytes": p.peak_bytes,
                              "fits": budget is None or p.peak_bytes <= budget})
        return made[key]

    root = state(())
    cands = rep.candidates = candidates(root.t, tiles)
    if exhaustive:
        rep.search = f"exhaustive over {2 ** len(cands)} subsets"
        final = [state(m) for r in range(len(cands) + 1)
                 for m in itertools.combinations(cands, r)]
    else:
        # candidates in the order the unmerged program issues them
        first: Dict[str, int] = {}
        for i, n in enumerate(_call_nodes(root.t)):
            first.setdefault(root.t.origin.get(n.name), i)
        cands = sorted(cands, key=lambda c: first[c])
        states = [root]
        capped = False
        for i, c in enumerate(cands):
            grown = []
            for st in states:
                for merged in (st.merged, st.merged + (c,)):
                    child = state(merged)
                    _checkpoint(child, boundary(child.t, cands[i + 1:]))
                    if budget is None or child.peak_before <= budget:
                        grown.append(child)
            kept = [a for a in grown if not any(b is not a and _dominates(b, a) and
                                                (not _dominates(a, b) or id(b) < id(a))
                                                for b in grown)]
            kept.sort(key=lambda s: (s.times[:1], s.peak_before))
            capped = capped or len(kept) > MAX_STATES
            states = kept[:MAX_STATES]
            rep.states.append(len(states))
        final = states
        rep.search = (f"dynamic program over {len(cands)} candidates in issue order: "
                      f"{len(made)} of {2 ** len(cands)} subsets simulated, at most "
                      f"{max(rep.states, default=1)} states kept per stage"
                      + (f" (capped at {MAX_STATES}: not exact)" if capped else ""))
    fits = [s for s in final if budget is None or s.pred.peak_bytes <= budget]
    if not fits:
        raise ValueError(f"bucketing: no choice fits the memory budget {budget:.0f} bytes "
                         f"(the smallest simulated peak was "
                         f"{min(x['peak_bytes'] for x in rep.tried):.0f} bytes)")
    best = min(fits, key=lambda s: (s.pred.makespan_s, s.pred.peak_bytes, len(s.merged)))
    rep.chosen = list(best.merged)
    rep.rejected = [c for c in rep.candidates if c not in best.merged]
    return best.t, rep
