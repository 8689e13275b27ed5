#!/usr/bin/env python3
"""The plan of scripts/gpu_check.sh as data: its steps, the running time budget, the
summary it writes, and the builtin comparisons (`@compare`, `@compare-logs`). The runner
(gpu_check_run.py) plays it. Standard library only (it starts before anything is
installed)."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

GRACE_S = 5          # SIGABRT -> SIGKILL
RESERVE_S = 10       # kept back for the last summary
PROBE_S = 10         # nvidia-smi -L, counted like a step
OUT_FILES_MAX = 8    # what the lent machine brings back from $OUT
MAX_FAIL_LOGS = 3
FILE_MAX_BYTES = 15 * 2**20
TAIL_CHARS = {"fail": 6000, "timeout": 12000}
SKIP_RC = 77


# --------------------------------------------------------------------------- the plan

@dataclass
class Step:
    name: str
    timeout: Optional[int]            # None: a builtin run in-process
    command: str
    gpus: int = 1
    extra: bool = False
    required: bool = False
    after: Tuple[str, ...] = ()
    keep: Tuple[str, ...] = ()

    @property
    def builtin(self) -> bool:
        return self.timeout is None

    @property
    def cost(self) -> int:
        """The most seconds it can take."""
        return 1 if self.builtin else self.timeout + GRACE_S

    @property
    def section(self) -> str:
        return self.name.split("/")[0]


def parse_plan(text: str) -> List[Step]:
    steps: List[Step] = []
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split("|", 3)]
        if len(parts) != 4 or not parts[0] or not parts[3]:
            raise ValueError(f"plan line {no}: want NAME | TIMEOUT_S | OPTIONS | COMMAND: {raw!r}")
        name, t, opts, cmd = parts
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-/]*", name):
            raise ValueError(f"plan line {no}: bad step name {name!r}")
        if any(s.name == name for s in steps):
            raise ValueError(f"plan line {no}: step {name} twice")
        if t == "-":
            if not cmd.startswith("@"):
                raise ValueError(f"plan line {no}: only a builtin (@...) runs without a timeout")
            timeout = None
        else:
            if cmd.startswith("@") or not t.isdigit() or int(t) <= 0:
                raise ValueError(f"plan line {no}: timeout {t!r} (a command needs whole "
                                 f"seconds > 0, a builtin '-')")
            timeout = int(t)
        step = Step(name, timeout, cmd)
        for o in opts.split():
            key, _, val = o.partition("=")
            if key in ("extra", "required") and not val:
                setattr(step, key, True)
            elif key == "gpus" and val.isdigit():
                step.gpus = int(val)
            elif key in ("after", "keep") and val:
                setattr(step, key, tuple(v for v in val.split(",") if v))
            else:
                raise ValueError(f"plan line {no}: unknown option {o!r}")
        for dep in step.after:
            if not any(s.name == dep for s in steps):
                raise ValueError(f"plan line {no}: after={dep}: no earlier step of that name")
        for k in step.keep:
            if "/" in k or not re.fullmatch(r"[A-Za-z0-9_.\-]+", k):
                raise ValueError(f"plan line {no}: keep={k}: a plain file name of $T")
        steps.append(step)
    if not steps:
        raise ValueError("empty plan")
    n = len(output_files(steps))
    if n > OUT_FILES_MAX:
        raise ValueError(f"the plan can write {n} files to $OUT; the lent machine brings "
                         f"back {OUT_FILES_MAX}")
    return steps


def output_files(steps: Sequence[Step]) -> List[str]:
    """Every file the run can leave in $OUT (the most of them)."""
    keep = []
    for s in steps:
        keep += [k for k in s.keep if k not in keep]
    return (["summary.json"] + keep + ["hang.log"]
            + [f"fail-{i + 1}-of-{MAX_FAIL_LOGS}.log" for i in range(MAX_FAIL_LOGS)])


def plan_report(steps: Sequence[Step], budget_s: float, gpus: int,
                only: Optional[Sequence[str]] = None) -> Dict:
    """What `--plan` prints: the steps, and the worst case of those that always run."""
    rows, core = [], PROBE_S + RESERVE_S
    for s in steps:
        runs = s.gpus <= gpus and (not only or s.name in only)
        if runs and not s.extra:
            core += s.cost
        rows.append({"name": s.name, "section": s.section, "timeout_s": s.timeout,
                     "cost_s": s.cost, "gpus": s.gpus, "extra": s.extra,
                     "required": s.required, "after": list(s.after), "keep": list(s.keep),
                     "runs_with_gpus": runs, "command": s.command})
    files = output_files(steps)
    return {"budget_s": budget_s, "gpus": gpus, "grace_s": GRACE_S, "reserve_s": RESERVE_S,
            "probe_s": PROBE_S, "worst_case_s": core, "headroom_s": budget_s - core,
            "fits": core <= budget_s, "outputs": files, "max_files": len(files),
            "out_files_max": OUT_FILES_MAX, "steps": rows}


# --------------------------------------------------------------------------- budget

class Budget:
    """Seconds left of a fixed budget, on a clock that can be replaced in tests."""

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic):
        self.total, self.clock, self.t0 = float(total_s), clock, clock()

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float:
        return self.total - self.elapsed()

    def fits(self, cost_s: float) -> bool:
        """A step of at most `cost_s` seconds can start and still leave the reserve."""
        return cost_s <= self.left() - RESERVE_S


# --------------------------------------------------------------------------- summary

class Summary:
    """summary.json in $OUT, rewritten whole (atomically) after every step, so that even a
    run killed from outside leaves one; plus the few other files, counted."""

    def __init__(self, out: str, meta: Dict):
        self.out = out
        os.makedirs(out, exist_ok=True)
        self.data = dict(meta, status="running", steps=[], log=[], files=["summary.json"])
        self.fail_logs = 0

    def line(self, text: str) -> None:
        print(text, flush=True)
        self.data["log"].append(text)

    def step(self, rec: Dict) -> Dict:
        self.data["steps"].append(rec)
        return rec

    def copy_in(self, src: str, name: str, tail_bytes: int = FILE_MAX_BYTES) -> Optional[str]:
        """Copy `src` to $OUT/name (its last `tail_bytes` at most); None if it would pass
        OUT_FILES_MAX or `src` is missing."""
        if not os.path.isfile(src):
            return None
        if name not in self.data["files"] and len(self.data["files"]) >= OUT_FILES_MAX:
            self.line(f"  (not kept: {name}: $OUT already holds {OUT_FILES_MAX} files)")
            return None
        size = os.path.getsize(src)
        with open(src, "rb") as f, open(os.path.join(self.out, name), "wb") as g:
            if size > tail_bytes:
                f.seek(size - tail_bytes)
                g.write(b"[... cut: the first %d bytes ...]\n" % (size - tail_bytes))
            shutil.copyfileobj(f, g)
        if name not in self.data["files"]:
            self.data["files"].append(name)
        return name

    def write(self) -> None:
        path = os.path.join(self.out, "summary.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, path)


# --------------------------------------------------------------------------- builtins

def _rel(x: float, y: float) -> float:
    return abs(x - y) / max(abs(x), 1e-30)


# goals of the timing row (TP=1: nothing to hide, so DHelix may only cost): gated
GOAL_SPEED = 0.97           # DHelix tokens/s over megatron's, at least
GOAL_MEMORY = 1.05          # DHelix peak activation memory over megatron's, at most
CHECKSUM_FLOOR = 1e-6       # absolute floor of a checksum's scale (an all-zero grad)


def _checksum_diffs(a: Dict, b: Dict, tol: float, what: str) -> Tuple[float, List[str]]:
    """name -> [sum, sum of squares] of A against B: the worst relative difference and a
    line per parameter past `tol` (or missing on one side). A sum is measured against
    max(|sum|, sqrt(sum of squares), floor): a sum near zero of large entries cannot meet
    a relative bound; a sum of squares against max(itself, floor)."""
    bad, worst = [], 0.0
    for n in sorted(set(a) | set(b)):
        if n not in a or n not in b:
            bad.append(f"{what} {n}: only in {'the baseline' if n in a else 'DHelix'}")
            continue
        (s1, q1), (s2, q2) = a[n], b[n]
        if not all(math.isfinite(v) for v in (s1, q1, s2, q2)):
            bad.append(f"{what} {n}: not finite ({s1}, {q1} vs {s2}, {q2})")
            continue
        ds = abs(s1 - s2) / max(abs(s1), math.sqrt(abs(q1)), CHECKSUM_FLOOR)
        dq = abs(q1 - q2) / max(abs(q1), CHECKSUM_FLOOR)
        worst = max(worst, ds, dq)
        if ds > tol or dq > tol:
            bad.append(f"{what} {n}: sum {s1:.6g} vs {s2:.6g}, sum of squares {q1:.6g} vs "
                       f"{q2:.6g} (rel diff {max(ds, dq):.2e} > {tol:g})")
    return worst, bad


def compare_runs(a_path: str, b_path: str, tol: float, timing: bool = False
                 ) -> Tuple[bool, Dict, List[str]]:
    """Two `dhelix train --json` results: baseline A, DHelix B. Gates, each a failure
    line: every loss within `tol` (relative); where A has checksums (`--checksums`), every
    step's gradient [sum, sum of squares] per parameter and the final weights' within
    `tol` (`_checksum_diffs`; a parameter on one side only fails); with `timing`, the
    goals GOAL_SPEED and GOAL_MEMORY."""
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    return compare_runs_dicts(a, b, tol, timing)


def compare_runs_dicts(a: Dict, b: Dict, tol: float, timing: bool = False
                       ) -> Tuple[bool, Dict, List[str]]:
    la, lb = a.get("losses", []), b.get("losses", [])
    if not la or len(la) != len(lb):
        return False, {"iterations": [len(la), len(lb)]}, [
            f"FAIL losses logged: {len(la)} vs {len(lb)}"]
    fails: List[str] = []
    worst = max(_rel(x, y) if math.isfinite(y) else math.inf for x, y in zip(la, lb))
    if not worst <= tol:
        i = max(range(len(la)), key=lambda k: _rel(la[k], lb[k]) if math.isfinite(lb[k])
                else math.inf)
        fails.append(f"losses: step {i + 1} {la[i]:.6g} vs {lb[i]:.6g} (rel diff "
                     f"{worst:.2e} > {tol:g})")
    gw = ww = 0.0
    if a.get("grad_checksums") is not None:
        ga, gb = a["grad_checksums"], b.get("grad_checksums") or []
        if len(ga) != len(gb):
            fails.append(f"gradient checksums: {len(ga)} steps vs {len(gb)}")
        for step, (x, y) in enumerate(zip(ga, gb)):
            w, bad = _checksum_diffs(x, y, tol, f"gradient step {step + 1}")
            gw = max(gw, w)
            fails += bad
    if a.get("weight_checksums") is not None:
        ww, bad = _checksum_diffs(a["weight_checksums"], b.get("weight_checksums") or {},
                                  tol, "final weight")
        fails += bad
    ta, tb = a["tokens_per_s"], b["tokens_per_s"]
    ma, mb = a["peak_memory_bytes"], b["peak_memory_bytes"]
    num = {"loss_max_rel_diff": worst, "tolerance": tol, "grad_max_rel_diff": gw,
           "weight_max_rel_diff": ww, "final_loss": [la[-1], lb[-1]],
           "tokens_per_s": [ta, tb], "speed_ratio": tb / ta,
           "peak_activation_gib": [ma / 2**30, mb / 2**30],
           "memory_ratio": mb / ma if ma else None}
    if a.get("peak_memory_total_bytes") and b.get("peak_memory_total_bytes"):
        num["peak_total_gib"] = [a["peak_memory_total_bytes"] / 2**30,
                                 b["peak_memory_total_bytes"] / 2**30]
        num["total_memory_ratio"] = (b["peak_memory_total_bytes"]
                                     / a["peak_memory_total_bytes"])
    lines = [f"losses max rel diff {worst:.2e} | gradients {gw:.2e} | final weights "
             f"{ww:.2e} (tol {tol:g}) | tokens/s {ta:.0f} -> {tb:.0f} "
             f"({num['speed_ratio']:.3f}x) | peak activations {ma / 2**30:.2f} -> "
             f"{mb / 2**30:.2f} GiB"]
    if timing:
        mem = num["memory_ratio"] or num.get("total_memory_ratio") or math.inf
        num["goal_speed_met"] = num["speed_ratio"] >= GOAL_SPEED
        num["goal_memory_met"] = mem <= GOAL_MEMORY
        lines.append(f"goal (TP=1): speed >= {GOAL_SPEED}x: "
                     f"{'met' if num['goal_speed_met'] else 'MISSED'}; memory <= "
                     f"{GOAL_MEMORY}x ({mem:.3f}x): "
                     f"{'met' if num['goal_memory_met'] else 'MISSED'}")
        if not num["goal_speed_met"]:
            fails.append(f"speed {num['speed_ratio']:.3f}x < goal {GOAL_SPEED}x")
        if not num["goal_memory_met"]:
            fails.append(f"memory {mem:.3f}x > goal {GOAL_MEMORY}x")
    num["failures"] = len(fails)
    lines += [f"FAIL {f}" for f in fails[:20]]
    if len(fails) > 20:
        lines.append(f"FAIL ... and {len(fails) - 20} more")
    return not fails, num, lines


def compare_resumed(straight_path: str, resumed_path: str, tol: float
                    ) -> Tuple[bool, Dict, List[str]]:
    """A straight run against one resumed from its save: the resumed run's steps equal
    the straight run's last ones (losses, gradient checksums), and the final weights."""
    a, b = (json.load(open(p)) for p in (straight_path, resumed_path))
    k = len(b.get("losses", []))
    if not k or k > len(a.get("losses", [])):
        return False, {"iterations": [len(a.get("losses", [])), k]}, [
            f"FAIL steps logged: straight {len(a.get('losses', []))}, resumed {k}"]
    tail = dict(a, losses=a["losses"][-k:],
                grad_checksums=(a.get("grad_checksums") or [])[-k:] or None)
    ok, num, lines = compare_runs_dicts(tail, b, tol)
    num["resumed_steps"] = k
    return ok, num, [f"resumed {k} of {len(a['losses'])} steps: " + lines[0]] + lines[1:]


_LM_LOSS = re.compile(r"lm loss: ([0-9.Ee+-]+)")
_ITER_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def compare_logs(a_path: str, b_path: str, tol: float) -> Tuple[bool, Dict, List[str]]:
    """Two Megatron-LM logs (without and with --dhelix): the logged `lm loss`es."""
    ta, tb = (open(p, errors="replace").read() for p in (a_path, b_path))
    a, b = ([float(m) for m in _LM_LOSS.findall(t)] for t in (ta, tb))
    num: Dict = {"iterations": [len(a), len(b)], "tolerance": tol}
    if not a or len(a) != len(b):
        return False, num, [f"iterations logged: megatron {len(a)}, dhelix {len(b)}"]
    worst = max(_rel(x, y) for x, y in zip(a, b))
    num.update(loss_max_rel_diff=worst, first_loss=[a[0], b[0]], last_loss=[a[-1], b[-1]])
    lines = [f"lm loss first/last: megatron {a[0]:.5f}/{a[-1]:.5f}, dhelix "
             f"{b[0]:.5f}/{b[-1]:.5f}; max rel diff {worst:.2e} (tol {tol:g})"]
    ms = [[float(v) for v in _ITER_MS.findall(t)] for t in (ta, tb)]
    if all(len(m) >= 2 for m in ms):
        half = [m[len(m) // 2:] for m in ms]        # the later half: past the warm-up
        ma, mb = (sum(h) / len(h) for h in half)
        num.update(iter_ms=[ma, mb], speed_ratio=ma / mb)
        lines.append(f"ms per iteration (later half): megatron {ma:.1f}, dhelix {mb:.1f} "
                     f"({ma / mb:.3f}x speed)")
    return worst <= tol, num, lines


BUILTINS = {"@compare": lambda a, b, tol, *t: compare_runs(a, b, float(tol), bool(t)),
            "@compare-resumed": lambda a, b, tol: compare_resumed(a, b, float(tol)),
            "@compare-logs": lambda a, b, tol: compare_logs(a, b, float(tol))}


def _expand(s: str, env: Dict[str, str]) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?",
                  lambda m: env.get(m.group(1), m.group(0)), s)
