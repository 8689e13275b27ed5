"""DHelix's own cost, or an A/B of plans: `dhelix train` of megatron and of DHelix with
each plan given (default: the trivial plan — the same ops in megatron's order, nothing
paired), alternating in every round, on the links given. Prints each run's median step
and its speedup over megatron's run of the same round.

    python scripts/own_cost.py --links none,paced:1000gbit --rounds 2
    python scripts/own_cost.py --links paced:1gbit --plan rotated.json,unrotated.json \\
        --rounds 3 --train-iters 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def _chunks(plan: str) -> list:
    """`--dhelix-mlp-chunks C` for a plan file made for a layer with its MLP in chunks
    (`dhelix plan --dhelix-mlp-chunks C` records the shape in the plan's meta)."""
    if not plan.endswith(".json"):
        return []
    c = json.load(open(plan)).get("meta", {}).get("shape", {}).get("mlp_chunks", 1)
    return ["--dhelix-mlp-chunks", str(c)] if c > 1 else []


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--links", default="none,paced:1000gbit")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--config", default="small16")
    p.add_argument("--train-iters", type=int, default=6)
    p.add_argument("--plan", default="trivial",
                   help="DHelix's plans, comma separated: built-in names or plan files "
                        "(default: trivial)")
    a = p.parse_args()
    plans = [x for x in a.plan.split(",") if x]
    work = tempfile.mkdtemp(prefix="dhelix-own-cost-")
    for link in a.links.split(","):
        for r in range(a.rounds):
            got = {}
            for method in ["megatron"] + plans:
                out = os.path.join(work, "run.json")
                cmd = [sys.executable, "-m", "dhelix.cli", "train", "--nproc", "2",
                       "--config", a.config, "--tensor-model-parallel-size", "2",
                       "--sequence-parallel", "--seq-length", "128", "--micro-batch-size",
                       "4", "--global-batch-size", "32", "--train-iters",
                       str(a.train_iters), "--log-interval", str(a.train_iters),
                       "--data", "synthetic", "--link", link, "--json", out]
                if method != "megatron":
                    cmd += ["--dhelix", "--dhelix-plan", method] + _chunks(method)
                subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
                got[method] = statistics.median(json.load(open(out))["step_times_s"][1:])
            mg = got["megatron"]
            cols = "  ".join(f"{os.path.basename(m)} {got[m] * 1e3:6.0f} ms {mg / got[m]:.2f}x"
                             for m in plans)
            print(f"{link:16s} round {r + 1}: megatron {mg * 1e3:6.0f} ms  {cols}", flush=True)


if __name__ == "__main__":
    main()
