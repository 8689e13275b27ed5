"""Executor traces: the Tracer that times every op, Chrome-trace JSON (one track per
lane) and a PNG timeline.

The Tracer reads a clock. On CPU it is the host clock: an op's work runs in the calling
thread (compute) or gloo's (comm), so host time is its time. On CUDA the host only
launches kernels, so ops are timed by CUDA events recorded on the stream each op runs
on; they become seconds when the events are read, after one synchronize.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, List, Optional, Sequence, Tuple

import torch


@dataclass
class TraceEvent:
    strand: str
    op: str
    lane: str
    start: float
    end: float
    step: int
    label: str = ""


@dataclass
class Mark:
    """What a clock notes when an op is issued."""
    t: Any                    # the clock's reading
    waited: float             # the strand's host seconds spent waiting for comm results
    open: Tuple = ()          # the strand's comms not yet read (their Pendings)


class HostClock:
    """perf_counter seconds. A compute op's work starts once the comm results it read
    had arrived (the host blocked for them); a comm ends when a reader first had it."""

    def reset(self):
        self.t0 = time.perf_counter()

    def mark(self, S) -> Mark:
        return Mark(time.perf_counter(), S.waited)

    def now(self):
        return time.perf_counter()

    def work_start(self, mark: Mark, S):
        return mark.t + (S.waited - mark.waited)

    def comm_end(self, p):
        return p.t_done if p is not None and p.t_done else time.perf_counter()

    def seconds(self, points: Sequence) -> List[float]:
        return [p - self.t0 for p in points]


class CudaClock:
    """CUDA events (enable_timing) recorded on the current stream, where compute ops run;
    a comm ends at its lane's event (`Pending.handle`, recorded on the lane stream after
    the collective), which must be created with enable_timing=True."""

    def reset(self):
        self.t0 = self.now()

    def mark(self, S) -> Mark:
        return Mark(self.now(), S.waited, tuple(p for p in S.pending if not p.done))

    def now(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def work_start(self, mark: Mark, S):
        # the stream runs the op's kernels once it reached them and every comm the op
        # read was done: the latest of these events
        return (mark.t,) + tuple(p.handle for p in mark.open if p.done)

    def comm_end(self, p):
        return p.handle if p is not None else self.now()

    def seconds(self, points: Sequence) -> List[float]:
        """A point is an event, or a tuple of events: the latest of them."""
        torch.cuda.synchronize()     # elapsed_time needs every event to have happened
        t0 = self.t0

        def sec(ev):
            try:
                return t0.elapsed_time(ev) / 1e3
            except RuntimeError as e:
                raise RuntimeError("tracing on CUDA reads the lanes' comm events: CudaLanes "
                                   "must create them with enable_timing=True") from e
        return [max(sec(e) for e in p) if isinstance(p, tuple) else sec(p) for p in points]


def clock_for(lanes) -> "HostClock | CudaClock":
    """The clock that times ops on `lanes`; CUDA lanes then time-stamp their comm events
    (the clock reads them), which they do not otherwise."""
    from dhelix.strand.lanes import CudaLanes
    if isinstance(lanes, CudaLanes):
        lanes.timing = True
        return CudaClock()
    return HostClock()


@dataclass
class Tracer:
    """Collects one event per op: issue time to completion time on its lane. `clock`
    None: CUDA events if the first op traced runs on CUDA lanes, else the host clock."""
    clock: Optional[Any] = None
    step: int = 0
    # events whose start and end are still the clock's readings; the first of them
    # already converted to seconds
    _raw: List[TraceEvent] = field(default_factory=list, init=False, repr=False)
    _done: List[TraceEvent] = field(default_factory=list, init=False, repr=False)
    _auto: bool = field(default=True, init=False, repr=False)

    def __post_init__(self):
        self._auto = self.clock is None
        self.clock = self.clock or HostClock()
        self.clock.reset()

    def reset(self):
        self._raw.clear()
        self._done.clear()
        self.step = 0
        self.clock.reset()

    @property
    def events(self) -> List[TraceEvent]:
        """The events in seconds from the last reset (reading them waits for the device)."""
        new = self._raw[len(self._done):]
        if new:
            starts = self.clock.seconds([e.start for e in new])
            ends = self.clock.seconds([e.end for e in new])
            self._done += [replace(e, start=a, end=b) for e, a, b in zip(new, starts, ends)]
        return list(self._done)

    # -- called by the executor around each op ------------------------------------------
    def begin(self, S) -> Mark:
        if self._auto and not self._raw:      # the lanes say which clock times the ops
            clock = clock_for(S.lanes)
            if type(clock) is not type(self.clock):
                self.clock = clock
                clock.reset()
        return self.clock.mark(S)

    def compute(self, S, op, mark: Mark) -> None:
        self._raw.append(TraceEvent(S.strand, op.name, "compute",
                                    self.clock.work_start(mark, S), self.clock.now(),
                                    self.step, S.label))

    def comm(self, S, op, mark: Mark, p, step: Optional[int] = None) -> None:
        """After the barrier resolved `p`, the comm's Pending; `step`: the executor step
        that issued it (the barrier may come steps later)."""
        self._raw.append(TraceEvent(S.strand, op.name, op.spec.lane, mark.t,
                                    self.clock.comm_end(p),
                                    self.step if step is None else step, S.label))


LANE_TID = {"compute": 0, "intra": 1, "inter": 2}
# the paced link's modelled transfers of this rank (what the wire does, whoever issued
# them: DHelix's lanes or megatron's own collectives); their own track, never an op's lane
LINK = "link"
LINK_TID = 4


def chrome_trace(events: Sequence, rank: int = 0) -> dict:
    """{"traceEvents": [...]}: every op as a complete event on its lane's track,
    labelled with its strand (α/β) and micro-batch (F3 = forward of micro-batch 3)."""
    out: List[dict] = []
    for lane, tid in list(LANE_TID.items()) + [(LINK + " (modelled)", LINK_TID)]:
        out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                    "args": {"name": lane}})
    out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                "args": {"name": f"rank {rank}"}})
    for e in events:
        tid = LINK_TID if e.lane == LINK else LANE_TID.get(e.lane, 3)
        out.append({"name": e.op, "ph": "X", "pid": rank, "tid": tid,
                    "ts": e.start * 1e6, "dur": max(e.end - e.start, 0) * 1e6,
                    "cat": e.strand,
                    "args": {"strand": e.strand, "microbatch": e.label, "lane": e.lane,
                             "step": e.step}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


STRAND_COLORS = {"α": "tab:blue", "β": "tab:orange", LINK: "tab:green"}
PHASE_COLORS = {"F": "#d9d9d9", "F∥B": "#b7e4b0", "B": "#f2d7b6", "B∥B": "#e8c1e0"}
PHASE_NAMES = {"F": "F alone (first forward)", "F∥B": "F ∥ B (paired)",
               "B": "B alone (last backward)", "B∥B": "B ∥ B (the paired last two)"}


def _mb(label: str) -> str:
    """'F3' -> 'F(3)'; any other label as it is."""
    if len(label) > 1 and label[0] in "FB" and label[1:].isdigit():
        return f"{label[0]}({label[1:]})"
    return label


def phases(events: Sequence) -> List[Tuple[str, str, float, float]]:
    """(kind, label, start, end) per phase of the step, in time order: kind 'F' (a
    forward alone: F(1)), 'F∥B' (a forward beside a backward: F(k+1) ∥ B(k)) or 'B' (a
    backward alone: B(N)), or 'B∥B' (the paired tail, B(N−1) ∥ B(N)). A micro-batch's executor steps (first to last) that overlap
    the other strand's make one paired phase; seconds from the events."""
    spans = {}          # (strand, label) -> [first step, last step, start, end]
    for e in events:
        if not e.label:
            continue
        sp = spans.setdefault((e.strand, e.label), [e.step, e.step, e.start, e.end])
        sp[0], sp[1] = min(sp[0], e.step), max(sp[1], e.step)
        sp[2], sp[3] = min(sp[2], e.start), max(sp[3], e.end)
    fwd = sorted((v, k[1]) for k, v in spans.items() if k[0] == "α")
    bwd = sorted((v, k[1]) for k, v in spans.items() if k[0] == "β")
    out, used = [], set()
    for (fs, fe, ft0, ft1), fl in fwd:
        with_b = [(v, bl) for v, bl in bwd if v[0] <= fe and fs <= v[1]]
        if not with_b:
            out.append(("F", _mb(fl), ft0, ft1))
            continue
        used.update(bl for _, bl in with_b)
        out.append(("F∥B", f"{_mb(fl)} ∥ {', '.join(_mb(bl) for _, bl in with_b)}",
                    min([ft0] + [v[2] for v, _ in with_b]),
                    max([ft1] + [v[3] for v, _ in with_b])))
    # backwards alone: B(N), or B(N−1) ∥ B(N) (`--dhelix-pair-last`) where two overlap
    for v, bl in [(v, bl) for v, bl in bwd if bl not in used]:
        last = out[-1] if out and out[-1][0] in ("B", "B∥B") else None
        if last is not None and v[2] < last[3]:
            out[-1] = ("B∥B", f"{last[1]} ∥ {_mb(bl)}", last[2], max(last[3], v[3]))
        else:
            out.append(("B", _mb(bl), v[2], v[3]))
    return sorted(out, key=lambda p: p[2])


def link_events(spans: Sequence[Tuple[float, float]], t0: float) -> List[TraceEvent]:
    """The paced link's transfers of this rank ((start, done) on the host clock,
    `PacedLink.spans_between`) as events on the link track, in seconds from `t0`."""
    return [TraceEvent(LINK, "transfer", LINK, s - t0, e - t0, -1) for s, e in spans]


def paced_link_events(tracer: "Tracer", events: Sequence[TraceEvent]) -> List[TraceEvent]:
    """The paced link's transfers over the span of `events` (the tracer's, in seconds),
    if a paced link is installed and the tracer reads the host clock (the link model's
    clock); else none."""
    from dhelix.links.paced import active
    link = active()
    if link is None or not isinstance(tracer.clock, HostClock) or not events:
        return []
    t0 = tracer.clock.t0
    spans = link.spans_between(t0 + min(e.start for e in events),
                               t0 + max(e.end for e in events))
    return link_events(spans, t0)


def time_report(events: Sequence) -> List[dict]:
    """Where the time goes: per phase (`phases`), then the time between phases (the
    embedding, the loss and megatron's code around the layers) and the whole traced
    span, how long it took and which share of it the compute lane (DHelix's layer ops;
    None between the phases, where megatron's untraced code runs) and the link were
    busy (the link: None without link events, i.e. not on the paced link)."""
    from dhelix.links.paced import union_seconds
    layer = [e for e in events if e.lane != LINK]
    if not layer:
        return []
    compute = [(e.start, e.end) for e in layer if e.lane == "compute"]
    link = [(e.start, e.end) for e in events if e.lane == LINK]
    t0, t1 = min(e.start for e in layer), max(e.end for e in layer)

    def row(name, kind, windows):
        span = sum(b - a for a, b in windows)
        busy = lambda spans: (sum(union_seconds(spans, a, b) for a, b in windows) / span
                              if span > 0 else 0.0)
        # between the phases megatron's own code computes (embedding, loss): not traced
        return {"phase": name, "kind": kind, "seconds": span,
                "compute_busy": None if kind == "between" else busy(compute),
                "link_busy": busy(link) if link else None}
    ph = phases(layer)
    rows = [row(label, kind, [(a, b)]) for kind, label, a, b in ph]
    gaps, end = [], t0
    for _, _, a, b in ph:
        if a > end:
            gaps.append((end, a))
        end = max(end, b)
    if gaps:
        rows.append(row("between phases", "between", gaps))
    rows.append(row("whole (traced)", "whole", [(t0, t1)]))
    return rows


def report_markdown(rows: Sequence[dict], rank: int = 0) -> str:
    pct = lambda v: "-" if v is None else f"{v * 100:.0f}%"
    out = [f"Where the time goes, rank {rank} (last iteration; compute: DHelix's layer "
           f"ops, megatron's embedding and loss between the phases are not traced; link: "
           f"the paced link's modelled transfers)", "",
           "| phase | ms | compute busy | link busy |", "|---|---:|---:|---:|"]
    out += [f"| {r['phase']} | {r['seconds'] * 1e3:.1f} | {pct(r['compute_busy'])} | "
            f"{pct(r['link_busy'])} |" for r in rows]
    return "\n".join(out) + "\n"


def timeline_figure(events: Sequence, title: str = ""):
    """The timeline as a matplotlib figure: one row per lane, every op a bar coloured by
    its strand with its name where it fits, the phases (F(1), F(k+1) ∥ B(k), B(N))
    shaded and named above the lanes, and a legend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lanes = [l for l in LANE_TID if any(e.lane == l for e in events)]
    lanes += sorted({e.lane for e in events} - set(lanes))
    lanes = lanes or ["compute"]
    fig, ax = plt.subplots(figsize=(16, 1.9 + 0.7 * len(lanes)))
    bars = []
    for e in events:
        y = lanes.index(e.lane)
        w = (e.end - e.start) * 1e3
        ax.barh(y, w, left=e.start * 1e3, height=0.6,
                color=STRAND_COLORS.get(e.strand, "tab:gray"),
                edgecolor="none" if e.lane == LINK else "black", linewidth=0.3, zorder=2)
        if e.lane != LINK:
            bars.append((e.op, e.start * 1e3, w, y))
    top = len(lanes) - 0.5
    kinds = []
    for i, (kind, label, t0, t1) in enumerate(phases(events)):
        ax.axvspan(t0 * 1e3, t1 * 1e3, color=PHASE_COLORS[kind], alpha=0.6, zorder=0,
                   linewidth=0)
        ax.text((t0 + t1) / 2 * 1e3, top + (0.08 if i % 2 == 0 else 0.38), label,
                ha="center", va="bottom", fontsize=8, zorder=3)
        kinds.append(kind)
    ax.set_ylim(-0.5, top + 0.75)
    if events:
        t_end = max(e.end for e in events) * 1e3
        ax.set_xlim(min(e.start for e in events) * 1e3, t_end if t_end > 0 else 1.0)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"{l} (modelled)" if l == LINK else l for l in lanes])
    ax.set_xlabel("ms")
    ax.set_title(title or "DHelix executor timeline (last iteration)")
    handles = [Patch(color=STRAND_COLORS["α"], label="α: forward ops"),
               Patch(color=STRAND_COLORS["β"], label="β: backward ops")]
    if LINK in lanes:
        handles.append(Patch(color=STRAND_COLORS[LINK], label="link: a transfer in flight"))
    handles += [Patch(color=PHASE_COLORS[k], alpha=0.6, label=PHASE_NAMES[k])
                for k in PHASE_COLORS if k in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8,
              frameon=False)
    fig.tight_layout()
    # op names where they fit: measured once the layout is fixed
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for name, x, w, y in bars:
        (px0, _), (px1, _) = ax.transData.transform([(x, y), (x + w, y)])
        if px1 - px0 < 8:
            continue
        t = ax.text(x + w / 2, y, name, ha="center", va="center", fontsize=6, zorder=3,
                    clip_on=True)
        if t.get_window_extent(renderer).width > (px1 - px0) - 2:
            t.remove()
    return fig


def plot_timeline(events: Sequence, path: str, title: str = "") -> None:
    import matplotlib.pyplot as plt
    fig = timeline_figure(events, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def trace_files(path: str, rank: int = 0) -> Tuple[str, str]:
    """(JSON, PNG) that `--dhelix-trace PATH` writes on `rank`: PATH's stem with
    `.rank{rank}` (every rank, rank 0 too): trace.json -> trace.rank0.json, trace.rank0.png."""
    base, ext = os.path.splitext(path)
    base = f"{base}.rank{rank}"
    return base + (ext or ".json"), base + ".png"


def write_trace(events: Sequence, path: str, rank: int = 0) -> List[str]:
    """Write this rank's Chrome trace JSON and PNG timeline (`trace_files`), and where
    the time went per phase (`time_report`) as a markdown table beside them (.md), also
    kept in the JSON's "otherData"."""
    jpath, ppath = trace_files(path, rank)
    mpath = os.path.splitext(ppath)[0] + ".md"
    os.makedirs(os.path.dirname(os.path.abspath(jpath)), exist_ok=True)
    rows = time_report(events)
    trace = chrome_trace(events, rank)
    trace["otherData"] = {"time_report": rows}
    with open(jpath, "w") as f:
        json.dump(trace, f)
    with open(mpath, "w") as f:
        f.write(report_markdown(rows, rank))
    plot_timeline(events, ppath, f"DHelix executor timeline, rank {rank} (last iteration)")
    return [jpath, ppath, mpath]
