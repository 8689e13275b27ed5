"""`dhelix helix-bench` (flags in dhelix/cli/helix_bench.py): Helix's passes measured on
the paced link.

For the reference program (a TP+SP transformer block, or the small GPT) on local gloo
ranks, each configuration — the program compiled without the passes, and Helix with K
tile streams — is timed (forward + backward, median step) on the link and on a link
1000x faster (the compute alone); the difference is the exposed communication. Writes a
markdown table, JSON, a bar chart and a before/after timeline (PNG + Chrome trace).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import List


@dataclass
class HelixBenchOptions:
    """What `dhelix helix-bench` takes (its defaults are the parser's)."""
    nproc: int                  # local gloo ranks: the TP group
    link: str                   # paced:RATE[,LATENCY]
    model: str                  # "block" (one TP+SP block) or "gpt"
    hidden: int
    heads: int
    layers: int                 # gpt only
    vocab: int                  # gpt only
    batch: int
    seq: int
    tiles: List[int]            # tile-stream counts K to compare
    bucketing: bool
    inductor: bool
    iters: int
    warmup: int
    out: str                    # prefix for .md, .json, .png, .timeline.png, .trace.json


def _configs(tiles: List[int], bucketing: bool = False):
    """(name, K, reorder, bucketing) per row; with bucketing each K runs without and
    with it, side by side."""
    out = [("compiled, no passes", 1, False, False)]
    for k in tiles:
        out.append((f"helix K={k}", k, True, False))
        if bucketing and k > 1:
            out.append((f"helix K={k} + buckets", k, True, True))
    return out


def on_rank(args) -> dict:
    import torch
    import torch._dynamo
    import torch.distributed as dist

    from dhelix.helix import HelixOptions, helix_backend, paced
    from dhelix.helix.backend import _Timed
    from dhelix.helix.models import build
    from dhelix.links import parse_link

    link = parse_link(args.link)
    torch.manual_seed(0)
    model, _ = build(args.model, hidden=args.hidden, heads=args.heads, layers=args.layers,
                     vocab=args.vocab)
    w, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(1)
    if args.model == "block":
        x = torch.randn(args.batch, args.seq, args.hidden, generator=g).chunk(w, 1)[r]
        x = x.contiguous().requires_grad_()
    else:
        x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    rows, timelines = [], {}
    pictured = (_configs(args.tiles)[0][0], f"helix K={args.tiles[0]}")
    configs = _configs(args.tiles, args.bucketing)

    def step():
        dist.barrier()
        y = m(x)
        y = y.to_local() if hasattr(y, "to_local") else y
        y.float().sum().backward()

    for name, k, reorder, bucketing in configs:
        times, recorded, memory = {}, {}, {}
        for which, rate in (("fast", link.rate_Bps * 1000), ("link", link.rate_Bps)):
            torch._dynamo.reset()
            paced.use_link(paced.GraphLink(rate, link.latency_s))
            backend = helix_backend(HelixOptions(
                tiles=k, reorder=reorder, paced=True, link=args.link,
                bucketing=bucketing))
            m = torch.compile(model, backend=backend)
            steps = []
            for it in range(args.warmup + args.iters):
                dist.barrier()
                t0 = time.perf_counter()
                y = m(x)
                y = y.to_local() if hasattr(y, "to_local") else y
                y.float().sum().backward()
                steps.append(time.perf_counter() - t0)
            times[which] = statistics.median(steps[args.warmup:])
            if name in pictured:
                _Timed.record = []
                step()
                recorded[which] = _Timed.record
                _Timed.record = None
                if which == "link":
                    timelines[name] = recorded["link"]
                    _Timed.memory = {}
                    step()
                    memory, _Timed.memory = _Timed.memory, None
            if r == 0:
                print(f"helix bench: {name:20s} {which:4s} {times[which] * 1e3:8.1f} ms",
                      flush=True)
        buckets = [b for g in backend.report.graphs if (b := g.get("buckets"))]
        row = {"method": name, "tiles": k, "step_link_s": times["link"],
               "buckets_chosen": sum(len(b["chosen"]) for b in buckets),
               "step_fast_s": times["fast"],
               "exposed_comm_s": max(times["link"] - times["fast"], 0.0),
               "report": backend.report.graphs}
        if name in pictured:
            row["graphs"] = _predicted_vs_measured(backend.report, recorded, memory, link,
                                                   w)
        rows.append(row)
    if args.inductor:
        rows += _inductor_rows(args, model, x, link, step_of=lambda mm: _step(mm, x))
    base = rows[0]
    for row in rows:
        row["speedup"] = base["step_link_s"] / row["step_link_s"]
        # No cut to speak of when the baseline shows no exposed communication (noise).
        row["exposed_cut"] = (1 - row["exposed_comm_s"] / base["exposed_comm_s"]
                              if base["exposed_comm_s"] > 0 else None)
    return {"rows": rows, "timelines": timelines}


def _step(m, x):
    import torch.distributed as dist
    dist.barrier()
    y = m(x)
    y = y.to_local() if hasattr(y, "to_local") else y
    y.float().sum().backward()


def _inductor_rows(args, model, x, link, step_of) -> list:
    """The program compiled by Inductor, without and with PyTorch's own compute/comm
    reordering (`reorder_for_compute_comm_overlap`), on the same link: its generated code
    calls the collectives by name, so they are paced by standing in for the ops
    (`paced.patched_ops`) once compiled."""
    import torch
    import torch._dynamo
    import torch._inductor.config as icfg
    import torch.distributed as dist

    from dhelix.helix import paced
    rows = []
    for name, reorder in (("inductor", False),
                          ("inductor + reorder_for_compute_comm_overlap", True)):
        torch._dynamo.reset()
        icfg.reorder_for_compute_comm_overlap = reorder
        m = torch.compile(model)
        paced.use_link(None)
        for _ in range(2):                 # compile forward and backward, unpaced
            step_of(m)
        times = {}
        for which, rate in (("fast", link.rate_Bps * 1000), ("link", link.rate_Bps)):
            paced.use_link(paced.GraphLink(rate, link.latency_s))
            steps = []
            with paced.patched_ops():
                for _ in range(args.warmup + args.iters):
                    t0 = time.perf_counter()
                    step_of(m)
                    steps.append(time.perf_counter() - t0)
            times[which] = statistics.median(steps[args.warmup:])
            if dist.get_rank() == 0:
                print(f"helix bench: {name:20s} {which:4s} {times[which] * 1e3:8.1f} ms",
                      flush=True)
        icfg.reorder_for_compute_comm_overlap = False
        rows.append({"method": name, "tiles": 1, "step_link_s": times["link"],
                     "step_fast_s": times["fast"],
                     "exposed_comm_s": max(times["link"] - times["fast"], 0.0),
                     "buckets_chosen": 0, "report": []})
    return rows


def _predicted_vs_measured(report, recorded, memory, link, world) -> dict:
    """Per graph: the simulator's makespan (compute durations measured node by node on
    the fast link, collectives from the link model) and peak memory, beside the makespan
    measured on the link and the peak measured node by node."""
    from dhelix.helix.simulate import overlap_slowdown, simulate_graph
    out = {}
    for g, timed in report.modules.items():
        fast = [e for e in recorded["fast"] if e["graph"] == g]
        slow = [e for e in recorded["link"] if e["graph"] == g]
        seconds = {e["node"]: e["t1"] - e["t0"] for e in fast}
        pred = simulate_graph(timed.gm, seconds, link.rate_Bps, link.latency_s, world)
        # the same with compute stretched under a collective by the factor measured here
        factor = overlap_slowdown(fast, slow)
        slowed = simulate_graph(timed.gm, seconds, link.rate_Bps, link.latency_s, world,
                                overlap_slowdown=factor or 1.0)
        measured = max(e.get("link_done") or e["t1"] for e in slow) - min(e["t0"] for e in slow)
        out[g] = {"simulated_s": pred.makespan_s, "measured_s": measured,
                  "overlap_slowdown": factor, "simulated_slowed_s": slowed.makespan_s,
                  "simulated_peak_bytes": pred.peak_bytes,
                  "measured_peak_bytes": memory.get(g)}
    return out


def _percent(x) -> str:
    return "n/a" if x is None else f"{x * 100:.0f}%"


def markdown(rows) -> str:
    lines = ["| method | step on link ms | compute alone ms | exposed comm ms | exposed comm "
             "cut | speedup |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['step_link_s'] * 1e3:.1f} | "
                     f"{r['step_fast_s'] * 1e3:.1f} | {r['exposed_comm_s'] * 1e3:.1f} | "
                     f"{_percent(r['exposed_cut'])} | {r['speedup']:.2f}x |")
    sim = [(r["method"], g, v) for r in rows for g, v in r.get("graphs", {}).items()]
    if sim:
        lines += ["", "| method | graph | simulated ms | overlap slowdown | simulated with "
                      "it ms | measured ms | simulated peak MiB | measured peak MiB |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for m, g, v in sim:
            f = v.get("overlap_slowdown")
            lines.append(f"| {m} | {g} | {v['simulated_s'] * 1e3:.1f} | "
                         f"{'n/a' if f is None else f'{f:.2f}'} | "
                         f"{v['simulated_slowed_s'] * 1e3:.1f} | "
                         f"{v['measured_s'] * 1e3:.1f} | "
                         f"{v['simulated_peak_bytes'] / 2**20:.2f} | "
                         f"{(v['measured_peak_bytes'] or 0) / 2**20:.2f} |")
    return "\n".join(lines)


def draw(result, out: str) -> List[str]:
    """Bar chart of step and exposed comm; the before/after timeline (PNG + trace)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [r["method"] for r in rows]
    ax.bar(names, [r["step_fast_s"] * 1e3 for r in rows], label="compute alone")
    ax.bar(names, [r["exposed_comm_s"] * 1e3 for r in rows],
           bottom=[r["step_fast_s"] * 1e3 for r in rows], label="exposed communication")
    ax.set_ylabel("step (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=120)
    plt.close(fig)
    tl = result["timelines"]
    fig, axes = plt.subplots(len(tl), 1, figsize=(11, 1.8 * len(tl) + 0.6), squeeze=False)
    trace = []
    for ax, (name, ev) in zip(axes[:, 0], tl.items()):
        t0 = min(e["t0"] for e in ev)
        colors = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:gray"]
        for e in ev:
            comm = "link_done" in e
            row = 1 if comm else 0
            end = e.get("link_done") or e["t1"]
            c = colors[e["stream"]] if 0 <= e["stream"] < 4 else colors[-1]
            if e["op"] == "_wait":
                c, row = "tab:red", 0
            ax.barh(row, (end - e["t0"]) * 1e3, left=(e["t0"] - t0) * 1e3, color=c,
                    height=0.8)
            trace.append({"name": e["op"], "ph": "X", "ts": (e["t0"] - t0) * 1e6,
                          "dur": (end - e["t0"]) * 1e6, "pid": name,
                          "tid": "link" if comm else "compute",
                          "args": {"node": e["node"], "stream": e["stream"],
                                   "graph": e["graph"]}})
        ax.set_yticks([0, 1], ["thread", "link"])
        ax.set_title(f"{name} (colour: tile stream; red: waiting for a collective)",
                     fontsize=9)
    axes[-1, 0].set_xlabel("ms (one forward + backward, rank 0)")
    fig.tight_layout()
    fig.savefig(out + ".timeline.png", dpi=120)
    plt.close(fig)
    with open(out + ".trace.json", "w") as f:
        json.dump({"traceEvents": trace}, f)
    return [out + ".png", out + ".timeline.png", out + ".trace.json"]


def run_bench(o: HelixBenchOptions) -> int:
    """Time every configuration on `o.nproc` local ranks; write the table, JSON and
    pictures under the `o.out` prefix."""
    from dhelix.links import LinkError, parse_link
    try:
        kind = parse_link(o.link).kind
    except LinkError as e:
        print(f"dhelix helix-bench: error: {e}", file=sys.stderr)
        return 2
    if kind != "paced":
        print(f"dhelix helix-bench: error: --link {o.link}: give a paced link "
              f"(paced:RATE[,LATENCY])", file=sys.stderr)
        return 2
    from dhelix.testing import run_ranks
    res = run_ranks(on_rank, o.nproc, o, timeout=3600)[0]
    md = markdown(res["rows"])
    print(md)
    os.makedirs(os.path.dirname(os.path.abspath(o.out)), exist_ok=True)
    with open(o.out + ".md", "w") as f:
        f.write(md + "\n")
    with open(o.out + ".json", "w") as f:
        json.dump({"args": asdict(o), "rows": res["rows"]}, f, indent=1)
    files = draw(res, o.out)
    print(f"helix bench: wrote {o.out}.md, {o.out}.json, {', '.join(files)}")
    return 0
