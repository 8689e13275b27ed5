"""The whole pipeline step on the simulator: DHelix's fold beside megatron's 1F1B and
interleaved schedules, with the same per-layer costs (DESIGN §1.5, §1.6).

The layer simulator (`planner.simulate`) gives three per-layer times: a forward alone, a
backward alone (the trivial plan's strands, i.e. what megatron runs) and one co-executed
step of the plan (a forward of one micro-batch beside a backward of another). A chunk of n
layers costs n times those. Each schedule is an order of work items per stage (plain data,
`FoldedOrder`); `play` times it: an item starts when its stage is free and its inputs
have arrived (an input from another stage one P2P message later), a step's items end
together. This is the executor's rule, so the fold's order (`pipeline_order.folded_order`) and the
real `FoldedSchedule` (dhelix/folding/schedule.py) agree on what runs where.

Memory per stage (activations only; parameters, grads and optimizer state are the same
per stage for all three schedules, one copy of each): a forward item keeps its chunk's
saved activations until its backward item; a step adds the layer step's transient peak
on top of the larger of before/after.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from dhelix.planner.pipeline_order import (FoldedOrder, Item, Step, fold_deps, folded_order,
                                          play)

Deps = Callable[[int, Item], List[Tuple[int, Item]]]


class PipelineError(ValueError):
    """A pipeline layout the schedule cannot run (bad sizes)."""


@dataclass
class LayerCosts:
    """One layer's times (s) and bytes, from the layer simulator."""
    f: float                 # forward alone
    b: float                 # backward alone
    pair: float              # one plan step: a forward beside a backward
    saved: float             # activations a forward keeps for its backward
    transient: float         # the most a layer step adds above the kept activations

    @classmethod
    def from_plan(cls, layer, plan, table, force: bool = False) -> "LayerCosts":
        from dhelix.planner.simulate import LaneModel, simulate
        model = LaneModel(layer, table, base_bytes=0.0, force=force)
        fidx, bidx = list(range(len(layer.forward))), list(range(len(layer.backward)))
        saved = sum(model.f_saved)
        tf, pf, _ = model.step(fidx, [], mem0=0.0)
        tb, pb, _ = model.step([], bidx, mem0=saved)
        res = simulate(layer, plan, table, base_bytes=saved, force=force)
        transient = max(pf - saved, pb - saved, res.peak_bytes - 2 * saved, 0.0)
        return cls(tf, tb, res.makespan, saved, transient)


@dataclass
class PipelineResult:
    schedule: str
    order: FoldedOrder                      # timed: every Step's start/end in seconds
    makespan: float
    busy: List[float]                       # per stage, seconds of work
    peak_bytes: List[float]                 # per stage, activations
    in_flight: List[int] = field(default_factory=list)

    @property
    def bubble(self) -> float:
        """Idle share of stage-time: 1 - busy / (stages × makespan)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)

    def to_json(self) -> dict:
        return {"schedule": self.schedule, "makespan_s": self.makespan,
                "bubble": self.bubble, "busy_s": self.busy,
                "peak_activation_bytes": self.peak_bytes, "in_flight": self.in_flight}


# ---- the baselines' orders (megatron-core's 1F1B and interleaved) -----------------------

def one_f_one_b_order(stages: int, microbatches: int) -> FoldedOrder:
    """megatron's 1F1B: stage g runs G-g-1 warm-up forwards, then one forward one
    backward, then the remaining backwards. Items ("F"|"B", 0, m)."""
    return interleaved_order(stages, microbatches, 1)


def interleaved_order(stages: int, microbatches: int, chunks: int) -> FoldedOrder:
    """megatron's interleaved 1F1B with `chunks` model chunks per stage: virtual
    micro-batch k is chunk (k // G) % v of micro-batch (k // (G v)) G + k % G; backward in
    the mirrored chunk order; warm-up (G-g-1)·2 + (v-1)·G items (v = 1: G-g-1)."""
    G, N, v = stages, microbatches, chunks
    if v > 1 and N % G:
        raise PipelineError(f"the interleaved schedule needs the number of micro-batches "
                            f"({N}) to be a multiple of --pipeline-model-parallel-size ({G})")
    total = N * v

    def item(kind, k):
        c = (k // G) % v
        return (kind, c if kind == "F" else v - 1 - c, (k // (G * v)) * G + k % G)

    order = FoldedOrder(G, N, [[] for _ in range(G)])
    for g in range(G):
        warm = min(total, G - g - 1 if v == 1 else (G - g - 1) * 2 + (v - 1) * G)
        steps = [Step(item("F", k), None) for k in range(warm)]
        for k in range(total - warm):
            steps.append(Step(item("F", warm + k), None))
            steps.append(Step(None, item("B", k)))
        steps += [Step(None, item("B", k)) for k in range(total - warm, total)]
        order.steps[g] = steps
    return order


def interleaved_deps(stages: int, chunks: int) -> Deps:
    """Chunk c of stage g holds virtual stage c·G + g."""
    G, v = stages, chunks

    def deps(g, it):
        kind, c, m = it
        if kind == "F":
            if g > 0:
                return [(g - 1, it)]
            return [(G - 1, ("F", c - 1, m))] if c > 0 else []
        own = [(g, ("F", c, m))]
        if g < G - 1:
            return own + [(g + 1, it)]
        return own + ([(0, ("B", c + 1, m))] if c < v - 1 else [])
    return deps


def _activations(order: FoldedOrder, saved: Callable[[Item], float],
                 transient: float) -> Tuple[List[float], List[int]]:
    """Per stage: peak activation bytes and most micro-batches holding activations."""
    peaks, flights = [], []
    for steps in order.steps:
        live, peak, most = 0.0, 0.0, 0
        held: Dict[int, int] = {}                 # micro-batch -> items not yet backward
        for s in steps:
            before = live
            if s.fwd:
                live += saved(s.fwd)
                held[s.fwd[2]] = held.get(s.fwd[2], 0) + 1
            if s.bwd:
                live -= saved(s.bwd)
                held[s.bwd[2]] -= 1
            peak = max(peak, max(before, live) + transient)
            most = max(most, sum(1 for v in held.values() if v > 0))
        peaks.append(peak)
        flights.append(most)
    return peaks, flights


# ---- the three schedules --------------------------------------------------------------

def simulate_pipeline(costs: LayerCosts, num_layers: int, stages: int, microbatches: int,
                      p2p_s: float, vpp_layers: Optional[int] = None) -> Dict[str, PipelineResult]:
    """megatron 1F1B, megatron interleaved (when `vpp_layers` is given) and the DHelix
    fold for one global step of `microbatches` micro-batches on `stages` stages."""
    L, G, N = num_layers, stages, microbatches
    if G < 2:
        raise PipelineError("a pipeline needs --pipeline-model-parallel-size 2 or more")
    if N < 1:
        raise PipelineError(f"--num-microbatches {N}: give 1 or more")
    if L % (2 * G):
        raise PipelineError(f"{L} layers do not fold evenly over --pipeline-model-parallel-"
                            f"size {G}: the fold needs a multiple of 2×{G} = {2 * G}")
    out: Dict[str, PipelineResult] = {}

    def result(name, order, deps, n_layers, pair):
        t = play(order, deps, lambda it: n_layers * (costs.f if it[0] == "F" else costs.b),
                 lambda f, b: n_layers * pair, p2p_s)
        busy = [sum(s.end - s.start for s in st) for st in t.steps]
        peak, flight = _activations(t, lambda it: n_layers * costs.saved, costs.transient)
        return PipelineResult(name, t, max(s[-1].end for s in t.steps if s), busy, peak,
                              flight)

    out["megatron-1f1b"] = result("megatron-1f1b", one_f_one_b_order(G, N),
                                  interleaved_deps(G, 1), L // G, costs.f + costs.b)
    if vpp_layers:
        if L % (G * vpp_layers) or L // (G * vpp_layers) < 2:
            raise PipelineError(f"--num-layers-per-virtual-pipeline-stage {vpp_layers}: "
                                f"{L} layers over {G} stages need at least 2 chunks of "
                                f"{vpp_layers} per stage")
        v = L // (G * vpp_layers)
        out["megatron-interleaved"] = result("megatron-interleaved",
                                             interleaved_order(G, N, v),
                                             interleaved_deps(G, v), vpp_layers,
                                             costs.f + costs.b)
    out["dhelix-fold"] = result("dhelix-fold", folded_order(G, N), fold_deps(G),
                                L // (2 * G), costs.pair)
    return out


def activation_bytes(shape: dict, hidden_size: int) -> float:
    """One micro-batch's activation between stages (a shape dict of `dhelix plan`)."""
    tp = int(shape.get("tp", 1))
    seq = int(shape["seq"]) // (tp if shape.get("sp") else 1)
    return float(seq * int(shape["mbs"]) * hidden_size * (2 if shape.get("bf16") else 4))


def cluster_p2p_seconds(nbytes: float, cluster: dict, lane: str = "inter") -> float:
    """A P2P message over a cluster file's `intra_node` or `inter_node` link."""
    ln = cluster[f"{lane}_node"]
    bw = float(ln["bandwidth_GBps"]) * 1e9 * float(ln.get("efficiency", 1.0))
    return nbytes / bw + float(ln.get("latency_us", 0.0)) * 1e-6


def pipeline_trace(results: Dict[str, PipelineResult]) -> dict:
    """Chrome-trace JSON: one process per schedule, one thread per stage."""
    events = []
    for pid, (name, r) in enumerate(results.items()):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        for g, steps in enumerate(r.order.steps):
            for s in steps:
                label = " | ".join(f"{i[0]}{i[1]}·{i[2]}" for i in (s.fwd, s.bwd) if i)
                events.append({"ph": "X", "name": label, "pid": pid, "tid": g,
                               "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6,
                               "cat": "pair" if s.fwd and s.bwd else "alone"})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def draw_pipelines(results: Dict[str, PipelineResult], path: str, title: str = "",
                   unit_costs: bool = False) -> None:
    """One stage × time panel per schedule, on one time axis. With `unit_costs` (the
    README's picture) times are in units of a chunk forward and every item is labelled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    G = results[names[0]].order.stages
    fig, axes = plt.subplots(len(names), 1, sharex=True,
                             figsize=(12, (0.55 * G + 0.8) * len(names) + 0.6))
    axes = axes if len(names) > 1 else [axes]
    for ax, name in zip(axes, names):
        r = results[name]
        for g, steps in enumerate(r.order.steps):
            for s in steps:
                items = [it for it in (s.fwd, s.bwd) if it]
                w = (s.end - s.start) / len(items)
                for k, it in enumerate(items):
                    ax.barh(g, w, left=s.start + k * w, height=0.7,
                            color="#4c72b0" if it[0] == "F" else "#dd8452",
                            alpha=0.5 + 0.4 * min(it[1], 1), edgecolor="black",
                            linewidth=0.3)
                    if unit_costs:                # F0·3: chunk 0 of micro-batch 3
                        ax.text(s.start + (k + 0.5) * w, g, f"{it[0]}{it[1]}·{it[2] + 1}",
                                ha="center", va="center", fontsize=5)
        ax.set_yticks(range(G))
        ax.set_yticklabels([f"stage {g}" for g in range(G)], fontsize=7)
        ax.invert_yaxis()
        what = (f"{r.makespan:.0f} units" if unit_costs else
                f"{r.makespan * 1e3:.1f} ms, peak act. {max(r.peak_bytes) / 2**20:.0f} MiB")
        ax.set_title(f"{name}: {what}, bubble {r.bubble * 100:.0f}%", fontsize=8)
    axes[-1].set_xlabel(f"time ({'a chunk forward = 1' if unit_costs else 's'}); blue "
                        f"forward, orange backward (darker: back chunk); a paired step is "
                        f"split in two halves")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def p2p_seconds(shape: dict, hidden_size: int, gbps: Optional[float] = None,
                cluster: Optional[dict] = None, lane: str = "inter") -> Tuple[float, str]:
    """One activation (or its grad) between stages, and how it was reckoned: at `gbps`
    GB/s when given, else over a cluster file's link, else not modelled (0)."""
    from dhelix.planner.problem import InputError, per_rank_shape
    nbytes = activation_bytes(per_rank_shape(shape), hidden_size)
    if gbps is not None:
        if gbps <= 0:
            raise InputError(f"--p2p-GBps {gbps}: give a positive bandwidth")
        return nbytes / (gbps * 1e9), f"{nbytes / 2**20:.2f} MiB at {gbps} GB/s"
    if cluster is None:
        return 0.0, "not modelled: costs from a table; give --p2p-GBps"
    return cluster_p2p_seconds(nbytes, cluster, lane), (
        f"{nbytes / 2**20:.2f} MiB over the cluster's {lane}-node link")
