"""A layer's chain run as two batch halves round-robin, priced (DESIGN §1.6).

With `--dhelix-halves` B(N), which has no partner, runs its micro-batch as two batch
halves (`strand.executor.run_tiles`): the chain is cut into runs of compute ops and single
comm ops (`plan.comm_runs`), and step k runs half a's k-th run beside half b's (k−1)-th,
back to back, one barrier at the end. So one half's comm runs beside the other half's
compute, as α's beside β's in a co-step.

The simulator plays that with its own two-strand model (`LaneModel`): a "layer" whose two
chains are the two halves of the one chain (names prefixed `a:` and `b:`), and a table
derived from the profiled one, since the table was measured at the whole micro-batch:

* every op of a half takes 1/2 of the whole op's time (compute: half the rows of every
  GEMM; comm: half the bytes) — its issue cost on the thread (`host_*`) stays whole;
* a compute op beside the other half's comm op is slowed as the table measured that comm
  op slowing the compute ops of the other chain (the median stretch over them; the
  table has no pairs of one chain with itself).

The same model prices two whole micro-batches' chains round-robin (`share` 1: each tile
a whole micro-batch, every op its whole time): the last two backwards of
`--dhelix-pair-last`.

Neither is measured at the half shape, so the price is an estimate: on a CPU a GEMM of
half the rows runs at a lower rate, which this does not see (`docs/results.md`).
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from typing import List, Tuple

from dhelix.planner.costs import CostTable
from dhelix.planner.opspec import LayerOps, OpSpec
from dhelix.planner.plan import comm_runs

TILES = 2      # run_tiles runs two halves


def _halved(chain: List[OpSpec], prefix: str, share: float) -> List[OpSpec]:
    def name(n):
        return None if n is None else prefix + n
    return [replace(o, name=name(o.name), after=name(o.after), reader=name(o.reader),
                    flops=o.flops * share, comm_bytes=o.comm_bytes * share,
                    saved_bytes=o.saved_bytes * share, temp_bytes=o.temp_bytes * share)
            for o in chain]


def _stretch_beside(table: CostTable, layer: LayerOps, kind: str) -> dict:
    """For each op of the `kind` chain: the median stretch the table measured between it
    and the ops of the other chain on the other lane kind (1 where none)."""
    mine, other = (layer.forward, layer.backward) if kind == "fwd" else \
        (layer.backward, layer.forward)
    out = {}
    for o in mine:
        ss = [table.stretch(o.name, p.name) if kind == "fwd" else
              table.stretch(p.name, o.name)
              for p in other if (p.lane == "compute") != (o.lane == "compute")]
        out[o.name] = statistics.median(ss) if ss else 1.0
    return out


def tiled_chain(layer: LayerOps, table: CostTable, kind: str,
                share: float = 1.0 / TILES) -> Tuple[LayerOps, CostTable]:
    """The two halves of the layer's `kind` ("fwd" or "bwd") chain as a two-strand layer
    and its derived table (module doc); `share`: each tile's part of the micro-batch the
    table was measured at (1: two whole micro-batches)."""
    if kind not in ("fwd", "bwd"):
        raise ValueError(f"kind must be 'fwd' or 'bwd', not {kind!r}")
    chain = list(layer.forward if kind == "fwd" else layer.backward)
    alone = table.alone_f if kind == "fwd" else table.alone_b
    in_step = table.in_step_f if kind == "fwd" else table.in_step_b
    host = table.host_f if kind == "fwd" else table.host_b
    a, b = _halved(chain, "a:", share), _halved(chain, "b:", share)
    two = LayerOps(a, b)
    t = CostTable.empty(two, {"derived": f"two batch halves of the {kind} chain" if share < 1
                              else f"two micro-batches' {kind} chains"})
    stretch = _stretch_beside(table, layer, kind)
    for o in chain:
        for pre, al, ins, hs in (("a:", t.alone_f, t.in_step_f, t.host_f),
                                 ("b:", t.alone_b, t.in_step_b, t.host_b)):
            al[pre + o.name] = alone[o.name] * share
            if o.name in in_step:
                ins[pre + o.name] = in_step[o.name] * share
            if o.name in host:
                hs[pre + o.name] = host[o.name]
    for fa in chain:
        for fb in chain:
            if fa.lane == fb.lane:
                continue        # one lane: never concurrent, no entry read
            if fa.lane != "compute" and fb.lane != "compute":
                s = 1.0         # two comm lanes: the simulator reads no stretch of theirs
            else:
                s = stretch[(fb if fa.lane == "compute" else fa).name]
            ta, tb = t.alone_f["a:" + fa.name], t.alone_b["b:" + fb.name]
            t.pair[("a:" + fa.name, "b:" + fb.name)] = max(ta, tb) + (s - 1.0) * min(ta, tb)
    return two, t


def tiles_makespan(layer: LayerOps, table: CostTable, kind: str, force: bool = False,
                   share: float = 1.0 / TILES) -> float:
    """Seconds of one layer's `kind` chain as two tiles round-robin (`run_tiles`): two
    batch halves, or two whole micro-batches with `share` 1."""
    from dhelix.planner.simulate import LaneModel
    two, t = tiled_chain(layer, table, kind, share)
    model = LaneModel(two, t, force=force)
    runs = comm_runs(two.forward)            # both halves cut alike
    pos = {n: i for i, n in enumerate(model.f_names)}
    idx = [[pos[n] for n in run] for run in runs]
    steps = [(idx[k] if k < len(idx) else [], idx[k - 1] if k >= 1 else [])
             for k in range(len(idx) + 1)]
    return model.run(steps)[0]


__all__ = ["TILES", "tiled_chain", "tiles_makespan"]
