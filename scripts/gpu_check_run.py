#!/usr/bin/env python3
"""The runner of scripts/gpu_check.sh's plan (the plan itself: gpu_check_plan.py).

    python3 scripts/gpu_check_run.py run [--plan] [--budget S] [--only A,B] [--gpus N]
                                         [--out DIR] < PLAN   # what gpu_check.sh does
    python3 scripts/gpu_check_run.py compare A.json B.json TOL [timing]
    python3 scripts/gpu_check_run.py compare-logs A.log B.log TOL

**run**: the plan is one step a line, `NAME | TIMEOUT_S | OPTIONS | COMMAND` (`#`
comments). A command runs under `bash -c` in its own process group, with $T a scratch
folder outside $OUT, PYTHONFAULTHANDLER=1, no core files; its log goes to $T/logs. At its
timeout the group gets SIGABRT (every Python thread's stack lands in the log), SIGKILL
GRACE_S later. A timed-out step (a hang, or only slow) skips the steps that need it
(`after=`), not the rest; the run's status is then "hang". Exit 77 from a command: skipped, its
last line the reason. TIMEOUT_S `-` with a command `@compare ...`/`@compare-logs ...`: a
builtin, run here. OPTIONS: `required` (a failure ends the run), `extra` (not part of the
worst case the plan promises: runs only if its timeout still fits), `gpus=N` (skipped on
fewer GPUs), `after=A,B` (skipped unless A and B passed), `keep=F,G` (files of $T copied to
$OUT). The running budget: a step starts only if its timeout plus GRACE_S fits in what is
left of the budget less RESERVE_S, else it is skipped ("skip: no time left"). $OUT gets
summary.json (rewritten after each step: every step's name, status, seconds, numbers, last
log lines, and the log tail of a failure or hang), the `keep` files, hang.log (the hung
step's log) and at most MAX_FAIL_LOGS failed steps' logs: never more than OUT_FILES_MAX.
`--dry-run DIR`: every command step is replaced by copying recorded results from DIR
(`NAME.json` / `NAME.log`, the step name's `/` as `-`) to the `--json PATH` or
`.../megatron-lm-<mode>.log` the command names; the builtins then gate on them: the plan's
order, dependencies and gates checked without running anything (a CPU test; or a device
run's results replayed).
Standard library only (the runner starts before anything is installed)."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check_plan import (BUILTINS, FILE_MAX_BYTES, GRACE_S, MAX_FAIL_LOGS,  # noqa: E402
                            PROBE_S, RESERVE_S, SKIP_RC, TAIL_CHARS, Budget, Step, Summary,
                            compare_logs, compare_runs, output_files, parse_plan,
                            plan_report, _expand)

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


def dry_command(cmd: str, name: str, dry: str, log_path: str) -> int:
    """--dry-run: instead of `cmd`, copy the recorded results of step `name` from `dry`
    to where `cmd` would write them (its `--json PATH`; a Megatron-LM step's log)."""
    import shutil
    key = name.replace("/", "-")
    done = []
    m = re.search(r"--json\s+(\S+)", cmd)
    if m and os.path.isfile(os.path.join(dry, key + ".json")):
        shutil.copyfile(os.path.join(dry, key + ".json"), m.group(1))
        done.append(m.group(1))
    m = re.search(r"LOGDIR=(\S+).*gpu_megatron_lm\.sh\s+(\w+)", cmd)
    if m and os.path.isfile(os.path.join(dry, key + ".log")):
        dst = os.path.join(m.group(1), f"megatron-lm-{m.group(2)}.log")
        shutil.copyfile(os.path.join(dry, key + ".log"), dst)
        done.append(dst)
    with open(log_path, "a") as f:
        f.write(f"dry run: {', '.join(done) if done else 'nothing recorded'}\n")
    return 0


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
             clock: Callable[[], float] = time.monotonic, dry: Optional[str] = None) -> int:
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
    if dry:
        summary.data["dry_run"] = os.path.abspath(dry)
        summary.line(f"  (dry run: recorded results from {dry}; no command runs)")
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
                if dry:
                    rc, timed_out = dry_command(_expand(s.command, env), s.name, dry, log), False
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
                # only what depends on it is lost (after=): a slow step is not a reason
                # to skip the measurements that follow it; its group is already killed
                hang = True
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


# --------------------------------------------------------------------------- main

def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a plan read from stdin (scripts/gpu_check.sh)")
    r.add_argument("--out", default=os.environ.get("OUT") or "gpu-check")
    r.add_argument("--budget", type=float, default=540.0)
    r.add_argument("--only", default=None, help="comma-separated step names")
    r.add_argument("--gpus", type=int, default=None, help="instead of nvidia-smi -L")
    r.add_argument("--plan", action="store_true", help="print the plan as JSON; run nothing")
    r.add_argument("--plan-file", default=None, help="instead of stdin")
    r.add_argument("--dry-run", default=None, metavar="DIR",
                   help="copy recorded results from DIR instead of running commands")
    c = sub.add_parser("compare", help="two dhelix train --json results")
    c.add_argument("a"), c.add_argument("b"), c.add_argument("tol", type=float)
    c.add_argument("timing", nargs="?")
    cl = sub.add_parser("compare-logs", help="two Megatron-LM logs")
    cl.add_argument("a"), cl.add_argument("b"), cl.add_argument("tol", type=float)
    a = p.parse_args(argv)
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
    return run_plan(steps, a.out, a.budget, a.gpus, only, dry=a.dry_run)


if __name__ == "__main__":
    sys.exit(main())
