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
    DHelix's with the trivial and the planned plan, L layers × N micro-batches, and the
    planned plan with the paired tail (`dhelix-last`, `--dhelix-pair-last`);
  * PP > 1: the pipeline simulator (`planner/pipeline.py`): 1F1B, interleaved (two chunks
    per stage) and the fold with the planned plan, the P2P message over the slowest stage
    boundary's link;
  * plus the output layer's GEMMs, N × 3 per step (paced on both paths; with PP added to
    the step as a whole, an approximation);
  * plus what the DP traffic adds (`StageDP`), one bucket per layer as megatron's DDP
    makes them (the small model's buckets are about a layer each too): the gradient
    buckets reduced behind the last micro-batch's backward, their tail exposed, and with
    the distributed optimizer the parameter all-gathers that megatron chains through the
    first micro-batch's forward, throttling it where a gather outlasts a layer's forward
    (both alone in both schedules); with PP each stage's tail, and every stage's gathers
    on the first micro-batch's way through the pipeline.
Not predicted: the unpaced parts (embedding, loss, optimizer at the small model's speed)
and the ranks' own time beyond the paced ops (`own share` in the table).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from dhelix.bench.report import step_time

DEFAULT_CONFIGS = {False: "tiny-llama-emu", True: "tiny-moe-emu"}   # by "has experts"


def node_ids(a, cluster: dict) -> List[int]:
    """Each rank's node: `gpus_per_node` ranks per node, in launch order. A run whose DP
    was cut (`--emulate ...,dp=D`) so far that its DP group would sit inside one node,
    where the published DP's group crosses nodes, runs on smaller nodes instead — TP×CP
    ranks times at most half its DP — so that its DP group still crosses them: priced on
    the NIC at the same share (a node's rings, TP×CP), not on the node's links."""
    from dhelix.train.emulate import parse
    gpn = int(cluster.get("gpus_per_node", 8))
    tp, cp, _, dp = _sizes(a)
    emu = parse(a.compute, a.emulate) if getattr(a, "emulate", "") else None
    published = emu.data_parallel_size if emu else None
    if published and 1 < dp and tp * cp * dp <= gpn < tp * cp * published:
        gpn = tp * cp * max(1, min(gpn // (tp * cp), dp // 2))
    return [r // gpn for r in range(a.nproc)]


def _sizes(a):
    tp, cp, pp = (a.tensor_model_parallel_size, a.context_parallel_size,
                  a.pipeline_model_parallel_size)
    return tp, cp, pp, a.nproc // (tp * cp * pp)


def _lane(ranks, nodes) -> str:
    return "intra" if len({nodes[r] for r in ranks}) == 1 else "inter"


def _reduce_s(nbytes: float, ranks: List[int], nodes, cluster, grow: float = 1.0,
              kind: str = "all_reduce") -> float:
    """One collective over `ranks`, priced as a group `grow` times their number (the
    emulated DP size over the run's, as the paced link prices it); across nodes at the
    NIC's share (`costmodel.nic_share`)."""
    from dhelix.planner.costmodel import collective_seconds, nic_share
    if len(ranks) < 2 or not nbytes:
        return 0.0
    lane = _lane(ranks, nodes)
    ln = cluster[f"{lane}_node"]
    bw = float(ln["bandwidth_GBps"]) * 1e9 * float(ln.get("efficiency", 1.0))
    if lane == "inter":            # the node's other rings cross its NICs at the same time
        home = nodes[ranks[0]]
        bw /= nic_share(cluster, nodes.count(home), sum(nodes[r] == home for r in ranks))
    return collective_seconds(kind, nbytes, max(1, round(len(ranks) * grow)), bw,
                              float(ln.get("latency_us", 0.0)) * 1e-6)


@dataclass
class StageDP:
    """One pipeline stage's DP (and expert-DP) traffic as megatron's DDP moves it, one
    bucket per layer, seconds per collective: `reduce` the gradient buckets in the order
    the last backward readies them (the output layer and final norm with the last layer,
    the embedding with the first), `gather` the distributed optimizer's parameter
    all-gathers (`--overlap-param-gather`) in forward order, [] without it."""
    reduce: List[float]
    gather: List[float]

    def exposed(self, t_fwd: float, t_bwd: float) -> Tuple[float, float]:
        """(reduce, gather): the seconds each adds to the step. A bucket's reduction
        starts when the last micro-batch's backward has passed its layer (one layer every
        `t_bwd`) and the link is free; what ends after the backward is exposed. The
        gathers are chained as megatron chains them: the first is issued when the step
        starts, each next one when the first micro-batch's forward reaches the layer
        before (its pre-hook), and a layer's forward (`t_fwd`) waits for its own."""
        n, link = len(self.reduce), 0.0
        for i, r in enumerate(self.reduce):
            link = max(link, (i + 1) * t_bwd) + r
        reduce = max(0.0, link - n * t_bwd)
        issue = link = end = 0.0
        for g in self.gather:
            link = max(issue, link) + g          # this layer's parameters are here
            issue = max(link, end)               # its forward starts: the next is issued
            end = issue + t_fwd
        return reduce, (max(0.0, end - len(self.gather) * t_fwd) if self.gather else 0.0)


def stage_dp(a, big, cluster, stage_layers: List[int], holds: List[tuple]) -> List[StageDP]:
    """Per pipeline stage, its DP and expert-DP buckets priced on the link its group spans
    at the emulated DP size (`_reduce_s`). `holds`: per stage, (has the embedding, has the
    output layer). Gradients move in fp32 and are all-reduced, or reduce-scattered with
    the distributed optimizer, whose all-gather moves bf16 parameters (Megatron-LM with
    --bf16)."""
    from dhelix.models.params import param_classes
    from dhelix.train.emulate import parse
    tp, cp, pp, dp = _sizes(a)
    emu = parse(getattr(a, "compute", "none"), getattr(a, "emulate", ""))
    grow = ((emu and emu.data_parallel_size) or dp) / dp
    dist_opt = getattr(a, "distributed_optimizer", False)
    ep = a.expert_model_parallel_size
    c = param_classes(big, tp, ep)
    nodes = node_ids(a, cluster)
    per_stage = tp * cp * dp
    out = []
    for g in range(pp):
        base = g * per_stage
        # megatron's order tp-cp-dp-pp: DP (with CP) steps over the TP ranks; the experts'
        # (expert TP 1: ep-dp over the stage's ranks) steps over the EP ranks
        dp_ranks = [base + k * tp for k in range(cp * dp)]
        edp_ranks = [base + k * ep for k in range(per_stage // ep)] if ep > 1 else []

        def price(dense: float, experts: float, kind: str, dtype_bytes: int) -> float:
            return (_reduce_s(dense * dtype_bytes, dp_ranks, nodes, cluster, grow, kind) +
                    _reduce_s(experts * dtype_bytes, edp_ranks, nodes, cluster, grow, kind))
        first, last = holds[g]
        n = stage_layers[g]
        # forward order: the embedding with the first layer, the output with the last
        extra = [c["embedding"] if first and i == 0 else 0.0 for i in range(n)]
        if last and n:
            extra[-1] += c["output"] + c["norm"]
        kind = "reduce_scatter" if dist_opt else "all_reduce"
        reduce = [price(c["layer"] + e, c["experts"], kind, 4) for e in reversed(extra)]
        gather = [price(c["layer"] + e, c["experts"], "all_gather", 2) for e in extra] \
            if dist_opt else []
        out.append(StageDP(reduce, gather))
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
    # the output layer's three GEMMs per micro-batch, paced on both paths and alone in both
    # schedules (megatron's post-process runs outside DHelix's co-steps)
    from dhelix.train.emulate_gemms import head_seconds
    s, b = emu.seq_length or a.seq_length, emu.micro_batch_size or a.micro_batch_size
    head = N * 3 * head_seconds(big, cluster, s // cp * b, tp)
    out = {}
    if pp == 1:
        none = StepExtras(0, 0, 0, 0, 0, 0, L)
        dp_comm = stage_dp(a, big, cluster, [L], [(True, True)])[0]
        for m, w in (("megatron", simulate_megatron_step(ops, table, L, N, none)),
                     ("dhelix-trivial", simulate_step(ops, trivial_plan(ops), table, L, N,
                                                      none)),
                     ("dhelix-plan", simulate_step(ops, plan, table, L, N, none)),
                     ("dhelix-last", simulate_step(ops, plan, table, L, N, none,
                                                   pair_last=True))):
            # F(1) runs alone in both schedules, its gathers throttle it; the buckets
            # reduce behind B(N), alone or (`--dhelix-pair-last`) beside B(N−1)
            red, gat = dp_comm.exposed(w.layer_forward_s, w.layer_tail_s or
                                       w.layer_backward_s)
            out[m] = {"layers_s": w.total_s, "head_s": head, "reduce_s": red,
                      "gather_s": gat, "step_s": w.total_s + head + red + gat}
        return out
    act = s // cp // (tp if tp > 1 else 1) * b * big.hidden_size * 2
    nodes, per_stage = node_ids(a, cluster), tp * cp * dp
    lane = max((_lane([g * per_stage + r, (g + 1) * per_stage + r], nodes)
                for g in range(pp - 1) for r in range(per_stage)), key=("intra", "inter").index)
    costs = LayerCosts.from_plan(ops, plan, table)
    res = simulate_pipeline(costs, L, pp, N, cluster_p2p_seconds(act, cluster, lane),
                            vpp_layers=L // (2 * pp))
    for m, r in res.items():
        fold = m == "dhelix-fold"       # the fold's stage 0 holds the first and last layers
        holds = [((g == 0), (g == 0) if fold else (g == pp - 1)) for g in range(pp)]
        exposed = [d.exposed(costs.f, costs.b)
                   for d in stage_dp(a, big, cluster, [L // pp] * pp, holds)]
        # each stage's last backward ends with its own buckets' tail; the first
        # micro-batch's forward crosses every stage, each throttled by its gathers
        ends = [max(x.end for x in st) if st else 0.0 for st in r.order.steps]
        gat = sum(g for _, g in exposed)
        # the head's stage does its GEMMs per micro-batch on top (approximated as added)
        step = max(e + red for e, (red, _) in zip(ends, exposed)) + gat + head
        out[m] = {"layers_s": r.makespan, "head_s": head,
                  "reduce_s": step - head - gat - r.makespan, "gather_s": gat,
                  "step_s": step}
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
            "predicted_gather_s": p["gather_s"], "predicted_head_s": p["head_s"],
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
             "| model | method | emulated step ms | simulator ms (layers + head + DP "
             "reduce + param gather exposed) | "
             "measured / simulator | speedup (simulator) | tokens/s | own share | "
             "woken late | final loss |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['method']} | {r['step_s'] * 1e3:.1f} | "
            f"{r['predicted_step_s'] * 1e3:.1f} ({r['predicted_layers_s'] * 1e3:.1f} + "
            f"{r.get('predicted_head_s', 0.0) * 1e3:.1f} + "
            f"{r['predicted_reduce_s'] * 1e3:.1f} + {r['predicted_gather_s'] * 1e3:.1f}) | "
            f"{r['measured_vs_predicted']:.3f} | "
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
