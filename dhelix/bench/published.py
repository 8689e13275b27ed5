"""`dhelix published`: the published evaluation's table (arXiv 2411.15871) at an emulated
cluster's time, one `dhelix bench --compute paced:...` run per row.

Each row is a published model and layout. What runs: the small model of the emulated
model's kind (`tiny-llama-emu` / `tiny-moe-emu`) with the emulated model's full layer
count, TP, CP, PP and EP as published, DP cut to what this machine holds (`max_ranks`) with
the DP gradient reduction still priced at the published DP size (`--emulate ...,dp=D`),
8 micro-batches per DP rank (mbs 1). Both sides run DP as megatron's users do: the
distributed optimizer with overlapped gradient reduce and parameter gather. Megatron runs
1F1B and interleaved with PP (the better counts), DHelix the planner's plan (the fold with
PP). The rows' numbers are emulated time (`train/emulate.py`): the ranks wait out each
op's time on the cluster model; what is not paced runs at the small model's speed. The
command that runs rows and writes the table: `bench/table.py`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

MICROBATCHES = 8            # per DP rank, mbs 1: the stated choice where the paper's is unknown


@dataclass(frozen=True)
class Row:
    key: str                 # --rows names it
    model: str               # configs/models/MODEL.yaml, the emulated shape
    cluster: str             # configs/clusters/CLUSTER.yaml
    seq: int                 # the emulated sequence length
    dp: int                  # the published layout
    tp: int
    cp: int = 1
    pp: int = 1
    ep: int = 1
    group: str = "A40"       # the paper's table the row belongs to
    seq_source: str = "choice"   # "paper" where the paper states it

    @property
    def model_ranks(self) -> int:
        return self.tp * self.cp * self.pp

    def layout(self) -> str:
        parts = [f"DP{self.dp}", f"TP{self.tp}"] + [f"{k}{v}" for k, v in
                                                    (("CP", self.cp), ("PP", self.pp),
                                                     ("EP", self.ep)) if v > 1]
        return " × ".join(parts)


def _std(model, dp, tp, pp=1):
    return Row(f"{model}", model, "a40", 4096, dp, tp, pp=pp, group="A40")


def _long(model, dp, tp, cp, pp=1):
    return Row(f"{model}-long", model, "a40", 16384, dp, tp, cp, pp, group="A40 long sequence")


ROWS: List[Row] = [
    _std("llama-8b", 16, 4), _std("llama-25b", 8, 8), _std("llama-39b", 4, 8, 2),
    _std("gpt-6.7b", 16, 4), _std("gpt-18b", 8, 8), _std("gpt-30b", 4, 8, 2),
    _long("llama-8b", 8, 4, 2), _long("llama-25b", 4, 8, 2), _long("llama-39b", 2, 8, 2, 2),
    _long("gpt-6.7b", 8, 4, 2), _long("gpt-18b", 4, 8, 2), _long("gpt-30b", 2, 8, 2, 2),
    Row("llama-66b-16k", "llama-66b", "a800", 16384, 2, 8, 2, 2, group="A800",
        seq_source="paper"),
    Row("llama-66b-32k", "llama-66b", "a800", 32768, 1, 8, 4, 2, group="A800",
        seq_source="paper"),
    Row("phi-3.5-moe", "phi-3.5-moe", "a800", 4096, 16, 1, 1, 4, 8, group="A800"),
]


@dataclass
class TableOptions:
    rows: str = ""                # comma-separated keys; "" = every row
    factor: float = 32.0          # x: the ranks run this many times slower than the cluster
    max_ranks: int = 16           # DP is cut so that a row fits (16 ranks at x=32: the
    #                               emulation's fidelity measured, docs/links.md)
    train_iters: int = 2          # the first step is not timed
    num_layers: int = 0           # > 0: this depth instead of the model's (tests)
    microbatches: int = MICROBATCHES
    seq_length: int = 64          # the small model's own sequence
    out: str = "published"        # directory: table.md, table.json, table.png, rows/
    simulate: bool = False        # the simulator's table only (simulated.md), no runs
    pair_last: bool = False       # DHelix with --dhelix-pair-last where it runs (`tail_row`)


class TableError(ValueError):
    """Rows or options that cannot run; names the fix."""


def run_dp(row: Row, max_ranks: int) -> Optional[int]:
    """The largest DP dividing the published one that fits `max_ranks` (and holds the
    experts: EP divides DP × CP); None when not even DP 1 fits."""
    for d in range(row.dp, 0, -1):
        if row.dp % d == 0 and row.model_ranks * d <= max_ranks and \
                (d * row.cp * row.tp) % row.ep == 0:
            return d
    return None


def small_config(row: Row, layers: int, work: str) -> str:
    """The small model of the row's kind with `layers` layers, as a YAML in `work`."""
    import yaml

    from dhelix.bench.emulated import DEFAULT_CONFIGS
    from dhelix.models.config import load_model_config, resolve_config_path
    moe = bool(load_model_config(row.model).num_experts)
    base = DEFAULT_CONFIGS[moe]
    with open(resolve_config_path(base)) as f:
        raw = yaml.safe_load(f)
    raw["num_layers"] = layers
    path = os.path.join(work, f"{base}-{layers}.yaml")
    with open(path, "w") as f:
        f.write(f"# {base} at {row.model}'s depth ({layers} layers), for `dhelix published`\n")
        yaml.safe_dump(raw, f, sort_keys=False)
    return path


def tail_row(row: Row) -> bool:
    """Whether `--dhelix-pair-last` runs on the row's layout (PP and EP 1)."""
    return row.pp == 1 and row.ep == 1


def bench_options(row: Row, o: TableOptions, work: str):
    from dhelix.bench.run import BenchOptions
    from dhelix.models.config import load_model_config
    d = run_dp(row, o.max_ranks)
    layers = o.num_layers or load_model_config(row.model).num_layers
    methods = "megatron-1f1b,megatron-interleaved,dhelix-fold" if row.pp > 1 else \
        "megatron,dhelix-last" if o.pair_last and tail_row(row) else "megatron,dhelix-plan"
    return BenchOptions(
        configs=small_config(row, layers, work), links="paced:1gbit",
        nproc=row.model_ranks * d, tensor_model_parallel_size=row.tp,
        seq_length=o.seq_length, micro_batch_size=1, pipeline_model_parallel_size=row.pp,
        context_parallel_size=row.cp, expert_model_parallel_size=row.ep,
        num_microbatches=o.microbatches, train_iters=o.train_iters,
        compute=f"paced:{row.cluster},x={o.factor:g}",
        emulate=f"{row.model},seq={row.seq},mbs=1,dp={row.dp}", methods=methods,
        distributed_optimizer=True, out=os.path.join(work, row.key))


def summarize(row: Row, o: TableOptions, bench_rows: List[dict], rc: int,
              wall_s: float) -> dict:
    """The table's row from the bench's rows: megatron's better schedule against DHelix's."""
    by = {r["method"]: r for r in bench_rows}
    megs = [by[m] for m in ("megatron", "megatron-1f1b", "megatron-interleaved") if m in by]
    meg = min(megs, key=lambda r: r["step_s"])
    dh = by.get("dhelix-plan") or by.get("dhelix-last") or by["dhelix-fold"]
    meg_sim = min(r["predicted_step_s"] for r in megs)
    return {
        "row": row.key, "group": row.group, "model": row.model, "cluster": row.cluster,
        "seq": row.seq, "seq_source": row.seq_source, "published": row.layout(),
        "ranks": dh["ranks"], "run_dp": dh["layout"]["dp"],
        "global_batch": o.microbatches * row.dp, "layers": dh["config_layers"],
        "megatron_method": meg["method"], "megatron_ms": meg["step_s"] * 1e3,
        "dhelix_method": dh["method"], "dhelix_ms": dh["step_s"] * 1e3,
        "speedup": meg["step_s"] / dh["step_s"],
        "speedup_simulated": meg_sim / dh["predicted_step_s"],
        "megatron_sim_ms": meg_sim * 1e3, "dhelix_sim_ms": dh["predicted_step_s"] * 1e3,
        # what the DP traffic adds to DHelix's step in the simulator (`emulated.StageDP`)
        "dp_exposed_ms": (dh["predicted_reduce_s"] + dh.get("predicted_gather_s", 0.0)) * 1e3,
        "memory_vs_megatron": dh["peak_activation_bytes"] / max(1, meg["peak_activation_bytes"]),
        "losses_equal": rc == 0, "final_loss": (meg["final_loss"], dh["final_loss"]),
        "own_share": max(meg["own_share"], dh["own_share"]), "factor": o.factor,
        "wall_min": wall_s / 60,
    }


def markdown(done: List[dict], skipped: List[str]) -> str:
    lines = ["| row | published layout (seq) | ran: ranks, DP, layers | megatron (best) ms "
             "| DHelix ms | DHelix vs megatron measured (simulated) | act. memory vs "
             "megatron | losses equal | DP traffic exposed (sim.) ms | own share | "
             "minutes here |", "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in done:
        lines.append(
            f"| {r['row']} ({r['cluster']}) | {r['published']} ({r['seq']}) | {r['ranks']}, "
            f"DP{r['run_dp']}, {r['layers']} | {r['megatron_ms']:.0f} "
            f"({r['megatron_method']}) | {r['dhelix_ms']:.0f}"
            f"{' (pair-last)' if r.get('dhelix_method') == 'dhelix-last' else ''} | "
            f"**{r['speedup']:.2f}x** "
            f"({r['speedup_simulated']:.2f}x) | {r['memory_vs_megatron']:.3f} | "
            f"{'yes' if r['losses_equal'] else 'NO'} | "
            f"{r.get('dp_exposed_ms', r.get('reduce_ms', 0.0)):.0f} | "
            f"{r['own_share']:.1%} | {r['wall_min']:.1f} |")
    lines += [f"\nnot run: {s}" for s in skipped]
    return "\n".join(lines)


def plot(done: List[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(1.1 * len(done) + 2, 3.6))
    xs = range(len(done))
    ax.bar([x - 0.2 for x in xs], [r["speedup"] for r in done], 0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [r["speedup_simulated"] for r in done], 0.4,
           label="simulator")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["row"] for r in done], fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("DHelix vs megatron (emulated step)")
    ax.set_title("the published layouts at emulated time", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def simulated(row: Row, o: TableOptions, work: str) -> dict:
    """What the simulators predict for a row as `run_table` would run it (no ranks): each
    schedule's step and its parts (`bench.emulated.predictions`), megatron's better one
    against DHelix's."""
    from dhelix.bench.emulated import predictions
    from dhelix.train.emulate import parse
    b = bench_options(row, o, work)
    pred = predictions(b, b.configs, parse(b.compute, b.emulate))
    meg = min((m for m in pred if m.startswith("megatron")), key=lambda m: pred[m]["step_s"])
    dh = "dhelix-fold" if row.pp > 1 else "dhelix-plan"
    ms = lambda m, k: pred[m][k] * 1e3  # noqa: E731
    last = pred["dhelix-last"] if tail_row(row) else None       # --dhelix-pair-last
    return {"row": row.key, "cluster": row.cluster, "published": row.layout(),
            "seq": row.seq, "ranks": b.nproc, "run_dp": b.nproc // row.model_ranks,
            "megatron_method": meg, "megatron_ms": ms(meg, "step_s"),
            "dhelix_ms": ms(dh, "step_s"), "speedup": pred[meg]["step_s"] / pred[dh]["step_s"],
            "layers_ms": (ms(meg, "layers_s"), ms(dh, "layers_s")),
            "layers_speedup": pred[meg]["layers_s"] / pred[dh]["layers_s"],
            "head_ms": ms(dh, "head_s"),
            "pair_last_ms": last and last["step_s"] * 1e3,
            "pair_last_speedup": last and pred[meg]["step_s"] / last["step_s"],
            "dp_exposed_ms": (ms(meg, "reduce_s") + ms(meg, "gather_s"),
                              ms(dh, "reduce_s") + ms(dh, "gather_s"))}


def _layers(row: Row) -> int:
    from dhelix.models.config import load_model_config
    return load_model_config(row.model).num_layers
