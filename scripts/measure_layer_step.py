"""One DHelix layer step (α's forward ∥ β's backward) under several plans, side by side.

Runs 2 local gloo ranks (TP=2, sequence parallel) and times `run_layer_step` for the
trivial plan (nothing paired) and the built-in paired plan, alternating plans every
repeat so machine noise hits both alike. Run it on a slowed link:

    scripts/slow_link.sh 200mbit -- python scripts/measure_layer_step.py --config small
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def body(config, seq, mbs, reps, plan_path):
    import layer_fns
    from dhelix.planner.plan import Plan, paired_plan, trivial_plan
    from dhelix.strand.lanes import make_lanes

    _, dh, cfg, rope = layer_fns.setup_layer(config, 2, True, 3, seq, mbs)
    prog = dh.program
    ops = prog.layer_ops(seq, mbs)
    plans = {"trivial": trivial_plan(ops), "paired": paired_plan(ops)}
    if plan_path:
        plans["file"] = Plan.load(plan_path)
    x = layer_fns.inputs(cfg, seq, mbs, 1, True)
    g = layer_fns.inputs(cfg, seq, mbs, 2, True)
    lanes = make_lanes()
    meta = {"attention_mask": None, "rotary_pos_emb": rope}
    times = {k: [] for k in plans}
    for rep in range(reps + 2):
        for name, plan in plans.items():
            dt, _ = layer_fns.timed_layer_step(prog, plan, plans["trivial"], lanes, meta, x, g)
            if rep >= 2:   # warm-up
                times[name].append(dt)
    return {k: statistics.median(v) for k, v in times.items()}, \
        {k: (min(v), max(v)) for k, v in times.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="small")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--plan", default=None, help="also time this plan file")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from dhelix.testing import run_ranks
    med, rng = run_ranks(body, 2, a.config, a.seq_length, a.micro_batch_size, a.reps, a.plan,
                         timeout=1200, env={"OMP_NUM_THREADS": "1"})[0]
    base = med["trivial"]
    print(f"layer step ({a.config}, TP=2 SP, seq {a.seq_length}, mbs {a.micro_batch_size}), "
          f"median of {a.reps}:")
    for k, v in med.items():
        print(f"  {k:8s} {v * 1e3:8.2f} ms  (min {rng[k][0] * 1e3:.2f}, max "
              f"{rng[k][1] * 1e3:.2f})  speedup vs trivial {base / v:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"median_s": med, "range_s": rng, "args": vars(a)}, f, indent=1)


if __name__ == "__main__":
    main()
