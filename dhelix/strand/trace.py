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
    from dhelix.strand.lanes import CudaLanes
    return CudaClock() if isinstance(lanes, CudaLanes) else HostClock()


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

    def comm(self, S, op, mark: Mark, p) -> None:
        """After the barrier resolved `p`, the comm's Pending."""
        self._raw.append(TraceEvent(S.strand, op.name, op.spec.lane, mark.t,
                                    self.clock.comm_end(p), self.step, S.label))


LANE_TID = {"compute": 0, "intra": 1, "inter": 2}


def chrome_trace(events: Sequence, rank: int = 0) -> dict:
    """{"traceEvents": [...]}: every op as a complete event on its lane's track,
    labelled with its strand (α/β) and micro-batch (F3 = forward of micro-batch 3)."""
    out: List[dict] = []
    for lane, tid in LANE_TID.items():
        out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                    "args": {"name": lane}})
    out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                "args": {"name": f"rank {rank}"}})
    for e in events:
        out.append({"name": e.op, "ph": "X", "pid": rank, "tid": LANE_TID.get(e.lane, 3),
                    "ts": e.start * 1e6, "dur": max(e.end - e.start, 0) * 1e6,
                    "cat": e.strand,
                    "args": {"strand": e.strand, "microbatch": e.label, "lane": e.lane,
                             "step": e.step}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def plot_timeline(events: Sequence, path: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = [l for l in LANE_TID if any(e.lane == l for e in events)] or ["compute"]
    colors = {"α": "tab:blue", "β": "tab:orange"}
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.6 * len(lanes)))
    for e in events:
        y = lanes.index(e.lane) if e.lane in lanes else 0
        ax.barh(y, (e.end - e.start) * 1e3, left=e.start * 1e3, height=0.6,
                color=colors.get(e.strand, "tab:gray"), edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(lanes)
    ax.set_xlabel("ms")
    ax.set_title(title or "DHelix executor timeline (blue: α forward, orange: β backward)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_trace(events: Sequence, path: str, rank: int = 0) -> List[str]:
    """Write PATH (Chrome trace JSON) and PATH with .png (timeline); per rank if > 0."""
    base, ext = os.path.splitext(path)
    if rank:
        base = f"{base}.rank{rank}"
    jpath, ppath = base + (ext or ".json"), base + ".png"
    os.makedirs(os.path.dirname(os.path.abspath(jpath)), exist_ok=True)
    with open(jpath, "w") as f:
        json.dump(chrome_trace(events, rank), f)
    plot_timeline(events, ppath)
    return [jpath, ppath]
