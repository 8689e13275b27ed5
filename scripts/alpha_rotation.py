"""What the simulator says a rotated α would give: the steady-state layer pair with α's
forward chain rotated by s — α's layer step running ops s.. of layer i and then ops ..s−1
of layer i+1, so that α's next layer's first gather may start beside β's long tail — each
planned as `dhelix plan` plans (β rotated and reordered where that pays).

    python scripts/alpha_rotation.py --table table.json --config small16 \\
        --tensor-model-parallel-size 2 --sequence-parallel --seq-length 128 \\
        --micro-batch-size 4

Prints, per s, the planned pair's time and the co-step's time per layer pair. The schedule
does not run α rotated: α's forward is megatron's own, node by node (a layer's output is
returned before the next layer is called), so this is a model experiment — run it before
building that. A comm whose reader moves to the next layer step loses its reader here:
the step's barrier waits for it, as the executor's would.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import List

from dhelix.planner.opspec import LayerOps, OpSpec


def rotated_forward(layer: LayerOps, s: int) -> LayerOps:
    """`layer` with its forward chain rotated by `s` (ops s.. then ops ..s−1); a comm
    whose reader now runs in the next layer step waits at the step's barrier."""
    names = [o.name for o in layer.forward]
    if not 0 <= s < len(names):
        raise ValueError(f"rotation {s}: the forward chain has {len(names)} ops")
    f: List[OpSpec] = list(layer.forward[s:]) + list(layer.forward[:s])
    f = [dataclasses.replace(o, reader=None)
         if o.reader in names and names.index(o.name) < s <= names.index(o.reader) else o
         for o in f]
    return LayerOps(f, list(layer.backward))


def main():
    from dhelix.cli.planner_args import add_shape_args, shape_from_args
    from dhelix.models.config import load_model_config
    from dhelix.planner import dp
    from dhelix.planner.problem import layer_for_shape, load_costs
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p, required=True)          # the layer, as `dhelix plan` takes it
    p.add_argument("--table", required=True)
    p.add_argument("--rotations", default=None,
                   help="comma-separated s (default: every op of the forward chain)")
    a = p.parse_args()
    shape = shape_from_args(a)
    layer = layer_for_shape(shape)
    costs, _ = load_costs(layer, shape, a.table, None, False)
    L = load_model_config(shape["config"]).num_layers
    names = [o.name for o in layer.forward]
    rots = range(len(names)) if a.rotations is None else \
        [int(x) for x in a.rotations.split(",")]
    for s in rots:
        # force: the rotated chain has another signature, the same ops as the table's
        q = dp.plan(rotated_forward(layer, s), costs, rotate=True, reorder=True,
                    num_layers=L, force=True)
        print(f"s={s:2d} ({names[s]:>8}): pair {q.meta['predicted_s'] * 1e3:7.2f} ms, "
              f"co-step per layer pair {q.meta['co_step_predicted_s'] / L * 1e3:7.2f} ms, "
              f"β rotation {q.rotation}", flush=True)


if __name__ == "__main__":
    main()
