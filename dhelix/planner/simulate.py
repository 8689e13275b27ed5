"""Event simulator of DESIGN §1.5: plays a plan on the three lanes, predicts makespan and
peak memory.

Model of one step (α = the forward segment, β = the backward segment):

* Each strand is a chain: an op starts only after the previous op of its strand ended
  (a comm op waits for the compute before it, compute after a comm waits for the comm).
  So at most two ops run at any time, one per strand.
* Lanes: ``compute`` is ONE lane shared by both strands; ``intra`` and ``inter`` are one
  lane each.  An op runs only while no op of the other strand holds its lane.  Lanes are
  non-preemptive.  When both strands want the same free lane, the op that became ready
  first starts first; on a tie (same ready time, e.g. at the step's start) α goes first.
  (The executor approximates this by issuing, at each point, α's next op before β's.)
* Interference: two ops on different lanes that run at the same time both progress at
  rate 1/s, s = stretch(f, b) = max(1, 1 + (P - max(T_f, T_b)) / min(T_f, T_b))
  = max(1, 2 - OEF(f, b)) from the pair table; an op running alone progresses at rate 1.
  This reproduces the measurement it comes from: two ops launched together end exactly
  after P (for P >= max(T_f, T_b); a P below that is treated as perfect overlap).
  OEF = 1 -> no slow-down; OEF = 0 -> each runs at half speed while they overlap.
* A step ends at a barrier when all its ops are done; the plan's makespan is the sum of
  its steps' times.
* Memory: the run starts with ``base_bytes`` (default: the ``saved_bytes`` of all backward
  ops, i.e. β's activations are alive).  A forward op allocates its ``saved_bytes`` and
  ``temp_bytes`` when it starts and frees ``temp_bytes`` when it ends; a backward op
  allocates ``temp_bytes`` when it starts and frees ``temp_bytes + saved_bytes`` when it
  ends.  The peak is taken after every start.

`LaneModel.step` is the single-step function; the DP planner (and the C++ core, which
mirrors it operation by operation so both give bit-identical times) uses it as the cost
of a step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from dhelix.planner.costs import CostTable, TableError, concurrent
from dhelix.planner.opspec import LANES, LayerOps
from dhelix.planner.plan import Plan, validate

ALPHA, BETA = "alpha", "beta"
LANE_ID = {name: k for k, name in enumerate(LANES)}

Event = Tuple[str, str, str, float, float]       # (strand, op, lane, start, end)


@dataclass
class SimResult:
    makespan: float
    peak_bytes: float
    events: List[Event] = field(default_factory=list)
    step_times: List[float] = field(default_factory=list)

    def lane_busy(self) -> Dict[str, float]:
        """Total time each lane was occupied."""
        out = {lane: 0.0 for lane in LANES}
        for _, _, lane, s, e in self.events:
            out[lane] += e - s
        return out


class LaneModel:
    """Plain arrays of a layer's ops plus the table's stretch factors; `step` simulates one
    step given index lists into the forward and backward chains."""

    def __init__(self, layer: LayerOps, table: CostTable, base_bytes: Optional[float] = None,
                 force: bool = False, source: str = "<table>"):
        table.check(layer, source=source, pairs="concurrent", force=force)
        self.layer = layer
        for o in list(layer.forward) + list(layer.backward):
            if o.lane not in LANE_ID:
                raise ValueError(f"op '{o.name}': lane '{o.lane}' is not one of {LANES}")
        self.f_names = [o.name for o in layer.forward]
        self.b_names = [o.name for o in layer.backward]
        self.f_lane = [LANE_ID[o.lane] for o in layer.forward]
        self.b_lane = [LANE_ID[o.lane] for o in layer.backward]
        self.f_T = [float(table.alone_f[o.name]) for o in layer.forward]
        self.b_T = [float(table.alone_b[o.name]) for o in layer.backward]
        self.f_saved = [float(o.saved_bytes) for o in layer.forward]
        self.b_saved = [float(o.saved_bytes) for o in layer.backward]
        self.f_temp = [float(o.temp_bytes) for o in layer.forward]
        self.b_temp = [float(o.temp_bytes) for o in layer.backward]
        self.S = [[table.stretch(f.name, b.name) if concurrent(f, b) else 1.0
                   for b in layer.backward] for f in layer.forward]
        if base_bytes is None:
            base_bytes = 0.0
            for v in self.b_saved:
                base_bytes = base_bytes + v
        self.base = float(base_bytes)

    def step(self, fidx: Sequence[int], bidx: Sequence[int], mem0: float = 0.0,
             t0: float = 0.0, events: Optional[list] = None) -> Tuple[float, float, float]:
        """Simulate one step; return (duration, peak bytes, bytes at the end).

        The arithmetic here is mirrored exactly by csrc/planner.cpp (Problem::step)."""
        f_lane, b_lane, f_T, b_T, S = self.f_lane, self.b_lane, self.f_T, self.b_T, self.S
        na, nb = len(fidx), len(bidx)
        ia = ib = 0
        run_a = run_b = False
        rem_a = rem_b = 0.0
        ready_a = ready_b = 0.0
        st_a = st_b = 0.0
        t = 0.0
        mem = mem0
        peak = mem0
        while True:
            can_a = (not run_a) and ia < na
            can_b = (not run_b) and ib < nb
            if can_a or can_b:
                b_first = can_a and can_b and ready_b < ready_a
                for which in ((1, 0) if b_first else (0, 1)):
                    if which == 0:
                        if not can_a:
                            continue
                        k = fidx[ia]
                        if run_b and b_lane[bidx[ib]] == f_lane[k]:
                            continue
                        run_a = True
                        rem_a = f_T[k]
                        st_a = t
                        mem = mem + self.f_temp[k]
                        mem = mem + self.f_saved[k]
                        if mem > peak:
                            peak = mem
                    else:
                        if not can_b:
                            continue
                        k = bidx[ib]
                        if run_a and f_lane[fidx[ia]] == b_lane[k]:
                            continue
                        run_b = True
                        rem_b = b_T[k]
                        st_b = t
                        mem = mem + self.b_temp[k]
                        if mem > peak:
                            peak = mem
            if not run_a and not run_b:
                break
            if run_a and run_b:
                s = S[fidx[ia]][bidx[ib]]
                da = rem_a * s
                db = rem_b * s
                if da < db:
                    dt, fin_a, fin_b = da, True, False
                elif db < da:
                    dt, fin_a, fin_b = db, False, True
                else:
                    dt, fin_a, fin_b = da, True, True
            elif run_a:
                s = 1.0
                dt, fin_a, fin_b = rem_a, True, False
            else:
                s = 1.0
                dt, fin_a, fin_b = rem_b, False, True
            t_end = t + dt
            if run_a:
                if fin_a:
                    k = fidx[ia]
                    if events is not None:
                        events.append((ALPHA, self.f_names[k], LANES[f_lane[k]],
                                       t0 + st_a, t0 + t_end))
                    mem = mem - self.f_temp[k]
                    ready_a = t_end
                    ia += 1
                    run_a = False
                else:
                    rem_a = rem_a - dt / s
            if run_b:
                if fin_b:
                    k = bidx[ib]
                    if events is not None:
                        events.append((BETA, self.b_names[k], LANES[b_lane[k]],
                                       t0 + st_b, t0 + t_end))
                    mem = mem - self.b_temp[k]
                    mem = mem - self.b_saved[k]
                    ready_b = t_end
                    ib += 1
                    run_b = False
                else:
                    rem_b = rem_b - dt / s
            t = t_end
        return t, peak, mem


def simulate(layer: LayerOps, plan: Plan, table: Optional[CostTable] = None, *,
             cluster: Optional[dict] = None, group_sizes: Optional[Dict[str, int]] = None,
             dtype: str = "bf16", base_bytes: Optional[float] = None,
             force: bool = False) -> SimResult:
    """Play ``plan`` for ``layer``; costs from ``table``, or from the analytical model of
    ``cluster`` (with ``group_sizes``) when no table is given."""
    validate(plan, layer)
    if table is None:
        if cluster is None:
            raise TableError("simulate: give a cost table or a cluster description")
        from dhelix.planner.costmodel import analytical_table
        table = analytical_table(layer, cluster, group_sizes or {}, dtype=dtype)
    model = LaneModel(layer, table, base_bytes=base_bytes, force=force)
    fpos = {n: k for k, n in enumerate(model.f_names)}
    bpos = {n: k for k, n in enumerate(model.b_names)}
    events: List[Event] = []
    step_times: List[float] = []
    t = 0.0
    mem = model.base
    peak = mem
    for st in plan.steps:
        dur, p, mem = model.step([fpos[n] for n in st.fwd], [bpos[n] for n in st.bwd],
                                 mem0=mem, t0=t, events=events)
        step_times.append(dur)
        if p > peak:
            peak = p
        t = t + dur
    return SimResult(t, peak, events, step_times)


# ---- output ------------------------------------------------------------------------------

_COLORS = {ALPHA: "#4c72b0", BETA: "#dd8452"}


def plot_timeline(result: SimResult, path_png: str, title: Optional[str] = None) -> None:
    """Gantt chart: one row per lane, boxes colored by strand, dashed lines at barriers."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = list(LANES)
    fig, ax = plt.subplots(figsize=(14, 3.2))
    span = result.makespan if result.makespan > 0 else 1.0
    for strand, op, lane, s, e in result.events:
        y = rows.index(lane)
        ax.barh(y, e - s, left=s, height=0.6, color=_COLORS.get(strand, "gray"),
                edgecolor="black", linewidth=0.4)
        if (e - s) > 0.04 * span:
            ax.text(s + (e - s) / 2, y, op, ha="center", va="center", fontsize=6, color="white")
    t = 0.0
    for d in result.step_times[:-1]:
        t += d
        ax.axvline(t, color="gray", linestyle="--", linewidth=0.5)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows)
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel("time (s)")
    ax.set_title(title or f"makespan {result.makespan * 1e3:.3f} ms, "
                          f"peak {result.peak_bytes / 2**20:.1f} MiB")
    ax.legend(handles=[Patch(color=_COLORS[ALPHA], label="α (forward)"),
                       Patch(color=_COLORS[BETA], label="β (backward)")],
              loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)


def to_chrome_trace(result: SimResult) -> dict:
    """Chrome trace (chrome://tracing, Perfetto): one thread per lane, times in µs."""
    evs = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": k, "args": {"name": lane}}
           for k, lane in enumerate(LANES)]
    for strand, op, lane, s, e in result.events:
        evs.append({"name": op, "ph": "X", "ts": s * 1e6, "dur": (e - s) * 1e6, "pid": 0,
                    "tid": LANE_ID[lane], "cat": strand, "args": {"strand": strand}})
    return {"traceEvents": evs, "displayTimeUnit": "ms"}
