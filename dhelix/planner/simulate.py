"""Event simulator of DESIGN §1.5: plays a plan on the three lanes, predicts makespan and
peak memory.

A step is replayed the way the executor (`strand.executor.execute_step`) runs it:

* One thread issues both strands' ops. It starts with the strand whose first comm op
  comes earliest, runs that strand's ops in order until it has launched a comm op, then
  switches to the other strand (a strand with nothing left yields its turn).
* A compute op runs on the thread: it starts when the thread is free and the comm ops
  whose result it reads (`readers`) have ended, and the thread is busy until it ends.
  So the two strands' compute never overlaps, and a strand that waits for its own comm
  stalls the thread, as in the executor.
* A comm op is issued when the thread reaches it (and its own input is ready) and holds
  the thread for its host time (the table's `host_f`/`host_b`: issuing it and finishing
  it, on the paced link also its shared-memory copies; 0 where not measured, as on
  CUDA), charged at issue; it runs on its lane (`intra` or `inter`) first-in first-out:
  it starts when the lane is free and when it is issued. Ops of one strand therefore overlap too: a wgrad beside
  the reduce-scatter issued just before it, a dgrad beside the re-gather for the wgrad.
* Interference: a compute op running while the other strand's comm op is on its lane
  progresses at rate 1/s; the comm keeps its alone time. s comes from the pair table so
  that the two launched together end after the measured P (`compute_slowdown`). On a
  link that moves bytes without the cores (a NIC, NVLink, the paced link) s is 1.
* The steps of a plan run back to back (the executor's `run_layer_step`): a step ends
  when its ops are issued and its compute is done, and the next starts on the thread at
  once, with the comm ops still in flight (`Carry`); a comm op's result is waited for by
  its reader only, in whichever step that comes. The layer pair ends when the thread is
  done and every comm op has ended (its one barrier). `step` without a carry is one step
  from a barrier to a barrier: the DP planner's step cost (so a plan's sum of step costs
  bounds its makespan from above).
* Memory: the run starts with ``base_bytes`` (default: the ``saved_bytes`` of all backward
  ops, i.e. β's activations are alive). A forward op allocates its ``saved_bytes`` and
  ``temp_bytes`` when it starts (a comm op: when issued) and frees ``temp_bytes`` when it
  ends; a backward op allocates ``temp_bytes`` when it starts and frees ``temp_bytes +
  saved_bytes`` when it ends. Events are applied in time order (frees before
  allocations at equal times); the peak is taken after every allocation.

Which op reads a comm op's result (`comm_readers`): the op its `reader` names (a chunked
MLP's gathers and reduce-scatters), else the next op of its chain that is not a wgrad op; for a comm op that is itself a wgrad op (the re-gather of a wgrad's input),
the wgrad op that names it in `after`. A ring exchange of context parallel (group "cp")
is issued one attention step ahead: it runs under the `attn_i`/`attn_b_i` that follows
it and is read by the op after that step (the next exchange, which forwards the block, or
the last step); the final `kv_b_C` is read by `attn_in_b` at once.

`LaneModel.step` is the single-step function; the DP planner (and the C++ core, which
mirrors it operation by operation so both give bit-identical times) uses it as the cost
of a step. `LaneModel.run` plays a whole plan's steps with the carry.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from dhelix.planner.costs import CostTable, TableError, concurrent
from dhelix.planner.opspec import LANES, LayerOps
from dhelix.planner.plan import Plan, ordered_backward, rotated_backward, validate

ALPHA, BETA = "alpha", "beta"
LANE_ID = {name: k for k, name in enumerate(LANES)}

Event = Tuple[str, str, str, float, float]       # (strand, op, lane, start, end)


@dataclass
class Carry:
    """What one step of a layer pair hands the next (the reader-waits rule, module doc):
    the thread's time, each lane's free time, every comm op issued so far (its reader may
    come later), and the latest end of any op."""
    t: float = 0.0
    lane_free: List[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    comms: list = field(default_factory=list)
    end: float = 0.0


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
                 force: bool = False, source: str = "<table>",
                 readers: Optional[List[int]] = None,
                 lifetimes: Optional[List[Tuple[float, int]]] = None,
                 overlap_slowdown: float = 1.0, rotation: int = 0,
                 order: Optional[List[str]] = None):
        """`readers` and `lifetimes` describe a program that is not a layer's chains (a
        scheduled graph, `helix/`): which op reads each comm op's result, and for each op
        the bytes of its output and the op after whose end they are freed (-1: never).
        A layer's chains derive the first from their order and count memory by each op's
        saved and temporary bytes instead. `overlap_slowdown` stretches such a program's
        compute op that starts while one of its own collectives is in flight (a layer's
        chains take theirs from the table's pairs, one strand against the other).
        `order`: β's node order (`plan.Plan.backward`; None: the layer's chain);
        `rotation` r: that order rotated by r (`plan.Plan.rotation`); indices into the
        backward then count in that order."""
        table.check(layer, source=source, pairs="concurrent", force=force)
        self.layer = layer
        self.rotation = rotation
        bwd = rotated_backward(ordered_backward(layer, order), rotation)
        for o in list(layer.forward) + bwd:
            if o.lane not in LANE_ID:
                raise ValueError(f"op '{o.name}': lane '{o.lane}' is not one of {LANES}")
        self.f_names = [o.name for o in layer.forward]
        self.b_names = [o.name for o in bwd]
        self.f_lane = [LANE_ID[o.lane] for o in layer.forward]
        self.b_lane = [LANE_ID[o.lane] for o in bwd]
        # an op's duration: measured inside a layer step where the table has it
        self.f_T = [float(table.in_step_f.get(o.name, table.alone_f[o.name]))
                    for o in layer.forward]
        self.b_T = [float(table.in_step_b.get(o.name, table.alone_b[o.name])) for o in bwd]
        # a comm op's host time on the thread (module doc); 0 for compute ops
        self.f_H = [float(table.host_f.get(o.name, 0.0)) if o.lane != "compute" else 0.0
                    for o in layer.forward]
        self.b_H = [float(table.host_b.get(o.name, 0.0)) if o.lane != "compute" else 0.0
                    for o in bwd]
        self.f_saved = [float(o.saved_bytes) for o in layer.forward]
        self.b_saved = [float(o.saved_bytes) for o in bwd]
        self.f_temp = [float(o.temp_bytes) for o in layer.forward]
        self.b_temp = [float(o.temp_bytes) for o in bwd]
        self.S = [[compute_slowdown(f, b, table) for b in bwd]
                   for f in layer.forward]
        self.f_reader = list(readers) if readers is not None else comm_readers(layer.forward)
        self.b_reader = comm_readers(bwd)
        self.f_life = lifetimes
        self.self_S = float(overlap_slowdown)
        if base_bytes is None:
            base_bytes = 0.0
            for v in self.b_saved:
                base_bytes = base_bytes + v
        self.base = float(base_bytes)

    def run(self, steps: Sequence[Tuple[Sequence[int], Sequence[int]]], mem0: float = 0.0,
            events: Optional[list] = None, memory: Optional[list] = None,
            starts: Optional[list] = None) -> Tuple[float, float, float]:
        """A plan's steps (forward and backward index lists) back to back, with the carry:
        (makespan, peak bytes, bytes at the end); `starts` collects when each step began
        on the thread."""
        carry = Carry()
        peak = mem = mem0
        for fidx, bidx in steps:
            if starts is not None:
                starts.append(carry.t)
            _, p, mem = self.step(fidx, bidx, mem0=mem, events=events, memory=memory,
                                  carry=carry)
            if p > peak:
                peak = p
        return carry.end, peak, mem

    def step(self, fidx: Sequence[int], bidx: Sequence[int], mem0: float = 0.0,
             t0: float = 0.0, events: Optional[list] = None,
             memory: Optional[list] = None,
             carry: Optional[Carry] = None) -> Tuple[float, float, float]:
        """Simulate one step; return (duration, peak bytes, bytes at the end). `events`
        collects each op's (strand, name, lane, start, end); `memory` the bytes live after
        each allocation or free, as (time, bytes). With `carry` the step starts where the
        one before left the thread, lanes and comm ops in flight, and updates it (times
        are then absolute, and the duration runs from the step's start to its last op's
        end).

        Without a carry the arithmetic here is mirrored exactly by csrc/planner.cpp
        (Problem::simulate)."""
        lanes = (self.f_lane, self.b_lane)
        T = (self.f_T, self.b_T)
        H = (self.f_H, self.b_H)
        reader = (self.f_reader, self.b_reader)
        S = self.S
        qs = [(0, list(fidx)), (1, list(bidx))]
        qs = [q for q in qs if q[1]]

        def first_comm(q):
            ln = lanes[q[0]]
            for i, k in enumerate(q[1]):
                if ln[k] != 0:
                    return i
            return len(q[1])
        if len(qs) == 2 and first_comm(qs[1]) < first_comm(qs[0]):
            qs = [qs[1], qs[0]]
        pos = [0] * len(qs)
        cur = 0
        if carry is None:
            t = 0.0
            lane_free = [0.0, 0.0, 0.0]
            comms = []      # (strand, k, start, end) in issue order
        else:
            t, lane_free, comms = carry.t, carry.lane_free, carry.comms
        start = t
        mevs = []           # (time, 0 free / 1 alloc, seq, bytes)
        span = start
        ends = {}           # program ops: when each ended (for the lifetimes)
        while True:
            if pos[0] >= len(qs[0][1]) and (len(qs) < 2 or pos[1] >= len(qs[1][1])):
                break
            if pos[cur] >= len(qs[cur][1]):
                cur = 1 - cur
                continue
            x, lst = qs[cur]
            k = lst[pos[cur]]
            pos[cur] += 1
            ready = t
            for (cx, ck, cs, ce) in comms:
                if cx == x and reader[x][ck] == k and ce > ready:
                    ready = ce
            if x == 0 and self.f_life is not None:
                alloc, free = self.f_life[k][0], 0.0   # freed after its last reader
            elif x == 0:
                alloc, free = self.f_temp[k] + self.f_saved[k], self.f_temp[k]
            else:
                alloc, free = self.b_temp[k], self.b_temp[k] + self.b_saved[k]
            if lanes[x][k] == 0:
                st = ready
                w = T[x][k]
                end = st + w
                for (cx, ck, cs, ce) in comms:
                    if cs <= st and st < ce and (cx != x or self.self_S != 1.0):
                        s = self.self_S if cx == x else (S[k][ck] if x == 0 else S[ck][k])
                        if s > 1.0:
                            if st + w * s <= ce:
                                end = st + w * s
                            else:
                                end = ce + (w - (ce - st) / s)
                        break
                t = end
            else:
                ln = lanes[x][k]
                st = ready if ready > lane_free[ln] else lane_free[ln]
                end = st + T[x][k]
                lane_free[ln] = end
                comms.append((x, k, st, end))
                t = ready + H[x][k]
                if len(qs) == 2:
                    cur = 1 - cur
            mevs.append((ready, 1, len(mevs), alloc))
            mevs.append((end, 0, len(mevs), free))
            if end > span:
                span = end
            if self.f_life is not None and x == 0:
                ends[k] = end
            if events is not None:
                events.append((ALPHA if x == 0 else BETA,
                               (self.f_names if x == 0 else self.b_names)[k],
                               LANES[lanes[x][k]], t0 + st, t0 + end))
        if t > span:
            span = t
        if self.f_life is not None:          # each output freed after its last reader
            for k, (nbytes, last) in enumerate(self.f_life):
                if k in ends and last >= 0:
                    mevs.append((max(ends.get(last, span), ends[k]), 0, len(mevs), nbytes))
        mem = mem0
        peak = mem0
        for (tm, kind, seq, nbytes) in sorted(mevs):
            if kind == 1:
                mem = mem + nbytes
                if mem > peak:
                    peak = mem
            else:
                mem = mem - nbytes
            if memory is not None:
                memory.append((t0 + tm, mem))
        if carry is not None:
            carry.t = t
            if span > carry.end:
                carry.end = span
            return span - start, peak, mem
        return span, peak, mem


# a pair's measured time up to this share of its shorter op above its longer op is
# noise and launch cost (issuing the comm, on the thread), not a slowed compute
PAIR_NOISE = 0.25


def compute_slowdown(f, b, table: CostTable) -> float:
    """s for a compute op beside a comm op of the other strand (1 for any other pair):
    with the compute (alone tc) at rate 1/s while the comm (alone tm) runs, the two
    launched together end after tm + tc - tm/s; equal to the measured P when
    s = tm / (tc + tm - P). P <= max(tc, tm) means no slow-down (s = 1); P >= tc + tm
    means the compute made no progress beside the comm (s = inf).

    P is first lowered by PAIR_NOISE × min(tc, tm): where the comm is the longer op the
    rate model has no s between 1 (P = tm) and tm / tc (P just above tm), so a P a hair
    above tm — the measurement's noise, the comm's launch on the thread — would stretch
    a short compute op to the comm's whole length (a 0.2 ms norm beside a 1.7 ms
    all-gather to 1.7 ms, seen on the paced link's tables, where comm costs the cores
    nothing); a link whose comm does slow the compute (a tbf loopback) measures P far
    above that margin."""
    if not concurrent(f, b) or (f.lane == "compute") == (b.lane == "compute"):
        return 1.0
    tf, tb, p = table.alone_f[f.name], table.alone_b[b.name], table.pair[(f.name, b.name)]
    tc, tm = (tf, tb) if f.lane == "compute" else (tb, tf)
    if tc <= 0.0 or tm <= 0.0:
        return 1.0
    p = p - PAIR_NOISE * (tc if tc < tm else tm)
    if p <= (tc if tc > tm else tm):
        return 1.0
    rest = tc + tm - p
    return tm / rest if rest > 0.0 else float("inf")


def comm_readers(chain) -> List[int]:
    """For every op of a chain: the index of the op that reads its result if it is a comm
    op (-1 if none does or it is a compute op). See the module doc."""
    out = [-1] * len(chain)
    for c, o in enumerate(chain):
        if o.lane == "compute":
            continue
        if o.reader is not None:
            # (-1: the reader is the next node's, beyond a rotated chain's end)
            out[c] = next((k for k in range(c + 1, len(chain)) if chain[k].name == o.reader),
                          -1)
        elif o.wgrad:
            out[c] = next((k for k in range(c + 1, len(chain)) if chain[k].after == o.name),
                          -1)
        else:
            start = c + 1
            if o.group == "cp" and start < len(chain) and chain[start].name.startswith(
                    ("attn_", "attn_b_")) and chain[start].name != "attn_in_b":
                start += 1        # a ring exchange runs under the attention step after it
            out[c] = next((k for k in range(start, len(chain)) if not chain[k].wgrad), -1)
    return out


def simulate(layer: LayerOps, plan: Plan, table: Optional[CostTable] = None, *,
             cluster: Optional[dict] = None, group_sizes: Optional[Dict[str, int]] = None,
             dtype: str = "bf16", base_bytes: Optional[float] = None,
             force: bool = False) -> SimResult:
    """Play ``plan`` for ``layer``; costs from ``table``, or from the analytical model of
    ``cluster`` (with ``group_sizes``) when no table is given. A rotated plan plays one
    layer step of the co-step's steady state (β's rotated chain)."""
    validate(plan, layer)
    if table is None:
        if cluster is None:
            raise TableError("simulate: give a cost table or a cluster description")
        from dhelix.planner.costmodel import analytical_table
        table = analytical_table(layer, cluster, group_sizes or {}, dtype=dtype)
    model = LaneModel(layer, table, base_bytes=base_bytes, force=force,
                      rotation=plan.rotation, order=plan.backward)
    events: List[Event] = []
    starts: List[float] = []
    span, peak, _ = model.run(plan_indices(model, plan), mem0=model.base, events=events,
                              starts=starts)
    # a step's time: from its start on the thread to the next step's (the last: to the end)
    step_times = [b - a for a, b in zip(starts, starts[1:] + [span])]
    return SimResult(span, peak, events, step_times)


def plan_indices(model: LaneModel, plan: Plan) -> List[Tuple[List[int], List[int]]]:
    """The plan's steps as index lists into the model's forward and backward chains."""
    fpos = {n: k for k, n in enumerate(model.f_names)}
    bpos = {n: k for k, n in enumerate(model.b_names)}
    return [([fpos[n] for n in st.fwd], [bpos[n] for n in st.bwd]) for st in plan.steps]


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
