"""Segmented round-robin: the order in which the tile streams' ops are issued.

Within a stream, consecutive ops up to a `wait_tensor` form a segment (the wait opens the
next one). Segments are issued in turn — stream 0's first, stream 1's first, stream 0's
second, … — so the collective a segment starts runs while the other streams' segments
compute, and its wait comes only when its stream is issued again. Shared ops (run once)
are issued when the first op that reads them is. An op is only ever issued after every
op it reads: where the round-robin would break that, the stream waits for a later turn.
"""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.fx as fx

from dhelix.helix.tiling import Tiled

WAIT = torch.ops._c10d_functional.wait_tensor


def segments(nodes: List[fx.Node]) -> List[List[fx.Node]]:
    out: List[List[fx.Node]] = [[]]
    for n in nodes:
        if getattr(n.target, "overloadpacket", None) is WAIT and out[-1]:
            out.append([])
        out[-1].append(n)
    return [s for s in out if s]


def round_robin(t: Tiled) -> Dict[str, int]:
    """Reorder `t.gm`'s graph in place; returns the number of segments per stream."""
    g = t.gm.graph
    nodes = [n for n in g.nodes if n.op not in ("placeholder", "output")]
    streams = sorted({t.stream[n.name] for n in nodes if t.stream[n.name] >= 0})
    segs = {s: segments([n for n in nodes if t.stream[n.name] == s]) for s in streams}
    pos = {s: 0 for s in streams}                 # next segment of each stream
    done = {n for n in g.nodes if n.op == "placeholder"}
    order: List[fx.Node] = []

    def issue(n) -> bool:
        """Issue n after its shared inputs; False if it reads an op not yet issued."""
        for a in n.all_input_nodes:
            if a in done:
                continue
            if t.stream[a.name] >= 0 or not issue(a):
                return False
        done.add(n)
        order.append(n)
        return True

    while any(pos[s] < len(segs[s]) for s in streams):
        progress = False
        for s in streams:
            if pos[s] >= len(segs[s]):
                continue
            seg = segs[s][pos[s]]
            while seg and issue(seg[0]):
                seg.pop(0)
                progress = True
            if not seg:
                pos[s] += 1
        if not progress:       # cannot happen for a graph in topological order
            raise RuntimeError("round-robin: no stream can go on")
    for n in nodes:            # shared ops nothing in a stream reads (e.g. outputs only)
        if n not in done:
            issue(n)
    out = next(n for n in g.nodes if n.op == "output")
    for n in order:
        out.prepend(n)
    g.lint()
    t.gm.recompile()
    return {s: len(segs[s]) for s in streams}
