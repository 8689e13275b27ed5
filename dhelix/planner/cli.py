"""`dhelix plan | simulate | plan-sweep`: the planner and simulator from the command line.

* ``dhelix plan``       -- the DP planner (DESIGN §1.3) for one layer shape, costs from a
                           measured pairwise table (``--table``) or the analytical model of a
                           cluster file (``--cluster``); writes the plan JSON.
* ``dhelix simulate``   -- plays a plan file on the event simulator (DESIGN §1.5): makespan,
                           peak memory, lane busy times, timeline PNG and Chrome trace.
* ``dhelix plan-sweep`` -- plans many model shapes x clusters and reports the predicted
                           speed-up over the trivial plan (markdown, JSON, bar chart).

Every expected problem (missing or foreign table, bad cluster file, unknown model config,
a memory budget no plan meets, an illegal plan) prints one line
``dhelix <cmd>: error: ...`` on stderr and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER_DIR = os.path.join(_REPO, "configs", "clusters")
DEFAULT_CLUSTERS = ("a40", "a800", "h100")


class CliError(ValueError):
    """A bad command-line value; printed as one line, exit status 2."""


# ---- small helpers ---------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> float:
    """'2GiB' -> 2147483648, '500MB' -> 5e8, '1.5G' -> 1.5 * 2**30, '123' -> 123.

    KB/MB/GB/TB are powers of 1000; KiB/MiB/GiB/TiB and the bare K/M/G/T powers of 1024."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise CliError(f"--memory-budget: cannot read {text!r} as a size; write e.g. 2GiB, "
                       f"500MB, 1.5G or a number of bytes")
    v = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if v <= 0:
        raise CliError(f"--memory-budget: {text!r} is not a positive size")
    return v


def fmt_bytes(v: Optional[float]) -> str:
    if v is None:
        return "-"
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= k:
            return f"{v / k:.2f} {unit}"
    return f"{v:.0f} B"


def fmt_time(s: Optional[float]) -> str:
    if s is None:
        return "-"
    if abs(s) >= 1.0:
        return f"{s:.3f} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.2f} µs"


def resolve_cluster(name_or_path: str) -> str:
    """`h100` -> configs/clusters/h100.yaml; an existing path is taken as given."""
    from dhelix.planner.costmodel import ClusterError
    if os.path.isfile(name_or_path):
        return name_or_path
    cand = os.path.join(CLUSTER_DIR, name_or_path + ".yaml")
    if os.path.isfile(cand):
        return cand
    known = sorted(f[:-5] for f in os.listdir(CLUSTER_DIR) if f.endswith(".yaml")) \
        if os.path.isdir(CLUSTER_DIR) else []
    raise ClusterError(f"--cluster: cluster file '{name_or_path}' not found; give a path to a "
                       f"YAML file or one of: {', '.join(known) or '-'}")


def shapes_only_configs() -> List[str]:
    from dhelix.models.config import CONFIG_DIR, load_model_config
    out = []
    for f in sorted(os.listdir(CONFIG_DIR)):
        if f.endswith(".yaml"):
            cfg = load_model_config(f[:-5])
            if cfg.shapes_only:
                # by family, then by size (layers x hidden²): gpt-6.7b before gpt-18b
                out.append(((f.split("-")[0], cfg.num_layers * cfg.hidden_size ** 2), f[:-5]))
    return [name for _, name in sorted(out)]


def _dtype(bf16: bool) -> str:
    return "bf16" if bf16 else "fp32"


def _split_list(values) -> List[str]:
    out: List[str] = []
    for v in values or []:
        out += [x.strip() for x in str(v).split(",") if x.strip()]
    return out


def _expected_errors():
    """The exception types that mean bad input (one-line error, exit 2), not a bug."""
    from dhelix.models.config import ConfigError
    from dhelix.planner.costmodel import ClusterError
    from dhelix.planner.costs import TableError
    from dhelix.planner.plan import PlanError
    return (CliError, ConfigError, ClusterError, TableError, PlanError)


def _fail(cmd: str, e: BaseException) -> int:
    msg = " ".join(str(e).split())          # one line
    print(f"dhelix {cmd}: error: {msg}", file=sys.stderr)
    return 2


# ---- shapes ----------------------------------------------------------------------------------

def _add_shape_args(p, required: bool) -> None:
    g = p.add_argument_group("layer shape (Megatron's flag names)")
    g.add_argument("--config", required=required, default=None, metavar="NAME",
                   help="model config: a name under configs/models (tiny, llama-8b, ...) or a "
                        "YAML path")
    g.add_argument("--tensor-model-parallel-size", type=int, default=None, metavar="N",
                   help="TP size (default 1)")
    g.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="Megatron sequence parallelism (needs TP > 1)")
    g.add_argument("--seq-length", type=int, default=None, metavar="S", help="default 4096")
    g.add_argument("--micro-batch-size", type=int, default=None, metavar="B", help="default 1")
    g.add_argument("--bf16", action="store_true", default=None,
                   help="bf16 activations and peak FLOP/s (default fp32)")
    g.add_argument("--lane", choices=("intra", "inter"), default=None,
                   help="where the TP group lives: inside a node (intra, default) or across "
                        "nodes (inter)")


def _shape_given(a) -> bool:
    return any(getattr(a, k) is not None for k in
               ("config", "tensor_model_parallel_size", "sequence_parallel", "seq_length",
                "micro_batch_size", "bf16", "lane"))


def _shape_from_args(a) -> dict:
    if a.config is None:
        raise CliError("--config is required to describe the layer shape")
    tp = 1 if a.tensor_model_parallel_size is None else a.tensor_model_parallel_size
    seq = 4096 if a.seq_length is None else a.seq_length
    mbs = 1 if a.micro_batch_size is None else a.micro_batch_size
    for flag, v in (("--tensor-model-parallel-size", tp), ("--seq-length", seq),
                    ("--micro-batch-size", mbs)):
        if v <= 0:
            raise CliError(f"{flag} must be a positive integer, got {v}")
    sp = bool(a.sequence_parallel)
    if sp and tp > 1 and seq % tp:
        raise CliError(f"--seq-length {seq} must be divisible by --tensor-model-parallel-size "
                       f"{tp} with --sequence-parallel")
    return {"config": a.config, "tp": tp, "sp": sp and tp > 1, "seq": seq, "mbs": mbs,
            "bf16": bool(a.bf16), "lane": a.lane or "intra"}


def layer_for_shape(shape: dict):
    """LayerOps for a shape dict (config, tp, sp, seq, mbs, bf16, lane)."""
    from dhelix.models.config import ConfigError, load_model_config
    from dhelix.strand.program import layer_ops_for_shape
    cfg = load_model_config(shape["config"])
    try:
        return layer_ops_for_shape(cfg, shape["tp"], shape["sp"], shape["seq"], shape["mbs"],
                                   bf16=shape["bf16"], lane=shape["lane"])
    except (ValueError, AssertionError) as e:  # megatron's TransformerConfig checks
        raise ConfigError(f"--config {shape['config']} with TP={shape['tp']}: {e}")


def shape_str(shape: dict) -> str:
    parts = [str(shape.get("config")), f"TP={shape.get('tp')}"]
    if shape.get("sp"):
        parts.append("SP")
    parts += [f"seq {shape.get('seq')}", f"mbs {shape.get('mbs')}",
              "bf16" if shape.get("bf16") else "fp32", f"lane {shape.get('lane')}"]
    return ", ".join(parts)


# ---- cost sources ----------------------------------------------------------------------------

def _add_cost_args(p, required: bool) -> None:
    g = p.add_argument_group("cost source (one of)")
    m = g.add_mutually_exclusive_group(required=required)
    m.add_argument("--table", metavar="PATH",
                   help="measured pairwise overlap table from `dhelix profile`; refused if it "
                        "was made for another shape or cluster unless --force")
    m.add_argument("--cluster", metavar="NAME_OR_YAML",
                   help="analytical costs from a cluster file: a name under configs/clusters "
                        "(a40, a800, h100) or a YAML path")
    p.add_argument("--force", action="store_true",
                   help="use a table made for another layer signature (entries must still "
                        "cover this layer's ops)")


def load_costs(layer, shape: Optional[dict], table: Optional[str], cluster: Optional[str],
               force: bool) -> Tuple[object, dict]:
    """(CostTable, cost_source dict for the plan's meta)."""
    from dhelix.planner.costs import CostTable, TableError
    if table:
        try:
            t = CostTable.load(table, layer=layer, force=force, pairs="concurrent")
        except TableError as e:
            msg = str(e)
            if "signature" in msg and not force and shape is not None:
                msg += f" [this layer: {shape_str(shape)}; pass --force to use the table anyway]"
            raise TableError(msg)
        return t, {"kind": "table", "path": os.path.abspath(table), "forced": bool(force)}
    from dhelix.planner.costmodel import analytical_table, load_cluster
    if shape is None:
        raise CliError("the analytical cost model needs the layer's TP size and dtype; give "
                       "the shape flags (--config, --tensor-model-parallel-size, --bf16, ...)")
    path = resolve_cluster(cluster)
    c = load_cluster(path)
    name = c.get("name") or os.path.splitext(os.path.basename(path))[0]
    groups = {"tp": int(shape["tp"])}
    t = analytical_table(layer, c, groups, dtype=_dtype(shape["bf16"]), cluster_name=name)
    return t, {"kind": "cluster", "name": name, "path": os.path.abspath(path),
               "dtype": _dtype(shape["bf16"]), "group_sizes": groups}


def _cost_str(src: dict) -> str:
    if src.get("kind") == "table":
        return f"measured table {src.get('path')}" + (" (forced)" if src.get("forced") else "")
    return f"analytical, cluster {src.get('name')} ({src.get('path')})"


# ---- dhelix plan -----------------------------------------------------------------------------

def make_plan(shape: dict, table: Optional[str] = None, cluster: Optional[str] = None,
              memory_budget: Optional[float] = None, backend: str = "auto",
              force: bool = False):
    """Plan one layer shape; returns (plan, layer_ops) with the CLI's extra meta filled."""
    from dhelix.planner import dp
    layer = layer_for_shape(shape)
    costs, src = load_costs(layer, shape, table, cluster, force)
    p = dp.plan(layer, costs, memory_budget_bytes=memory_budget, backend=backend, force=force)
    p.meta["layer"] = layer.to_json()
    p.meta["shape"] = dict(shape)
    p.meta["cost_source"] = src
    return p, layer


def _readable_budget_error(e: BaseException) -> BaseException:
    """Add human units to the planner's 'memory budget ... cannot be met' message."""
    m = re.search(r"budget (\d+) bytes cannot be met: the lowest-peak plan peaks at (\d+) "
                  r"bytes, (\d+) bytes", str(e))
    if not m:
        return e
    budget, peak, over = (float(x) for x in m.groups())
    return type(e)(f"{e} [budget {fmt_bytes(budget)}, lowest possible peak {fmt_bytes(peak)}, "
                   f"{fmt_bytes(over)} too much; raise --memory-budget]")


def cmd_plan(a, argv) -> int:
    try:
        shape = _shape_from_args(a)
        budget = None if a.memory_budget is None else parse_bytes(a.memory_budget)
        p, layer = make_plan(shape, a.table, a.cluster, budget, a.backend, a.force)
    except _expected_errors() as e:
        return _fail("plan", _readable_budget_error(e))
    try:
        p.save(a.out)
    except OSError as e:
        return _fail("plan", CliError(f"--out {a.out}: cannot write the plan ({e.strerror})"))
    m = p.meta
    print(f"dhelix plan: {shape_str(shape)}")
    print(f"layer: {len(layer.forward)} forward x {len(layer.backward)} backward ops, "
          f"signature {layer.signature()}")
    print(f"costs: {_cost_str(m['cost_source'])}")
    print()
    print(p.table())
    print()
    t, triv = m["predicted_s"], m["trivial_predicted_s"]
    print(f"steps:                {len(p.steps)} ({p.num_paired()} paired)")
    print(f"predicted layer step: {fmt_time(t)}  (trivial plan {fmt_time(triv)}, "
          f"speedup {triv / t if t > 0 else 1.0:.3f}x)")
    budget_txt = "" if budget is None else f"  (budget {fmt_bytes(budget)})"
    print(f"predicted peak mem:   {fmt_bytes(m.get('predicted_peak_bytes'))}{budget_txt}")
    print(f"planning time:        {m['planning_time_s'] * 1e3:.1f} ms (backend {m['backend']})")
    print(f"wrote {a.out}  (simulate it: dhelix simulate {a.out})")
    return 0


# ---- dhelix simulate -------------------------------------------------------------------------

def _default_beside(plan_path: str, suffix: str) -> str:
    root, ext = os.path.splitext(plan_path)
    return (root if ext.lower() == ".json" else plan_path) + suffix


def cmd_simulate(a, argv) -> int:
    from dhelix.planner.costs import TableError
    from dhelix.planner.opspec import LayerOps
    from dhelix.planner.plan import Plan, PlanError, trivial_plan, validate
    from dhelix.planner.simulate import plot_timeline, simulate, to_chrome_trace
    try:
        plan = Plan.load(a.plan)
        meta = plan.meta or {}
        meta_shape = meta.get("shape") if isinstance(meta.get("shape"), dict) else None
        if _shape_given(a):
            shape = _shape_from_args(a)
            layer = layer_for_shape(shape)
            layer_from = "the shape flags"
        elif isinstance(meta.get("layer"), dict):
            try:
                layer = LayerOps.from_json(meta["layer"])
            except (KeyError, TypeError) as e:
                raise PlanError(f"{a.plan}: meta.layer is not a layer description ({e}); "
                                f"give the shape flags (--config, ...)")
            shape = meta_shape
            layer_from = "the plan file"
        elif meta_shape:
            shape = dict(meta_shape)
            layer = layer_for_shape(shape)
            layer_from = "the plan's shape"
        else:
            raise CliError(f"{a.plan} does not record its layer (no meta.layer; not written by "
                           f"`dhelix plan`): give the shape flags --config, "
                           f"--tensor-model-parallel-size, --sequence-parallel, --seq-length, "
                           f"--micro-batch-size, --bf16, --lane as for `dhelix plan`")
        validate(plan, layer, source=a.plan)
        table, cluster, force = a.table, a.cluster, a.force
        if not table and not cluster:
            src = meta.get("cost_source")
            if not isinstance(src, dict) or src.get("kind") not in ("table", "cluster"):
                raise CliError(f"{a.plan} does not record its cost source: give --table PATH "
                               f"or --cluster NAME")
            if src["kind"] == "table":
                table = src.get("path")
                force = force or bool(src.get("forced"))     # forced when planned
            else:
                cluster = src.get("path") if src.get("path") and os.path.isfile(src["path"]) \
                    else src.get("name")
        costs, src = load_costs(layer, shape, table, cluster, force)
        res = simulate(layer, plan, costs, force=force)
        triv = simulate(layer, trivial_plan(layer), costs, force=force)
    except _expected_errors() as e:
        return _fail("simulate", e)

    print(f"dhelix simulate: {a.plan}  ({len(plan.steps)} steps, {plan.num_paired()} paired; "
          f"layer from {layer_from})")
    if shape:
        print(f"shape: {shape_str(shape)}")
    print(f"costs: {_cost_str(src)}")
    speed = triv.makespan / res.makespan if res.makespan > 0 else 1.0
    print(f"makespan:      {fmt_time(res.makespan)}  (trivial plan {fmt_time(triv.makespan)}, "
          f"speedup {speed:.3f}x)")
    if isinstance(meta.get("predicted_s"), (int, float)):
        print(f"planner said:  {fmt_time(meta['predicted_s'])}")
    print(f"peak memory:   {fmt_bytes(res.peak_bytes)}  (trivial plan "
          f"{fmt_bytes(triv.peak_bytes)})")
    busy = res.lane_busy()
    span = res.makespan if res.makespan > 0 else 1.0
    print("lane busy:     " + ", ".join(f"{lane} {fmt_time(v)} ({v / span * 100:.0f}%)"
                                        for lane, v in busy.items()))
    png = a.png or _default_beside(a.plan, ".png")
    trace = a.trace or _default_beside(a.plan, ".trace.json")
    try:
        plot_timeline(res, png, title=f"{os.path.basename(a.plan)}: makespan "
                                      f"{fmt_time(res.makespan)} (trivial "
                                      f"{fmt_time(triv.makespan)}), peak "
                                      f"{fmt_bytes(res.peak_bytes)}")
        with open(trace, "w") as f:
            json.dump(to_chrome_trace(res), f)
    except OSError as e:
        return _fail("simulate", CliError(f"cannot write output: {e}"))
    print(f"wrote {png} (timeline) and {trace} (Chrome trace: chrome://tracing or Perfetto)")
    return 0


# ---- dhelix plan-sweep -----------------------------------------------------------------------

def sweep(configs: List[str], clusters: List[str], tp: int, sp: bool, seq: int, mbs: int,
          bf16: bool, lane: str = "intra", memory_budget: Optional[float] = None,
          backend: str = "auto", progress: bool = True) -> List[Dict]:
    """One row per (config, cluster): predicted and trivial step time, speedup, or error."""
    from tqdm import tqdm
    rows = []
    combos = [(c, k) for c in configs for k in clusters]
    layers: Dict[str, object] = {}
    errors = _expected_errors()
    bar = tqdm(combos, desc="plan-sweep", unit="plan", disable=not progress, file=sys.stderr)
    for cfg, clu in bar:
        bar.set_postfix_str(f"{cfg} on {clu}")
        shape = {"config": cfg, "tp": tp, "sp": sp and tp > 1, "seq": seq, "mbs": mbs,
                 "bf16": bf16, "lane": lane}
        row = {"config": cfg, "cluster": clu, "shape": shape}
        try:
            from dhelix.planner import dp
            if cfg not in layers:
                layers[cfg] = layer_for_shape(shape)
            layer = layers[cfg]
            costs, src = load_costs(layer, shape, None, clu, False)
            p = dp.plan(layer, costs, memory_budget_bytes=memory_budget, backend=backend)
            m = p.meta
            row.update(predicted_s=m["predicted_s"], trivial_predicted_s=m["trivial_predicted_s"],
                       speedup=m["speedup_vs_trivial"], steps=len(p.steps),
                       paired=p.num_paired(), peak_bytes=m.get("predicted_peak_bytes"),
                       planning_time_s=m["planning_time_s"], backend=m["backend"],
                       cost_source=src)
        except errors as e:
            row["error"] = " ".join(str(_readable_budget_error(e)).split())
        rows.append(row)
    bar.close()
    return rows


def sweep_markdown(rows: List[Dict]) -> str:
    head = ["config", "cluster", "plan step", "trivial step", "speedup", "steps (paired)",
            "peak mem", "planning"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["config"], r["cluster"], "error: " + r["error"], "", "", "", "", ""])
            continue
        body.append([r["config"], r["cluster"], fmt_time(r["predicted_s"]),
                     fmt_time(r["trivial_predicted_s"]), f"{r['speedup']:.3f}x",
                     f"{r['steps']} ({r['paired']})", fmt_bytes(r["peak_bytes"]),
                     f"{r['planning_time_s'] * 1e3:.1f} ms ({r['backend']})"])
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
                                                         a.micro_batch_size)):
            if v <= 0:
                raise CliError(f"{flag} must be a positive integer, got {v}")
        budget = None if a.memory_budget is None else parse_bytes(a.memory_budget)
    except _expected_errors() as e:
        return _fail("plan-sweep", e)
    tp, sp = a.tensor_model_parallel_size, a.sequence_parallel
    rows = sweep(configs, clusters, tp, sp, a.seq_length, a.micro_batch_size, a.bf16,
                 a.lane, budget, a.backend, progress=not a.no_progress)
    setting = (f"TP={tp}{', SP' if sp and tp > 1 else ''}, seq {a.seq_length}, "
               f"mbs {a.micro_batch_size}, {_dtype(a.bf16)}, lane {a.lane}")
    print(f"dhelix plan-sweep: {len(configs)} configs x {len(clusters)} clusters at {setting}; "
          f"analytical costs; predicted layer-step time (one α forward + one β backward)")
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


# ---- registration ----------------------------------------------------------------------------

def _add_planner_args(p) -> None:
    p.add_argument("--memory-budget", metavar="BYTES", default=None,
                   help="highest simulated peak memory of the layer step (β's saved "
                        "activations + α's new ones + transients), e.g. 2GiB, 500MB; plans "
                        "above it are rejected")
    p.add_argument("--backend", choices=("auto", "cpp", "python"), default="auto",
                   help="DP core: C++ (dhelix._planner_core), the Python reference, or auto")


def register(sub) -> None:
    p = sub.add_parser("plan", help="plan one layer shape (DP planner) and write the plan JSON",
                       description="Find the fastest legal plan (DESIGN §1.3) for one layer "
                                   "shape; costs from a measured table or a cluster file.")
    _add_shape_args(p, required=True)
    _add_cost_args(p, required=True)
    _add_planner_args(p)
    p.add_argument("--out", default="plan.json", metavar="PLAN.json",
                   help="where to write the plan (default plan.json)")
    p.set_defaults(func=cmd_plan)

    s = sub.add_parser("simulate", help="play a plan on the event simulator: makespan, peak "
                                        "memory, timeline PNG, Chrome trace",
                       description="Simulate a plan file (DESIGN §1.5). The layer and cost "
                                   "source come from the plan's meta (written by `dhelix "
                                   "plan`) unless given here.")
    s.add_argument("plan", metavar="PLAN", help="plan JSON file")
    _add_shape_args(s, required=False)
    _add_cost_args(s, required=False)
    s.add_argument("--png", default=None, metavar="PATH",
                   help="timeline chart (default: PLAN with .png)")
    s.add_argument("--trace", default=None, metavar="PATH",
                   help="Chrome trace JSON (default: PLAN with .trace.json)")
    s.set_defaults(func=cmd_simulate)

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
    w.add_argument("--lane", choices=("intra", "inter"), default="intra")
    _add_planner_args(w)
    w.add_argument("--json", default="plan-sweep.json", metavar="PATH",
                   help="results JSON (default plan-sweep.json)")
    w.add_argument("--png", default="plan-sweep.png", metavar="PATH",
                   help="bar chart (default plan-sweep.png)")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    w.set_defaults(func=cmd_plan_sweep)

