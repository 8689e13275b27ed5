"""The scheduled graph keeps every data dependency of the program (checked on graphs)."""
from __future__ import annotations

import torch.fx as fx

from dhelix.helix.tiling import Tiled


def check_dependencies(original: fx.Graph, t: Tiled) -> int:
    """Every copy of an original op reads copies of exactly the values the original op
    read (its own tile's, the shared one, or the tiles' sum), every op of the original
    graph has a copy, and every op is issued after what it reads. Returns the number of
    dependencies checked; raises AssertionError naming a broken one."""
    old = {n.name: n for n in original.nodes}
    new_nodes = list(t.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(new_nodes)}
    copied = set()
    checked = 0
    for n in new_nodes:
        for a in n.all_input_nodes:
            assert pos[a] < pos[n], f"{n.name} is issued before {a.name}, which it reads"
        v = old.get(t.origin.get(n.name, ""))
        if v is None or n.op != "call_function" or n.target != v.target or \
                n.name in t.concatenated:
            continue                     # tile slices, tile sums, concatenations, buckets
        want = {a.name for a in v.all_input_nodes}
        got = {t.origin[a.name] for a in n.all_input_nodes}
        assert got == want, (f"{n.name} (a copy of {v.name}) reads {sorted(got)}, the "
                             f"original read {sorted(want)}")
        copied.add(v.name)
        checked += len(want)
    missing = [n.name for n in original.nodes
               if n.op == "call_function" and n.name not in copied
               and n.name not in t.buckets]     # a bucketed collective: one merged copy
    assert not missing, f"ops with no copy in the scheduled graph: {missing}"
    return checked
