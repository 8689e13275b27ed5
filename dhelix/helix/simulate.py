"""A scheduled graph played by DHelix's own simulator (`planner.simulate.LaneModel`).

Each call of the graph becomes an op of one chain, in issue order: a collective is a
comm op on its lane (costed by the link model's ring formula, as everywhere), everything
else a compute op (its duration measured node by node, or given). The simulator plays
the chain as the executor plays a layer step — one thread issues, a collective runs on
its lane first-in first-out, the op reading it (its `wait_tensor`) waits for it — with
explicit readers and tensor lifetimes: every output is allocated when its op starts
(a collective's buffer when it is issued) and freed when the last op reading it, or any
view of it, ends; outputs of the graph live on.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from dhelix.planner.opspec import COMM, COMPUTE, LayerOps, OpSpec

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
COLLECTIVES = {c10d.all_gather_into_tensor: "all_gather",
               c10d.reduce_scatter_tensor: "reduce_scatter", c10d.all_reduce: "all_reduce"}
ALIASES = {aten.view, aten._unsafe_view, aten.t, aten.transpose, aten.permute, aten.expand,
           aten.slice, aten.select, aten.split, aten.split_with_sizes, aten.unsqueeze,
           aten.squeeze, aten.detach, aten.alias, aten.as_strided, c10d.wait_tensor,
           operator.getitem}


def _target(n: fx.Node):
    """The op a node runs (through the paced link's wrappers)."""
    from dhelix.helix import paced
    if n.target is paced._issue:
        return n.args[0].overloadpacket
    if n.target is paced._wait:
        return c10d.wait_tensor
    return getattr(n.target, "overloadpacket", n.target)


def _nbytes(val) -> float:
    if isinstance(val, torch.Tensor):
        return float(val.numel() * val.element_size())
    if isinstance(val, (list, tuple)):
        return sum(_nbytes(v) for v in val)
    return 0.0


@dataclass
class Program:
    layer: LayerOps                 # the graph's calls as one forward chain
    readers: List[int]              # comm op -> index of the op that waits for it
    lifetimes: List[Tuple[float, int]]   # op -> (output bytes, op after which freed)
    comm_bytes: Dict[str, float]


def program_of(gm: fx.GraphModule) -> Program:
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    index = {n: i for i, n in enumerate(nodes)}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = set(out_node.all_input_nodes)
    root: Dict[fx.Node, fx.Node] = {}
    for n in nodes:                     # a view shares its base's storage
        base = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        alias = _target(n) in ALIASES and base is not None
        if alias and base in index and _target(n) is operator.getitem and \
                _target(base) not in ALIASES:
            alias = False               # an output of a multi-output op: its own tensor
        # a view of a graph input holds no memory of the graph's own (root None)
        root[n] = (root.get(base) if base in index else None) if alias else n
    last: Dict[fx.Node, int] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a in index and root[a] is not None:
                r = root[a]
                last[r] = max(last.get(r, -1), index[n])
    ops, readers, life, comm = [], [], [], {}
    for i, n in enumerate(nodes):
        kind = COLLECTIVES.get(_target(n))
        val = n.meta.get("val")
        if kind is not None:
            from dhelix.helix import paced
            inp = n.args[1] if n.target is paced._issue else n.args[0]
            # NCCL's "size": the gathered output, the buffer reduced
            nbytes = _nbytes(val if kind == "all_gather" else inp.meta.get("val"))
            ops.append(OpSpec(n.name, COMM, "intra", group="tp", collective=kind,
                              comm_bytes=nbytes))
            comm[n.name] = nbytes
            waits = [u for u in n.users if _target(u) is c10d.wait_tensor]
            readers.append(index[waits[0]] if waits else -1)
        else:
            ops.append(OpSpec(n.name, COMPUTE, "compute"))
            readers.append(-1)
        multi = isinstance(val, (list, tuple)) and _target(n) not in ALIASES
        own = 0.0 if root[n] is not n or multi else _nbytes(val)
        lives = n in outputs or any(root.get(o) is n for o in outputs if o in root)
        life.append((own, -1 if lives else last.get(n, i)))
    layer = LayerOps(ops, [])
    return Program(layer, readers, life, comm)


@dataclass
class Prediction:
    makespan_s: float
    peak_bytes: float
    # with trace=True: the program, each op's (start, end) in issue order, and the live
    # bytes after each allocation or free as (time, bytes)
    program: Optional[Program] = None
    spans: Optional[List[Tuple[float, float]]] = None
    memory: Optional[List[Tuple[float, float]]] = None


def simulate_graph(gm: fx.GraphModule, seconds: Dict[str, float], rate_Bps: float,
                   latency_s: float, group_size: int, trace: bool = False,
                   overlap_slowdown: float = 1.0) -> Prediction:
    """Makespan and peak memory of the graph as scheduled: compute durations from
    `seconds` (node name -> s, e.g. measured), collectives from the link model; a compute
    op that starts while a collective is in flight takes `overlap_slowdown` times as long
    (as a table's overlap factor stretches one strand's op under the other's comm)."""
    from dhelix.planner.costmodel import collective_seconds
    from dhelix.planner.costs import CostTable
    from dhelix.planner.simulate import LaneModel
    prog = program_of(gm)
    table = CostTable.empty(prog.layer, provenance={"source": "helix graph"})
    waits = {n.name for n in gm.graph.nodes if n.op == "call_function"
             and _target(n) is c10d.wait_tensor}
    for o in prog.layer.forward:
        if o.kind == COMM:
            t = collective_seconds(o.collective, o.comm_bytes, group_size, rate_Bps, latency_s)
        else:   # a wait's own time is its collective's (what it measured was the transfer)
            t = 0.0 if o.name in waits else float(seconds.get(o.name, 0.0))
        table.alone_f[o.name] = t
    model = LaneModel(prog.layer, table, base_bytes=0.0, readers=prog.readers,
                      lifetimes=prog.lifetimes, overlap_slowdown=overlap_slowdown)
    events, memory = ([], []) if trace else (None, None)
    span, peak, _ = model.step(list(range(len(prog.layer.forward))), [], events=events,
                               memory=memory)
    if not trace:
        return Prediction(span, peak)
    return Prediction(span, peak, prog, [(e[3], e[4]) for e in events], memory)


class MemoryRecorder(fx.Interpreter):
    """Runs the graph node by node and measures the bytes of the distinct storages its
    intermediate values hold (inputs excluded) after every node: the measured peak."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.peak = 0.0
        self.at = None                  # the node at the peak
        self.inputs = set()

    def run_node(self, n):
        # a value nothing reads is dropped at once (as the generated code does; the
        # interpreter would keep it to the end)
        for k in [k for k in self.env if not k.users and k.op != "placeholder"]:
            del self.env[k]
        out = super().run_node(n)
        if n.op == "placeholder":
            for t in _tensors(out):
                self.inputs.add(t.untyped_storage().data_ptr())
            return out
        seen = {}
        for v in list(self.env.values()) + [out]:
            for t in _tensors(v):
                st = t.untyped_storage()
                if st.data_ptr() not in self.inputs:
                    seen[st.data_ptr()] = st.nbytes()
        total = float(sum(seen.values()))
        if total > self.peak:
            self.peak, self.at = total, n.name
        return out


def _tensors(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


def analytical_seconds(gm: fx.GraphModule, flops_per_s: float,
                       bytes_per_s: float) -> Dict[str, float]:
    """Compute durations from the graph alone (for choices made while compiling): GEMMs
    by their FLOPs, every other op by the bytes it writes; views cost nothing."""
    out = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        t = _target(n)
        val = n.meta.get("val")
        if t in (aten.mm, aten.addmm, aten.bmm) and isinstance(val, torch.Tensor):
            a = n.args[1] if t is aten.addmm else n.args[0]
            k = a.meta["val"].shape[-1]
            out[n.name] = 2.0 * val.numel() * k / flops_per_s
        elif t in ALIASES or t in COLLECTIVES:
            out[n.name] = 0.0
        else:
            out[n.name] = _nbytes(val) / bytes_per_s
    return out


def overlap_slowdown(fast: List[dict], slow: List[dict]) -> Optional[float]:
    """How much longer compute ops take while a collective is in flight, measured: the
    node-by-node timeline of one graph on the link (`slow`: collectives have `link_done`)
    against the same graph where the link is fast (`fast`). Time-weighted over the compute
    ops that started inside a collective's flight; None if none did."""
    alone = {e["node"]: e["t1"] - e["t0"] for e in fast}
    flights = [(e["t0"], e["link_done"]) for e in slow if e.get("link_done")]
    under = sum_alone = 0.0
    for e in slow:
        if e.get("link_done") or e["op"] == "_wait" or e["op"].startswith("wait_tensor") \
                or e["node"] not in alone:
            continue
        if any(a <= e["t0"] < b for a, b in flights):
            under += e["t1"] - e["t0"]
            sum_alone += alone[e["node"]]
    return under / sum_alone if sum_alone > 0 else None
