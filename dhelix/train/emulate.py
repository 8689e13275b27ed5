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
    emulate   MODEL[,seq=S][,mbs=B][,dp=D]  the shape whose time the ranks keep
    (parsed in `emulation_flags.py`)

`dhelix train --compute ... --emulate ...` (with `--link paced:...`) paces a run
(`install_for_run`): DHelix layers op by op (`Pacer.run`, from the executor), megatron's
own layers GEMM by GEMM (`GemmPacer`, a CPU-kernel hook: each GEMM named by its weight's
shape as the DHelix op it is). `scripts/emulate_layer_step.py` and
`scripts/emulate_pipelines.py` compare with the layer and pipeline simulators.

The output layer's GEMMs are paced on both paths (`emulate_gemms.py`, at the emulated
vocabulary). Not paced: elementwise ops, the embedding, the loss and the optimizer step
(they run at the small model's speed); the DDP gradient reduce and pipeline P2P are priced
at the layers' ratios (parameters, activations).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from dhelix.links import clock
from dhelix.models.params import grad_scales
from dhelix.train.emulate_gemms import _ACTIVE, _LOCAL, paced_op  # noqa: F401
from dhelix.train.emulation_flags import (Emulation, EmulationError, _cluster,  # noqa: F401
                                          parse)
from dhelix.planner.opspec import COMM, LayerOps


@dataclass
class Pacer:
    """Compute op name -> the seconds it takes in emulated time; the executor calls
    `after(op, t0)` when an op it started at `t0` has run."""
    seconds: Dict[str, float]
    link: object = None               # the paced link: compute stretched while it sends
    slowdown: float = 0.0             # the cluster's comm_compute_slowdown
    own_s: float = 0.0                # the small ops' own time, summed
    paced_s: float = 0.0              # their emulated time, summed
    overslept_s: float = 0.0          # woken later than their emulated end, summed
    ops: int = 0
    late: Dict[str, int] = field(default_factory=dict)   # ops that ran past their time
    counts: Dict[str, int] = field(default_factory=dict)  # paced calls, by op
    emulated: Optional[LayerOps] = None   # the emulated shape's layer and its cost table
    table: object = None
    routed: int = 0                   # MoE: the routed rows an expert op is priced for

    def run(self, op, S) -> None:
        """Run a DHelix compute op, then wait out its emulated time from when its work
        started (once the comm results it read had arrived); its GEMMs are not paced on
        their own meanwhile (`GemmPacer`)."""
        t0, w0 = time.perf_counter(), S.waited
        _LOCAL.in_op = True
        try:
            op.run(S)
        finally:
            _LOCAL.in_op = False
        self.after(op.spec.name, t0 + S.waited - w0, self.expert_share(op.spec.name, S))

    def expert_share(self, name: str, S) -> float:
        """An expert op's share of its emulated time: the rows routed to this rank's
        experts over the routed rows it is priced for (the routing's imbalance, as
        `GemmPacer` paces megatron's experts); 1 for every other op."""
        if not (self.routed and name.startswith("experts_") and S.has("moe_tpe")):
            return 1.0
        tpe = S.get("moe_tpe")
        return float(sum(tpe.tolist() if torch.is_tensor(tpe) else tpe)) / self.routed

    def after(self, name: str, t0: float, share: float = 1.0) -> None:
        """Op `name` (or `share` of it: one expert's GEMM of an expert op) started at
        `t0` and has run: wait out the rest of its emulated time."""
        now = time.perf_counter()
        d = self.seconds[name] * share * clock.SCALE
        if self.slowdown and self.link is not None:   # as the simulator's pair model
            d += self.slowdown * self.link.busy_seconds(t0, t0 + d)
        self.own_s += now - t0
        self.paced_s += d
        self.ops += 1
        self.counts[name] = self.counts.get(name, 0) + 1
        if now < t0 + d:
            time.sleep(t0 + d - now)
            # an oversubscribed machine wakes the rank late: the emulation runs slow by it
            self.overslept_s += time.perf_counter() - (t0 + d)
        else:
            self.late[name] = self.late.get(name, 0) + 1

    @property
    def overslept_share(self) -> float:
        """How much later than their emulated end the paced ops were woken, over their
        emulated time (valid while small, as `own_share`)."""
        return self.overslept_s / self.paced_s if self.paced_s else 0.0

    @property
    def own_share(self) -> float:
        """The small ops' own time over their emulated time (valid while small)."""
        return self.own_s / self.paced_s if self.paced_s else 0.0

def active() -> Optional[Pacer]:
    return _ACTIVE.get("pacer")


def emulated_layer(emu: Emulation, *, tp: int, sp: bool, cp: int = 1, ep: int = 1,
                   seq_length: int, micro_batch_size: int) -> tuple:
    """(the emulated model's config, its layer's ops at this TP/SP/CP/EP and the emulated
    sequence and micro-batch — `seq_length` and `micro_batch_size` unless the emulation
    gives its own —, their cost table on the cluster, the cluster): what paced compute
    waits out and what the simulators predict with (`bench/predict.py`)."""
    from dhelix.models.config import load_model_config
    from dhelix.planner.costmodel import analytical_table, group_sizes_of
    from dhelix.planner.shapes import layer_ops_for_shape
    cluster = _cluster(emu.cluster)
    big = load_model_config(emu.model)
    s, b = emu.seq_length or seq_length, emu.micro_batch_size or micro_batch_size
    try:
        ops = layer_ops_for_shape(big, tp, sp, s, b, bf16=True, ep=ep, cp=cp)
    except ValueError as e:
        raise EmulationError(f"--emulate {emu.model}: {e}") from None
    table = analytical_table(ops, cluster, group_sizes_of({"tp": tp, "cp": cp, "ep": ep}, ops),
                             cluster_name=emu.cluster)
    return big, ops, table, cluster


def nic_shares(cluster: dict, groups: Dict[str, object]) -> Dict[int, float]:
    """id(group) -> how many rings share each of this node's NICs with it
    (`costmodel.nic_share`), for the groups among `groups` that cross nodes."""
    import torch.distributed as dist
    from dhelix.base.nodes import node_ids
    from dhelix.planner.costmodel import nic_share
    ids = node_ids(dist.get_world_size())
    me = ids[dist.get_rank()]
    out = {}
    for g in groups.values():
        if g is None:
            continue
        ranks = dist.get_process_group_ranks(g)
        if len({ids[r] for r in ranks}) > 1:
            out[id(g)] = nic_share(cluster, ids.count(me), sum(ids[r] == me for r in ranks))
    return out


def install(emu: Emulation, small, live: LayerOps, *, tp: int, sp: bool, cp: int = 1,
            ep: int = 1, seq_length: int, micro_batch_size: int, bf16: bool = False,
            groups: Dict[str, object], gemms: bool = False,
            grads: Optional[Dict[str, float]] = None,
            head: Optional[tuple] = None) -> Pacer:
    """Pace this rank: `small` is the running model's config and `live` its layer's ops
    at `seq_length` × `micro_batch_size`, `groups` the process groups by name ("tp",
    "cp", "ep", "dp", "edp", "pp"), `grads` the DP groups' byte ratios (`grad_scales`;
    default: one layer's). Needs the paced link (it prices the collectives); sets its
    rates to the cluster's, slowed by the factor. `gemms`: megatron's layers run here,
    paced GEMM by GEMM; `head`: this rank's output-layer weight (hidden, vocabulary
    shard), paced on both paths (`emulate_gemms.py`)."""
    from dhelix.links.paced import active as active_link
    from dhelix.strand import executor
    link = active_link()
    if link is None:
        raise EmulationError("--compute paced:... prices collectives on the paced link: add "
                             "--link paced:RATE (its rate is replaced by the cluster's)")
    big, emulated, table, cluster = emulated_layer(
        emu, tp=tp, sp=sp, cp=cp, ep=ep, seq_length=seq_length,
        micro_batch_size=micro_batch_size)
    s, b = emu.seq_length or seq_length, emu.micro_batch_size or micro_batch_size
    names = lambda ops: [o.name for o in ops.forward] + [o.name for o in ops.backward]  # noqa
    if names(emulated) != names(live):
        raise EmulationError(f"--emulate {emu.model}: its layer's ops "
                             f"({', '.join(names(emulated))}) are not the running layer's "
                             f"({', '.join(names(live))}): emulate a model of the same kind "
                             f"(dense or MoE, the same norm and activation)")
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
    for g, r in (grads or {"dp": _layer_params(big) / _layer_params(small)}).items():
        ratio.setdefault(g, r)                      # gradients
    link.byte_scale = {id(g): ratio.get(k, act) for k, g in groups.items() if g is not None}
    # the distributed optimizer's parameter all-gather moves the parameters' dtype, bf16 in
    # the emulated run (Megatron-LM with --bf16: params_dtype bf16, gradients reduced in
    # fp32), where the small model gathers its own (fp32 unless bf16)
    for k in ("dp", "edp"):
        if groups.get(k) is not None:
            link.byte_scale[(id(groups[k]), "all_gather")] = \
                link.byte_scale[id(groups[k])] * 2 / (2 if bf16 else 4)
    link.group_size = {}
    dp_group = groups.get("dp")
    if emu.data_parallel_size and dp_group is not None:
        # DP cut to fit: the DP and expert-DP reductions priced at the emulated DP's size
        # (the ring's (n-1)/n and its steps' latencies), on the link the run's group spans
        grow = emu.data_parallel_size / (dp_group.size() // cp)
        link.group_size = {id(g): max(1, round(g.size() * grow))
                           for k, g in groups.items() if k in ("dp", "edp") and g is not None}
    link.share = nic_shares(cluster, groups)
    link.lanes = {k: (float(cluster[k]["bandwidth_GBps"]) * 1e9 *
                      float(cluster[k].get("efficiency", 1.0)) / f,
                      float(cluster[k].get("latency_us", 0.0)) * 1e-6 * f)
                  for k in ("intra_node", "inter_node")}
    from dhelix.train.emulate_gemms import _routed_rows
    pacer = Pacer(seconds, link, float(cluster.get("comm_compute_slowdown", 0.0)),
                  emulated=emulated, table=table,
                  routed=_routed_rows(small, tp, sp, seq_length, micro_batch_size, cp))
    executor.PACE = pacer
    _ACTIVE["pacer"] = pacer
    if head is not None:           # the output layer's GEMMs at the emulated vocabulary
        from dhelix.train.emulate_gemms import head_seconds
        t = head_seconds(big, cluster, s // cp * b, tp) * f
        seconds.update(head=t, head_dgrad=t, head_wgrad=t)
    if gemms or head is not None:  # megatron's own layers (and the head): by their GEMMs
        from dhelix.train.emulate_gemms import GemmPacer, _gemm_names, _install_gemm_hook
        _install_gemm_hook(GemmPacer(pacer, *_gemm_names(
            small, tp, sp, seq_length, micro_batch_size, cp, seconds, head=head,
            layers=gemms)))
    return pacer


def install_for_run(cfg, m, layout, chunks) -> Pacer:
    """`dhelix train`: pace this rank's model (`chunks`) as cfg.emulate on cfg.compute:
    DHelix layers op by op (what runs outside a DHelix step, evaluation, is not paced),
    megatron's layers GEMM by GEMM (`GemmPacer`), the collectives of every group at the
    emulated shape's bytes."""
    from megatron.core import parallel_state as ps
    from dhelix.models.config import load_model_config
    from dhelix.strand.layer import DHelixLayer
    from dhelix.train.emulate_gemms import output_weight_shape
    emu = parse(cfg.compute, cfg.emulate)
    layers = [mod for c in chunks for mod in c.modules() if isinstance(mod, DHelixLayer)]
    if layers:
        live = layers[0].program.layer_ops(cfg.seq_length, cfg.micro_batch_size)
    else:                          # megatron's layers: the ops a DHelix layer would have
        from dhelix.planner.shapes import layer_ops_for_shape
        live = layer_ops_for_shape(m, layout.tp, cfg.sequence_parallel, cfg.seq_length,
                                   cfg.micro_batch_size, bf16=cfg.bf16, ep=layout.ep,
                                   cp=layout.cp)
    groups = {"tp": ps.get_tensor_model_parallel_group(),
              "dp": ps.get_data_parallel_group(with_context_parallel=True),
              "edp": ps.get_expert_data_parallel_group() if layout.ep > 1 else None,
              "pp": ps.get_pipeline_model_parallel_group() if layout.pp > 1 else None,
              "cp": ps.get_context_parallel_group() if layout.cp > 1 else None,
              "ep": ps.get_expert_model_parallel_group() if layout.ep > 1 else None}
    return install(emu, m, live, tp=layout.tp, sp=cfg.sequence_parallel, cp=layout.cp,
                   ep=layout.ep, seq_length=cfg.seq_length,
                   micro_batch_size=cfg.micro_batch_size, bf16=cfg.bf16, groups=groups,
                   gemms=not layers,
                   grads=grad_scales(m, load_model_config(emu.model), chunks, layout.tp,
                                     layout.ep),
                   head=output_weight_shape(chunks))


def plan_maker(pacer: Pacer, path: Optional[str] = None):
    """make_plan for the plan book: the plan DHelix would run for the emulated shape —
    the plan file `path` (made by `dhelix plan` for that shape, validated against it), or
    the DP planner's plan on the cluster's table — stamped for the running layer, whose
    ops have the same names."""
    def make(live: LayerOps):
        from dhelix.planner import dp
        from dhelix.planner.min_gain import MIN_GAIN
        from dhelix.planner.plan import Plan, validate
        if path:
            p = Plan.load(path)
            validate(p, pacer.emulated, f"{path} (--dhelix-plan, for the --emulate shape)")
        else:
            p = dp.plan(pacer.emulated, pacer.table, rotate=True, reorder=True,
                        min_gain=MIN_GAIN)
        return Plan(live.signature(), [o.name for o in live.forward], list(p.backward),
                    p.steps, dict(p.meta, planned_for=pacer.emulated.signature()),
                    p.rotation)
    return make


def report(pacer: Pacer, emu: Emulation, step_s: float, microbatches: int, dp: int,
           seq_length: int, micro_batch_size: int) -> dict:
    """What the result JSON keeps: the emulated step time and tokens/s (the ranks' step
    time ÷ the factor; tokens of the emulated shape: its sequences and micro-batch size
    over this run's micro-batches and DP), the small ops' own share of paced compute (the
    emulation holds while it is small), and the ops that ran past their paced time."""
    step = step_s / emu.factor
    tokens = microbatches * dp * (emu.micro_batch_size or micro_batch_size) * \
        (emu.seq_length or seq_length)
    return {"emulate": emu.model, "cluster": emu.cluster, "factor": emu.factor,
            "warm_factor": emu.warm_factor,     # the first step's (not timed)
            "step_s": step, "tokens_per_s": tokens / step, "own_share": pacer.own_share,
            "overslept_share": pacer.overslept_share,
            "paced_ops": pacer.ops, "paced_compute_s": pacer.paced_s,
            "late_ops": dict(pacer.late), "paced_op_counts": dict(pacer.counts)}


def warm_up(emu: Emulation) -> None:
    """The run's first step, not timed, at the emulation's warm-up factor: every paced wait
    (ops and collectives) scaled by warm / factor (`clock.SCALE`)."""
    clock.SCALE = emu.warm_factor / emu.factor


def end_warm_up(pacer: Pacer) -> None:
    """Back to the emulation's factor, the statistics of the warm-up forgotten (the
    report covers the timed steps). Called after the first step's forward-backward, before
    its optimizer step: the parameter gathers that step starts run into the next."""
    from dhelix.links.paced import active as active_link
    from dhelix.links.shm import PEER_WAIT
    clock.SCALE = 1.0
    pacer.own_s = pacer.paced_s = pacer.overslept_s = 0.0
    pacer.ops = 0
    pacer.late.clear()
    pacer.counts.clear()
    link = active_link()
    if link is not None:
        link.reset_stats()
    PEER_WAIT["slot_s"] = 0.0


def uninstall() -> None:
    from dhelix.links.paced import active as active_link
    from dhelix.strand import executor
    clock.SCALE = 1.0
    executor.PACE = None
    _ACTIVE.pop("pacer", None)
    _ACTIVE.pop("gemm", None)           # the kernel hook stays, passing through
    link = active_link()
    if link is not None:
        link.byte_scale, link.lanes, link.group_size, link.share = {}, None, {}, {}


def _layer_params(m) -> float:
    h, f = m.hidden_size, m.ffn_hidden_size
    return 4 * h * h + 2 * h * f
