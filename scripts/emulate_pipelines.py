"""Paced compute against the pipeline simulator: megatron's 1F1B and interleaved
schedules and the DHelix fold, run by `dhelix train` on a small model while the ranks keep
an emulated model's time on a cluster model (`--compute`, `--emulate`: docs/links.md);
prints each schedule's measured emulated step beside the pipeline simulator's prediction
for the emulated shape (`planner/pipeline.py`, per-layer costs from the layer simulator
on the cluster's analytical table, the P2P message over the cluster's intra-node link).

    python scripts/emulate_pipelines.py --nproc 2 --pipeline-model-parallel-size 2 \
        --emulate llama-8b,seq=2048,mbs=1 --compute paced:a40,x=8
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def predict(a, L, N):
    """{schedule: predicted emulated step (s)} from the pipeline simulator."""
    from dhelix.train.emulate import _cluster, parse
    from dhelix.models.config import load_model_config
    from dhelix.planner.costmodel import analytical_table, group_sizes_of
    from dhelix.planner.pipeline import LayerCosts, cluster_p2p_seconds, simulate_pipeline
    from dhelix.planner.plan import paired_plan
    from dhelix.planner.shapes import layer_ops_for_shape
    emu = parse(a.compute, a.emulate)
    m, c = load_model_config(emu.model), _cluster(emu.cluster)
    s, b = emu.seq_length or a.seq_length, emu.micro_batch_size or a.micro_batch_size
    sp = a.tensor_model_parallel_size > 1
    ops = layer_ops_for_shape(m, a.tensor_model_parallel_size, sp, s, b, bf16=True)
    table = analytical_table(ops, c, group_sizes_of({"tp": a.tensor_model_parallel_size}, ops))
    lc = LayerCosts.from_plan(ops, paired_plan(ops), table)
    p2p = cluster_p2p_seconds(s // (a.tensor_model_parallel_size if sp else 1) * b *
                              m.hidden_size * 2, c, "intra")
    res = simulate_pipeline(lc, L, a.pipeline_model_parallel_size, N, p2p,
                            vpp_layers=a.vpp_layers)
    return {k: r.makespan for k, r in res.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--config", default="tiny-llama-emu")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=2)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--vpp-layers", type=int, default=2,
                   help="layers per virtual stage of the interleaved schedule")
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--emulate", default="llama-8b,seq=2048,mbs=1")
    p.add_argument("--compute", default="paced:a40,x=8")
    p.add_argument("--train-iters", type=int, default=3)
    a = p.parse_args()
    from dhelix.models.config import load_model_config
    L = load_model_config(a.config).num_layers
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    dp = a.nproc // (tp * pp)
    N = a.global_batch_size // (a.micro_batch_size * dp)
    runs = {"megatron-1f1b": [], "megatron-interleaved":
            ["--num-layers-per-virtual-pipeline-stage", str(a.vpp_layers)],
            "dhelix-fold": ["--dhelix", "--dhelix-fold", "--dhelix-plan", "paired"]}
    base = [sys.executable, "-m", "dhelix.cli", "train", "--nproc", str(a.nproc),
            "--config", a.config, "--pipeline-model-parallel-size", str(pp),
            "--tensor-model-parallel-size", str(tp), "--seq-length", str(a.seq_length),
            "--micro-batch-size", str(a.micro_batch_size), "--global-batch-size",
            str(a.global_batch_size), "--train-iters", str(a.train_iters), "--data",
            "synthetic", "--link", "paced:1gbit", "--compute", a.compute, "--emulate",
            a.emulate, "--log-interval", str(a.train_iters)] + \
        (["--sequence-parallel"] if tp > 1 else [])
    pred = predict(a, L, N)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name, extra in runs.items():
            j = os.path.join(d, name + ".json")
            print(f"running {name} ...", file=sys.stderr, flush=True)
            t = time.perf_counter()
            r = subprocess.run(base + extra + ["--json", j], capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"{name} failed:\n{r.stderr[-3000:]}")
            out[name] = json.load(open(j))
            out[name]["wall_s"] = time.perf_counter() - t
    print(f"{a.config} ({L} layers, seq {a.seq_length}) emulating {a.emulate} on "
          f"{a.compute}: {a.nproc} ranks, TP={tp} PP={pp} DP={dp}, {N} micro-batches")
    print("| schedule | measured step (ms) | simulator (ms) | measured / simulator | "
          "vs 1F1B measured | vs 1F1B simulated | own share | final loss |")
    print("|---|---|---|---|---|---|---|---|")
    b_m = out["megatron-1f1b"]["emulation"]["step_s"]
    for name, r in out.items():
        e = r["emulation"]
        print(f"| {name} | {e['step_s'] * 1e3:.1f} | {pred[name] * 1e3:.1f} | "
              f"{e['step_s'] / pred[name]:.3f} | {b_m / e['step_s']:.3f}x | "
              f"{pred['megatron-1f1b'] / pred[name]:.3f}x | {e['own_share']:.1%} | "
              f"{r['losses'][-1]:.6f} |")
    r0 = out["megatron-1f1b"]
    walls = ", ".join(f"{k} {v['wall_s']:.0f} s" for k, v in out.items())
    print(f"a rank: peak RSS {r0['peak_rss_bytes'] / 2**20:.0f} MiB (rank 0); whole runs: "
          f"{walls} (start-up and {a.train_iters} steps)")


if __name__ == "__main__":
    main()
