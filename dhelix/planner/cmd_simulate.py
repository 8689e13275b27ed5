"""`dhelix simulate`: play a plan file on the event simulator (DESIGN §1.5).

The layer and cost source come from the plan's meta (written by ``dhelix plan``) unless the
shape flags or ``--table``/``--cluster`` are given. Prints makespan, peak memory and lane busy
times against the trivial plan, and writes a timeline PNG and a Chrome trace.
"""
from __future__ import annotations

import json
import os

from dhelix.planner.cli import (CliError, _add_cost_args, _add_shape_args, _cost_str,
                                _expected_errors, _fail, _shape_from_args, _shape_given,
                                fmt_bytes, fmt_time, layer_for_shape, load_costs, node_size,
                                per_rank_shape, shape_str)


def _default_beside(plan_path: str, suffix: str) -> str:
    root, ext = os.path.splitext(plan_path)
    return (root if ext.lower() == ".json" else plan_path) + suffix


def cmd_simulate(a, argv) -> int:
    from dhelix.planner.opspec import LayerOps
    from dhelix.planner.plan import Plan, PlanError, trivial_plan, validate
    from dhelix.planner.simulate import plot_timeline, simulate, to_chrome_trace
    try:
        plan = Plan.load(a.plan)
        meta = plan.meta or {}
        meta_shape = meta.get("shape") if isinstance(meta.get("shape"), dict) else None
        table, cluster, force = _cost_source(a, meta)
        gpn = node_size(cluster)       # which groups fit in a node: the CP and EP lanes
        if _shape_given(a):
            shape = _shape_from_args(a)
            layer = layer_for_shape(shape, gpn)
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
            layer = layer_for_shape(shape, gpn)
            layer_from = "the plan's shape"
        else:
            raise CliError(f"{a.plan} does not record its layer (no meta.layer; not written by "
                           f"`dhelix plan`): give the shape flags --config, "
                           f"--tensor-model-parallel-size, --sequence-parallel, --seq-length, "
                           f"--micro-batch-size, --bf16, --lane, --context-parallel-size "
                           f"as for `dhelix plan`")
        validate(plan, layer, source=a.plan)
        costs, src = load_costs(layer, shape, table, cluster, force)
        res = simulate(layer, plan, costs, force=force)
        triv = simulate(layer, trivial_plan(layer), costs, force=force)
    except _expected_errors() as e:
        return _fail("simulate", e)

    print(f"dhelix simulate: {a.plan}  ({len(plan.steps)} steps, {plan.num_paired()} paired; "
          f"layer from {layer_from})")
    if shape:
        print(f"shape: {shape_str(shape, gpn)}")
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
    title = (f"{os.path.basename(a.plan)}: makespan {fmt_time(res.makespan)} (trivial "
             f"{fmt_time(triv.makespan)}), peak {fmt_bytes(res.peak_bytes)}")
    if not _write_pictures(lambda: plot_timeline(res, png, title=title), trace,
                           lambda: to_chrome_trace(res)):
        return 2
    print(f"wrote {png} (timeline) and {trace} (Chrome trace: chrome://tracing or Perfetto)")
    if a.pipeline_model_parallel_size and a.pipeline_model_parallel_size > 1:
        return _simulate_pipeline(a, layer, plan, costs, shape, cluster, force)
    return 0


def _simulate_pipeline(a, layer, plan, costs, shape, cluster, force) -> int:
    """The whole pipeline step: megatron 1F1B (and interleaved) vs the DHelix fold."""
    from dhelix.folding.simulate import (LayerCosts, PipelineError, draw_pipelines,
                                         pipeline_trace, simulate_pipeline)
    G, N = a.pipeline_model_parallel_size, a.num_microbatches or 2 * a.pipeline_model_parallel_size
    try:
        if not shape:
            raise CliError("--pipeline-model-parallel-size needs the model's layer count: "
                           "give the shape flags (--config, ...)")
        from dhelix.models.config import load_model_config
        m = load_model_config(shape["config"])
        L = a.num_layers or m.num_layers
        p2p, p2p_from = _p2p_seconds(a, shape, m, cluster)
        lc = LayerCosts.from_plan(layer, plan, costs, force=force)
        res = simulate_pipeline(lc, L, G, N, p2p, vpp_layers=a.num_layers_per_virtual_pipeline_stage)
    except _expected_errors() + (PipelineError,) as e:
        return _fail("simulate", e)
    print()
    print(f"pipeline: {L} layers on {G} stages, {N} micro-batches; P2P message "
          f"{fmt_time(p2p)} ({p2p_from})")
    print(f"per layer: forward {fmt_time(lc.f)}, backward {fmt_time(lc.b)}, plan step "
          f"(forward beside backward) {fmt_time(lc.pair)} vs {fmt_time(lc.f + lc.b)} apart")
    base = res["megatron-1f1b"]
    print(f"{'schedule':22s} {'step':>11s} {'vs 1F1B':>8s} {'bubble':>7s}  peak activations "
          f"per stage")
    for name, r in res.items():
        print(f"{name:22s} {fmt_time(r.makespan):>11s} {base.makespan / r.makespan:7.3f}x "
              f"{r.bubble * 100:6.1f}%  " + ", ".join(fmt_bytes(b) for b in r.peak_bytes))
    fold = res["dhelix-fold"]
    print(f"fold peak / 1F1B peak (the most on any stage): "
          f"{max(fold.peak_bytes) / max(base.peak_bytes):.2f}x")
    png = a.pipeline_png or _default_beside(a.plan, ".pipeline.png")
    trace = os.path.splitext(png)[0] + ".trace.json"
    title = f"{os.path.basename(a.plan)}: {L} layers, PP={G}, {N} micro-batches"
    if not _write_pictures(lambda: draw_pipelines(res, png, title=title), trace,
                           lambda: pipeline_trace(res)):
        return 2
    print(f"wrote {png} (stage × time per schedule) and {trace} (Chrome trace)")
    return 0


def _cost_source(a, meta: dict):
    """(table, cluster, force): the flags', else the one the plan was made with."""
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
    return table, cluster, force


def _write_pictures(draw, trace: str, trace_json) -> bool:
    """The PNG and the Chrome trace; an unwritable path is one error line."""
    try:
        draw()
        with open(trace, "w") as f:
            json.dump(trace_json(), f)
    except OSError as e:
        _fail("simulate", CliError(f"cannot write output: {e}"))
        return False
    return True


def _p2p_seconds(a, shape, m, cluster):
    """One activation (or its grad) between stages: bytes over the pipeline lane."""
    from dhelix.folding.simulate import activation_bytes, cluster_p2p_seconds
    nbytes = activation_bytes(per_rank_shape(shape), m.hidden_size)
    if a.p2p_gbps is not None:
        if a.p2p_gbps <= 0:
            raise CliError(f"--p2p-GBps {a.p2p_gbps}: give a positive bandwidth")
        return nbytes / (a.p2p_gbps * 1e9), f"{nbytes / 2**20:.2f} MiB at {a.p2p_gbps} GB/s"
    if not cluster:
        return 0.0, "not modelled: costs from a table; give --p2p-GBps"
    from dhelix.planner.cli import resolve_cluster
    from dhelix.planner.costmodel import load_cluster
    c = load_cluster(resolve_cluster(cluster))
    return cluster_p2p_seconds(nbytes, c, a.pipeline_lane), (
        f"{nbytes / 2**20:.2f} MiB over the cluster's {a.pipeline_lane}-node link")


def add_parser(sub) -> None:
    s = sub.add_parser("simulate", help="play a plan on the event simulator: makespan, peak "
                                        "memory, timeline PNG, Chrome trace",
                       description="Simulate a plan file on the three-lane executor replay "
                                   "(README: Planner and simulator). The layer and cost "
                                   "source come from the plan's meta (written by `dhelix "
                                   "plan`) unless given here.")
    s.add_argument("plan", metavar="PLAN", help="plan JSON file")
    _add_shape_args(s, required=False)
    _add_cost_args(s, required=False)
    s.add_argument("--png", default=None, metavar="PATH",
                   help="timeline chart (default: PLAN with .png)")
    s.add_argument("--trace", default=None, metavar="PATH",
                   help="Chrome trace JSON (default: PLAN with .trace.json)")
    g = s.add_argument_group("pipeline (the whole step: megatron 1F1B / interleaved vs the "
                             "DHelix fold)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=None, metavar="G",
                   help="simulate a pipeline of G stages (G >= 2)")
    g.add_argument("--num-microbatches", type=int, default=None, metavar="N",
                   help="micro-batches per step (default 2G)")
    g.add_argument("--num-layers", type=int, default=None, metavar="L",
                   help="layers of the model (default: the config's)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   metavar="V", help="also megatron's interleaved schedule, V layers per chunk")
    g.add_argument("--pipeline-lane", choices=("intra", "inter"), default="inter",
                   help="where neighbouring stages are: other nodes (inter, default) or "
                        "the same node")
    g.add_argument("--p2p-GBps", dest="p2p_gbps", type=float, default=None, metavar="BW",
                   help="P2P bandwidth in GB/s (default: the cluster file's lane)")
    g.add_argument("--pipeline-png", default=None, metavar="PATH",
                   help="stage × time chart (default: PLAN with .pipeline.png; a Chrome "
                        "trace beside it)")
    s.set_defaults(func=cmd_simulate)
