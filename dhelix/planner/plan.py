"""The layer plan: a versioned JSON file of steps, and the validator of DESIGN §1.2.

A step pairs at most one forward segment of strand α with at most one backward segment
of strand β; every op of both chains appears exactly once, in chain order (weight-grad
ops anywhere after their dgrad). A step may hold several comm ops of one process group:
the executor issues a step's ops in one deterministic order (the same on every rank, as
the plan is), the lane runs them first-in first-out, and each is waited for by its reader.

A plan with `rotation` r > 0 pairs α's layer with β's chain rotated by r: the last ops of
one backward node (from its op r on) and then the first r ops of the node below it. The
layer-step boundary then falls inside β's chain instead of at both strands' ends at once,
where both strands drain (`schedules/dhelix.py` walks β that way). Its steps name the ops
of the rotated chain (`rotated_backward`), in that order.

`backward` is β's order within one node: the layer's chain, or another order of it that
`check_order` allows (the planner's, `dp.plan(reorder=True)`: a re-gather issued early,
so the link has work while the strands compute). The rotation cuts that order.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Dict, List

from dhelix.planner.opspec import COMM, LayerOps

PLAN_FORMAT = "dhelix.plan"
PLAN_VERSION = 1


class PlanError(ValueError):
    """A plan that breaks a rule; the message names the file, step and rule."""


@dataclass
class Step:
    fwd: List[str] = field(default_factory=list)   # α's forward segment (op names)
    bwd: List[str] = field(default_factory=list)   # β's backward segment (op names)

    def to_json(self) -> dict:
        return {"fwd": list(self.fwd), "bwd": list(self.bwd)}


@dataclass
class Plan:
    signature: str                 # LayerOps.signature() of the layer it was made for
    forward: List[str]             # forward chain op names (for readable errors)
    backward: List[str]            # β's op names in one node's order (module doc)
    steps: List[Step]
    meta: Dict = field(default_factory=dict)   # who made it, predicted times, ...
    rotation: int = 0              # β's chain starts at its op `rotation` (module doc)

    # ---- serialisation -------------------------------------------------------------
    def to_json(self) -> dict:
        d = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "signature": self.signature,
             "forward": self.forward, "backward": self.backward}
        if self.rotation:       # absent when 0: the files of before read the same
            d["rotation"] = self.rotation
        d.update(steps=[s.to_json() for s in self.steps], meta=self.meta)
        return d

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @staticmethod
    def from_json(d: dict, source: str = "<plan>") -> "Plan":
        if not isinstance(d, dict) or d.get("format") != PLAN_FORMAT:
            raise PlanError(f"{source}: field 'format' must be '{PLAN_FORMAT}' "
                            f"(is this a DHelix plan file? write one with `dhelix plan`)")
        if d.get("version") != PLAN_VERSION:
            raise PlanError(f"{source}: field 'version' is {d.get('version')!r}, this DHelix "
                            f"reads version {PLAN_VERSION}; re-create the plan with `dhelix plan`")
        for key in ("signature", "forward", "backward", "steps"):
            if key not in d:
                raise PlanError(f"{source}: missing field '{key}'")
        steps = []
        for k, s in enumerate(d["steps"]):
            if not isinstance(s, dict) or set(s) - {"fwd", "bwd"}:
                raise PlanError(f"{source}: step {k}: a step is {{'fwd': [...], 'bwd': [...]}}")
            steps.append(Step(list(s.get("fwd", [])), list(s.get("bwd", []))))
        r = d.get("rotation", 0)
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < max(
                len(d["backward"]), 1):
            raise PlanError(f"{source}: field 'rotation' must be an integer from 0 to "
                            f"{len(d['backward']) - 1} (the backward op β's chain starts at), "
                            f"not {r!r}; re-create the plan with `dhelix plan`")
        return Plan(d["signature"], list(d["forward"]), list(d["backward"]), steps,
                    d.get("meta", {}), r)

    @staticmethod
    def load(path: str) -> "Plan":
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise PlanError(f"plan file not found: {path} (make one with `dhelix plan`)")
        except json.JSONDecodeError as e:
            raise PlanError(f"{path}: not valid JSON ({e}); the file is truncated or corrupted")
        return Plan.from_json(d, source=path)

    def digest(self) -> str:
        """Hash used to check that every rank holds the same plan."""
        payload = {"sig": self.signature, "steps": [s.to_json() for s in self.steps],
                   "backward": self.backward}
        if self.rotation:
            payload["rotation"] = self.rotation
        payload = json.dumps(payload, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def num_paired(self) -> int:
        return sum(1 for s in self.steps if s.fwd and s.bwd)

    def table(self) -> str:
        """The plan as a readable table, one row per step."""
        rows = [f"{'step':>4}  {'forward (α)':<40} {'backward (β)':<40}"]
        if self.rotation:
            rows.insert(0, f"β's chain rotated by {self.rotation}: from "
                           f"'{self.backward[self.rotation]}' of one layer to "
                           f"'{self.backward[self.rotation - 1]}' of the layer below")
        for k, s in enumerate(self.steps):
            rows.append(f"{k:>4}  {' '.join(s.fwd) or '-':<40} {' '.join(s.bwd) or '-':<40}")
        return "\n".join(rows)


# ---- validation ------------------------------------------------------------------------

def validate(plan: Plan, layer: LayerOps, source: str = "<plan>") -> None:
    """Raise PlanError naming the step and the rule broken; return None if legal."""
    if plan.signature != layer.signature():
        diff = shape_difference(plan.meta.get("shape"), getattr(layer, "shape", None))
        what = (f"it differs in {diff}" if diff else
                f"plan signature {plan.signature}, this layer {layer.signature()} (different "
                f"model shape, parallel sizes or dtype)")
        raise PlanError(
            f"{source}: rule 'layer-shape': the plan was made for another layer: {what}; "
            f"re-run `dhelix plan` with this run's --config, --tensor-model-parallel-size, "
            f"--sequence-parallel, --seq-length, --micro-batch-size and --bf16")
    r = plan.rotation
    if not 0 <= r < max(len(layer.backward), 1):
        raise PlanError(f"{source}: rule 'rotation': {r} is not a backward op's index "
                        f"(0..{len(layer.backward) - 1})")
    check_order(layer, plan.backward, source)
    node_b = ordered_backward(layer, plan.backward)
    node_index = {o.name: i for i, o in enumerate(node_b)}
    fwd_spec = {o.name: o for o in layer.forward}
    bwd_spec = {o.name: o for o in layer.backward}
    fwd_order = {o.name: i for i, o in enumerate(layer.forward)}
    bwd_chain = [o.name for o in rotated_backward(node_b, r) if not o.wgrad]
    # a comm op read by a named reader: the reader after it (as a wgrad after its dgrad)
    read_by = {o.reader: o.name for o in node_b if o.reader is not None}
    bwd_order = {n: i for i, n in enumerate(bwd_chain)}
    seen_f: Dict[str, int] = {}
    seen_b: Dict[str, int] = {}
    next_f = 0
    next_b = 0
    for k, step in enumerate(plan.steps):
        for strand, names, spec in (("fwd", step.fwd, fwd_spec), ("bwd", step.bwd, bwd_spec)):
            for name in names:
                op = spec.get(name)
                if op is None:
                    raise PlanError(f"{source}: step {k}: rule 'known-op': {strand} op "
                                    f"'{name}' is not in this layer's {strand} chain")
                seen = seen_f if strand == "fwd" else seen_b
                if name in seen:
                    raise PlanError(f"{source}: step {k}: rule 'each-op-once': {strand} op "
                                    f"'{name}' repeated (first in step {seen[name]})")
                seen[name] = k
                if strand == "bwd" and r and node_index[name] >= r and \
                        any(node_index[n] < r for n in seen_b):
                    raise PlanError(f"{source}: step {k}: rule 'rotation-order': '{name}' of "
                                    f"the layer above comes after an op of the layer below "
                                    f"(rotation {r}: every op from '{node_b[r].name}' "
                                    f"on runs before '{node_b[0].name}')")
                if strand == "fwd":
                    if fwd_order[name] != next_f:
                        want = layer.forward[next_f].name if next_f < len(layer.forward) else "-"
                        raise PlanError(f"{source}: step {k}: rule 'chain-order': forward op "
                                        f"'{name}' comes before '{want}'")
                    next_f += 1
                elif op.wgrad:
                    # rotated: a wgrad of the node above whose dgrad ran in the layer
                    # step before (the dgrad among the first r ops, the wgrad not)
                    for first, rule, what in ((op.after, "wgrad-after-dgrad", "its dgrad"),
                                              (read_by.get(name), "reader-after-comm",
                                               "the comm op it reads")):
                        if first is None or first in seen_b:
                            continue
                        if not node_index[first] < r <= node_index[name]:
                            raise PlanError(f"{source}: step {k}: rule '{rule}': '{name}' "
                                            f"runs before {what} '{first}'")
                else:
                    if bwd_order[name] != next_b:
                        raise PlanError(f"{source}: step {k}: rule 'chain-order': backward op "
                                        f"'{name}' comes before '{bwd_chain[next_b]}'")
                    next_b += 1
    missing = [o.name for o in layer.forward if o.name not in seen_f] + \
              [o.name for o in layer.backward if o.name not in seen_b]
    if missing:
        raise PlanError(f"{source}: rule 'each-op-once': ops missing from the plan: "
                        f"{', '.join(missing)}")


def check_order(layer: LayerOps, order: List[str], source: str = "<plan>") -> None:
    """`order` is a legal order of one node's backward ops (`Plan.backward`): each op of
    the layer once, the ops that are not wgrad ops in chain order, a wgrad op after its
    `after` op, a comm op before its `reader`. Raises PlanError naming the rule."""
    names = [o.name for o in layer.backward]
    if sorted(order) != sorted(names):
        extra = sorted(set(order) - set(names))
        missing = sorted(set(names) - set(order))
        raise PlanError(f"{source}: rule 'backward-order': field 'backward' must list each "
                        f"backward op of this layer once (unknown: {extra or '-'}, missing: "
                        f"{missing or '-'}); re-create the plan with `dhelix plan`")
    pos = {n: i for i, n in enumerate(order)}
    chain = [o.name for o in layer.backward if not o.wgrad]
    if [n for n in order if n in set(chain)] != chain:
        raise PlanError(f"{source}: rule 'backward-order': field 'backward' must keep the "
                        f"chain's order of the ops that are not wgrad ops ({', '.join(chain)})")
    for o in layer.backward:
        for first, then in ((o.after, o.name), (o.name, o.reader)):
            if first is not None and then is not None and then in pos and \
                    pos[first] > pos[then]:
                raise PlanError(f"{source}: rule 'backward-order': field 'backward' puts "
                                f"'{then}' before '{first}', which it must follow")


def ordered_backward(layer: LayerOps, order=None) -> List:
    """The layer's backward OpSpecs in `order` (op names: a plan's `backward`); None or
    the chain's own order: `layer.backward`."""
    if order is None:
        return list(layer.backward)
    spec = {o.name: o for o in layer.backward}
    return [spec[n] for n in order]


def rotated_backward(chain: List, r: int) -> List:
    """β's chain of a layer step rotated by r: the ops from r on of one node, then its
    first r ops (those of the node below)."""
    return list(chain[r:]) + list(chain[:r]) if r else list(chain)


def node_order(plan: Plan) -> List[str]:
    """The plan's backward op names in one node's own order (a strand with no partner
    runs them so): with a rotation, the plan's first r chain ops before the rest."""
    names = [n for s in plan.steps for n in s.bwd]
    if not plan.rotation:
        return names
    head = set(plan.backward[:plan.rotation])
    return [n for n in names if n in head] + [n for n in names if n not in head]


# ---- built-in plans ----------------------------------------------------------------------

def split_segments(ops) -> List[List[str]]:
    """Cut a chain into maximal segments holding at most one comm op per group."""
    segs: List[List[str]] = []
    cur: List[str] = []
    groups = set()
    for o in ops:
        if o.kind == COMM and o.group in groups:
            segs.append(cur)
            cur, groups = [], set()
        cur.append(o.name)
        if o.kind == COMM:
            groups.add(o.group)
    if cur:
        segs.append(cur)
    return segs


def comm_runs(ops) -> List[List[str]]:
    """Cut a chain into runs of compute ops and single comm ops."""
    comm = _comm_names(ops)
    segs: List[List[str]] = []
    for o in ops:
        if o.kind == COMM or not segs or segs[-1][-1] in comm:
            segs.append([o.name])
        else:
            segs[-1].append(o.name)
    return segs


def _comm_names(ops):
    return {o.name for o in ops if o.kind == COMM}


SHAPE_FIELDS = {"hidden": "hidden_size", "ffn": "ffn_hidden_size", "seq": "seq_length",
                "mbs": "micro_batch_size", "tp": "tensor_model_parallel_size",
                "sp": "sequence_parallel", "cp": "context_parallel_size",
                "dtype_bytes": "dtype bytes"}


def shape_difference(planned, current) -> str:
    """'seq_length: plan 4096, this run 64; ...' for the shape fields that differ. Only
    fields both record are compared: a field the plan does not record (`dhelix plan`
    writes its flags: config, tp, sp, seq, mbs, bf16, ...) is not a difference."""
    if not isinstance(planned, dict) or not isinstance(current, dict):
        return ""
    planned = dict(planned)
    if "dtype_bytes" not in planned and isinstance(planned.get("bf16"), bool):
        planned["dtype_bytes"] = 2 if planned["bf16"] else 4     # --bf16, as the layer's
    out = [f"{SHAPE_FIELDS.get(k, k)}: plan {planned[k]}, this run {current[k]}"
           for k in SHAPE_FIELDS
           if k in current and k in planned and planned[k] != current[k]]
    return "; ".join(out)


def new_plan(layer: LayerOps, steps: List[Step], meta: Dict, rotation: int = 0,
             order=None) -> Plan:
    """A plan for `layer`, carrying the layer's shape (so a mismatch can name the field);
    `order`: β's node order (default: the layer's chain)."""
    meta = dict(meta)
    if getattr(layer, "shape", None):
        meta.setdefault("shape", dict(layer.shape))
    return Plan(layer.signature(), [o.name for o in layer.forward],
                list(order) if order is not None else [o.name for o in layer.backward],
                steps, meta, rotation)


def _plan(layer: LayerOps, steps: List[Step], made_by: str) -> Plan:
    return new_plan(layer, steps, {"made_by": made_by})


def trivial_plan(layer: LayerOps) -> Plan:
    """All forward, then all backward, nothing paired (the baseline order)."""
    steps = [Step(fwd=s) for s in split_segments(layer.forward)]
    steps += [Step(bwd=s) for s in split_segments(layer.backward)]
    return _plan(layer, steps, "trivial")


def paired_plan(layer: LayerOps) -> Plan:
    """Built-in plan for when no planner output is given: each comm op of one strand
    runs beside the next compute run of the other strand."""
    f, b = comm_runs(layer.forward), comm_runs(layer.backward)
    fcomm, bcomm = _comm_names(layer.forward), _comm_names(layer.backward)
    steps: List[Step] = []
    i = j = 0
    while i < len(f) and j < len(b):
        f_is_comm, b_is_comm = f[i][0] in fcomm, b[j][0] in bcomm
        if f_is_comm and b_is_comm:
            # both strands wait on the same kind of resource: let the one further
            # behind (relative to its chain length) go alone
            if i / len(f) <= j / len(b):
                steps.append(Step(fwd=f[i])); i += 1
            else:
                steps.append(Step(bwd=b[j])); j += 1
        else:
            steps.append(Step(f[i], b[j])); i += 1; j += 1
    steps += [Step(fwd=s) for s in f[i:]] + [Step(bwd=s) for s in b[j:]]
    return _plan(layer, steps, "paired")


def check_same_plan_across_ranks(plan: Plan, source: str = "<plan>", group=None) -> None:
    """Every rank must execute the identical plan (DESIGN §1.2): compare digests once,
    at start-up, and fail on every rank with the ranks that differ — never a hang."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, (plan.digest(), source), group=group)
    mine = plan.digest()
    if len({d for d, _ in digests}) > 1:
        by = {}
        for r, (d, src) in enumerate(digests):
            by.setdefault(d, []).append(f"{r}({src})")
        detail = "; ".join(f"plan {d}: ranks {', '.join(rs)}" for d, rs in by.items())
        raise PlanError(f"{source}: rule 'same-plan-on-all-ranks': ranks hold different plans "
                        f"({detail}); this rank holds {mine}. Give every rank the same "
                        f"--dhelix-plan file")
