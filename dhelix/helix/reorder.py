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

    # Shared ops that only put outputs together (the tiles of a value saved for the
    # backward, concatenated): issued as soon as their tiles exist rather than at the
    # end, so each tile is freed after its last reader instead of every tile of every
    # saved value being alive at once when the forward ends.
    out_node = next(n for n in g.nodes if n.op == "output")
    assemble = set()
    for n in reversed(nodes):      # shared ops read only by the output or by such ops
        if t.stream[n.name] < 0 and n.users and \
                all(u is out_node or u in assemble for u in n.users):
            assemble.add(n)
    assemble = [n for n in nodes if n in assemble]

    def issue(n) -> bool:
        """Issue n after its shared inputs; False if it reads an op not yet issued."""
        for a in n.all_input_nodes:
            if a in done:
                continue
            if t.stream[a.name] >= 0 or not issue(a):
                return False
        done.add(n)
        order.append(n)
        for m in assemble:         # in graph order: a view after what it views
            if m not in done and all(a in done for a in m.all_input_nodes):
                done.add(m)
                order.append(m)
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
    t.segments = {s: len(segs[s]) for s in streams}
    return t.segments
