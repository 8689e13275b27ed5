"""`dhelix advise`: every legal layout of a job priced, the ones that fit ranked, megatron's
best beside DHelix's best, and what it takes to run the winner."""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

from dhelix.advise import report
from dhelix.advise.layouts import AdviseError, check_job, enumerate_layouts
from dhelix.advise.price import GiB, Prediction, Pricer, fits


@dataclass
class AdviseOptions:
    config: str = ""                    # model config (name or YAML)
    cluster: str = "h100"               # a40 | a800 | h100 | a cluster YAML
    gpus: int = 8
    seq_length: int = 4096
    global_batch_size: int = 512
    memory_per_gpu: Optional[float] = None   # GiB; default: the cluster file's memory_GiB
    top: int = 10
    recompute: str = "both"             # both | off | on
    dtype: str = "bf16"                 # bf16 (GPUs) | fp32 (as CPU runs train)
    overlap_table: Optional[List[str]] = None   # profiled tables (`dhelix profile`)
    out: str = "advise"                 # prefix for .md, .json, .png, the plan and sbatch


def run_advise(o: AdviseOptions) -> int:
    from tqdm import tqdm

    from dhelix.models.config import ConfigError, find_named_yaml, load_model_config
    from dhelix.planner.costmodel import ClusterError, gpus_per_node, load_cluster
    from dhelix.planner.costs import TableError
    t0 = time.perf_counter()
    try:
        m = load_model_config(o.config)
        path = find_named_yaml(o.cluster, "clusters", "--cluster", "cluster", ClusterError)
        cluster = load_cluster(path)
        mem = o.memory_per_gpu or cluster.get("memory_GiB")
        if not mem:
            raise AdviseError(f"{path}: no memory_GiB in the cluster file: give "
                              f"--memory-per-gpu GiB")
        gpn = gpus_per_node(cluster)
        check_job(m, o.gpus, gpn, o.seq_length, o.global_batch_size)
        pricer = Pricer(m, cluster, o.seq_length, o.global_batch_size, o.dtype,
                        o.overlap_table or ())
    except (AdviseError, ConfigError, ClusterError, TableError, FileNotFoundError) as e:
        print(f"dhelix advise: error: {e}", file=sys.stderr)
        return 2
    rc = {"both": (False, True), "off": (False,), "on": (True,)}[o.recompute]
    layouts = list(enumerate_layouts(m, o.gpus, gpn, o.seq_length, o.global_batch_size, rc))
    preds: List[Prediction] = []
    for lo in tqdm(layouts, desc="dhelix advise", unit="layout", file=sys.stderr,
                   mininterval=0.5):
        try:
            preds.append(pricer.price(lo))
        except ValueError as e:          # a shape the planner's rules refuse
            print(f"dhelix advise: skipped {lo.name()}: {e}", file=sys.stderr)
    ok = sorted((p for p in preds if fits(p, mem)), key=lambda p: -p.tokens_per_s)
    search_s = time.perf_counter() - t0
    unused = [path for path, _ in pricer.tables.values() if path not in pricer.tables_used]
    for path in unused:
        print(f"dhelix advise: warning: {path} matches no layout's layer shape (model, "
              f"TP/CP/EP, sequence, micro-batch, dtype): not used", file=sys.stderr)
    if not ok:
        least = min(preds, key=lambda p: p.memory_bytes)
        states = sum(least.memory[k] for k in ("weights", "grads", "optimizer"))
        fix = "add GPUs" if states > 0.9 * mem * GiB else \
            "add GPUs, recomputation (--recompute both or on) or a shorter --seq-length"
        print(f"dhelix advise: error: --config {m.name} fits no layout on {o.gpus} GPUs of "
              f"{mem:g} GiB: the smallest needs {least.memory_bytes / GiB:.1f} GiB per GPU "
              f"({least.layout.name()}: weights, gradients and optimizer states "
              f"{states / GiB:.1f} GiB, activations "
              f"{(least.memory_bytes - states) / GiB:.1f} GiB; 90% of a GPU's memory is "
              f"usable); {fix}", file=sys.stderr)
        return 2
    best = {w: next((p for p in ok if p.layout.who == w), None) for w in ("megatron", "dhelix")}
    top = ok[:o.top]
    for p in best.values():         # both bests are always in the table
        if p is not None and p not in top:
            top.append(p)
    os.makedirs(os.path.dirname(os.path.abspath(o.out)) or ".", exist_ok=True)
    plan_path = None
    if best["dhelix"] is not None:
        plan = pricer.layer(best["dhelix"].layout)[2]
        plan_path = o.out + ".plan.json"
        plan.save(plan_path)
    winner = ok[0]
    cname = cluster.get("name", os.path.splitext(os.path.basename(path))[0])
    report.sbatch(o.out + ".sbatch", m.name, winner.layout, o.seq_length,
                  o.global_batch_size, m, cname, plan_path, gpn)
    title = (f"{m.name} on {o.gpus} × {cname}, seq {o.seq_length}, global batch "
             f"{o.global_batch_size}")
    report.picture(top, o.out + ".png", title, mem)
    md = _markdown(o, m, cname, _source(cluster, path, pricer), top, best, winner,
                   plan_path, len(layouts), len(ok), pricer.planned, search_s, mem)
    with open(o.out + ".md", "w") as f:
        f.write(md + "\n")
    with open(o.out + ".json", "w") as f:
        json.dump({"options": asdict(o), "cost_source": _source(cluster, path, pricer),
                   "search_s": search_s, "layouts": len(layouts), "fit": len(ok),
                   "top": [p.to_json() for p in top],
                   "best": {k: (p.to_json() if p else None) for k, p in best.items()}},
                  f, indent=1)
    print(md)
    print(f"dhelix advise: wrote {o.out}.md, {o.out}.json, {o.out}.png, {o.out}.sbatch"
          + (f", {plan_path}" if plan_path else ""))
    return 0


def _source(cluster: dict, path: str, pricer: Pricer) -> str:
    s = (f"analytical model of {path} (peak FLOP/s × achieved_fraction "
         f"{cluster.get('achieved_fraction', 1.0)}, link bandwidths and latencies)")
    if pricer.tables_used:
        s = (f"the profiled tables {', '.join(sorted(pricer.tables_used))} for their layer "
             f"shapes (column \"cost\"), else the " + s)
    return s


def _markdown(o, m, cname, source, top, best, winner, plan_path, n_layouts, n_fit,
              planned, search_s, mem) -> str:
    bm, bd = best["megatron"], best["dhelix"]
    lines = [f"## dhelix advise: {m.name} on {o.gpus} GPUs ({cname}), seq {o.seq_length}, "
             f"global batch {o.global_batch_size}", "",
             f"{n_layouts} legal layouts, {n_fit} fit {mem:g} GiB per GPU; {planned} DP "
             f"plans (one per TP, CP, EP); search {search_s:.1f} s. Cost source: "
             f"{source}. The simulators' error, measured against runs: "
             f"docs/advise.md (\"Against measured runs\").", "", report.table(top, mem), ""]
    if bm and bd:
        lines.append(f"megatron's best: {bm.layout.name()}, {bm.tokens_per_s:,.0f} tokens/s; "
                     f"DHelix's best: {bd.layout.name()}, {bd.tokens_per_s:,.0f} tokens/s "
                     f"(**{bd.tokens_per_s / bm.tokens_per_s:.2f}x**).")
    lines += ["", f"Run the best ({winner.layout.name()}):", "```bash",
              report.command(m.name, winner.layout, o.seq_length, o.global_batch_size, m,
                             plan_path), "```",
              f"or `sbatch {o.out}.sbatch` (Slurm settings: configs/slurm/{cname}.env)."]
    return "\n".join(lines)
