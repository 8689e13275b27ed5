"""The whole training step (PP = 1) on the simulator: the layers by the layer simulator,
the rest of the step from the table's measured extras (DESIGN §1.5, §1.6).

DHelix's schedule with N micro-batches and L layers is (`schedules/dhelix.py`)

    F(1);  [F(k+1) ∥ B(k)] for k = 1..N−1;  B(N)

* F(1): α's L layers alone. The executor runs a strand without a partner as one step of
  its ops in the plan's order (no barrier between them), so one layer costs
  `LaneModel.step(all forward ops, [])`.
* each co-executed step: α's layer i beside β's layer L−i+1 by the plan, so L times the
  plan's makespan (every plan step, both strands). A rotated plan (`Plan.rotation`):
  L−1 rotated pairs, the last α layer beside the rest of β's last node, and β's first
  node's first ops alone (`co_step_layers`); `layer_pair_s` is that over L.
* B(N): β's L layers alone, one step of the backward ops in the plan's order.
* `--dhelix-pair-last` (`pair_last`): F(1) and F(2) alone, N−2 co-steps F(k+2) ∥ B(k),
  and the tail B(N−1) ∥ B(N): L layers, each two whole micro-batches' backward chains
  round-robin (`planner.tiles` with share 1).
* around the layers, every micro-batch once: the pre-process (embedding) forward and
  backward and the post-process (final norm, output layer, loss) forward and backward;
  the schedule runs them on the same thread as the layers, never beside a layer, so they
  add up. Per step once: the grad finalize, the optimizer step, zeroing the grad buffers.

Megatron's order (each micro-batch's forward then its backward, nothing paired) is the
same sum with N forwards alone and N backwards alone of the trivial plan — one step each,
so a comm runs beside its own strand's next ops as in megatron's layer — and no co-steps.

Both are one formula, `WholeStep`: L × (forwards alone × F + backwards alone × B +
co-steps × P) + N × (per micro-batch extras) + per step extras. Everything is a sum
because every piece ends before the next starts (barriers, the one schedule thread).

What a forward or backward with no partner costs is a function (`AloneCost`), so that a
schedule that splits F(1)/B(N) differently (e.g. into two halves run beside each other)
swaps it without touching the rest.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, List, Optional, Tuple

from dhelix.planner.costs import CostTable, StepExtras, TableError
from dhelix.planner.opspec import LayerOps
from dhelix.planner.plan import Plan, node_order, trivial_plan, validate
from dhelix.planner.simulate import LANE_ID, LaneModel

# (lane model, plan) -> (one layer's forward with no partner, its backward with none)
AloneCost = Callable[[LaneModel, Plan], Tuple[float, float]]


def plan_steps_alone(model: LaneModel, plan: Plan) -> Tuple[float, float]:
    """What the executor does for a layer with no partner (`run_layer_step` with one
    strand): the strand's ops in the plan's order as ONE step — no barrier between them,
    each comm waited for by its reader. `model` is unrotated; a rotated plan's backward
    runs in the node's own order (`plan.node_order`)."""
    fpos = {n: k for k, n in enumerate(model.f_names)}
    bpos = {n: k for k, n in enumerate(model.b_names)}
    f = model.step([fpos[n] for st in plan.steps for n in st.fwd], [])[0]
    b = model.step([], [bpos[n] for n in node_order(plan)])[0]
    return f, b


def halves_alone(layer: LayerOps, table: CostTable, force: bool = False) -> AloneCost:
    """The `AloneCost` of `--dhelix-halves`: F(1) whole, in the plan's order as one step;
    B(N) as two batch halves round-robin (`planner.tiles`)."""
    from dhelix.planner.tiles import tiles_makespan
    b = tiles_makespan(layer, table, "bwd", force=force)

    def alone(model, plan):
        return plan_steps_alone(model, plan)[0], b
    alone.halves = True            # WholeStep.halves: the phases say "two halves"
    return alone


def plan_makespan(model: LaneModel, plan: Plan) -> float:
    """One co-executed layer pair: the plan's steps back to back, a comm waited for by its
    reader only (the same number `simulate(layer, plan, table).makespan` gives)."""
    from dhelix.planner.simulate import plan_indices
    return model.run(plan_indices(model, plan))[0]


def co_step_layers(model: LaneModel, plan: Plan, num_layers: int) -> float:
    """The layers of one co-step, L pairs (`schedules/dhelix.py`); `model` has the plan's
    rotation. Unrotated: L plan makespans. Rotated by r: β's first node's first r ops
    alone (one step in the plan's order), L−1 rotated pairs, and α's last layer beside the
    rest of β's last node (the plan's steps without the first r ops)."""
    from dhelix.planner.simulate import plan_indices
    idx = plan_indices(model, plan)
    pair = model.run(idx)[0]
    if not plan.rotation:
        return num_layers * pair
    tail = len(model.b_names) - plan.rotation      # rotated positions < tail: the node above
    head = model.step([], [k for _, b in idx for k in b if k >= tail])[0]
    last = [(f, [k for k in b if k < tail]) for f, b in idx]
    last = model.run([(f, b) for f, b in last if f or b])[0]
    return head + (num_layers - 1) * pair + last


@dataclass
class WholeStep:
    """One training step, predicted: how many layer forwards / backwards run alone and
    how many co-executed layer-pair steps there are, what each costs, and the extras.
    Every `*_s` field is seconds; `total_s` is their sum (see the module doc)."""
    schedule: str                  # "dhelix" or "megatron"
    num_layers: int                # L
    num_microbatches: int          # N
    forwards_alone: int            # micro-batches whose forward runs with no partner
    backwards_alone: int           # ... whose backward runs with no partner
    co_steps: int                  # F(k+1) ∥ B(k) steps (each L layer pairs)
    layer_forward_s: float         # one layer's forward alone
    layer_backward_s: float        # one layer's backward alone
    layer_pair_s: float            # one layer pair co-executed (the plan's makespan)
    forward_alone_s: float         # L × forwards_alone × layer_forward_s
    backward_alone_s: float        # L × backwards_alone × layer_backward_s
    co_steps_s: float              # L × co_steps × layer_pair_s
    microbatch_extras_s: float     # N × (pre fwd + pre bwd + post fwd + post bwd)
    step_extras_s: float           # optimizer + finalize + zero grad, once
    total_s: float
    halves: bool = False           # B(N) as two batch halves round-robin
    layer_tail_s: float = 0.0      # one layer of B(N−1) ∥ B(N) (`--dhelix-pair-last`)
    tail_s: float = 0.0            # L × layer_tail_s; 0 without the paired tail

    @property
    def layers_s(self) -> float:
        return self.forward_alone_s + self.backward_alone_s + self.co_steps_s + self.tail_s

    def phases(self) -> List[Tuple[str, float]]:
        """(label, seconds) of each part, for printing; they add up to `total_s`."""
        L, N = self.num_layers, self.num_microbatches
        if self.schedule == "dhelix" and self.tail_s:
            out = [(f"F(1), F(2): {L} layers forward alone each", self.forward_alone_s),
                   (f"{self.co_steps} co-steps F(k+2) ∥ B(k): {L} layer pairs each",
                    self.co_steps_s),
                   (f"B({N - 1}) ∥ B({N}): {L} layers, two backwards round-robin",
                    self.tail_s)]
        elif self.schedule == "dhelix":
            out = [(f"F(1): {L} layers forward alone", self.forward_alone_s),
                   (f"{self.co_steps} co-steps F(k+1) ∥ B(k): {L} layer pairs each",
                    self.co_steps_s),
                   (f"B({N}): {L} layers backward alone" +
                    (" (two halves)" if self.halves else ""), self.backward_alone_s)]
        else:
            out = [(f"{self.forwards_alone} forwards: {L} layers each", self.forward_alone_s),
                   (f"{self.backwards_alone} backwards: {L} layers each",
                    self.backward_alone_s)]
        return out + [(f"embedding + loss, fwd and bwd, × {N} micro-batches",
                       self.microbatch_extras_s),
                      ("optimizer + grad finalize + zero grad", self.step_extras_s)]

    def to_json(self) -> dict:
        return asdict(self)


def _assemble(schedule: str, L: int, N: int, nf: int, nb: int, nc: int, f: float, b: float,
              p: float, extras: StepExtras, tail: float = 0.0) -> WholeStep:
    fa, ba, co, ta = L * nf * f, L * nb * b, L * nc * p, L * tail
    mb = N * extras.per_microbatch()
    st = extras.per_step()
    return WholeStep(schedule, L, N, nf, nb, nc, f, b, p, fa, ba, co, mb, st,
                     fa + ba + co + ta + mb + st, layer_tail_s=tail, tail_s=ta)


def _check_counts(num_layers: int, num_microbatches: int) -> None:
    if num_layers < 1:
        raise ValueError(f"whole step: num_layers must be >= 1, not {num_layers}")
    if num_microbatches < 1:
        raise ValueError(f"whole step: num_microbatches must be >= 1, not {num_microbatches}")


def simulate_step(layer: LayerOps, plan: Plan, table: CostTable, num_layers: int,
                  num_microbatches: int, extras: StepExtras, *, force: bool = False,
                  alone: AloneCost = plan_steps_alone, pair_last: bool = False) -> WholeStep:
    """DHelix's step: F(1); N−1 co-steps; B(N); the extras (module doc). With N = 1 there
    is no co-step: F(1) then B(1), each layer alone. `pair_last` (N ≥ 2): F(1), F(2);
    N−2 co-steps; B(N−1) ∥ B(N)."""
    _check_counts(num_layers, num_microbatches)
    validate(plan, layer)
    model = LaneModel(layer, table, force=force)
    f, b = alone(model, plan)
    rotated = LaneModel(layer, table, force=force, rotation=plan.rotation,
                        order=plan.backward) if plan.rotation else model
    p = co_step_layers(rotated, plan, num_layers) / num_layers
    N = num_microbatches
    if pair_last and getattr(alone, "halves", False):
        raise ValueError("pair_last and the halves both change B(N): price one of them")
    if pair_last and N > 1:
        from dhelix.planner.tiles import tiles_makespan
        tail = tiles_makespan(layer, table, "bwd", force=force, share=1.0)
        return _assemble("dhelix", num_layers, N, 2, 0, N - 2, f, b, p, extras, tail)
    w = _assemble("dhelix", num_layers, N, 1, 1, N - 1, f, b, p, extras)
    w.halves = bool(getattr(alone, "halves", False))    # `halves_alone` says so
    return w


def simulate_megatron_step(layer: LayerOps, table: CostTable, num_layers: int,
                           num_microbatches: int, extras: StepExtras, *,
                           force: bool = False) -> WholeStep:
    """Megatron's order: each micro-batch's forward, then its backward, every layer alone
    (the trivial plan: one forward step, one backward step), and the same extras."""
    _check_counts(num_layers, num_microbatches)
    model = LaneModel(layer, table, force=force)
    f, b = plan_steps_alone(model, trivial_plan(layer))
    N = num_microbatches
    return _assemble("megatron", num_layers, N, N, N, 0, f, b, 0.0, extras)


@dataclass
class ThreadFloor:
    """What the one thread that runs a step cannot avoid, whatever the plan: every compute
    op for its time inside a layer step and every comm op for its host time (issuing it
    and finishing it: on the paced link the shared-memory copies and sums), with nothing
    waited for; plus the extras. A plan's layer pair above `pair_s` waits for the link or
    for a comm its next op reads; none goes below it (a compute op is only ever stretched
    beside a comm). On a GPU the host times are launches and the floor is the compute."""
    layer_forward_s: float         # one layer's forward: compute + host work of its comms
    layer_backward_s: float        # ... its backward
    step_s: float                  # L × N × (forward + backward) + every extra

    @property
    def pair_s(self) -> float:
        return self.layer_forward_s + self.layer_backward_s


def thread_floor(layer: LayerOps, table: CostTable, num_layers: int, num_microbatches: int,
                 extras: StepExtras, *, force: bool = False) -> ThreadFloor:
    """The `ThreadFloor` of a step of `num_microbatches` micro-batches of `num_layers`
    layers, from the durations and host times the lane model plays."""
    _check_counts(num_layers, num_microbatches)
    model = LaneModel(layer, table, force=force)
    compute = LANE_ID["compute"]

    # a compute op holds the thread for its time, a comm op for its host work
    def thread(lanes, T, H):
        return sum(t if lane == compute else h for lane, t, h in zip(lanes, T, H))
    f = thread(model.f_lane, model.f_T, model.f_H)
    b = thread(model.b_lane, model.b_T, model.b_H)
    N = num_microbatches
    return ThreadFloor(f, b, num_layers * N * (f + b) + N * extras.per_microbatch() +
                       extras.per_step())


def extras_of(table: CostTable, source: str = "<table>") -> StepExtras:
    """The table's step extras, or a TableError naming the file and the fix."""
    if table.step_extras is None:
        raise TableError(
            f"{source}: the table has no step_extras (the embedding, loss, optimizer and "
            f"grad-finalize times a whole-step prediction adds to the layers); it was "
            f"made before `dhelix profile` measured them, or by the analytical model: "
            f"re-run `dhelix profile` with the same shape flags to write a table with them")
    return table.step_extras


def predict(layer: LayerOps, plan: Plan, table: CostTable, num_microbatches: int,
            num_layers: Optional[int] = None, source: str = "<table>",
            force: bool = False, halves: bool = False,
            pair_last: bool = False) -> Tuple[WholeStep, WholeStep]:
    """(DHelix's step with `plan`, megatron's step) from one table with extras; the layer
    count defaults to the one the extras were measured with. `halves`: B(N) as two batch
    halves round-robin (`--dhelix-halves`, priced by `planner.tiles`); `pair_last`: the
    paired tail of `--dhelix-pair-last`."""
    extras = extras_of(table, source)
    L = num_layers or extras.num_layers
    alone = halves_alone(layer, table, force=force) if halves else plan_steps_alone
    return (simulate_step(layer, plan, table, L, num_microbatches, extras, force=force,
                          alone=alone, pair_last=pair_last),
            simulate_megatron_step(layer, table, L, num_microbatches, extras, force=force))


__all__ = ["AloneCost", "ThreadFloor", "WholeStep", "co_step_layers", "extras_of",
           "halves_alone",
           "plan_makespan",
           "plan_steps_alone",
           "predict", "simulate_megatron_step", "simulate_step", "thread_floor"]
