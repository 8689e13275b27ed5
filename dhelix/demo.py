"""`dhelix demo`: a GPT on local ranks, baseline megatron then DHelix, side by side."""
from __future__ import annotations

import json
import os
import sys
import tempfile


def register(sub):
    p = sub.add_parser("demo", help="train baseline then --dhelix on local ranks and compare")
    p.add_argument("--config", default="small")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--tensor-model-parallel-size", type=int, default=2)
    p.add_argument("--train-iters", type=int, default=20)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--link", default="none", metavar="RATE",
                   help="run both inside a network namespace whose loopback is limited to "
                        "RATE (e.g. 4gbit; needs root): an emulated slow cluster")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--out", default=None, help="folder for the runs' JSON (default: temp)")
    p.set_defaults(func=run)


def _train_argv(a, out_json, dhelix):
    dp = a.nproc // a.tensor_model_parallel_size
    argv = ["train", "--config", a.config, "--tensor-model-parallel-size",
            str(a.tensor_model_parallel_size), "--sequence-parallel", "--train-iters",
            str(a.train_iters), "--seq-length", str(a.seq_length), "--micro-batch-size",
            str(a.micro_batch_size), "--global-batch-size",
            str(a.micro_batch_size * a.num_microbatches * dp), "--data", "corpus",
            "--log-interval", str(max(1, a.train_iters // 4)), "--json", out_json,
            "--lr", str(a.lr), "--clip-grad", "1.0"]
    return argv + (["--dhelix"] if dhelix else [])


def run(a, argv) -> int:
    from dhelix.links import launch, parse_link
    from dhelix.train.dist import spawn_local

    out = a.out or tempfile.mkdtemp(prefix="dhelix-demo-")
    os.makedirs(out, exist_ok=True)
    results = {}
    link = f" over a {a.link} link" if a.link != "none" else ""
    with launch(parse_link(a.link)) as (prefix, env):
        for name, dh in (("megatron", False), ("dhelix", True)):
            path = os.path.join(out, f"{name}.json")
            print(f"\n=== {name}: {a.nproc} local ranks{link} ===", flush=True)
            rc = spawn_local(a.nproc, _train_argv(a, path, dh), prefix=prefix, extra_env=env)
            if rc != 0:
                print(f"dhelix demo: the {name} run failed (exit {rc})", file=sys.stderr)
                return rc
            with open(path) as f:
                results[name] = json.load(f)
    print(table(results["megatron"], results["dhelix"]))
    with open(os.path.join(out, "demo.json"), "w") as f:
        json.dump({k: {kk: v[kk] for kk in ("losses", "tokens_per_s", "peak_memory_bytes")}
                   for k, v in results.items()}, f, indent=1)
    print(f"(runs saved under {out})")
    return 0


def table(base: dict, dh: dict) -> str:
    worst = max(abs(x - y) / abs(x) for x, y in zip(base["losses"], dh["losses"]))
    match = "yes" if worst <= 1e-5 else "NO"
    rows = [
        ("tokens/s", f"{base['tokens_per_s']:.0f}", f"{dh['tokens_per_s']:.0f}",
         f"{dh['tokens_per_s'] / base['tokens_per_s']:.2f}x"),
        ("final loss", f"{base['losses'][-1]:.5f}", f"{dh['losses'][-1]:.5f}",
         f"losses match: {match} (max rel diff {worst:.1e})"),
        ("peak activations (MiB)", f"{base['peak_memory_bytes'] / 2**20:.2f}",
         f"{dh['peak_memory_bytes'] / 2**20:.2f}",
         f"{dh['peak_memory_bytes'] / base['peak_memory_bytes']:.2f}x"),
    ]
    w = [max(len(r[i]) for r in rows + [("", "megatron", "dhelix", "")]) for i in range(4)]
    lines = ["", f"| {'':<{w[0]}} | {'megatron':>{w[1]}} | {'dhelix':>{w[2]}} | "
                 f"{'dhelix vs megatron':<{w[3]}} |",
             f"|{'-' * (w[0] + 2)}|{'-' * (w[1] + 2)}|{'-' * (w[2] + 2)}|{'-' * (w[3] + 2)}|"]
    for r in rows:
        lines.append(f"| {r[0]:<{w[0]}} | {r[1]:>{w[1]}} | {r[2]:>{w[2]}} | {r[3]:<{w[3]}} |")
    return "\n".join(lines)
