"""Runs that end well (issue 58): the launcher owns its ranks, and a run stops on purpose.

  stopping       every command that starts ranks (train, profile, bench, layouts,
                 validate-model, demo), mid-work: SIGTERM (and on train SIGINT and SIGHUP,
                 which take the same path in the shared launcher) to the launcher ends it
                 with 128 + the signal and one last line
                 `dhelix ...: SIG... received: stopped N ranks`; SIGKILL to the launcher
                 (no word) takes its ranks too (the parent-death signal). Within 10 s no
                 process of the run is left: every process whose environment carries the
                 run's marker is gone (pids read from /proc, zombies aside).
  exit options   --exit-signal-handler (SIGTERM to the launcher mid-run: the step
                 finishes, a save, exit 0), --exit-interval and --exit-duration-in-mins,
                 with --dhelix (TP=2+SP) and the fold (PP=2): resuming to the end gives
                 the uninterrupted run's losses, gradient checksums and final weights bit
                 for bit.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from compare import same_numbers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config", "tiny", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
SHAPE = TINY + ["--seq-length", "32", "--micro-batch-size", "2"]


def _commands(tmp):
    """Each command that starts ranks, sized to run well past the signal."""
    return {
        "train": ["train", "--nproc", "2", *TINY, "--train-iters", "100000",
                  "--log-interval", "1"],
        "profile": ["profile", "--nproc", "2", *SHAPE, "--repeats", "200",
                    "--out", f"{tmp}/table"],
        "bench": ["bench", "--configs", "tiny", "--links", "none", "--nproc", "2",
                  "--tensor-model-parallel-size", "1", "--seq-length", "32",
                  "--num-microbatches", "4", "--train-iters", "100000", "--profile-repeats",
                  "1", "--profile-runs", "1", "--out", f"{tmp}/b"],
        "layouts": ["layouts", "--rows", "TP×DP", "--train-iters", "100000",
                    "--out", f"{tmp}/lay"],
        "validate-model": ["validate-model", "--nproc", "2", *SHAPE, "--repeats", "200", "--plans", "30",
                           "--out", f"{tmp}/val"],
        "demo": ["demo", "--config", "tiny", "--train-iters", "100000", "--repeats", "2",
                 "--num-microbatches", "2", "--out", f"{tmp}/demo"],
    }


def _marked(marker):
    """Live pids of the processes whose environment carries `marker` (zombies aside)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        out.append(int(pid))
    return out


def _ranks(launcher):
    r = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def _terminal_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # a background pytest ignores it


# every signal on `train`; SIGTERM and SIGKILL on the other commands, whose launcher is the
# same code (`dist.spawn_local`; SIGINT and SIGHUP take SIGTERM's path there): CI's time
CASES = [("train", s) for s in ("SIGTERM", "SIGINT", "SIGHUP", "SIGKILL")] + [
    (c, s) for c in ("profile", "bench", "layouts", "validate-model", "demo")
    for s in ("SIGTERM", "SIGKILL")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command,sig", CASES)
def test_a_stopped_launcher_leaves_no_rank(tmp_path, command, sig):
    argv = _commands(tmp_path)[command]
    marker = f"DHELIX_STOP_TEST={uuid.uuid4().hex}"
    env = dict(os.environ, DHELIX_STOP_TEST=marker.split("=", 1)[1])
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "dhelix.cli", *argv], stdout=out,
                             stderr=err, stdin=subprocess.DEVNULL, cwd=ROOT, env=env,
                             start_new_session=True, preexec_fn=_terminal_sigint)
    try:
        # mid-work: ranks running for 3 s (a training step: its second iteration logged)
        deadline, since = time.time() + 180, None
        while True:
            assert p.poll() is None, f"ended (rc {p.returncode}) before the signal:\n" \
                                     f"{err_path.read_text()[-3000:]}"
            assert time.time() < deadline, "no ranks at work within 180 s:\n" + \
                err_path.read_text()[-3000:]
            up = len(_ranks(p.pid)) >= 2
            since = (since or time.time()) if up else None
            if since and time.time() - since >= 3 and (
                    command != "train" or "iter    2/" in out_path.read_text()):
                break
            time.sleep(0.1)
        before = _marked(marker)
        assert len(before) >= 3, before            # the launcher and its ranks
        t = time.time()
        os.kill(p.pid, getattr(signal, sig))
        p.wait(timeout=15)
        while _marked(marker) and time.time() - t < 10:
            time.sleep(0.1)
        left = _marked(marker)
    finally:
        for pid in _marked(marker):
            os.kill(pid, signal.SIGKILL)
        if p.poll() is None:
            p.kill()
            p.wait()
    assert not left, f"{len(left)} processes of the run left 10 s after {sig}: {left}"
    err = err_path.read_text()
    if sig == "SIGKILL":
        assert p.returncode == -signal.SIGKILL
        return
    assert p.returncode == 128 + getattr(signal, sig), err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(rf"dhelix {command}: {sig} received: stopped [24] ranks", last), \
        err[-3000:]
    assert "Traceback" not in err, err[-3000:]


# ---- Megatron-LM's exit options --------------------------------------------------------

RUNS = {
    "dhelix": TINY + ["--dhelix", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1"],
    "fold": ["--config", "tiny4", "--pipeline-model-parallel-size", "2",
             "--micro-batch-size", "1", "--global-batch-size", "4", "--dhelix",
             "--dhelix-fold"],
}
STEPS = 8


def _train(tmp_path, name, *extra, wait=True):
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "dhelix.cli", "train", "--nproc", "2", "--checksums",
           "--log-interval", "1", "--json", str(out), "--timeout", "300", *extra]
    if not wait:
        return cmd, out
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(out.read_text()), r.stdout


def _check_resumed(straight, parts):
    """The parts of a stopped and resumed run, in order, together equal `straight`."""
    losses = [x for p in parts for x in p["losses"]]
    grads = [x for p in parts for x in p["grad_checksums"]]
    same_numbers(losses, straight["losses"], 0.0, "losses, stopped and resumed")
    assert grads == straight["grad_checksums"], "gradient checksums, stopped and resumed"
    assert parts[-1]["weight_checksums"] == straight["weight_checksums"], "final weights"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", ["dhelix", "fold"])
def test_sigterm_with_exit_signal_handler_saves_and_resumes_exactly(tmp_path, run):
    """SIGTERM to the launcher at a random step of a long run: the ranks finish the step,
    save, exit 0 with a line saying where; a --load run to STEPS equals the straight one."""
    import random
    straight, _ = _train(tmp_path, "straight", *RUNS[run], "--train-iters", str(STEPS))
    at = random.Random(run).randint(2, 5)
    cmd, out = _train(tmp_path, "first", *RUNS[run], "--train-iters", str(STEPS),
                      "--save", str(tmp_path / "ck"), "--exit-signal-handler", wait=False)
    log = tmp_path / "first.log"
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        deadline = time.time() + 200
        while f"iter    {at}/" not in log.read_text():
            assert p.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGTERM)
        assert p.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    text = log.read_text()
    first = json.loads(out.read_text())
    n = len(first["losses"])
    assert at <= n < STEPS and first["exited"].startswith("SIGTERM received"), text[-2000:]
    assert f"dhelix train: saved iteration {n} to {tmp_path}/ck/iter_{n:07d}" in text
    assert (f"dhelix train: SIGTERM received (--exit-signal-handler): exiting after "
            f"iteration {n} (resume with --load {tmp_path}/ck)") in text
    rest, _ = _train(tmp_path, "rest", *RUNS[run], "--train-iters", str(STEPS),
                     "--load", str(tmp_path / "ck"))
    assert rest["first_iteration"] == n + 1 and rest["exited"] is None
    _check_resumed(straight, [first, rest])


@pytest.mark.timeout(600)
def test_exit_interval_and_duration_resume_exactly(tmp_path):
    """--exit-interval 5: stops after iteration 5, saved. Resumed with
    --exit-duration-in-mins 1e-4 (a few ms) too: stops after its first step (6), saved.
    Resumed again: the rest (the interval not reached again). The three parts together
    equal the straight run bit for bit."""
    kw = RUNS["dhelix"] + ["--train-iters", str(STEPS)]
    straight, _ = _train(tmp_path, "straight", *kw)
    ck = str(tmp_path / "ck")
    load = ["--load", ck]
    p0, _ = _train(tmp_path, "part0", *kw, "--save", ck, "--exit-interval", "5")
    p1, log = _train(tmp_path, "part1", *kw, "--save", ck, "--exit-interval", "5", *load,
                     "--exit-duration-in-mins", "1e-4")
    p2, _ = _train(tmp_path, "part2", *kw, "--save", ck, "--exit-interval", "5", *load)
    assert [len(p["losses"]) for p in (p0, p1, p2)] == [5, 1, STEPS - 6], log[-2000:]
    assert p0["exited"] == "--exit-interval 5" and p2["exited"] is None
    assert "--exit-duration-in-mins 0.0001 reached: exiting after iteration 6" in log
    _check_resumed(straight, [p0, p1, p2])


def test_exit_flags_are_checked_before_ranks_start():
    for flags, msg in ((["--exit-interval", "0"], "--exit-interval 0: must be >= 1"),
                       (["--exit-duration-in-mins", "-1"],
                        "--exit-duration-in-mins -1.0: must be > 0")):
        r = subprocess.run([sys.executable, "-m", "dhelix.cli", "train", "--nproc", "2",
                            *TINY, *flags], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and r.stderr.strip().endswith(msg), r.stderr[-2000:]
