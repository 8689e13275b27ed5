"""DHelix's own cost: `dhelix train` of megatron and of DHelix with the trivial plan (the
same ops in megatron's order, nothing paired), alternating, on links where there is
nothing to hide. Prints each run's median step and the ratio per round.

    python scripts/own_cost.py --links none,paced:1000gbit --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--links", default="none,paced:1000gbit")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--config", default="small16")
    p.add_argument("--train-iters", type=int, default=6)
    p.add_argument("--plan", default="trivial", help="the DHelix plan (default: trivial)")
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="dhelix-own-cost-")
    rows = []
    for link in a.links.split(","):
        for r in range(a.rounds):
            got = {}
            for method in ("megatron", "dhelix"):
                out = os.path.join(work, f"{method}.json")
                cmd = [sys.executable, "-m", "dhelix.cli", "train", "--nproc", "2",
                       "--config", a.config, "--tensor-model-parallel-size", "2",
                       "--sequence-parallel", "--seq-length", "128", "--micro-batch-size",
                       "4", "--global-batch-size", "32", "--train-iters",
                       str(a.train_iters), "--log-interval", str(a.train_iters),
                       "--data", "synthetic", "--link", link, "--json", out]
                if method == "dhelix":
                    cmd += ["--dhelix", "--dhelix-plan", a.plan]
                subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
                ts = json.load(open(out))["step_times_s"][1:]
                got[method] = statistics.median(ts)
            rows.append((link, r + 1, got["megatron"], got["dhelix"]))
            print(f"{link:16s} round {r + 1}: megatron {got['megatron'] * 1e3:7.0f} ms  "
                  f"dhelix ({a.plan}) {got['dhelix'] * 1e3:7.0f} ms  "
                  f"{got['megatron'] / got['dhelix']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
