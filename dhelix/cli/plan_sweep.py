"""`dhelix plan-sweep`: plan many model shapes x clusters with analytical costs.

For every (model config, cluster) it runs the planner (dhelix/planner/sweep.py) and reports
the predicted speed-up of the plan over the trivial plan as a markdown table, a JSON file
and a grouped bar chart; failing combinations are listed in the table and make the exit
status 1.
"""
from __future__ import annotations

import argparse
import json
import sys

from dhelix.base.units import parse_bytes
from dhelix.cli.common import fail
from dhelix.cli.planner_args import add_cp_arg, add_planner_args, split_list
from dhelix.planner.problem import (DEFAULT_CLUSTERS, InputError, check_cp, dtype_name,
                                    expected_errors, resolve_cluster, shapes_only_configs)
from dhelix.planner.sweep import sweep, sweep_chart, sweep_markdown


def add_parser(sub) -> None:
    w = sub.add_parser("plan-sweep", help="plan many model shapes x clusters; predicted "
                                          "speedups as a table, JSON and bar chart",
                       description="Run the planner with analytical costs for every model "
                                   "config x cluster and report the predicted speedup of the "
                                   "plan over the trivial plan (nothing paired: what "
                                   "megatron's schedule runs).")
    w.add_argument("--configs", nargs="+", default=None, metavar="NAME",
                   help="model configs (space or comma separated; default: every "
                        "shapes_only config)")
    w.add_argument("--clusters", nargs="+", default=None, metavar="NAME",
                   help=f"clusters (default: {' '.join(DEFAULT_CLUSTERS)})")
    w.add_argument("--tensor-model-parallel-size", type=int, default=8, metavar="N",
                   help="default 8")
    w.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="sequence parallelism (default on; --no-sequence-parallel turns it off)")
    w.add_argument("--seq-length", type=int, default=4096, metavar="S", help="default 4096")
    w.add_argument("--micro-batch-size", type=int, default=1, metavar="B", help="default 1")
    w.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 (default on; --no-bf16 for fp32)")
    w.add_argument("--lane", choices=("intra", "inter"), default="intra",
                   help="where the TP group lives: inside a node (intra, default) or across "
                        "nodes (inter)")
    w.add_argument("--pipeline-model-parallel-size", type=int, default=1, metavar="G",
                   help="G > 1: also the whole pipeline step, megatron 1F1B vs the DHelix "
                        "fold (default 1)")
    w.add_argument("--expert-model-parallel-size", type=int, default=1, metavar="P",
                   help="EP for the MoE configs (phi-3.5-moe): experts over P ranks, "
                        "all-to-all as planned ops (default 1)")
    add_cp_arg(w, default=1)
    w.add_argument("--data-parallel-size", type=int, default=1, metavar="D",
                   help="DP size of the layout (reported; default 1); the GPUs are "
                        "DP × TP × CP × PP")
    w.add_argument("--num-microbatches", type=int, default=None, metavar="N",
                   help="micro-batches per step for the pipeline (default 2G)")
    add_planner_args(w)
    w.add_argument("--json", default="plan-sweep.json", metavar="PATH",
                   help="results JSON (default plan-sweep.json)")
    w.add_argument("--png", default="plan-sweep.png", metavar="PATH",
                   help="bar chart (default plan-sweep.png)")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    w.set_defaults(func=run)


def run(a) -> int:
    try:
        configs = split_list(a.configs) or shapes_only_configs()
        clusters = split_list(a.clusters) or list(DEFAULT_CLUSTERS)
        for clu in clusters:                    # fail fast on a bad cluster name
            resolve_cluster(clu)
        for flag, v in (("--tensor-model-parallel-size", a.tensor_model_parallel_size),
                        ("--seq-length", a.seq_length), ("--micro-batch-size",
                                                         a.micro_batch_size),
                        ("--pipeline-model-parallel-size", a.pipeline_model_parallel_size),
                        ("--data-parallel-size", a.data_parallel_size),
                        ("--expert-model-parallel-size", a.expert_model_parallel_size)):
            if v <= 0:
                raise InputError(f"{flag} must be a positive integer, got {v}")
        check_cp(a.context_parallel_size, a.seq_length)    # the same for every row
        budget = None if a.memory_budget is None else parse_bytes(a.memory_budget, "--memory-budget")
    except expected_errors() as e:
        return fail("plan-sweep", e)
    tp, sp = a.tensor_model_parallel_size, a.sequence_parallel
    pp, dp_size = a.pipeline_model_parallel_size, a.data_parallel_size
    nmb = a.num_microbatches or 2 * pp
    ep, cp = a.expert_model_parallel_size, a.context_parallel_size
    rows = sweep(configs, clusters, tp, sp, a.seq_length, a.micro_batch_size, a.bf16,
                 a.lane, budget, a.backend, progress=not a.no_progress, pp=pp,
                 microbatches=nmb, ep=ep, cp=cp)
    setting = (f"TP={tp}{', SP' if sp and tp > 1 else ''}, seq {a.seq_length}, "
               f"mbs {a.micro_batch_size}, {dtype_name(a.bf16)}, lane {a.lane}")
    if cp > 1:
        ring = sorted({r["cp_lane"] for r in rows if "cp_lane" in r})
        setting += (f", CP={cp} (ring attention, {a.seq_length // cp} tokens per rank"
                    + (f", {'/'.join(ring)}-node" if ring else "") + ")")
    if ep > 1:
        setting += f", EP={ep} for MoE configs"
    if pp > 1 or dp_size > 1 or cp > 1:
        # megatron's world: DP = world / (TP·CP·PP); EP is carved out of DP·CP
        cp_txt = f" × CP={cp}" if cp > 1 else ""
        setting += (f"; DP={dp_size} × TP={tp}{cp_txt} × PP={pp} = "
                    f"{dp_size * tp * cp * pp} GPUs")
        if pp > 1 or dp_size > 1:
            setting += f", {nmb} micro-batches per step"
    print(f"dhelix plan-sweep: {len(configs)} configs x {len(clusters)} clusters at {setting}; "
          f"analytical costs; predicted layer-step time (one α forward + one β backward)" +
          ("; pipeline step: megatron 1F1B vs the DHelix fold (P2P over the inter-node "
           "link; DP's gradient reduction, the same for both, not counted)" if pp > 1 else ""))
    print()
    print(sweep_markdown(rows))
    ok = [r for r in rows if "error" not in r]
    if ok:
        best = max(ok, key=lambda r: r["speedup"])
        print()
        print(f"best: {best['config']} on {best['cluster']} at {best['speedup']:.3f}x the "
              f"trivial plan; "
              f"total planning time {sum(r['planning_time_s'] for r in ok) * 1e3:.1f} ms")
    try:
        with open(a.json, "w") as f:
            json.dump({"format": "dhelix.plan-sweep", "setting": {
                "tp": tp, "sp": sp and tp > 1, "seq": a.seq_length, "mbs": a.micro_batch_size,
                "bf16": a.bf16, "lane": a.lane, "memory_budget_bytes": budget,
                "pp": pp, "dp": dp_size, "num_microbatches": nmb,
                "ep": a.expert_model_parallel_size, "cp": cp,
                "backend": a.backend,
                # each row's "speedup": its plan over the trivial plan (nothing paired)
                "speedup_vs": "trivial plan"}, "rows": rows}, f, indent=1)
        sweep_chart(rows, a.png, f"DHelix planner, predicted speedup vs trivial plan ({setting})")
    except OSError as e:
        return fail("plan-sweep", InputError(f"cannot write output: {e}"))
    print(f"wrote {a.json} and {a.png}")
    bad = [r for r in rows if "error" in r]
    if bad:
        print(f"dhelix plan-sweep: error: {len(bad)} of {len(rows)} combinations failed "
              f"(see the table)", file=sys.stderr)
        return 1
    return 0
