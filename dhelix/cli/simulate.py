"""`dhelix simulate`: play a plan file on the event simulator (DESIGN §1.5).

The layer and cost source come from the plan's meta (written by ``dhelix plan``) unless the
shape flags or ``--table``/``--cluster`` are given. Prints makespan, peak memory and lane busy
times against the trivial plan, and writes a timeline PNG and a Chrome trace; with
``--pipeline-model-parallel-size`` also the whole pipeline step (dhelix/planner/pipeline.py);
with ``--num-microbatches`` alone (PP = 1) the whole training step, DHelix's schedule and
megatron's order, from a table that `dhelix profile` wrote with its step extras
(dhelix/planner/whole_step.py).
"""
from __future__ import annotations

import json
import os

from dhelix.base.units import fmt_bytes, fmt_time
from dhelix.cli.common import fail
from dhelix.cli.planner_args import add_cost_args, add_shape_args, shape_from_args, shape_given
from dhelix.planner.problem import (InputError, cost_str, expected_errors, load_costs,
                                    node_size, plan_cost_source, plan_layer, resolve_cluster,
                                    shape_str)


def add_parser(sub) -> None:
    s = sub.add_parser("simulate", help="play a plan on the event simulator: makespan, peak "
                                        "memory, timeline PNG, Chrome trace",
                       description="Simulate a plan file on the three-lane executor replay "
                                   "(README: Planner and simulator). The layer and cost "
                                   "source come from the plan's meta (written by `dhelix "
                                   "plan`) unless given here.")
    s.add_argument("plan", metavar="PLAN", help="plan JSON file")
    add_shape_args(s, required=False)
    add_cost_args(s, required=False)
    s.add_argument("--png", default=None, metavar="PATH",
                   help="timeline chart (default: PLAN with .png)")
    s.add_argument("--trace", default=None, metavar="PATH",
                   help="Chrome trace JSON (default: PLAN with .trace.json)")
    g = s.add_argument_group("the whole step (PP = 1: DHelix's F(1); F(k+1) ∥ B(k); B(N) vs "
                             "megatron's order, with --num-microbatches; pipeline: megatron "
                             "1F1B / interleaved vs the DHelix fold)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=None, metavar="G",
                   help="simulate a pipeline of G stages (G >= 2)")
    g.add_argument("--num-microbatches", type=int, default=None, metavar="N",
                   help="micro-batches per step (pipeline: default 2G); without a pipeline: "
                        "predict the whole training step with N micro-batches (needs a "
                        "table `dhelix profile` wrote, with the embedding, loss, optimizer "
                        "and finalize times)")
    g.add_argument("--halves", action="store_true",
                   help="with --num-microbatches (PP = 1): B(N) as two batch halves "
                        "round-robin, as `dhelix train --dhelix-halves` runs it")
    g.add_argument("--pair-last", action="store_true",
                   help="with --num-microbatches (PP = 1): F(1), F(2) alone and B(N-1) ∥ "
                        "B(N) round-robin, as `dhelix train --dhelix-pair-last` runs it")
    g.add_argument("--num-layers", type=int, default=None, metavar="L",
                   help="layers of the model (default: the config's; without a pipeline: "
                        "the number the table's step extras were measured with)")
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
    s.set_defaults(func=run)


def _default_beside(plan_path: str, suffix: str) -> str:
    root, ext = os.path.splitext(plan_path)
    return (root if ext.lower() == ".json" else plan_path) + suffix


def run(a) -> int:
    from dhelix.planner.plan import Plan, trivial_plan, validate
    from dhelix.planner.simulate import plot_timeline, simulate, to_chrome_trace
    try:
        for flag, on in (("--halves", a.halves), ("--pair-last", a.pair_last)):
            if on and ((a.pipeline_model_parallel_size or 1) > 1 or
                       a.num_microbatches is None):
                raise InputError(f"{flag} prices B(N) in the whole step without a "
                                 f"pipeline: give --num-microbatches N and no "
                                 f"--pipeline-model-parallel-size")
        if a.halves and a.pair_last:
            raise InputError("--halves and --pair-last both change B(N): give one of them")
        plan = Plan.load(a.plan)
        meta = plan.meta or {}
        table, cluster, force = plan_cost_source(a.plan, meta, a.table, a.cluster,
                                                  a.force)
        gpn = node_size(cluster)       # which groups fit in a node: the CP and EP lanes
        layer, shape, layer_from = plan_layer(a.plan, meta, shape_from_args(a)
                                              if shape_given(a) else None, gpn)
        validate(plan, layer, source=a.plan)
        if a.host_scale is not None:
            host_scale = a.host_scale
        else:     # the plan's own, where it was made from the same table with one
            src0 = meta.get("cost_source") if isinstance(meta.get("cost_source"), dict) else {}
            host_scale = float(src0.get("host_scale", 1.0)) if not (a.table or a.cluster) \
                else 1.0
        costs, src = load_costs(layer, shape, table, cluster, force, host_scale)
        pp = a.pipeline_model_parallel_size or 1
        if pp <= 1 and a.num_microbatches is not None:
            whole = _whole_step(a, layer, plan, costs, src, force)   # errors before output
        res = simulate(layer, plan, costs, force=force)
        triv = simulate(layer, trivial_plan(layer), costs, force=force)
    except expected_errors() as e:
        return fail("simulate", e)

    print(f"dhelix simulate: {a.plan}  ({len(plan.steps)} steps, {plan.num_paired()} paired; "
          f"layer from {layer_from})")
    if shape:
        print(f"shape: {shape_str(shape, gpn)}")
    print(f"costs: {cost_str(src)}")
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
    if pp > 1:
        return _simulate_pipeline(a, layer, plan, costs, shape, cluster, force)
    if a.num_microbatches is not None:
        _print_whole_step(*whole, src, costs.step_extras)
    return 0


def _whole_step(a, layer, plan, costs, src, force):
    """(DHelix's step, megatron's step): the layers by the simulator, the rest from the
    table's step extras; a table without them (or the analytical model) is an error that
    names the fix."""
    from dhelix.planner.costs import TableError
    from dhelix.planner.whole_step import predict, thread_floor
    if src.get("kind") != "table":
        raise TableError(f"--num-microbatches without a pipeline predicts the whole training "
                         f"step, which needs the embedding, loss, optimizer and finalize "
                         f"times of a measured table; the analytical model (cluster "
                         f"{src.get('name')}) has none: give --table with a table from "
                         f"`dhelix profile`")
    if a.num_microbatches < 1:
        raise InputError(f"--num-microbatches {a.num_microbatches}: give at least 1")
    if a.num_layers is not None and a.num_layers < 1:
        raise InputError(f"--num-layers {a.num_layers}: give at least 1")
    dh, mg = predict(layer, plan, costs, a.num_microbatches, a.num_layers,
                     source=src.get("path", "<table>"), force=force, halves=a.halves,
                     pair_last=a.pair_last)
    floor = thread_floor(layer, costs, dh.num_layers, dh.num_microbatches, costs.step_extras,
                         force=force)
    return dh, mg, floor


def _print_whole_step(dh, mg, floor, src, extras) -> None:
    print()
    print(f"whole step: {dh.num_layers} layers, {dh.num_microbatches} micro-batches, PP=1 "
          f"(embedding, loss, optimizer, finalize measured in {src.get('path')})")
    print(f"per layer: forward alone {fmt_time(dh.layer_forward_s)}, backward alone "
          f"{fmt_time(dh.layer_backward_s)} (the plan's steps); co-executed pair "
          f"{fmt_time(dh.layer_pair_s)}; megatron's order: forward "
          f"{fmt_time(mg.layer_forward_s)}, backward {fmt_time(mg.layer_backward_s)}")
    for title, w in (("DHelix (this plan)", dh), ("megatron's order", mg)):
        print(f"  {title}")
        for label, v in w.phases():
            print(f"    {label:58s} {fmt_time(v):>11s}")
        print(f"    {'total':58s} {fmt_time(w.total_s):>11s}")
    speed = mg.total_s / dh.total_s if dh.total_s > 0 else 1.0
    print(f"predicted step: DHelix {fmt_time(dh.total_s)}, megatron {fmt_time(mg.total_s)}, "
          f"speedup {speed:.3f}x")
    above = dh.layer_pair_s / floor.pair_s - 1 if floor.pair_s > 0 else 0.0
    print(f"thread floor (every compute op's time in a layer step + every comm op's host "
          f"work, nothing waited for): layer pair {fmt_time(floor.pair_s)} (this plan's "
          f"{above * 100:+.1f}%), whole step {fmt_time(floor.step_s)}: no schedule of these "
          f"ops on one thread beats megatron's order by more than "
          f"{mg.total_s / floor.step_s:.3f}x")
    if extras.num_layers != dh.num_layers:
        print(f"note: the optimizer and finalize were timed on a model of "
              f"{extras.num_layers} layers, not {dh.num_layers}")


def _simulate_pipeline(a, layer, plan, costs, shape, cluster, force) -> int:
    """The whole pipeline step: megatron 1F1B (and interleaved) vs the DHelix fold."""
    from dhelix.planner.pipeline import (LayerCosts, PipelineError, draw_pipelines,
                                         p2p_seconds, pipeline_trace, simulate_pipeline)
    G = a.pipeline_model_parallel_size
    N = a.num_microbatches or 2 * G
    try:
        if not shape:
            raise InputError("--pipeline-model-parallel-size needs the model's layer count: "
                           "give the shape flags (--config, ...)")
        from dhelix.models.config import load_model_config
        m = load_model_config(shape["config"])
        L = a.num_layers or m.num_layers
        p2p, p2p_from = p2p_seconds(shape, m.hidden_size, a.p2p_gbps,
                                    _cluster_file(cluster), a.pipeline_lane)
        lc = LayerCosts.from_plan(layer, plan, costs, force=force)
        res = simulate_pipeline(lc, L, G, N, p2p, vpp_layers=a.num_layers_per_virtual_pipeline_stage)
    except expected_errors() + (PipelineError,) as e:
        return fail("simulate", e)
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


def _cluster_file(cluster):
    """The cluster file's contents, for the pipeline's P2P link; None without one."""
    if not cluster:
        return None
    from dhelix.planner.costmodel import load_cluster
    return load_cluster(resolve_cluster(cluster))


def _write_pictures(draw, trace: str, trace_json) -> bool:
    """The PNG and the Chrome trace; an unwritable path is one error line."""
    try:
        draw()
        with open(trace, "w") as f:
            json.dump(trace_json(), f)
    except OSError as e:
        fail("simulate", InputError(f"cannot write output: {e}"))
        return False
    return True
