"""Plan many model shapes x clusters with analytical costs (`dhelix plan-sweep`).

For every (model config, cluster) the planner's plan and its predicted layer step against
the trivial plan's (nothing paired, what megatron's schedule runs), and with a pipeline
the whole step of megatron's 1F1B and the DHelix fold; rendered as a markdown table and a
grouped bar chart. A row that fails holds its error message instead.
"""
from __future__ import annotations

import sys
import textwrap
from typing import Dict, List, Optional

from dhelix.base.units import fmt_bytes, fmt_time
from dhelix.planner.problem import (cp_lane, expected_errors, layer_for_shape, load_costs,
                                    node_size, per_rank_shape, readable_budget_error,
                                    resolve_cluster)


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
    errors = expected_errors()
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
            row["error"] = " ".join(str(readable_budget_error(e)).split())
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
    from dhelix.planner.pipeline import (LayerCosts, activation_bytes, cluster_p2p_seconds,
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
    head = ["config", "cluster", "plan step", "trivial step", "speedup vs trivial plan",
            "steps (paired)",
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
    """Grouped bars: one group per model config, one bar per cluster; height = the
    plan's predicted speedup over the trivial plan. The title wraps to the figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    configs = list(dict.fromkeys(r["config"] for r in rows))
    clusters = list(dict.fromkeys(r["cluster"] for r in rows))
    val = {(r["config"], r["cluster"]): r.get("speedup") for r in rows}
    width = 0.8 / max(1, len(clusters))
    fig_w = max(6.0, 1.1 * len(configs) + 2)
    fig, ax = plt.subplots(figsize=(fig_w, 4))
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
    # about 13 characters of 9 pt text per inch: wrapped, the whole title shows
    ax.set_title(textwrap.fill(title, width=int(13 * fig_w)), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
