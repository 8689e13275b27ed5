"""The Slurm batch file on a real one-node Slurm cluster (scripts/slurm/local_cluster.sh).
Without root or without Slurm these tests skip, naming what is missing; under CI=true
(.ci/run installs Slurm) they fail instead, so CI cannot pass without running them."""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from dhelix.train.dist import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "slurm", "local_cluster.sh")
TRAIN = ["train", "--config", "tiny", "--tensor-model-parallel-size", "2",
         "--sequence-parallel", "--train-iters", "5", "--dhelix"]


def _missing():
    if os.geteuid() != 0:
        return "needs root to start munge, slurmctld and slurmd"
    missing = [b for b in ("sbatch", "slurmctld", "slurmd", "munged") if not shutil.which(b)]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): on Debian, "
                f"apt-get install slurm-wlm munge (.ci/run does)")
    return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = _missing()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and the Slurm tests cannot run: {why}", pytrace=False)
        pytest.skip(why)
    d = str(tmp_path_factory.mktemp("slurm") / "cluster")
    env = dict(os.environ, DHELIX_SLURM_DIR=d, DHELIX_SLURMCTLD_PORT=str(free_port()),
               DHELIX_SLURMD_PORT=str(free_port()))
    env["SLURM_CONF"] = os.path.join(d, "slurm.conf")
    try:
        r = subprocess.run([SCRIPT, "up"], env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        yield env
    finally:
        r = subprocess.run([SCRIPT, "down"], env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        assert not os.path.exists(d)
        left = subprocess.run(["pgrep", "-f", d], capture_output=True, text=True).stdout
        assert not left.strip(), f"left running: {left}"


def _sbatch(cluster, out, *args):
    env = dict(cluster, MASTER_PORT=str(free_port()))
    r = subprocess.run(["sbatch", "--wait", "--parsable", "--nodes=1", "--ntasks-per-node=2",
                        f"--output={out}", "scripts/slurm/dhelix.sbatch",
                        "configs/slurm/local.env", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    job = r.stdout.strip().split(";")[0]
    return r, job, open(out).read() if os.path.exists(out) else ""


def _state(cluster, job):
    return subprocess.run(["squeue", "-t", "all", "-h", "-j", job, "-o", "%T"], env=cluster,
                          capture_output=True, text=True).stdout.strip()


def test_sbatch_trains_like_nproc(cluster, tmp_path):
    """5 steps of TP=2+SP with --dhelix on 2 srun tasks: the losses of the same run
    started with `dhelix train --nproc 2`; the output file holds log and result."""
    out_json = str(tmp_path / "slurm.json")
    r, job, log = _sbatch(cluster, str(tmp_path / "job.out"), *TRAIN, "--json", out_json)
    assert r.returncode == 0, r.stderr + log
    assert _state(cluster, job) == "COMPLETED"
    assert "iter    5/5" in log and "== result" in log and '"losses"' in log
    ref_json = str(tmp_path / "nproc.json")
    r = subprocess.run([sys.executable, "-m", "dhelix.cli", *TRAIN, "--nproc", "2",
                        "--json", ref_json, "--timeout", "300"], cwd=ROOT, capture_output=True,
                       text=True, timeout=400)
    assert r.returncode == 0, r.stderr
    a, b = json.load(open(out_json)), json.load(open(ref_json))
    assert a["config"]["world_size"] == 2 and a["config"]["schedule"] == "dhelix"
    assert a["losses"] == b["losses"]


def test_failing_rank_fails_the_job(cluster, tmp_path):
    r, job, log = _sbatch(cluster, str(tmp_path / "bad.out"), "train", "--config", "tiny",
                          "--tensor-model-parallel-size", "3", "--train-iters", "5")
    assert r.returncode != 0
    assert _state(cluster, job) == "FAILED"
    assert "world size 2 is not divisible by --tensor-model-parallel-size 3" in log


@pytest.mark.parametrize("ci", ["true", None])
def test_without_slurm_fails_in_ci_and_skips_elsewhere(tmp_path, ci):
    """The two tests above, run by pytest with no Slurm on PATH: under CI=true both fail
    (error at setup, naming what is missing); without CI both skip with that reason."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PATH"] = str(tmp_path)               # an empty folder: no sbatch, slurmd, ...
    if ci:
        env["CI"] = ci
    tests = [f"{__file__}::{t}" for t in ("test_sbatch_trains_like_nproc",
                                          "test_failing_rank_fails_the_job")]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                        *tests], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    out = r.stdout + r.stderr
    why = ("Slurm is not installed (sbatch, slurmctld, slurmd, munged missing)"
           if os.geteuid() == 0 else "needs root")
    assert why in out, out
    if ci:
        assert r.returncode == 1 and "2 errors" in out, out
        assert out.count("CI=true and the Slurm tests cannot run") >= 2, out
    else:
        assert r.returncode == 0 and "2 skipped" in out, out
        assert "CI=true" not in out, out


def _wait_for(pred, what, timeout=240):
    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, what()
        time.sleep(0.5)


def _text(path):
    return open(path).read() if os.path.exists(path) else ""


def _submit(cluster, out, *args, env=None):
    r = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2",
                        f"--output={out}", "scripts/slurm/dhelix.sbatch",
                        "configs/slurm/local.env", *args], cwd=ROOT,
                       env=dict(cluster, MASTER_PORT=str(free_port()), **(env or {})),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


LONG = ["train", "--config", "tiny", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--dhelix", "--log-interval", "1", "--checksums"]


@pytest.mark.timeout(600)
def test_time_limit_signal_saves_resubmits_and_finishes(cluster, tmp_path):
    """The signal Slurm sends before the time limit (#SBATCH --signal=B:USR1@300; sent
    here at once with `scancel --signal=USR1 --batch`, Slurm's own path to the batch
    shell: its timing, up to a minute early, is Slurm's): the ranks get SIGTERM
    (--exit-signal-handler), save and exit 0, the job is COMPLETED and submits itself
    again with --load; the second job goes on to the end. Every step's loss of the two
    jobs' logs and the final weights equal an uninterrupted `dhelix train --nproc 2`."""
    script = open(os.path.join(ROOT, "scripts", "slurm", "dhelix.sbatch")).read()
    assert "#SBATCH --signal=B:USR1@300" in script
    steps, ck, out = 40, str(tmp_path / "ck"), str(tmp_path / "first.out")
    flags = [*LONG, "--train-iters", str(steps), "--save", ck, "--exit-signal-handler"]
    job = _submit(cluster, out, *flags, "--json", str(tmp_path / "run.json"))
    _wait_for(lambda: "iter    3/" in _text(out), lambda: "no iteration 3: " + _text(out))
    r = subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=cluster,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    _wait_for(lambda: _state(cluster, job) not in ("PENDING", "RUNNING", "COMPLETING"),
              lambda: "job still running: " + _text(out))
    log1 = _text(out)
    assert _state(cluster, job) == "COMPLETED", log1
    assert "dhelix.sbatch: time limit near (USR1): SIGTERM to the ranks" in log1
    assert "SIGTERM received (--exit-signal-handler): exiting after iteration" in log1
    m = re.search(r"resubmitted as job (\d+) \(2 more allowed\)", log1)
    assert m, log1
    out2 = str(tmp_path / f"dhelix-{m.group(1)}.out")
    _wait_for(lambda: _state(cluster, m.group(1)) == "COMPLETED",
              lambda: f"second job {_state(cluster, m.group(1))}: " + _text(out2))
    log2 = _text(out2)
    assert f"resumed from {ck}/iter_" in log2 and f"iter   {steps}/{steps}" in log2, log2
    losses = [float(x) for x in re.findall(r" iter +\d+/\d+ \| loss ([0-9.]+)", log1 + log2)]
    ref_json = str(tmp_path / "straight.json")
    r = subprocess.run([sys.executable, "-m", "dhelix.cli", *flags[:-3], "--nproc", "2",
                        "--json", ref_json, "--timeout", "300"], cwd=ROOT,
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    ref = json.load(open(ref_json))
    assert losses == [float(f"{x:.6f}") for x in ref["losses"]]
    assert json.load(open(tmp_path / "run.json"))["weight_checksums"] == \
        ref["weight_checksums"]


@pytest.mark.timeout(300)
def test_scancel_leaves_no_rank(cluster, tmp_path):
    """`scancel` of a running job: within 10 s no process whose environment carries the
    job's marker is left (the batch shell, srun, both ranks)."""
    from test_stop import _marked
    marker = f"m{os.getpid()}x{free_port()}"
    out = str(tmp_path / "job.out")
    job = _submit(cluster, out, *LONG, "--train-iters", "100000",
                  env={"DHELIX_STOP_TEST": marker})
    _wait_for(lambda: "iter    2/" in _text(out), lambda: "no iteration 2: " + _text(out))
    assert len(_marked(f"DHELIX_STOP_TEST={marker}")) >= 2
    subprocess.run(["scancel", job], env=cluster, timeout=60, check=True)
    t = time.time()
    while _marked(f"DHELIX_STOP_TEST={marker}") and time.time() - t < 10:
        time.sleep(0.2)
    assert not _marked(f"DHELIX_STOP_TEST={marker}")
