"""`dhelix demo`: a GPT on local ranks, megatron-core then DHelix, side by side.

The two schedules run alternately (`--repeats` times each) on the same seed and data over
an emulated cluster link, and the table shows each one's median tokens/s with its spread,
the final losses (equal: DHelix changes the order of work, not the math) and peak
activation memory.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

DEFAULT_LINK = "paced:1gbit"


@dataclass
class DemoOptions:
    config: str = "small"
    nproc: int = 2
    tensor_model_parallel_size: int = 2
    train_iters: int = 10
    seq_length: int = 128
    micro_batch_size: int = 4
    num_microbatches: int = 8
    repeats: int = 2
    link: str = DEFAULT_LINK
    lr: float = 5e-4
    out: Optional[str] = None         # folder for the runs' JSON (default: temp)


def _train_argv(a, out_json, dhelix):
    dp = a.nproc // a.tensor_model_parallel_size
    argv = ["train", "--config", a.config, "--tensor-model-parallel-size",
            str(a.tensor_model_parallel_size), "--sequence-parallel", "--train-iters",
            str(a.train_iters), "--seq-length", str(a.seq_length), "--micro-batch-size",
            str(a.micro_batch_size), "--global-batch-size",
            str(a.micro_batch_size * a.num_microbatches * dp), "--data", "corpus",
            "--log-interval", str(max(1, a.train_iters // 2)), "--json", out_json,
            "--lr", str(a.lr), "--clip-grad", "1.0"]
    return argv + (["--dhelix"] if dhelix else [])


def run_demo(a: DemoOptions) -> int:
    from dhelix.links import LinkError, launch, parse_link
    from dhelix.train.dist import spawn_local

    try:
        link = parse_link(a.link)
    except LinkError as e:
        print(f"dhelix demo: error: {e}", file=sys.stderr)
        return 2
    out = a.out or tempfile.mkdtemp(prefix="dhelix-demo-")
    os.makedirs(out, exist_ok=True)
    runs = {"megatron": [], "dhelix": []}
    with launch(link) as (prefix, env):
        for rep in range(a.repeats):
            for name, dh in (("megatron", False), ("dhelix", True)):
                path = os.path.join(out, f"{name}-{rep}.json")
                print(f"\n=== {name} (run {rep + 1}/{a.repeats}): {a.nproc} local ranks, "
                      f"link {link.text} ===", flush=True)
                rc = spawn_local(a.nproc, _train_argv(a, path, dh), prefix=prefix,
                                 extra_env=env, name="dhelix demo")
                if rc != 0:
                    print(f"dhelix demo: the {name} run failed (exit {rc})", file=sys.stderr)
                    return rc
                with open(path) as f:
                    runs[name].append(json.load(f))
    print(f"\nlink: {describe(link)}; {a.repeats} alternating runs of each schedule")
    print(table(runs["megatron"], runs["dhelix"]))
    with open(os.path.join(out, "demo.json"), "w") as f:
        json.dump({k: [{kk: r[kk] for kk in ("losses", "tokens_per_s", "peak_memory_bytes")}
                       for r in v] for k, v in runs.items()} | {"link": link.text}, f, indent=1)
    print(f"(runs saved under {out})")
    return 0


def describe(link) -> str:
    if link.kind == "paced":
        return (f"{link.text} (collectives complete at a {link.rate_Bps * 8 / 1e9:g} Gbit/s "
                f"link model, holding no CPU)")
    if link.kind == "tbf":
        return f"{link.text} (loopback limited by tc tbf: every byte costs CPU)"
    return "none (plain loopback)"


def _speed(runs):
    v = [r["tokens_per_s"] for r in runs]
    return statistics.median(v), min(v), max(v)


def table(base: list, dh: list) -> str:
    worst = max(abs(x - y) / abs(x) for b, d in zip(base, dh)
                for x, y in zip(b["losses"], d["losses"]))
    match = "yes" if worst <= 1e-5 else "NO"
    (mb, lb, hb), (md, ld, hd) = _speed(base), _speed(dh)
    pb, pd = base[0]["peak_memory_bytes"], dh[0]["peak_memory_bytes"]
    rows = [
        ("tokens/s (median)", f"{mb:.0f}", f"{md:.0f}", f"{md / mb:.2f}x"),
        ("tokens/s (min-max)", f"{lb:.0f}-{hb:.0f}", f"{ld:.0f}-{hd:.0f}",
         f"{ld / hb:.2f}x-{hd / lb:.2f}x"),
        ("final loss", f"{base[0]['losses'][-1]:.5f}", f"{dh[0]['losses'][-1]:.5f}",
         f"losses match: {match} (max rel diff {worst:.1e})"),
        ("peak activations (MiB)", f"{pb / 2**20:.2f}", f"{pd / 2**20:.2f}", f"{pd / pb:.2f}x"),
    ]
    w = [max(len(r[i]) for r in rows + [("", "megatron", "dhelix", "dhelix vs megatron")])
         for i in range(4)]
    lines = [f"| {'':<{w[0]}} | {'megatron':>{w[1]}} | {'dhelix':>{w[2]}} | "
             f"{'dhelix vs megatron':<{w[3]}} |",
             f"|{'-' * (w[0] + 2)}|{'-' * (w[1] + 2)}|{'-' * (w[2] + 2)}|{'-' * (w[3] + 2)}|"]
    for r in rows:
        lines.append(f"| {r[0]:<{w[0]}} | {r[1]:>{w[1]}} | {r[2]:>{w[2]}} | {r[3]:<{w[3]}} |")
    return "\n".join(lines)
