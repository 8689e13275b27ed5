#!/usr/bin/env python3
"""The lent GPU machine's checks: the CUDA lanes check, and the runner that times
scripts/gpu_check.sh's plan.

    python3 scripts/gpu_lanes_check.py lanes          # CudaLanes on one GPU (JSON out)
    python3 scripts/gpu_lanes_check.py run [--plan] [--budget S] [--only A,B] [--gpus N]
                                           [--out DIR] < PLAN   # what gpu_check.sh does
    python3 scripts/gpu_lanes_check.py compare A.json B.json TOL [timing]
    python3 scripts/gpu_lanes_check.py compare-logs A.log B.log TOL

**lanes**: one GPU can hold only a one-rank NCCL group, but its collectives still run
kernels on the lane stream, which is what stream ordering and buffer lifetimes are about.
For each collective of `dhelix.strand.lanes.CudaLanes`: the input is made on the compute
stream; `torch.cuda._sleep` (about 50 ms) is queued on the lane stream BEFORE the launch,
so the collective reads its input late; the input's last Python reference is dropped and
a tensor of the same size is allocated and filled with -1 on the compute stream (the
caching allocator hands it the freed block unless the lane recorded or kept the input);
then `resolve`, and the output must equal the input (on one rank all-gather,
reduce-scatter, all-reduce and all-to-all are the identity). A control runs the unsafe
pattern (NCCL on a side stream, input not recorded): when it comes out corrupted, the
check is known to see this bug on this machine. P2P (send/recv, ring_exchange, p2p)
needs two ranks: skipped. Exit 0 pass, 1 fail, 77 no CUDA.

**run**: the plan is one step a line, `NAME | TIMEOUT_S | OPTIONS | COMMAND` (`#`
comments). A command runs under `bash -c` in its own process group, with $T a scratch
folder outside $OUT, PYTHONFAULTHANDLER=1, no core files; its log goes to $T/logs. At its
timeout the group gets SIGABRT (every Python thread's stack lands in the log), SIGKILL
GRACE_S later. A timed-out step ends the run: a hang. Exit 77 from a command: skipped, its
last line the reason. TIMEOUT_S `-` with a command `@compare ...`/`@compare-logs ...`: a
builtin, run here. OPTIONS: `required` (a failure ends the run), `extra` (not part of the
worst case the plan promises: runs only if its timeout still fits), `gpus=N` (skipped on
fewer GPUs), `after=A,B` (skipped unless A and B passed), `keep=F,G` (files of $T copied to
$OUT). The running budget: a step starts only if its timeout plus GRACE_S fits in what is
left of the budget less RESERVE_S, else it is skipped ("skip: no time left"). $OUT gets
summary.json (rewritten after each step: every step's name, status, seconds, numbers, last
log lines, and the log tail of a failure or hang), the `keep` files, hang.log (the hung
step's log) and at most MAX_FAIL_LOGS failed steps' logs: never more than OUT_FILES_MAX.
Standard library only (the runner starts before anything is installed)."""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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


def compare_runs(a_path: str, b_path: str, tol: float, timing: bool = False
                 ) -> Tuple[bool, Dict, List[str]]:
    """Two `dhelix train --json` results: baseline A, DHelix B."""
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    la, lb = a.get("losses", []), b.get("losses", [])
    if not la or len(la) != len(lb):
        return False, {"iterations": [len(la), len(lb)]}, [
            f"losses logged: {len(la)} vs {len(lb)}"]
    worst = max(_rel(x, y) for x, y in zip(la, lb))
    gw = 0.0
    for ga, gb in zip(a.get("grad_checksums") or [], b.get("grad_checksums") or []):
        for n in ga:
            (_, q1), (_, q2) = ga[n], gb[n]
            gw = max(gw, _rel(q1, q2))
    ta, tb = a["tokens_per_s"], b["tokens_per_s"]
    ma, mb = a["peak_memory_bytes"], b["peak_memory_bytes"]
    num = {"loss_max_rel_diff": worst, "tolerance": tol, "grad_sumsq_max_rel_diff": gw,
           "final_loss": [la[-1], lb[-1]], "tokens_per_s": [ta, tb],
           "speed_ratio": tb / ta, "peak_activation_gib": [ma / 2**30, mb / 2**30],
           "memory_ratio": mb / ma if ma else None}
    if a.get("peak_memory_total_bytes") and b.get("peak_memory_total_bytes"):
        num["peak_total_gib"] = [a["peak_memory_total_bytes"] / 2**30,
                                 b["peak_memory_total_bytes"] / 2**30]
        num["total_memory_ratio"] = (b["peak_memory_total_bytes"]
                                     / a["peak_memory_total_bytes"])
    lines = [f"losses max rel diff {worst:.2e} (tol {tol:g}) | grad sum-of-squares max rel "
             f"diff {gw:.2e} | tokens/s {ta:.0f} -> {tb:.0f} ({num['speed_ratio']:.3f}x) | "
             f"peak activations {ma / 2**30:.2f} -> {mb / 2**30:.2f} GiB"]
    if timing:
        mem = num["memory_ratio"] or num.get("total_memory_ratio") or math.inf  # as before
        num["goal_speed_met"] = num["speed_ratio"] >= 0.97
        num["goal_memory_met"] = mem <= 1.05
        lines.append(f"goal (TP=1): speed >= 0.97x: "
                     f"{'met' if num['goal_speed_met'] else 'MISSED'}; memory <= 1.05x "
                     f"({mem:.3f}x): {'met' if num['goal_memory_met'] else 'MISSED'}")
    return worst <= tol, num, lines


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
            "@compare-logs": lambda a, b, tol: compare_logs(a, b, float(tol))}


def _expand(s: str, env: Dict[str, str]) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?",
                  lambda m: env.get(m.group(1), m.group(0)), s)


# --------------------------------------------------------------------------- runner

class Interrupted(Exception):
    pass


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _no_core():
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass


def run_command(cmd: str, timeout: float, log_path: str, env: Dict[str, str], cwd: str
                ) -> Tuple[int, bool]:
    """`bash -c cmd` in its own process group, output to log_path. At `timeout`: SIGABRT
    to the group, SIGKILL GRACE_S later. Returns (exit code, timed out)."""
    with open(log_path, "ab") as log:
        p = subprocess.Popen(["bash", "-c", cmd], stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                             start_new_session=True, preexec_fn=_no_core)
        timed_out = False
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            log.write(f"\n[gpu_check: timeout after {timeout:g} s: SIGABRT to the process "
                      f"group; the stacks follow if faulthandler printed them]\n".encode())
            log.flush()
            _killpg(p.pid, signal.SIGABRT)
        except BaseException:
            _killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
        finally:
            # the whole group gone before the next step (a dump takes a moment)
            end = time.monotonic() + (GRACE_S if timed_out else 1)
            while (p.poll() is None or _group_alive(p.pid)) and time.monotonic() < end:
                time.sleep(0.05)
            _killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode, timed_out


def _tail(path: str, chars: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            n = f.tell()
            f.seek(max(0, n - 4 * chars))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return text[-chars:]


def _last_lines(path: str, n: int = 3) -> List[str]:
    lines = [l.rstrip()[:300] for l in _tail(path, 4000).splitlines()
             if l.strip() and not l.startswith("RESULT ")]
    return lines[-n:]


def _result_numbers(path: str) -> Optional[Dict]:
    """The last `RESULT {json}` line a step printed."""
    found = None
    for l in _tail(path, 200000).splitlines():
        if l.startswith("RESULT "):
            try:
                found = json.loads(l[len("RESULT "):])
            except ValueError:
                pass
    return found


def probe_gpus() -> Tuple[int, List[str]]:
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                           timeout=PROBE_S)
    except (OSError, subprocess.TimeoutExpired):
        return 0, []
    names = [l.strip() for l in r.stdout.splitlines() if l.startswith("GPU ")]
    return len(names), names


def run_plan(steps: Sequence[Step], out: str, budget_s: float, gpus: Optional[int] = None,
             only: Optional[Sequence[str]] = None, cwd: Optional[str] = None,
             clock: Callable[[], float] = time.monotonic) -> int:
    """Run the plan; 0: all that ran passed, 1: a failure, 2: a hang (or interrupted)."""
    budget = Budget(budget_s, clock)
    cwd = cwd or os.getcwd()
    names: List[str] = []
    if gpus is None:
        gpus, names = probe_gpus()
    tmp = tempfile.mkdtemp(prefix="gpu-check-")
    os.makedirs(os.path.join(tmp, "logs"))
    if os.path.isdir(out):                        # a local rerun: no stale results
        for f in set(output_files(steps)) | {f for f in os.listdir(out)
                                             if re.fullmatch(r"fail-.*\.log", f)}:
            if os.path.isfile(os.path.join(out, f)):
                os.remove(os.path.join(out, f))
    plan = plan_report(steps, budget_s, gpus, only)
    plan.pop("steps")
    summary = Summary(out, {
        "script": "scripts/gpu_check.sh", "budget_s": budget_s,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpus": gpus, "gpu_names": names, "scratch": tmp,
        "env": {k: os.environ.get(k) for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTHONPATH",
                                               "CUDA_VISIBLE_DEVICES")},
        "plan": plan})
    env = dict(os.environ, T=tmp, OUT=os.path.abspath(out), PYTHONFAULTHANDLER="1",
               PYTHONUNBUFFERED="1")
    status: Dict[str, str] = {}
    stop: Optional[str] = None          # why every later step is skipped
    hang = False

    def on_signal(signum, frame):
        raise Interrupted(signal.Signals(signum).name)
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    summary.line(f"gpu check: {gpus} GPU(s) {names}; budget {budget_s:g} s; scratch {tmp}")
    if not gpus:
        summary.line("  (no GPU in `nvidia-smi -L`: the GPU steps skip; --gpus N overrides)")
    try:
        for s in steps:
            rec = summary.step({"name": s.name, "section": s.section, "timeout_s": s.timeout,
                                "status": "running", "seconds": 0.0})
            reason = None
            if only and s.name not in only:
                reason = "skip: not selected (--only)"
            elif s.gpus > gpus:
                reason = f"skip: needs {s.gpus} GPU(s), {gpus} here"
            elif stop:
                reason = f"skip: {stop}"
            elif any(status.get(d) != "pass" for d in s.after):
                d = next(d for d in s.after if status.get(d) != "pass")
                reason = f"skip: needs {d} ({status.get(d, 'not run')})"
            elif not budget.fits(s.cost):
                reason = (f"skip: no time left (needs {s.cost} s, "
                          f"{budget.left() - RESERVE_S:.0f} s left)")
            if reason:
                rec["status"] = status[s.name] = reason
                if not (only and s.name not in only):
                    summary.line(f"[{budget.elapsed():4.0f}s] {s.name}: {reason}")
                continue
            summary.write()                     # says which step was running, if killed
            t0 = clock()
            log = os.path.join(tmp, "logs", s.name.replace("/", "-") + ".log")
            if s.builtin:
                argv = shlex.split(_expand(s.command, env))
                try:
                    ok, num, lines = BUILTINS[argv[0]](*argv[1:])
                    st = "pass" if ok else "fail"
                except Exception as e:          # a missing or broken result file
                    st, num, lines = "fail", {}, [f"{type(e).__name__}: {e}"]
                with open(log, "w") as f:
                    f.write("\n".join(lines) + "\n")
                rec.update(numbers=num, lines=lines)
            else:
                rc, timed_out = run_command(s.command, s.timeout, log, env, cwd)
                rec["rc"] = rc
                last = _last_lines(log)
                rec["lines"] = last
                if timed_out:
                    st = "timeout"
                elif rc == 0:
                    st = "pass"
                elif rc == SKIP_RC:
                    st = "skip: " + (last[-1] if last else "exit 77").removeprefix("skip: ")
                else:
                    st = "fail"
                num = _result_numbers(log)
                if num is not None:
                    rec["numbers"] = num
            rec["status"] = status[s.name] = st
            rec["seconds"] = round(clock() - t0, 2)
            if st in ("fail", "timeout"):
                rec["tail"] = _tail(log, TAIL_CHARS[st])
                if st == "timeout":
                    rec["log_file"] = summary.copy_in(log, "hang.log", 4 * 2**20)
                elif summary.fail_logs < MAX_FAIL_LOGS:
                    summary.fail_logs += 1
                    rec["log_file"] = summary.copy_in(
                        log, f"fail-{summary.fail_logs}-of-{MAX_FAIL_LOGS}.log", 2**20)
            for k in s.keep:
                src = os.path.join(tmp, k)
                if os.path.isfile(src) and os.path.getsize(src) > FILE_MAX_BYTES:
                    summary.line(f"  (not kept: {k}, {os.path.getsize(src)} bytes)")
                elif summary.copy_in(src, k):
                    rec.setdefault("files", []).append(k)
            summary.line(f"[{budget.elapsed():4.0f}s] {s.name}: {st} ({rec['seconds']:.1f} s)"
                         + "".join(f"\n    {l}" for l in rec.get("lines", [])[-3:]))
            if st == "timeout":
                hang, stop = True, f"after the hang in {s.name}"
            elif st == "fail" and s.required:
                stop = f"{s.name} failed"
            summary.write()
    except Interrupted as e:
        for rec in summary.data["steps"]:
            if rec["status"] == "running":
                rec["status"] = f"interrupted ({e})"
        hang, stop = True, f"interrupted ({e})"
        summary.line(f"gpu check: interrupted by {e}")
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    counts: Dict[str, int] = {}
    for rec in summary.data["steps"]:
        k = rec["status"].split(":")[0].split(" ")[0]
        counts[k] = counts.get(k, 0) + 1
    failed = counts.get("fail", 0)
    summary.data.update(
        counts=counts, elapsed_s=round(budget.elapsed(), 1),
        status="hang" if hang else "fail" if failed else
        "pass" if counts.get("pass") else "nothing ran",
        numbers={r["name"]: r["numbers"] for r in summary.data["steps"] if r.get("numbers")})
    summary.line(f"gpu check: {summary.data['status']} | {counts} | "
                 f"{budget.elapsed():.0f} s of {budget_s:g} | files in {out}: "
                 f"{', '.join(summary.data['files'])}")
    summary.write()
    return 2 if hang else 1 if failed or not counts.get("pass") else 0


# --------------------------------------------------------------------------- lanes

SLEEP_S = 0.05
SHAPE = (1024, 1024)          # 4 MiB of fp32: a large-pool block, handed over whole


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _version(v) -> str:
    return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def lanes_check() -> Tuple[int, Dict]:
    import torch
    if not torch.cuda.is_available():
        return SKIP_RC, {"status": "skip", "reason": "no CUDA device"}
    import torch.distributed as dist
    from dhelix.strand.lanes import CudaLanes

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1, device_id=dev)
    group = dist.group.WORLD
    lanes = CudaLanes()

    # cycles for SLEEP_S, measured (the clock idles low until the GPU is busy)
    probe = 10_000_000
    torch.cuda._sleep(probe)                        # warm-up
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.cuda._sleep(probe)
    e1.record()
    torch.cuda.synchronize()
    cycles = max(probe, int(probe * SLEEP_S * 1000 / max(e0.elapsed_time(e1), 1e-3)))

    def values(k: int, rows: int = SHAPE[0]) -> "torch.Tensor":
        n = rows * SHAPE[1]                          # exact in fp32: < 2**24
        return torch.arange(n, dtype=torch.float32, device=dev).add_(k * 2**20).view(
            rows, SHAPE[1])

    def race(*a) -> Dict:
        try:
            return _race(*a)
        except Exception as e:          # an error is a failed case, the others still run
            torch.cuda.synchronize()
            return {"status": "fail", "error": f"{type(e).__name__}: {e}"[:500]}

    def _race(k: int, lane_streams, launch, resolve, wanted_rows=SHAPE[0]) -> Dict:
        """Input made on the compute stream; the lane delayed; the collective launched;
        the input's last reference dropped and a same-size tensor filled with -1 on the
        compute stream; then resolve, and the output read on the compute stream."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()    # no other free block of this size: the handover is sure
        x = values(k)
        for s in lane_streams:
            with torch.cuda.stream(s):
                torch.cuda._sleep(cycles)
        handle = launch(x)
        ptr = x.data_ptr()
        del x
        y = torch.empty(SHAPE, dtype=torch.float32, device=dev)
        y.fill_(-1.0)
        reused = y.data_ptr() == ptr
        lane_busy = not all(s.query() for s in lane_streams)
        outs = [o.clone() for o in resolve(handle)]
        torch.cuda.synchronize()
        want = values(k, wanted_rows)
        errs = [float((o - want).abs().max()) if o.shape == want.shape else math.inf
                for o in outs]
        del y
        return {"status": "pass" if max(errs) == 0 else "fail", "max_abs_err": max(errs),
                "input_block_reused": reused, "lane_busy_at_overwrite": lane_busy}

    one = lambda p: [lanes.resolve(p)]
    cases: Dict[str, Dict] = {}
    cases["all_gather"] = race(1, [lanes._stream("intra")],
                               lambda x: lanes.all_gather("ag", x, group, "intra"), one)
    cases["reduce_scatter"] = race(2, [lanes._stream("intra")],
                                   lambda x: lanes.reduce_scatter("rs", x, group, "intra"), one)
    cases["all_reduce"] = race(3, [lanes._stream("inter")],
                               lambda x: lanes.all_reduce("ar", x, group, "inter"), one)
    cases["all_to_all"] = race(4, [lanes._stream("inter")], lambda x: lanes.all_to_all(
        "a2a", x, [SHAPE[0]], [SHAPE[0]], group, "inter"), one)

    def two(x):     # two lanes at once, waited by one barrier
        y = values(5)
        ps = [lanes.all_gather("ag-intra", x, group, "intra"),
              lanes.all_gather("ag-inter", y, group, "inter")]
        del y
        return ps

    def barrier(ps):
        lanes.barrier(ps)
        return [p.out for p in ps]
    cases["barrier"] = race(5, [lanes._stream("intra"), lanes._stream("inter")], two, barrier)
    for name in ("send", "recv", "p2p", "ring_exchange"):
        cases[name] = {"status": "skip", "reason": "point-to-point needs two ranks"}

    # the control: the unsafe pattern itself (NCCL on a side stream, the input not recorded)
    side = torch.cuda.Stream()

    def unsafe(x):
        out = torch.empty_like(x)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_gather_into_tensor(out, x, group=group)
            ev = torch.cuda.Event()
            ev.record(side)
        out.record_stream(side)
        return out, ev

    def unsafe_resolve(h):
        torch.cuda.current_stream().wait_event(h[1])
        return [h[0]]
    control = race(6, [side], unsafe, unsafe_resolve)
    control["corrupted"] = control.pop("status") == "fail" and "error" not in control

    dist.destroy_process_group()
    checked = [c for c in cases.values() if c["status"] != "skip"]
    ok = all(c["status"] == "pass" for c in checked)
    res = {"status": "pass" if ok else "fail", "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "nccl": _version(torch.cuda.nccl.version()),
           "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
           "sleep_cycles": cycles, "sleep_ms": SLEEP_S * 1000,
           "passed": sum(c["status"] == "pass" for c in checked), "checked": len(checked),
           "cases": cases, "control": control,
           "control_sees_the_bug": control["corrupted"]}
    return (0 if ok else 1), res


def lanes_main() -> int:
    rc, res = lanes_check()
    for name, c in res.get("cases", {}).items():
        print(f"{name:15s} {c['status']:5s} " + " ".join(
            f"{k}={v}" for k, v in c.items() if k != "status"))
    if "control" in res:
        c = res["control"]
        print(f"control (unsafe pattern): corrupted={c['corrupted']} "
              f"(block reused={c.get('input_block_reused')}): " +
              ("the check sees this bug here" if c["corrupted"] else
               "NOT seen here: a pass above is weaker evidence"))
    print("RESULT " + json.dumps(res))
    if "cases" in res:
        print(f"lanes: {res['passed']}/{res['checked']} collectives pass; the control "
              f"{'sees' if res['control_sees_the_bug'] else 'does NOT see'} the bug here")
    else:
        print(f"skip: {res.get('reason')}")
    return rc


# --------------------------------------------------------------------------- main

def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("lanes", help="the CUDA lanes check on one GPU")
    r = sub.add_parser("run", help="run a plan read from stdin (scripts/gpu_check.sh)")
    r.add_argument("--out", default=os.environ.get("OUT") or "gpu-check")
    r.add_argument("--budget", type=float, default=540.0)
    r.add_argument("--only", default=None, help="comma-separated step names")
    r.add_argument("--gpus", type=int, default=None, help="instead of nvidia-smi -L")
    r.add_argument("--plan", action="store_true", help="print the plan as JSON; run nothing")
    r.add_argument("--plan-file", default=None, help="instead of stdin")
    c = sub.add_parser("compare", help="two dhelix train --json results")
    c.add_argument("a"), c.add_argument("b"), c.add_argument("tol", type=float)
    c.add_argument("timing", nargs="?")
    cl = sub.add_parser("compare-logs", help="two Megatron-LM logs")
    cl.add_argument("a"), cl.add_argument("b"), cl.add_argument("tol", type=float)
    a = p.parse_args(argv)
    if a.cmd == "lanes":
        return lanes_main()
    if a.cmd in ("compare", "compare-logs"):
        ok, num, lines = (compare_runs(a.a, a.b, a.tol, bool(a.timing)) if a.cmd == "compare"
                          else compare_logs(a.a, a.b, a.tol))
        print("\n".join("  " + l for l in lines))
        print("RESULT " + json.dumps(num))
        return 0 if ok else 1
    text = open(a.plan_file).read() if a.plan_file else sys.stdin.read()
    try:
        steps = parse_plan(text)
    except ValueError as e:
        print(f"gpu_check: bad plan: {e}", file=sys.stderr)
        return 2
    only = [s for s in a.only.split(",") if s] if a.only else None
    unknown = [n for n in only or [] if not any(s.name == n for s in steps)]
    if unknown:
        print(f"gpu_check: --only: no step {', '.join(unknown)}", file=sys.stderr)
        return 2
    if a.plan:
        print(json.dumps(plan_report(steps, a.budget, 1 if a.gpus is None else a.gpus, only),
                         indent=1))
        return 0
    return run_plan(steps, a.out, a.budget, a.gpus, only)


if __name__ == "__main__":
    sys.exit(main())
