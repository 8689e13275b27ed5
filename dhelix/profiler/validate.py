"""`dhelix validate-model`: does the simulator predict real layer-step times?

Runs ≥30 random legal plans (plus the trivial, paired and DP plans) on the real ranks,
measures each, predicts each with the simulator from the pairwise table, and reports the
Spearman rank correlation and the median absolute error, with a scatter plot.
"""
from __future__ import annotations

import json
import random
import statistics
from typing import List


def spearman(a: List[float], b: List[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else 0.0


def validate_model(harness, table, nplans: int = 30, warmup: int = 1, repeats: int = 5,
                   seed: int = 0, show_progress: bool = True):
    from tqdm import tqdm

    from dhelix.planner import dp
    from dhelix.planner import enumerate as enumerate_
    from dhelix.planner.plan import paired_plan, trivial_plan
    from dhelix.planner.simulate import simulate

    ops = harness.ops
    rng = random.Random(seed)
    plans = [trivial_plan(ops), paired_plan(ops), dp.plan(ops, table)]
    plans += [enumerate_.random_legal_plan(ops, rng) for _ in range(nplans)]
    names = ["trivial", "paired", "dp"] + [f"random{k}" for k in range(nplans)]
    predicted = [simulate(ops, p, table).makespan for p in plans]
    bar = tqdm(total=warmup + repeats, desc="dhelix validate-model (rounds of all plans)",
               disable=not show_progress)
    measured = harness.time_plans(plans, warmup, repeats, progress=bar)
    bar.close()
    errors = [abs(p - m) / m for p, m in zip(predicted, measured)]
    return {
        "plans": names, "predicted_s": predicted, "measured_s": measured,
        "spearman": spearman(predicted, measured),
        "median_abs_error": statistics.median(errors),
        "n": len(plans),
    }


def scatter(result: dict, path: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    p = [x * 1e3 for x in result["predicted_s"]]
    m = [x * 1e3 for x in result["measured_s"]]
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.scatter(m, p, s=18, alpha=0.8)
    for name, x, y in zip(result["plans"], m, p):
        if not name.startswith("random"):
            ax.annotate(name, (x, y), fontsize=8)
    lo, hi = min(m + p), max(m + p)
    ax.plot([lo, hi], [lo, hi], "k--", linewidth=0.8)
    ax.set_xlabel("measured layer step (ms)")
    ax.set_ylabel("simulated layer step (ms)")
    ax.set_title(title or f"Spearman {result['spearman']:.2f}, median |err| "
                          f"{result['median_abs_error'] * 100:.1f}%")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
