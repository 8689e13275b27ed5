"""`dhelix bench --compute paced:CLUSTER --emulate MODEL`: the bench at an emulated
cluster's time (paced compute, `train/emulate.py`), each row's measured step beside what
the simulators predict for the same layout and schedule.

The runs are the bench's usual ones, with the small model (`tiny-llama-emu`, or
`tiny-moe-emu` with experts) paced to the emulated shape and the ranks placed on the
cluster's nodes (`gpus_per_node` ranks each, in megatron's rank order: TP, CP, DP, PP), so
each group's collectives go over the link a real run's would. DHelix's rows run the plan
the DP planner makes for the emulated shape on the cluster's table (no profile: the cost
source is the cluster file).

The prediction, from the same table the pacing waits out (`emulate.emulated_layer`):
  * PP = 1: the whole-step simulator (`planner/whole_step.py`) for megatron's order and
    DHelix's with the trivial and the planned plan, L layers × N micro-batches;
  * PP > 1: the pipeline simulator (`planner/pipeline.py`): 1F1B, interleaved (two chunks
    per stage) and the fold with the planned plan, the P2P message over the slowest stage
    boundary's link;
  * plus the DP gradient reduction (and the expert-DP one) at the end of the step, one
    all-reduce of each stage's gradients as the emulation moves them
    (`emulate.stage_grad_bytes`), on the link its group spans; a stage's step ends when
    its own reduction does. (The small model's gradients fit one of megatron's buckets, so
    nothing of the reduction overlaps the backward in the measurement either.)
Not predicted: the unpaced parts (embedding, loss, optimizer at the small model's speed)
and the ranks' own time beyond the paced ops (`own share` in the table).
"""
from __future__ import annotations

from typing import Dict, List

from dhelix.bench.report import step_time

DEFAULT_CONFIGS = {False: "tiny-llama-emu", True: "tiny-moe-emu"}   # by "has experts"


def node_ids(a, cluster: dict) -> List[int]:
    """Each rank's node: `gpus_per_node` ranks per node, in launch order."""
    gpn = int(cluster.get("gpus_per_node", 8))
    return [r // gpn for r in range(a.nproc)]


def _sizes(a):
    tp, cp, pp = (a.tensor_model_parallel_size, a.context_parallel_size,
                  a.pipeline_model_parallel_size)
    return tp, cp, pp, a.nproc // (tp * cp * pp)


def _lane(ranks, nodes) -> str:
    return "intra" if len({nodes[r] for r in ranks}) == 1 else "inter"


def _reduce_s(nbytes: float, ranks: List[int], nodes, cluster, grow: float = 1.0,
              kind: str = "all_reduce") -> float:
    """One gradient reduction over `ranks`, priced as a group `grow` times their number
    (the emulated DP size over the run's, as the paced link prices it)."""
    from dhelix.planner.costmodel import collective_seconds
    if len(ranks) < 2 or not nbytes:
        return 0.0
    ln = cluster[f"{_lane(ranks, nodes)}_node"]
    bw = float(ln["bandwidth_GBps"]) * 1e9 * float(ln.get("efficiency", 1.0))
    return collective_seconds(kind, nbytes, max(1, round(len(ranks) * grow)), bw,
                              float(ln.get("latency_us", 0.0)) * 1e-6)


def dp_reduce_seconds(a, small, big, cluster, stage_layers: List[int],
                      holds: List[tuple]) -> List[float]:
    """Per pipeline stage: its DP (and expert-DP) gradient all-reduce, seconds. `holds`:
    per stage, (has the embedding, has the output layer)."""
    from dhelix.models.params import stage_grad_bytes
    from dhelix.train.emulate import parse
    tp, cp, pp, dp = _sizes(a)
    emu = parse(getattr(a, "compute", "none"), getattr(a, "emulate", ""))
    grow = ((emu and emu.data_parallel_size) or dp) / dp
    # the distributed optimizer reduce-scatters the gradients (its all-gather of the
    # weights overlaps the next step's forward)
    kind = "reduce_scatter" if getattr(a, "distributed_optimizer", False) else "all_reduce"
    ep = a.expert_model_parallel_size
    nodes = node_ids(a, cluster)
    per_stage = tp * cp * dp
    out = []
    for g in range(pp):
        nb = stage_grad_bytes(big, tp, ep, stage_layers[g], *holds[g])
        base = g * per_stage
        # megatron's order tp-cp-dp-pp: DP (with CP) steps over the TP ranks; the experts'
        # (expert TP 1: ep-dp over the stage's ranks) steps over the EP ranks
        dp_ranks = [base + k * tp for k in range(cp * dp)]
        edp_ranks = [base + k * ep for k in range(per_stage // ep)] if ep > 1 else []
        out.append(_reduce_s(nb["dp"], dp_ranks, nodes, cluster, grow, kind) +
                   _reduce_s(nb["edp"], edp_ranks, nodes, cluster, grow, kind))
    return out


def predictions(a, cfg: str, emu) -> Dict[str, dict]:
    """method -> {"step_s", "layers_s", "reduce_s"}: the simulators' prediction of the
    emulated step (module doc)."""
    from dhelix.models.config import load_model_config
    from dhelix.planner import dp as planner
    from dhelix.planner.costs import StepExtras
    from dhelix.planner.pipeline import LayerCosts, cluster_p2p_seconds, simulate_pipeline
    from dhelix.planner.plan import trivial_plan
    from dhelix.planner.whole_step import simulate_megatron_step, simulate_step
    from dhelix.train.emulate import emulated_layer
    tp, cp, pp, dp = _sizes(a)
    small = load_model_config(cfg)
    L, N = small.num_layers, a.num_microbatches
    big, ops, table, cluster = emulated_layer(
        emu, tp=tp, sp=tp > 1, cp=cp, ep=a.expert_model_parallel_size,
        seq_length=a.seq_length, micro_batch_size=a.micro_batch_size)
    plan = planner.plan(ops, table)
    out = {}
    if pp == 1:
        none = StepExtras(0, 0, 0, 0, 0, 0, L)
        reduce_s = dp_reduce_seconds(a, small, big, cluster, [L], [(True, True)])[0]
        for m, w in (("megatron", simulate_megatron_step(ops, table, L, N, none)),
                     ("dhelix-trivial", simulate_step(ops, trivial_plan(ops), table, L, N,
                                                      none)),
                     ("dhelix-plan", simulate_step(ops, plan, table, L, N, none))):
            out[m] = {"layers_s": w.total_s, "reduce_s": reduce_s,
                      "step_s": w.total_s + reduce_s}
        return out
    s, b = emu.seq_length or a.seq_length, emu.micro_batch_size or a.micro_batch_size
    act = s // cp // (tp if tp > 1 else 1) * b * big.hidden_size * 2
    nodes, per_stage = node_ids(a, cluster), tp * cp * dp
    lane = max((_lane([g * per_stage + r, (g + 1) * per_stage + r], nodes)
                for g in range(pp - 1) for r in range(per_stage)), key=("intra", "inter").index)
    res = simulate_pipeline(LayerCosts.from_plan(ops, plan, table), L, pp, N,
                            cluster_p2p_seconds(act, cluster, lane),
                            vpp_layers=L // (2 * pp))
    for m, r in res.items():
        fold = m == "dhelix-fold"       # the fold's stage 0 holds the first and last layers
        holds = [((g == 0), (g == 0) if fold else (g == pp - 1)) for g in range(pp)]
        red = dp_reduce_seconds(a, small, big, cluster, [L // pp] * pp, holds)
        ends = [max(x.end for x in st) if st else 0.0 for st in r.order.steps]
        step = max(e + d for e, d in zip(ends, red))
        out[m] = {"layers_s": r.makespan, "reduce_s": step - r.makespan, "step_s": step}
    return out


def _peak(r: dict) -> int:
    """A run's peak activation bytes (its largest stage's with PP)."""
    return max(r.get("peak_memory_bytes_per_stage") or [r.get("peak_memory_bytes", 0)])


def rows(a, cfg: str, link: str, res: dict, methods, pred: Dict[str, dict]) -> List[dict]:
    base = res[methods[0]]["emulation"]["step_s"]
    out = []
    for m in methods:
        e, p = res[m]["emulation"], pred[m]
        out.append({
            "config": cfg, "link": link, "method": m, "emulate": e["emulate"],
            "cluster": e["cluster"], "factor": e["factor"], "ranks": a.nproc,
            "layout": dict(zip(("tp", "cp", "pp", "dp"), _sizes(a)),
                           ep=a.expert_model_parallel_size),
            "step_s": e["step_s"], "tokens_per_s": e["tokens_per_s"],
            "speedup": base / e["step_s"], "predicted_step_s": p["step_s"],
            "predicted_layers_s": p["layers_s"], "predicted_reduce_s": p["reduce_s"],
            "predicted_speedup": pred[methods[0]]["step_s"] / p["step_s"],
            "measured_vs_predicted": e["step_s"] / p["step_s"],
            "own_share": e["own_share"], "overslept_share": e.get("overslept_share", 0.0),
            "ranks_step_s": step_time(res[m]),
            "final_loss": res[m]["losses"][-1],
            "peak_activation_bytes": _peak(res[m]),
            "memory_vs_baseline": _peak(res[m]) / max(1, _peak(res[methods[0]])),
        })
    return out


def markdown(rows: List[dict]) -> str:
    r0 = rows[0]
    lo = r0["layout"]
    lines = [f"emulated: {r0['emulate']} on {r0['cluster']} (the ranks {r0['factor']:g}x "
             f"slower), {r0['ranks']} ranks: TP={lo['tp']} CP={lo['cp']} PP={lo['pp']} "
             f"DP={lo['dp']} EP={lo['ep']}", "",
             "| model | method | emulated step ms | simulator ms (layers + DP reduce) | "
             "measured / simulator | speedup (simulator) | tokens/s | own share | "
             "woken late | final loss |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['method']} | {r['step_s'] * 1e3:.1f} | "
            f"{r['predicted_step_s'] * 1e3:.1f} ({r['predicted_layers_s'] * 1e3:.1f} + "
            f"{r['predicted_reduce_s'] * 1e3:.1f}) | {r['measured_vs_predicted']:.3f} | "
            f"{r['speedup']:.2f}x ({r['predicted_speedup']:.2f}x) | "
            f"{r['tokens_per_s']:.0f} | {r['own_share']:.1%} | "
            f"{r['overslept_share']:.1%} | {r['final_loss']:.6f} |")
    return "\n".join(lines)


def plot(rows: List[dict], path: str) -> None:
    """Measured emulated step beside the simulator's, per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 2, 3.6))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["step_s"] * 1e3 for r in rows], 0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [r["predicted_step_s"] * 1e3 for r in rows], 0.4,
           label="simulator")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{r['config']}\n{r['method']}" for r in rows], fontsize=7)
    ax.set_ylabel("emulated step (ms)")
    r0 = rows[0]
    ax.set_title(f"{r0['emulate']} on {r0['cluster']}, {r0['ranks']} ranks", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
