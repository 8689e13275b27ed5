"""Paced compute against the layer simulator: one DHelix layer step (α's forward ∥ β's
backward) of a small model on 2 ranks (TP=2+SP), paced to an emulated model on a cluster
model (`dhelix/train/emulate.py`), under the trivial and the paired plan; prints the
measured emulated step time beside the simulator's prediction for the emulated shape, and
the small ops' own share of the paced time (the emulation holds while it is small).

    python scripts/emulate_layer_step.py --config tiny-llama --emulate llama-8b,seq=4096,mbs=1 \
        --compute paced:a40,x=8
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny-llama", help="the model that runs")
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--emulate", default="llama-8b,seq=4096,mbs=1")
    p.add_argument("--compute", default="paced:a40,x=8")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    from dhelix.testing import run_ranks
    from emulate_fns import layer_step
    r = run_ranks(layer_step, 2, a.config, a.emulate, a.compute, a.seq_length,
                  a.micro_batch_size, a.reps, timeout=1200,
                  env={"DHELIX_LINK": "paced:1gbit"})[0]
    print(f"{a.config} (seq {a.seq_length}, mbs {a.micro_batch_size}) emulating {a.emulate} "
          f"on {a.compute}, TP=2+SP, median of {a.reps}; the small ops' own share of paced "
          f"compute {r['own_share']:.1%}; outputs equal to unpaced: {all(r['same'].values())}")
    print("| plan | measured (ms) | simulator (ms) | measured / simulator |")
    print("|---|---|---|---|")
    for k in ("trivial", "paired"):
        m, s = r["measured"][k], r["predicted"][k]
        print(f"| {k} | {m * 1e3:.1f} | {s * 1e3:.1f} | {m / s:.3f} |")


if __name__ == "__main__":
    main()
