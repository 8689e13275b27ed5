"""The README's picture of the fold (docs/fold.png): the DHelix fold beside megatron's
1F1B with unit costs (a chunk forward 1, backward 2, a pair 3).

    python scripts/draw_fold.py [--stages 4] [--microbatches 8] [--png docs/fold.png]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dhelix.planner.pipeline import LayerCosts, draw_pipelines, simulate_pipeline  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=4, help="pipeline stages (default 4)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches (default 8)")
    p.add_argument("--png", default="docs/fold.png", help="output (default docs/fold.png)")
    a = p.parse_args()
    unit = LayerCosts(f=1.0, b=2.0, pair=3.0, saved=1.0, transient=0.0)
    res = simulate_pipeline(unit, 2 * a.stages, a.stages, a.microbatches, 0.0)
    draw_pipelines(res, a.png, f"{a.stages} stages, {a.microbatches} micro-batches, unit "
                               f"costs (no gain from pairing counted)", unit_costs=True)
    for name, r in res.items():
        print(f"{name}: bubble {r.bubble * 100:.1f}%")
    print(f"wrote {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
