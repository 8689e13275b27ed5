"""The bench's rows (measured, beside what the simulators predicted) and their outputs:
the markdown table, the speedup picture, and both again from a finished bench's JSON."""
from __future__ import annotations

import json
import statistics
from typing import List, Optional

from dhelix.bench.predict import pp_simulate

METHODS = ("megatron", "intra-batch", "dhelix-trivial", "dhelix-plan", "dhelix-halves")
PP_METHODS = ("megatron-1f1b", "megatron-interleaved", "dhelix-fold")
# with --dhelix-mlp-chunks C: the planned run with its layers' MLP forward in C chunks
CHUNKS = "dhelix-chunks"
# with --dhelix-keep-gathered: the planned run whose layers keep the forward's gathered
# inputs for the weight gradients (no backward re-gathers), planned from the same table
KEEP = "dhelix-keep"
# --dhelix-pair-last (B(N−1) ∥ B(N)): offered with PP and EP 1, run when --methods
# names it
LAST = "dhelix-last"
# MoE: the intra-batch peer splits dense layers only; megatron's own fwd∥bwd overlap for
# MoE (combined 1F1B, --overlap-moe-expert-parallel-comm) needs CUDA streams and events
EP_METHODS = ("megatron", "dhelix-trivial", "dhelix-plan")
# the methods that must train bit for bit as the bench's first (megatron's) run: same
# seed, data and arithmetic, only the order of independent work differs (the intra-batch
# peer, DHelix's halves and the MLP chunks split a batch's GEMMs, so a weight's gradient
# adds parts and may round differently)
EXACT = ("dhelix-trivial", "dhelix-plan", "dhelix-fold", KEEP, LAST)


def loss_mismatch(method: str, r: dict, base_method: str, base: dict) -> str:
    """'' if run `r` of `method` trained as the baseline run did (or need not: not in
    EXACT), else what differs: a DHelix run with other losses is a bug, not a result."""
    if method not in EXACT or r["losses"] == base["losses"]:
        return ""
    return f"{method}'s losses {r['losses']} against {base_method}'s {base['losses']}"


def peer_wait_per_step(r: dict):
    """Seconds a step of run `r` (a `dhelix train --json` result, rank 0) waited for a
    peer rank, which the link model does not price (`link.peer_late_s` + `peer_slot_s`),
    or None without a paced link."""
    link = r.get("link") or {}
    if "peer_late_s" not in link:
        return None
    steps = link.get("steps", len(r["step_times_s"]))     # the steps its stats cover
    return (link["peer_late_s"] + link["peer_slot_s"]) / max(steps, 1)


def step_time(r: dict) -> float:
    ts = r["step_times_s"][1:] or r["step_times_s"]
    return statistics.median(ts)


def pool_round(prev: Optional[dict], r: dict, rnd: int) -> dict:
    """Round `rnd`'s run `r` of a method (a `dhelix train --json` result with its
    `peer_wait_s`) pooled with the method's earlier rounds `prev` (None in round 0): the
    timed steps of every round (each run's first step is its warm-up), tokens/s and peer
    waits averaged over the rounds, and each round's own median step (`round_step_s`):
    the machine drifts between rounds, so a row's per-round speedups, each against
    megatron's run of the same round, show the spread the pooled median hides."""
    r["round_step_s"] = (prev["round_step_s"] if prev else []) + [step_time(r)]
    if prev is None:
        return r
    r["step_times_s"] = prev["step_times_s"] + r["step_times_s"][1:]
    r["tokens_per_s"] = (prev["tokens_per_s"] * rnd + r["tokens_per_s"]) / (rnd + 1)
    if r.get("peer_wait_s") is not None and prev.get("peer_wait_s") is not None:
        r["peer_wait_s"] = (prev["peer_wait_s"] * rnd + r["peer_wait_s"]) / (rnd + 1)
    return r


def round_speedups(base: dict, r: dict) -> List[float]:
    """Megatron's median step over the method's, round by round (empty for results
    pooled before rounds were kept)."""
    return [b / t for b, t in zip(base.get("round_step_s", []), r.get("round_step_s", []))]


def rewrite(json_path: str, out: str) -> None:
    """Write the .md and .png of a finished bench again from its .json."""
    with open(json_path) as f:
        rows = json.load(f)["rows"]
    pp = rows[0]["method"] in PP_METHODS
    with open(out + ".md", "w") as f:
        f.write((pp_markdown(rows) if pp else markdown(rows)) + "\n")
    if pp:
        plot(rows, out + ".png", PP_METHODS, "megatron 1F1B")
    else:
        plot(rows, out + ".png", [m for m in METHODS + (CHUNKS, KEEP)
                                  if any(r["method"] == m for r in rows)])


def rows(cfg, link, res, tr, methods=METHODS, sim_layer=None,
          predicted=None, floors=None) -> List[dict]:
    """One row per method. `predicted`: method -> the simulator's whole step; `floors`:
    method -> the thread floor of its whole step (`planner.whole_step.thread_floor`)."""
    base = step_time(res["megatron"])
    triv = step_time(res["dhelix-trivial"])
    comp, comm = tr["layer_compute_s"], tr["layer_comm_s"]
    rest = max(triv - comp - comm, 0.0)         # embedding, head, loss, optimizer, glue
    lower = rest + max(comp, comm)
    exposed = max(base - (rest + comp), 1e-9)   # the baseline's time beyond compute
    out = []
    predicted, floors = predicted or {}, floors or {}
    for m in methods:
        t = step_time(res[m])
        w = predicted.get(m)
        out.append({
            "config": cfg, "link": link, "method": m, "step_s": t,
            "tokens_per_s": res[m]["tokens_per_s"],
            "speedup": base / t,
            "round_speedups": round_speedups(res["megatron"], res[m]),
            "peak_activation_bytes": res[m]["peak_memory_bytes"],
            "memory_vs_baseline": res[m]["peak_memory_bytes"] /
            res["megatron"]["peak_memory_bytes"],
            "lower_bound_s": lower, "layer_compute_s": comp, "layer_comm_s": comm,
            # what the one thread cannot avoid: compute + the comms' host work + extras
            "thread_floor_s": floors.get(m),
            "hidden_share": (base - t) / exposed if m != "megatron" else 0.0,
            "final_loss": res[m]["losses"][-1],
            "sim_layer_speedup": sim_layer if m == "dhelix-plan" else None,
            # the whole step the simulator predicts from the same table, and its error
            "predicted_step_s": w.total_s if w else None,
            "prediction_error": (w.total_s - t) / t if w else None,
            "predicted_breakdown": w.to_json() if w else None,
            # what the simulator cannot see: rank 0's waits for a late peer, a step
            "peer_wait_s": res[m].get("peer_wait_s"),
        })
    return out


def pp_rows(a, cfg, link, res, cost_source) -> List[dict]:
    """Pipeline rows: measured, and the pipeline simulator's prediction from the same
    costs the fold planned with."""
    sim = pp_simulate(a, cfg, link, cost_source)
    base = step_time(res["megatron-1f1b"])
    base_peak = max(res["megatron-1f1b"]["peak_memory_bytes_per_stage"])
    out = []
    for m in PP_METHODS:
        r, t = res[m], step_time(res[m])
        s = sim.get(m)
        out.append({
            "config": cfg, "link": link, "method": m, "step_s": t,
            "tokens_per_s": r["tokens_per_s"], "speedup": base / t,
            "peak_activation_bytes_per_stage": r["peak_memory_bytes_per_stage"],
            "peak_vs_1f1b": max(r["peak_memory_bytes_per_stage"]) / base_peak,
            "idle_share_per_stage": r["idle_share_per_stage"],
            "sim_step_s": s.makespan if s else None,
            "sim_bubble": s.bubble if s else None,
            "sim_idle_per_stage": ([1 - b / s.makespan for b in s.busy] if s else None),
            "sim_speedup": sim["megatron-1f1b"].makespan / s.makespan if s else None,
            "final_loss": r["losses"][-1],
        })
    return out


def pp_markdown(rows) -> str:
    lines = ["| model | link | schedule | tokens/s | speedup vs 1F1B (sim.) | step ms (sim.) | "
             "peak act. per stage MiB | peak vs 1F1B | idle per stage: measured (sim.) |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        idle = ", ".join(f"{m * 100:.0f}%" + (f" ({s * 100:.0f}%)" if s is not None else "")
                         for m, s in zip(r["idle_share_per_stage"],
                                         r["sim_idle_per_stage"] or [None] * 99))
        sim_sp = f" ({r['sim_speedup']:.2f}x)" if r["sim_speedup"] else ""
        sim_t = f" ({r['sim_step_s'] * 1e3:.0f})" if r["sim_step_s"] else ""
        lines.append(
            f"| {r['config']} | {r['link']} | {r['method']} | {r['tokens_per_s']:.0f} | "
            f"{r['speedup']:.2f}x{sim_sp} | {r['step_s'] * 1e3:.0f}{sim_t} | "
            + ", ".join(f"{b / 2**20:.0f}" for b in r["peak_activation_bytes_per_stage"])
            + f" | {r['peak_vs_1f1b']:.2f}x | {idle} |")
    return "\n".join(lines)


def markdown(rows) -> str:
    lines = ["| model | link | method | tokens/s | speedup | per round | step ms | "
             "predicted ms (error) | lower bound ms (thread floor) | "
             "compute / comm ms (comm/compute) | "
             "exposed comm hidden | peak act. vs base | sim. layer |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = r["layer_comm_s"] / max(r["layer_compute_s"], 1e-12)
        lines.append(
            f"| {r['config']} | {r['link']} | {r['method']} | {r['tokens_per_s']:.0f} | "
            f"{r['speedup']:.2f}x | {_per_round(r)} | {r['step_s'] * 1e3:.0f} | "
            f"{_predicted(r)} | "
            f"{_bounds(r)} | "
            f"{r['layer_compute_s'] * 1e3:.0f} / {r['layer_comm_s'] * 1e3:.0f} ({ratio:.2f}) | "
            f"{r['hidden_share'] * 100:.0f}% | {r['memory_vs_baseline']:.2f}x | "
            f"{_x(r.get('sim_layer_speedup'))} |")
    return "\n".join(lines)


def _bounds(r) -> str:
    """The measured lower bound max(compute, comm) + the rest, and the thread floor the
    simulator gives on the same table, where there is one."""
    f = r.get("thread_floor_s")
    return f"{r['lower_bound_s'] * 1e3:.0f}" + ("" if f is None else f" ({f * 1e3:.0f})")


def _per_round(r) -> str:
    """The row's speedup in each round, in round order ("-" for one round)."""
    rs = r.get("round_speedups") or []
    return " / ".join(f"{v:.2f}" for v in rs) if len(rs) > 1 else "-"


def _predicted(r) -> str:
    p, e = r.get("predicted_step_s"), r.get("prediction_error")
    return "-" if p is None else f"{p * 1e3:.0f} ({e * 100:+.0f}%)"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def plot(rows, path, methods=METHODS, baseline="megatron-core"):
    """Speedup per link, one panel per model; simulated speedups (pipeline rows) dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({r["config"] for r in rows})
    fig, axes = plt.subplots(1, len(configs), figsize=(5.5 * len(configs), 4), squeeze=False)
    for ax, cfg in zip(axes[0], configs):
        links = list(dict.fromkeys(r["link"] for r in rows if r["config"] == cfg))
        xs = list(range(len(links)))
        for k, m in enumerate(methods):
            sel = [next(r for r in rows if r["config"] == cfg and r["link"] == l and
                        r["method"] == m) for l in links]
            ax.plot(xs, [r["speedup"] for r in sel], marker="o", color=f"C{k}", label=m)
            # each round's own speedup: the spread a pooled median hides
            for x, r in zip(xs, sel):
                rs = r.get("round_speedups") or []
                if len(rs) > 1:
                    ax.vlines(x + 0.04 * (k - len(methods) / 2), min(rs), max(rs),
                              color=f"C{k}", linewidth=1.5, alpha=0.6)
            if any(r.get("sim_speedup") for r in sel):
                ax.plot(xs, [r.get("sim_speedup") or float("nan") for r in sel],
                        linestyle="--", color=f"C{k}", label=f"{m} (simulated)")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks(xs)
        # long link names (paced:1gbit,20us,slow=0.15) would run into each other
        ax.set_xticklabels(links, rotation=20, ha="right", fontsize=8)
        ax.set_xlabel("link")
        ax.set_ylabel(f"speedup over {baseline}")
        ax.set_title(cfg)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
