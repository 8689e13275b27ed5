"""Executor traces: Chrome-trace JSON (one track per lane) and a PNG timeline."""
from __future__ import annotations

import json
import os
from typing import List, Sequence

LANE_TID = {"compute": 0, "intra": 1, "inter": 2}


def chrome_trace(events: Sequence, rank: int = 0) -> dict:
    """{"traceEvents": [...]}: every op as a complete event on its lane's track,
    labelled with its strand (α/β) and micro-batch (F3 = forward of micro-batch 3)."""
    out: List[dict] = []
    for lane, tid in LANE_TID.items():
        out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                    "args": {"name": lane}})
    out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                "args": {"name": f"rank {rank}"}})
    for e in events:
        out.append({"name": e.op, "ph": "X", "pid": rank, "tid": LANE_TID.get(e.lane, 3),
                    "ts": e.start * 1e6, "dur": max(e.end - e.start, 0) * 1e6,
                    "cat": e.strand,
                    "args": {"strand": e.strand, "microbatch": e.label, "lane": e.lane,
                             "step": e.step}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def plot_timeline(events: Sequence, path: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = [l for l in LANE_TID if any(e.lane == l for e in events)] or ["compute"]
    colors = {"α": "tab:blue", "β": "tab:orange"}
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.6 * len(lanes)))
    for e in events:
        y = lanes.index(e.lane) if e.lane in lanes else 0
        ax.barh(y, (e.end - e.start) * 1e3, left=e.start * 1e3, height=0.6,
                color=colors.get(e.strand, "tab:gray"), edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(lanes)
    ax.set_xlabel("ms")
    ax.set_title(title or "DHelix executor timeline (blue: α forward, orange: β backward)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_trace(events: Sequence, path: str, rank: int = 0) -> List[str]:
    """Write PATH (Chrome trace JSON) and PATH with .png (timeline); per rank if > 0."""
    base, ext = os.path.splitext(path)
    if rank:
        base = f"{base}.rank{rank}"
    jpath, ppath = base + (ext or ".json"), base + ".png"
    os.makedirs(os.path.dirname(os.path.abspath(jpath)), exist_ok=True)
    with open(jpath, "w") as f:
        json.dump(chrome_trace(events, rank), f)
    plot_timeline(events, ppath)
    return [jpath, ppath]
