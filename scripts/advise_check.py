"""`dhelix advise` against measured runs on this machine: every layout of a small model
on 2 and 4 local ranks (TP, DP, CP, PP with 1F1B, interleaved and the fold; EP for an MoE
config) is priced by advise (fp32, the analytical model of this machine: one core's
measured GEMM rate, the paced link's rate) and run by `dhelix train` on the paced link;
prints the predicted and the measured order (Spearman's rank correlation) and the
predicted vs measured memory per rank (weights, gradient buffers, optimizer states and
peak activations; the busiest rank).

    python scripts/advise_check.py --nproc 2,4 --link paced:1gbit --out advise-check

With `--profile`, each layer shape the layouts use is first measured by `dhelix profile`
on the same link (its ranks: TP × CP × EP), and advise prices from those tables
(`--overlap-table`: the layers, the head and the optimizer as measured) instead of the
analytical model.
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
    p.add_argument("--nproc", default="2,4")
    p.add_argument("--config", default="tiny-llama-emu")
    p.add_argument("--moe-config", default="tiny-moe-emu")
    p.add_argument("--moe-nproc", default="2", help="rank counts the MoE config runs at")
    p.add_argument("--limit", type=int, default=0, help="at most this many layouts per "
                   "rank count and model (0: all)")
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--train-iters", type=int, default=3)
    p.add_argument("--link", default="paced:1gbit")
    p.add_argument("--out", default="advise-check")
    p.add_argument("--profile", action="store_true", help="price from tables `dhelix "
                   "profile` measures first, one per layer shape")
    p.add_argument("--repeats", type=int, default=5, help="dhelix profile --repeats")
    a = p.parse_args()
    import yaml
    from dhelix.advise.layouts import enumerate_layouts
    from dhelix.advise.price import Pricer
    from dhelix.advise.report import train_flags
    from dhelix.bench.run import machine_cluster
    from dhelix.models.config import load_model_config
    from dhelix.profiler.validate import spearman
    work = tempfile.mkdtemp(prefix="dhelix-advise-check-")
    rows = []
    for n in (int(x) for x in a.nproc.split(",")):
        path = machine_cluster(a.link, os.path.join(work, f"machine-{n}.yaml"))
        cluster = yaml.safe_load(open(path))
        cluster.update(gpus_per_node=n, memory_GiB=16)
        with open(path, "w") as f:
            yaml.safe_dump(cluster, f)
        for name in (a.config, a.moe_config):
            if name == a.moe_config and str(n) not in a.moe_nproc.split(","):
                continue
            m = load_model_config(name)
            los = [lo for lo in enumerate_layouts(m, n, n, a.seq_length,
                                                  a.global_batch_size, (False,))
                   if lo.mbs == a.micro_batch_size and (lo.ep > 1) == bool(m.num_experts)]
            los = los[:a.limit or None]
            tables = [profile(name, shape, a, work) for shape in
                      sorted({(lo.tp, lo.cp, lo.ep) for lo in los})] if a.profile else []
            pricer = Pricer(m, cluster, a.seq_length, a.global_batch_size, "fp32", tables)
            for lo in los:
                pred = pricer.price(lo)
                out = os.path.join(work, f"{n}-{name}-{len(rows)}.json")
                cmd = [sys.executable, "-m", "dhelix.cli", "train", "--nproc", str(n),
                       "--link", a.link, "--data", "synthetic", "--train-iters",
                       str(a.train_iters), "--json", out,
                       *train_flags(lo, name, m, a.seq_length, a.global_batch_size, path)]
                print(f"[{len(rows) + 1}] {n} ranks {name} {lo.name()} ...", file=sys.stderr,
                      flush=True)
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
                if r.returncode:
                    print(f"    failed: {r.stderr[-800:]}", file=sys.stderr)
                    continue
                res = json.load(open(out))
                steady = res["step_times_s"][1:] or res["step_times_s"]
                meas_mem = sum(res["model_state_bytes"].values()) + res["peak_memory_bytes"]
                rows.append({"nproc": n, "config": name, "layout": lo.name(),
                             "cost_source": pred.cost_source,
                             "predicted_s": pred.step_s, "measured_s":
                             statistics.median(steady), "predicted_bytes":
                             pred.memory_bytes, "measured_bytes": meas_mem,
                             "predicted_memory": pred.memory,
                             "measured_memory": dict(res["model_state_bytes"],
                                                     activations=res["peak_memory_bytes"])})
    lines = []
    for n in sorted({r["nproc"] for r in rows}):
        sel = [r for r in rows if r["nproc"] == n]
        rho = spearman([r["predicted_s"] for r in sel], [r["measured_s"] for r in sel])
        lines += [f"### {n} ranks ({len(sel)} layouts): Spearman {rho:.2f}", "",
                  "| model | layout | predicted ms | measured ms | predicted rank | measured "
                  "rank | memory predicted / measured KiB |", "|---|---|---:|---:|---:|---:|---|"]
        pr = sorted(range(len(sel)), key=lambda i: sel[i]["predicted_s"])
        mr = sorted(range(len(sel)), key=lambda i: sel[i]["measured_s"])
        for i, r in enumerate(sel):
            lines.append(f"| {r['config']} | {r['layout']} | {r['predicted_s'] * 1e3:.1f} | "
                         f"{r['measured_s'] * 1e3:.1f} | {pr.index(i) + 1} | "
                         f"{mr.index(i) + 1} | {r['predicted_bytes'] / 1024:.0f} / "
                         f"{r['measured_bytes'] / 1024:.0f} "
                         f"({r['predicted_bytes'] / r['measured_bytes']:.2f}) |")
        lines.append("")
    md = "\n".join(lines)
    print(md)
    with open(a.out + ".md", "w") as f:
        f.write(md + "\n")
    with open(a.out + ".json", "w") as f:
        json.dump(rows, f, indent=1)


def profile(name: str, shape, a, work: str) -> str:
    """`dhelix profile` of one layer shape (TP, CP, EP) on the link; the table's path."""
    tp, cp, ep = shape
    out = os.path.join(work, f"table-{name}-tp{tp}-cp{cp}-ep{ep}.json")
    cmd = [sys.executable, "-m", "dhelix.cli", "profile", "--config", name, "--seq-length",
           str(a.seq_length), "--micro-batch-size", str(a.micro_batch_size),
           "--tensor-model-parallel-size", str(tp), "--context-parallel-size", str(cp),
           "--nproc", str(tp * cp * ep), "--link", a.link, "--repeats", str(a.repeats),
           "--pairs", "concurrent", "--out", out]
    if tp > 1:
        cmd.append("--sequence-parallel")
    if ep > 1:
        cmd += ["--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", "1"]
    print(f"profile {name} TP{tp} CP{cp} EP{ep} ...", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    return out


if __name__ == "__main__":
    main()
