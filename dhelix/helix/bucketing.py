"""Bucketing: the K stream copies of a collective merged back into one, where it pays.

A merge trades overlap for fewer, larger messages: the bucket starts when the last tile's
input is ready and every tile waits for all of it, but it pays one latency instead of K.
Whether that pays depends on the link, the sizes and the rest of the schedule, so each
choice is scored by DHelix's simulator on the whole scheduled graph (makespan, and peak
memory against a budget: a bucket's concatenated input and output are extra buffers).

Candidates are the program's collectives whose K copies are all-gathers, reduce-scatters
or all-reduces on one group. The choice is an exhaustive search over subsets of
candidates (2^N simulations) when N is at most `EXHAUSTIVE` and a greedy pass (merge one
candidate at a time, in order, while it improves) beyond; not the dynamic program the
issue asks for.
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
EXHAUSTIVE = 8


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
class Choice:
    merged: Tuple[str, ...]
    makespan_s: float
    peak_bytes: float
    fits: bool


@dataclass
class BucketReport:
    candidates: List[str] = field(default_factory=list)
    chosen: List[str] = field(default_factory=list)
    rejected: List[str] = field(default_factory=list)
    search: str = ""
    tried: List[Dict] = field(default_factory=list)


def choose(build: Callable[[Tuple[str, ...]], Tiled], score: Callable[[Tiled], Tuple[float, float]],
           cands: List[str], budget: Optional[float]) -> Tuple[Tiled, BucketReport]:
    """The merge set with the least simulated makespan whose peak fits `budget`;
    `build(merged)` gives the scheduled graph, `score` its (makespan, peak)."""
    rep = BucketReport(candidates=list(cands))
    best: Optional[Tuple[Choice, Tiled]] = None

    def consider(merged):
        nonlocal best
        t = build(merged)
        span, peak = score(t)
        c = Choice(tuple(merged), span, peak, budget is None or peak <= budget)
        rep.tried.append({"merged": list(merged), "makespan_s": span, "peak_bytes": peak,
                          "fits": c.fits})
        if c.fits and (best is None or span < best[0].makespan_s):
            best = (c, t)
        return c

    if len(cands) <= EXHAUSTIVE:
        rep.search = f"exhaustive over {2 ** len(cands)} subsets"
        for r in range(len(cands) + 1):
            for merged in itertools.combinations(cands, r):
                consider(merged)
    else:
        rep.search = "greedy, in order"
        cur = consider(())
        for c in cands:
            trial = consider(cur.merged + (c,))
            if trial.fits and trial.makespan_s < cur.makespan_s:
                cur = trial
    if best is None:
        raise ValueError(f"bucketing: no choice fits the memory budget {budget:.0f} bytes "
                         f"(the smallest simulated peak was "
                         f"{min(x['peak_bytes'] for x in rep.tried):.0f} bytes)")
    rep.chosen = list(best[0].merged)
    rep.rejected = [c for c in cands if c not in best[0].merged]
    return best[1], rep
