"""What a new user meets: errors before any rank starts, a dead rank, help texts."""
import argparse
import os
import signal
import subprocess
import sys
import time

import pytest

TINY = ["--config", "tiny", "--tensor-model-parallel-size", "2", "--sequence-parallel"]


def dhelix(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dhelix.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("flags,message", [
    (["--micro-batch-size", "0"], "--micro-batch-size 0: must be a positive integer"),
    (["--micro-batch-size", "-1"], "--micro-batch-size -1: must be a positive integer"),
    (["--seq-length", "-5"], "--seq-length -5: must be a positive integer"),
    (["--train-iters", "0"], "--train-iters 0: must be a positive integer"),
    (["--data-path", "/nonexistent/corpus"],
     "--data-path /nonexistent/corpus: /nonexistent/corpus.bin not found"),
])
def test_bad_input_is_one_message_before_any_rank_starts(flags, message):
    t = time.time()
    r = dhelix("train", "--nproc", "2", *TINY, *flags)
    assert r.returncode == 2
    assert r.stderr.count(message) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert "rank" not in r.stderr.lower()          # no rank was started
    assert time.time() - t < 60


def test_plan_for_another_shape_names_the_field(tmp_path):
    """A plan made with `dhelix plan`'s defaults is checked against the run before any rank
    starts, and the message names the field that differs."""
    plan = tmp_path / "p.json"
    r = dhelix("plan", *TINY, "--seq-length", "128", "--cluster", "h100", "--out", str(plan))
    assert r.returncode == 0, r.stderr
    r = dhelix("train", "--nproc", "2", *TINY, "--seq-length", "64", "--dhelix",
               "--dhelix-plan", str(plan))
    assert r.returncode == 2
    assert "seq_length: plan 128, this run 64" in r.stderr and r.stderr.count("error") == 1
    # only the real difference: a field the plan does not record is not one
    assert "plan None" not in r.stderr, r.stderr
    assert "differs in seq_length: plan 128, this run 64; re-run" in r.stderr, r.stderr
    # plan's defaults are train's: a plan made without shape flags fits a default run
    r = dhelix("plan", *TINY, "--cluster", "h100", "--out", str(plan))
    assert r.returncode == 0, r.stderr
    r = dhelix("train", "--nproc", "2", *TINY, "--train-iters", "1", "--dhelix",
               "--dhelix-plan", str(plan), "--timeout", "200")
    assert r.returncode == 0, r.stderr[-2000:]


def test_dhelix_with_one_microbatch_warns_and_default_pairs():
    r = dhelix("train", "--nproc", "2", *TINY, "--train-iters", "1", "--dhelix",
               "--global-batch-size", "2", "--timeout", "200")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "pairs nothing" in r.stderr and "--global-batch-size" in r.stderr
    r = dhelix("train", "--nproc", "2", *TINY, "--train-iters", "1", "--dhelix",
               "--timeout", "200")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "microbatches=4" in r.stdout and "pairs nothing" not in r.stderr


def test_killed_rank_is_reported(tmp_path):
    """kill -9 of a rank mid-training: the job ends non-zero within 30 s and says which
    rank died, how, at what iteration, and that the others were stopped. The job's stdout
    and stderr go to files (a pipe nobody reads blocks a child that fills it); its log
    must reach iteration 3 within 120 s."""
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err_f:
        p = subprocess.Popen([sys.executable, "-m", "dhelix.cli", "train", "--nproc", "2",
                              *TINY, "--train-iters", "100000", "--log-interval", "1"],
                             stdout=out, stderr=err_f, stdin=subprocess.DEVNULL, text=True)
    try:
        deadline = time.time() + 120
        while "iter    3/" not in out_path.read_text():
            assert p.poll() is None, (f"the job ended (rc {p.returncode}) before iteration "
                                      f"3:\n{out_path.read_text()[-2000:]}"
                                      f"{err_path.read_text()[-3000:]}")
            assert time.time() < deadline, ("no iteration 3 within 120 s:\n"
                                             f"{out_path.read_text()[-2000:]}"
                                             f"{err_path.read_text()[-3000:]}")
            time.sleep(0.2)
        kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True,
                              text=True).stdout.split()
        assert len(kids) == 2, kids
        # rank 1 is the second child started
        os.kill(int(sorted(kids, key=int)[1]), signal.SIGKILL)
        t = time.time()
        p.wait(timeout=30)
        assert time.time() - t < 30
    finally:
        if p.poll() is None:                   # a failed check: stop the job and its ranks
            for kid in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True,
                                      text=True).stdout.split():
                os.kill(int(kid), signal.SIGKILL)
            p.kill()
            p.wait()
    err = err_path.read_text()
    assert p.returncode != 0
    assert "rank 1" in err and "SIGKILL" in err and "iteration" in err, err
    assert "stopped" in err and "rank 0" in err, err


def test_a_finished_rank_skips_the_interpreters_teardown(tmp_path):
    """A rank whose work is done exits without Python's finalization, where torch's and
    gloo's C++ threads can abort the process after every output was written (seen in CI:
    "terminate called without an active exception", SIGABRT, after `profile` wrote its
    table). Here an object that aborts when collected at teardown stands in for them; the
    atexit handlers (the shared-memory segments' unlink) still run."""
    marker = tmp_path / "atexit-ran"
    code = ("import atexit, os, runpy, sys\n"
            "class Bomb:\n    def __del__(self): os.abort()\n"
            "sys.modules['builtins'].bomb = Bomb()\n"
            f"atexit.register(lambda: open({str(marker)!r}, 'w').close())\n"
            f"sys.argv = ['dhelix', 'plan', '--config', 'tiny', '--cluster', 'a40', "
            f"'--out', {str(tmp_path / 'p.json')!r}]\n"
            "runpy.run_module('dhelix.cli', run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "p.json").exists() and marker.exists()


def test_a_death_after_the_work_is_said_to_be_at_exit(tmp_path, capsys):
    """The launcher's summary tells a rank that died while exiting, its output written,
    from one that never started (which it used to claim)."""
    from dhelix.train.dist import _report_failure
    _report_failure("dhelix profile", 1, -6, 2, str(tmp_path))
    assert "before its first iteration" in capsys.readouterr().err
    (tmp_path / "done.rank1").touch()
    _report_failure("dhelix profile", 1, -6, 2, str(tmp_path))
    err = capsys.readouterr().err
    assert "rank 1 was killed by signal 6 (SIGABRT) after its work was done" in err, err
    assert "first iteration" not in err


def test_fold_help_and_error():
    r = dhelix("train", "--help")
    assert "U-folded pipeline" in " ".join(r.stdout.split())
    r = dhelix("train", "--nproc", "2", *TINY, "--dhelix", "--dhelix-fold")
    assert r.returncode == 2 and "--dhelix-fold" in r.stderr
    assert "--pipeline-model-parallel-size 2 or more" in r.stderr


def _walk(parser):
    yield parser
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                yield from _walk(sub)


def test_every_option_has_help():
    from dhelix.cli import build_parser
    missing = []
    for p in _walk(build_parser()):
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not a.help or a.help == argparse.SUPPRESS:
                missing.append(f"{p.prog} {'/'.join(a.option_strings) or a.dest}")
    assert not missing, "options without help: " + ", ".join(missing)


def test_demo_runs_alternately_and_reports_spread(tmp_path):
    r = dhelix("demo", "--config", "tiny", "--train-iters", "2", "--repeats", "2",
               "--num-microbatches", "2", "--micro-batch-size", "2", "--seq-length", "32",
               "--out", str(tmp_path), timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "link: paced:1gbit" in r.stdout
    assert "tokens/s (median)" in r.stdout and "tokens/s (min-max)" in r.stdout
    assert "losses match: yes" in r.stdout
    order = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("=== ")]
    assert order == ["megatron", "dhelix", "megatron", "dhelix"]
    assert len(list(tmp_path.glob("*-1.json"))) == 2


def test_bad_link_is_one_message_with_one_prefix():
    r = dhelix("train", "--nproc", "2", *TINY, "--link", "paced:abc")
    assert r.returncode == 2
    assert r.stderr.strip() == ("dhelix: error: --link: cannot read rate 'abc' (use e.g. "
                                "2gbit, 500mbit)"), r.stderr


def test_memory_budget_takes_byte_units():
    """--dhelix-memory-budget reads sizes as `dhelix plan --memory-budget` does."""
    from dhelix.cli import build_parser
    p = build_parser()
    for text, v in (("2GiB", 2 * 2**30), ("500MB", 500e6), ("1e9", 1e9), ("123", 123)):
        a = p.parse_args(["train", "--dhelix", "--dhelix-memory-budget", text])
        assert a.dhelix_memory_budget == v
    r = dhelix("train", "--dhelix", "--dhelix-memory-budget", "2XB")
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == (
        "dhelix train: error: argument --dhelix-memory-budget: cannot read '2XB' as a size; "
        "write e.g. 2GiB, 500MB, 1.5G or a number of bytes"), r.stderr
