"""`dhelix plan-sweep`: plan many model shapes x clusters with analytical costs.

For every (model config, cluster) it runs the planner and reports the predicted speed-up over
the trivial plan as a markdown table, a JSON file and a grouped bar chart; failing
combinations are listed in the table and make the exit status 1.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional

from dhelix.planner.cli import (DEFAULT_CLUSTERS, CliError, _add_planner_args, _dtype,
                                _expected_errors, _fail, _readable_budget_error, _split_list,
                                add_cp_arg, check_cp, cp_lane, fmt_bytes, fmt_time,
                                layer_for_shape, load_costs, node_size, parse_bytes,
                                per_rank_shape, resolve_cluster, shapes_only_configs)


def sweep(configs: List[str], clusters: List[str], tp: int, sp: bool, seq: int, mbs: int,
          bf16: bool, lane: str = "intra", memory_budget: Optional[float] = None,
          backend: str = "auto", progress: bool = True, pp: int = 1,
          microbatches: Optional[int] = None, ep: int = 1, cp: int = 1) -> List[Dict]:
    """One row per (config, cluster): predicted and trivial step time, speedup, or error;
    with pp > 1 also the whole pipeline step of megatron 1F1B and the DHelix fold. With
    context parallel `cp` > 1 every layer's attention is a ring over cp ranks (`seq` is the
    global sequence length), inside a node or across by the cluster's GPUs per node."""
    from tqdm import tqdm
    rows = []
    combos = [(c, k) for c in configs for k in clusters]
    layers: Dict[tuple, object] = {}
    errors = _expected_errors()
    bar = tqdm(combos, desc="plan-sweep", unit="plan", disable=not progress, file=sys.stderr)
    for cfg, clu in bar:
        bar.set_postfix_str(f"{cfg} on {clu}")
        shape = {"config": cfg, "tp": tp, "sp": sp and tp > 1, "seq": seq, "mbs": mbs,
                 "bf16": bf16, "lane": lane}
        if ep > 1 and _is_moe(cfg):               # EP applies to the MoE configs only
            shape["ep"] = ep
        if cp > 1:
            shape["cp"] = cp
        row = {"config": cfg, "cluster": clu, "shape": shape}
        try:
            from dhelix.planner import dp
            gpn = node_size(clu)                  # the CP/EP lanes depend on the node size
            if cp > 1:
                row["cp_lane"] = cp_lane(shape, gpn)
            if (cfg, gpn) not in layers:
                layers[(cfg, gpn)] = layer_for_shape(shape, gpn)
            layer = layers[(cfg, gpn)]
            costs, src = load_costs(layer, shape, None, clu, False)
            p = dp.plan(layer, costs, memory_budget_bytes=memory_budget, backend=backend)
            m = p.meta
            row.update(predicted_s=m["predicted_s"], trivial_predicted_s=m["trivial_predicted_s"],
                       speedup=m["speedup_vs_trivial"], steps=len(p.steps),
                       paired=p.num_paired(), peak_bytes=m.get("predicted_peak_bytes"),
                       planning_time_s=m["planning_time_s"], backend=m["backend"],
                       cost_source=src)
            if pp > 1:
                row.update(_pipeline(layer, p, costs, shape, clu, pp, microbatches or 2 * pp))
        except errors as e:
            row["error"] = " ".join(str(_readable_budget_error(e)).split())
        rows.append(row)
    bar.close()
    return rows


def _is_moe(cfg: str) -> bool:
    from dhelix.models.config import ConfigError, load_model_config
    try:
        return bool(load_model_config(cfg).num_experts)
    except ConfigError:
        return False                              # reported by the row itself


def _pipeline(layer, plan, costs, shape, cluster, pp, microbatches) -> Dict:
    """The whole pipeline step on the pipeline simulator (P2P over the inter-node link)."""
    from dhelix.folding.simulate import (LayerCosts, activation_bytes, cluster_p2p_seconds,
                                         simulate_pipeline)
    from dhelix.models.config import load_model_config
    from dhelix.planner.costmodel import load_cluster
    m = load_model_config(shape["config"])
    p2p = cluster_p2p_seconds(activation_bytes(per_rank_shape(shape), m.hidden_size),
                              load_cluster(resolve_cluster(cluster)), "inter")
    res = simulate_pipeline(LayerCosts.from_plan(layer, plan, costs), m.num_layers, pp,
                            microbatches, p2p)
    base, fold = res["megatron-1f1b"], res["dhelix-fold"]
    return {"pipeline": {k: r.to_json() for k, r in res.items()},
            "pp_1f1b_step_s": base.makespan, "pp_fold_step_s": fold.makespan,
            "pp_speedup": base.makespan / fold.makespan,
            "pp_peak_vs_1f1b": max(fold.peak_bytes) / max(base.peak_bytes)}


def sweep_markdown(rows: List[Dict]) -> str:
    pp = any("pp_speedup" in r for r in rows)
    head = ["config", "cluster", "plan step", "trivial step", "speedup", "steps (paired)",
            "peak mem", "planning"]
    if pp:
        head += ["1F1B step", "fold step", "fold vs 1F1B", "fold peak vs 1F1B"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["config"], r["cluster"], "error: " + r["error"]] +
                        [""] * (len(head) - 3))
            continue
        body.append([r["config"], r["cluster"], fmt_time(r["predicted_s"]),
                     fmt_time(r["trivial_predicted_s"]), f"{r['speedup']:.3f}x",
                     f"{r['steps']} ({r['paired']})", fmt_bytes(r["peak_bytes"]),
                     f"{r['planning_time_s'] * 1e3:.1f} ms ({r['backend']})"])
        if pp:
            body[-1] += [fmt_time(r["pp_1f1b_step_s"]), fmt_time(r["pp_fold_step_s"]),
                         f"{r['pp_speedup']:.3f}x", f"{r['pp_peak_vs_1f1b']:.2f}x"]
    w = [max(len(x[i]) for x in body + [head]) for i in range(len(head))]
    lines = ["| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(head)) + " |",
             "|" + "|".join("-" * (w[i] + 2) for i in range(len(head))) + "|"]
    for x in body:
        lines.append("| " + " | ".join(v.ljust(w[i]) for i, v in enumerate(x)) + " |")
    return "\n".join(lines)


def sweep_chart(rows: List[Dict], path: str, title: str) -> None:
    """Grouped bars: one group per model config, one bar per cluster; height = speedup."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    configs = list(dict.fromkeys(r["config"] for r in rows))
    clusters = list(dict.fromkeys(r["cluster"] for r in rows))
    val = {(r["config"], r["cluster"]): r.get("speedup") for r in rows}
    width = 0.8 / max(1, len(clusters))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(configs) + 2), 4))
    for k, clu in enumerate(clusters):
        xs = [i + (k - (len(clusters) - 1) / 2) * width for i in range(len(configs))]
        ys = [val.get((c, clu)) or 0.0 for c in configs]
        bars = ax.bar(xs, ys, width, label=clu)
        for b, y in zip(bars, ys):
            if y:
                ax.text(b.get_x() + b.get_width() / 2, y, f"{y:.2f}", ha="center",
                        va="bottom", fontsize=6)
    ax.axhline(1.0, color="gray", linewidth=0.6, linestyle="--")
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels(configs, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("predicted speedup vs trivial plan")
    ys_all = [v for v in val.values() if v]
    lo = min(ys_all + [1.0])
    hi = max(ys_all + [1.0])
    ax.set_ylim(max(0.0, lo - 0.1 * (hi - lo + 0.1)), hi + 0.15 * (hi - lo + 0.1))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_plan_sweep(a, argv) -> int:
    try:
        configs = _split_list(a.configs) or shapes_only_configs()
        clusters = _split_list(a.clusters) or list(DEFAULT_CLUSTERS)
        for clu in clusters:                    # fail fast on a bad cluster name
            resolve_cluster(clu)
        for flag, v in (("--tensor-model-parallel-size", a.tensor_model_parallel_size),
                        ("--seq-length", a.seq_length), ("--micro-batch-size",
                                                         a.micro_batch_size),
                        ("--pipeline-model-parallel-size", a.pipeline_model_parallel_size),
                        ("--data-parallel-size", a.data_parallel_size),
                        ("--expert-model-parallel-size", a.expert_model_parallel_size)):
            if v <= 0:
                raise CliError(f"{flag} must be a positive integer, got {v}")
        check_cp(a.context_parallel_size, a.seq_length)    # the same for every row
        budget = None if a.memory_budget is None else parse_bytes(a.memory_budget)
    except _expected_errors() as e:
        return _fail("plan-sweep", e)
    tp, sp = a.tensor_model_parallel_size, a.sequence_parallel
    pp, dp_size = a.pipeline_model_parallel_size, a.data_parallel_size
    nmb = a.num_microbatches or 2 * pp
    ep, cp = a.expert_model_parallel_size, a.context_parallel_size
    rows = sweep(configs, clusters, tp, sp, a.seq_length, a.micro_batch_size, a.bf16,
                 a.lane, budget, a.backend, progress=not a.no_progress, pp=pp,
                 microbatches=nmb, ep=ep, cp=cp)
    setting = (f"TP={tp}{', SP' if sp and tp > 1 else ''}, seq {a.seq_length}, "
               f"mbs {a.micro_batch_size}, {_dtype(a.bf16)}, lane {a.lane}")
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
        print(f"best: {best['config']} on {best['cluster']} at {best['speedup']:.3f}x; "
              f"total planning time {sum(r['planning_time_s'] for r in ok) * 1e3:.1f} ms")
    try:
        with open(a.json, "w") as f:
            json.dump({"format": "dhelix.plan-sweep", "setting": {
                "tp": tp, "sp": sp and tp > 1, "seq": a.seq_length, "mbs": a.micro_batch_size,
                "bf16": a.bf16, "lane": a.lane, "memory_budget_bytes": budget,
                "pp": pp, "dp": dp_size, "num_microbatches": nmb,
                "ep": a.expert_model_parallel_size, "cp": cp,
                "backend": a.backend}, "rows": rows}, f, indent=1)
        sweep_chart(rows, a.png, f"DHelix planner, predicted speedup vs trivial plan ({setting})")
    except OSError as e:
        return _fail("plan-sweep", CliError(f"cannot write output: {e}"))
    print(f"wrote {a.json} and {a.png}")
    bad = [r for r in rows if "error" in r]
    if bad:
        print(f"dhelix plan-sweep: error: {len(bad)} of {len(rows)} combinations failed "
              f"(see the table)", file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> None:
    w = sub.add_parser("plan-sweep", help="plan many model shapes x clusters; predicted "
                                          "speedups as a table, JSON and bar chart",
                       description="Run the planner with analytical costs for every model "
                                   "config x cluster and report the predicted speedup of the "
                                   "plan over the trivial plan.")
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
    _add_planner_args(w)
    w.add_argument("--json", default="plan-sweep.json", metavar="PATH",
                   help="results JSON (default plan-sweep.json)")
    w.add_argument("--png", default="plan-sweep.png", metavar="PATH",
                   help="bar chart (default plan-sweep.png)")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    w.set_defaults(func=cmd_plan_sweep)
