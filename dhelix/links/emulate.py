"""Paced compute: a small model runs, and the ranks' clocks run at a large one's speed on
a cluster (issue 28; a first piece, see docs/links.md).

The real program runs — every op of the DHelix layer, every collective, the executor's
steps and barriers — on the small model's tensors. Each compute op then waits, without
holding a core, until the time the emulated shape's op takes on the emulated cluster has
passed since it started (`Pacer`, called by the executor); the paced link prices each
collective at the emulated shape's bytes (the small op's bytes × the shape ratio of its
group) on the cluster's own links. Time on the ranks is then the emulated cluster's time,
`factor` times slower (so that the small ops' own cost stays a small share of every
paced op: `Pacer.own_share` measures it).

The emulated shape's op costs are the analytical model of a cluster file
(`planner.costmodel.analytical_table`), for the layer the planner builds for that shape at
this run's TP/SP/CP/EP (`planner.shapes.layer_ops_for_shape`): op for op the same names as
the live layer's, which is checked.

    compute   paced:CLUSTER[,x=FACTOR]   a40 | a800 | h100 | a cluster YAML; FACTOR >= 1
    emulate   MODEL[,seq=S][,mbs=B]      the shape whose time the ranks keep

So far one layer step is paced (`scripts/emulate_layer_step.py`, `tests/test_emulate.py`);
`dhelix train` and `dhelix bench` do not take these settings yet.

Not paced yet: megatron's own layers (the baseline: emulate it with the DHelix layer and
the trivial plan), the embedding, the loss and the optimizer step; the DDP gradient
reduce and pipeline P2P are priced at the layer ratios (parameters, activations).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Dict, Optional

from dhelix.planner.opspec import COMM, LayerOps


class EmulationError(ValueError):
    """A --compute / --emulate value that cannot be used; names the flag and the fix."""


@dataclass(frozen=True)
class Emulation:
    cluster: str                  # a40 | a800 | h100 | a YAML path
    factor: float = 1.0           # emulated time runs this many times slower than the cluster
    model: str = ""               # the emulated model config (name or YAML)
    seq_length: Optional[int] = None
    micro_batch_size: Optional[int] = None


def parse(compute: str, emulate: str) -> Optional[Emulation]:
    """`paced:a40,x=4` and `llama-8b,seq=4096,mbs=1` -> an Emulation (None: not paced)."""
    compute = (compute or "none").strip()
    if compute == "none":
        return None
    m = re.fullmatch(r"paced:([^,]+)(?:,x=([\d.]+))?", compute)
    if not m:
        raise EmulationError(f"--compute {compute!r}: use paced:CLUSTER[,x=FACTOR] (e.g. "
                             f"paced:a40,x=4), CLUSTER a40, a800, h100 or a cluster YAML")
    factor = float(m.group(2) or 1.0)
    if factor < 1:
        raise EmulationError(f"--compute {compute!r}: x={factor:g} would ask the small ops "
                             f"to run faster than the cluster; give x >= 1")
    parts = [p.strip() for p in (emulate or "").split(",") if p.strip()]
    if not parts or "=" in parts[0]:
        raise EmulationError("--compute paced:... needs --emulate MODEL[,seq=S][,mbs=B]: "
                             "the model shape whose time the ranks keep (e.g. llama-8b)")
    opts = {}
    for p in parts[1:]:
        k, _, v = p.partition("=")
        if k not in ("seq", "mbs") or not v.isdigit() or int(v) < 1:
            raise EmulationError(f"--emulate {emulate!r}: {p!r}: use seq=S and mbs=B, "
                                 f"positive integers")
        opts[k] = int(v)
    return Emulation(m.group(1), factor, parts[0], opts.get("seq"), opts.get("mbs"))


def _cluster(name: str) -> dict:
    import os
    from dhelix.planner.costmodel import load_cluster
    path = name if os.path.exists(name) else os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "configs", "clusters", f"{name}.yaml")
    if not os.path.exists(path):
        raise EmulationError(f"--compute paced:{name}: no such cluster (a40, a800, h100, or "
                             f"a cluster YAML path)")
    return load_cluster(path)


@dataclass
class Pacer:
    """Compute op name -> the seconds it takes in emulated time; the executor calls
    `after(op, t0)` when an op it started at `t0` has run."""
    seconds: Dict[str, float]
    link: object = None               # the paced link: compute stretched while it sends
    slowdown: float = 0.0             # the cluster's comm_compute_slowdown
    own_s: float = 0.0                # the small ops' own time, summed
    paced_s: float = 0.0              # their emulated time, summed
    ops: int = 0
    late: Dict[str, int] = field(default_factory=dict)   # ops that ran past their time
    emulated: Optional[LayerOps] = None   # the emulated shape's layer and its cost table
    table: object = None

    def after(self, name: str, t0: float) -> None:
        now = time.perf_counter()
        d = self.seconds[name]
        if self.slowdown and self.link is not None:   # as the simulator's pair model
            d += self.slowdown * self.link.busy_seconds(t0, t0 + d)
        self.own_s += now - t0
        self.paced_s += d
        self.ops += 1
        if now < t0 + d:
            time.sleep(t0 + d - now)
        else:
            self.late[name] = self.late.get(name, 0) + 1

    @property
    def own_share(self) -> float:
        """The small ops' own time over their emulated time (valid while small)."""
        return self.own_s / self.paced_s if self.paced_s else 0.0


_ACTIVE: Dict[str, Pacer] = {}


def active() -> Optional[Pacer]:
    return _ACTIVE.get("pacer")


def install(emu: Emulation, small, live: LayerOps, *, tp: int, sp: bool, cp: int = 1,
            ep: int = 1, seq_length: int, micro_batch_size: int, bf16: bool = False,
            groups: Dict[str, object]) -> Pacer:
    """Pace this rank: `small` is the running model's config and `live` its layer's ops
    at `seq_length` × `micro_batch_size`, `groups` the
    process groups by name ("tp", "cp", "ep", "dp", "pp"). Needs the paced link (it
    prices the collectives); sets its rates to the cluster's, slowed by the factor."""
    from dhelix.links.paced import active as active_link
    from dhelix.models.config import load_model_config
    from dhelix.planner.costmodel import analytical_table, group_sizes_of
    from dhelix.planner.shapes import layer_ops_for_shape
    from dhelix.strand import executor
    link = active_link()
    if link is None:
        raise EmulationError("--compute paced:... prices collectives on the paced link: add "
                             "--link paced:RATE (its rate is replaced by the cluster's)")
    cluster = _cluster(emu.cluster)
    big = load_model_config(emu.model)
    s, b = emu.seq_length or seq_length, emu.micro_batch_size or micro_batch_size
    try:
        emulated = layer_ops_for_shape(big, tp, sp, s, b, bf16=True, ep=ep, cp=cp)
    except ValueError as e:
        raise EmulationError(f"--emulate {emu.model}: {e}") from None
    names = lambda ops: [o.name for o in ops.forward] + [o.name for o in ops.backward]  # noqa
    if names(emulated) != names(live):
        raise EmulationError(f"--emulate {emu.model}: its layer's ops "
                             f"({', '.join(names(emulated))}) are not the running layer's "
                             f"({', '.join(names(live))}): emulate a model of the same kind "
                             f"(dense or MoE, the same norm and activation)")
    table = analytical_table(emulated, cluster,
                             group_sizes_of({"tp": tp, "cp": cp, "ep": ep}, emulated),
                             cluster_name=emu.cluster)
    f = emu.factor
    seconds = {o.name: (table.alone_f if o in emulated.forward else table.alone_b)[o.name] * f
               for o in list(emulated.forward) + list(emulated.backward) if o.kind != COMM}
    # the collectives: the emulated shape's bytes on the cluster's links, `f` times slower
    ratio = {}
    for o_live, o_big in zip(list(live.forward) + list(live.backward),
                             list(emulated.forward) + list(emulated.backward)):
        if o_live.kind == COMM and o_live.comm_bytes:
            ratio.setdefault(o_live.group, o_big.comm_bytes / o_live.comm_bytes)
    # (the emulated shape runs in bf16; the small one in bf16 or fp32)
    act = (s * b * big.hidden_size * 2) / (seq_length * micro_batch_size * small.hidden_size
                                           * (2 if bf16 else 4))
    ratio.setdefault("pp", act)                     # hidden states between stages
    ratio.setdefault("dp", _layer_params(big) / _layer_params(small))   # gradients
    link.byte_scale = {id(g): ratio.get(k, act) for k, g in groups.items() if g is not None}
    link.lanes = {k: (float(cluster[k]["bandwidth_GBps"]) * 1e9 *
                      float(cluster[k].get("efficiency", 1.0)) / f,
                      float(cluster[k].get("latency_us", 0.0)) * 1e-6 * f)
                  for k in ("intra_node", "inter_node")}
    pacer = Pacer(seconds, link, float(cluster.get("comm_compute_slowdown", 0.0)),
                  emulated=emulated, table=table)
    executor.PACE = pacer
    _ACTIVE["pacer"] = pacer
    return pacer


def uninstall() -> None:
    from dhelix.links.paced import active as active_link
    from dhelix.strand import executor
    executor.PACE = None
    _ACTIVE.pop("pacer", None)
    link = active_link()
    if link is not None:
        link.byte_scale, link.lanes = {}, None


def _layer_params(m) -> float:
    h, f = m.hidden_size, m.ffn_hidden_size
    return 4 * h * h + 2 * h * f
