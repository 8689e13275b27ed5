"""The torch.compile backend: AOT autograd's forward and backward graphs through the
passes, each pass's work written to a report.

    from dhelix.helix import HelixOptions, helix_backend
    model = torch.compile(model, backend=helix_backend(HelixOptions(tiles=2)))

The graphs run as FX programs (no Inductor): the passes decide the order of the ops,
the ops are PyTorch's own.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import torch
import torch.fx as fx

from dhelix.helix.check import check_dependencies
from dhelix.helix.reorder import round_robin
from dhelix.helix.tiling import Dim, Layouts, tile

C10D = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")


@dataclass
class HelixOptions:
    tiles: int = 2                 # K tile streams (1: no tiling)
    reorder: bool = True           # segmented round-robin of the streams
    batch_dim: int = 0             # the batch dimension of the program's inputs
    paced: bool = False            # collectives on the paced link (`helix.paced`)
    bucketing: bool = False        # merge the streams' copies of a collective where it pays
    memory_budget_bytes: Optional[float] = None   # bucketing: the simulated peak's limit
    bucketing_search: str = "dp"   # "dp" (the dynamic program) or "exhaustive" (2^N)
    # the machine the bucketing choice is simulated for (compute from the graph's FLOPs
    # and bytes, collectives from the link model)
    link: str = "paced:1gbit"
    flops_per_s: float = 5e10
    bytes_per_s: float = 5e9

    def __post_init__(self):
        if not isinstance(self.tiles, int) or self.tiles < 1:
            raise ValueError(f"HelixOptions.tiles {self.tiles!r}: give a whole number of "
                             f"tile streams, 1 or more")
        if self.bucketing_search not in ("dp", "exhaustive"):
            raise ValueError(f"HelixOptions.bucketing_search {self.bucketing_search!r}: "
                             f"use 'dp' or 'exhaustive'")


@dataclass
class HelixReport:
    """What the passes did, one entry per graph (forward, backward)."""
    graphs: List[Dict] = field(default_factory=list)
    modules: Dict[str, object] = field(default_factory=dict)   # graph name -> what runs

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"graphs": self.graphs}, f, indent=1)

    def summary(self) -> str:
        return "\n".join(
            f"helix {g['graph']}: no passes" if g.get("passes") == "none" else
            f"helix {g['graph']}: {g['ops_before']} ops -> {g['ops_after']} | "
            f"{g['tiles']} streams, {g['split_ops']} ops split, {g['shared_ops']} run once | "
            f"collectives {g['collectives_before']} -> {g['collectives_after']} | segments "
            f"{g['segments']} | {g['dependencies_checked']} dependencies kept | simulated "
            f"peak {g['simulated_peak_bytes_before'] / 2**20:.2f} -> "
            f"{g['simulated_peak_bytes_after'] / 2**20:.2f} MiB"
            for g in self.graphs)


def _collectives(g: fx.Graph) -> int:
    return sum(1 for n in g.nodes if n.op == "call_function" and
               getattr(getattr(n.target, "overloadpacket", None), "__name__", "") in C10D)


def _ops(g: fx.Graph) -> int:
    return sum(1 for n in g.nodes if n.op == "call_function")


def _is_batch_input(x) -> bool:
    """A plain tensor input of the program (parameters arrive as Parameters or, under
    tensor parallel, as DTensors; meshes and process groups are not tensors)."""
    return type(x) is torch.Tensor


def helix_backend(options: Optional[HelixOptions] = None,
                  report: Optional[HelixReport] = None):
    """A torch.compile backend applying the Helix passes (see the package doc)."""
    from torch._dynamo.backends.common import aot_autograd
    opts = options or HelixOptions()
    rep = report if report is not None else HelixReport()

    def run_passes(gm: fx.GraphModule, inputs: Dict[str, object], name: str):
        from dhelix.helix.paced import pace
        if opts.tiles == 1 and not opts.reorder:      # no passes: the program as captured
            rep.graphs.append({"graph": name, "tiles": 1, "passes": "none",
                               "collectives_before": _collectives(gm.graph),
                               "ops_before": _ops(gm.graph)})
            if opts.paced:
                pace(gm)
            return _Timed(gm, name, report=rep)
        before = gm.graph
        peak_before = _simulated_peak(gm)
        buckets = None
        if opts.bucketing and opts.tiles > 1:
            t, segs, buckets = _bucketed(gm, inputs, opts)
        else:
            t = tile(gm, inputs, opts.tiles)
            segs = round_robin(t) if opts.reorder else {}
        checked = check_dependencies(before, t)
        rep.graphs.append({
            "graph": name, "tiles": opts.tiles, "ops_before": _ops(before),
            "ops_after": _ops(t.gm.graph), "split_ops": t.split_ops,
            "shared_ops": t.shared_ops, "collectives_before": _collectives(before),
            "collectives_after": _collectives(t.gm.graph), "segments": segs,
            "dependencies_checked": checked, "options": asdict(opts),
            "simulated_peak_bytes_before": peak_before,
            "simulated_peak_bytes_after": _simulated_peak(t.gm),
            "buckets": asdict(buckets) if buckets is not None else None})
        if opts.paced:
            pace(t.gm)
        t.timed = _Timed(t.gm, name, t.stream, report=rep)
        return t

    def backend(gm: fx.GraphModule, example_inputs):
        # every tensor input (a DTensor too) becomes one tensor placeholder of AOT's graph,
        # in order; meshes and process groups become opaque ones in between
        tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
        state: Dict[str, object] = {}

        def fw(fgm: fx.GraphModule, ex):
            phs = [n for n in fgm.graph.nodes if n.op == "placeholder"
                   and isinstance(n.meta.get("val"), torch.Tensor)]
            inputs = {}
            for x, ph in zip(tensors, phs):
                if _is_batch_input(x):
                    if tuple(ph.meta["val"].shape) != tuple(x.shape):
                        raise RuntimeError(f"helix: input of shape {tuple(x.shape)} does not "
                                           f"match graph input {ph.name}")
                    inputs[ph.name] = Dim(opts.batch_dim)
            layouts = Layouts(fgm.graph, inputs, opts.tiles)
            out = next(n for n in fgm.graph.nodes if n.op == "output")
            state["by_name"] = {n.name: layouts.get(n) for n in fgm.graph.nodes}
            state["outputs"] = [layouts.get(a) for a in out.args[0]]
            return _timed(run_passes(fgm, inputs, "forward"))

        def bw(bgm: fx.GraphModule, ex):
            by_name, outs = state["by_name"], state["outputs"]
            inputs = {}
            for n in bgm.graph.nodes:
                if n.op != "placeholder":
                    continue
                if n.name.startswith("tangents_"):
                    inputs[n.name] = outs[int(n.name.split("_")[1]) - 1]
                elif n.name in by_name:
                    inputs[n.name] = by_name[n.name]
            return _timed(run_passes(bgm, inputs, "backward"))

        return aot_autograd(fw_compiler=fw, bw_compiler=bw)(gm, example_inputs)

    backend.report = rep
    return backend


def _bucketed(gm: fx.GraphModule, inputs, opts: HelixOptions):
    """Tile, then choose the buckets by simulating candidate sets (`helix.bucketing`);
    returns the chosen scheduled graph, its segments, the report."""
    from dhelix.helix.bucketing import choose, merge
    from dhelix.helix.simulate import analytical_seconds, simulate_graph
    from dhelix.helix.tiling import propagate_shapes
    from dhelix.links import parse_link
    link = parse_link(opts.link, "HelixOptions.link")
    if link.kind != "paced":
        raise ValueError(f"HelixOptions.link {opts.link!r}: bucketing needs a link model "
                         f"(paced:RATE[,LATENCY])")
    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_initialized() else 2

    def build(merged):
        t = tile(gm, inputs, opts.tiles)
        for origin in merged:
            merge(t, origin)
        if merged:
            t.gm.graph.lint()
            t.gm.recompile()
            propagate_shapes(t.gm)
        if opts.reorder:
            round_robin(t)
        return t

    def simulate(t):
        sec = analytical_seconds(t.gm, opts.flops_per_s, opts.bytes_per_s)
        return simulate_graph(t.gm, sec, link.rate_Bps, link.latency_s, world, trace=True)
    t, rep = choose(build, simulate, opts.tiles, opts.memory_budget_bytes,
                    exhaustive=opts.bucketing_search == "exhaustive")
    return t, t.segments, rep


def _simulated_peak(gm: fx.GraphModule) -> float:
    """Peak bytes of the graph's own values in the order it runs (`helix.simulate`)."""
    from dhelix.helix.simulate import simulate_graph
    unit = {n.name: 1e-3 for n in gm.graph.nodes}
    return simulate_graph(gm, unit, 1e9, 0.0, 2).peak_bytes


def _timed(x):
    return x if isinstance(x, _Timed) else x.timed


class _Timed:
    """The graph to run; with `record` set, run node by node, recording when each node
    ran (compute), was issued (collectives) and waited: the measured timeline; with
    `memory` set, the measured peak of its intermediate values (`helix.simulate`)."""
    record: Optional[list] = None
    memory: Optional[dict] = None

    def __init__(self, gm: fx.GraphModule, name: str, stream: Optional[dict] = None,
                 report: Optional[HelixReport] = None):
        self.gm, self.name, self.stream = gm, name, stream or {}
        if report is not None:
            report.modules[name] = self

    def __call__(self, *args):
        if _Timed.memory is not None:
            from dhelix.helix.simulate import MemoryRecorder
            r = MemoryRecorder(self.gm)
            out = r.run(*args)
            _Timed.memory[self.name] = r.peak
            return out
        if _Timed.record is None:
            return self.gm(*args)
        return _Recorder(self, _Timed.record).run(*args)


class _Recorder(fx.Interpreter):
    def __init__(self, timed: _Timed, events: list):
        super().__init__(timed.gm)
        self.timed, self.events = timed, events

    def run_node(self, n):
        import time
        t0 = time.perf_counter()
        out = super().run_node(n)
        if n.op == "call_function":
            from dhelix.helix import paced
            name = getattr(n.target, "__name__", str(n.target))
            ev = {"graph": self.timed.name, "node": n.name, "op": name,
                  "stream": self.timed.stream.get(n.name, -1),
                  "t0": t0, "t1": time.perf_counter()}
            if n.target is paced._issue:
                ev["op"] = str(n.args[0].overloadpacket.__name__)
                ev["link_done"] = paced._DONE.get(id(out))
            self.events.append(ev)
        return out
