"""What a new user met (issue 24): the launcher names the first rank to fail, Ctrl-C is
one line, step lines carry elapsed time and ETA, the trace picture is readable."""
import json
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


# ---- the first rank to fail ------------------------------------------------------------

def _child_with_rank(parent: int, rank: int, deadline: float) -> int:
    """The pid of `parent`'s child process started as RANK=`rank`."""
    while time.time() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if ppid == parent and f"RANK={rank}".encode() in env:
                return int(pid)
        time.sleep(0.2)
    raise AssertionError(f"no child of {parent} with RANK={rank}")


def test_launcher_names_the_first_rank_to_fail():
    """Rank 1 killed mid-run (as the OOM killer would): rank 0 then dies of a lost
    connection in its next collective. The launcher names rank 1, how it died and at what
    iteration, and leaves rank 0's lost connection out."""
    p = subprocess.Popen([sys.executable, "-m", "dhelix.cli", "train", "--nproc", "2", *TINY,
                          "--train-iters", "1000", "--timeout", "200"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stdout:                           # training has started
            if line.startswith(" iter    2/"):
                break
        os.kill(_child_with_rank(p.pid, 1, time.time() + 60), signal.SIGKILL)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("dhelix train: rank 1 was killed by signal 9 (SIGKILL) at "
                           "iteration "), err[-3000:]
    assert last.endswith("; stopped the other rank (rank 0)"), err[-3000:]
    assert "closed by peer" not in err.lower() and "reset by peer" not in err.lower(), \
        err[-3000:]
    assert "[rank0]" not in err, err[-3000:]


def _status(folder, crashes):
    """A status folder holding the crash records ranks leave: rank -> (time, error)."""
    folder.mkdir()
    for rank, (t, error) in crashes.items():
        (folder / f"crash.rank{rank}").write_text(json.dumps({"time": t, "error": error}))
    return str(folder)


LOST = ("Traceback (most recent call last):\n  ...\nRuntimeError: [pair.cc:553] "
        "Connection closed by peer [127.0.0.1]:6065.\n")
OWN = "Traceback (most recent call last):\n  ...\nRuntimeError: bad file\n"


def test_first_failure_by_time_and_cause(tmp_path):
    """Which rank `spawn_local` names: the earliest recorded failure, not the lowest rank
    seen in one poll; a rank that only lost its peer comes after one that failed of its
    own (its record can be earlier: the failed rank tears down before its hook runs);
    a rank that recorded its failure but was stopped while tearing down still counts."""
    from dhelix.train.dist import _first_failure
    # no records (killed ranks): the exit seen first
    assert _first_failure(str(tmp_path), {0: (2.0, 1), 1: (1.0, -9)}, 2) == (1, -9)
    # both seen in one poll: the recorded times decide
    st = _status(tmp_path / "a", {0: (1.2, OWN), 1: (1.1, OWN)})
    assert _first_failure(st, {0: (1.5, 1), 1: (1.5, 1)}, 2) == (1, 1)
    # rank 0 lost its peer, even if it recorded that first
    st = _status(tmp_path / "b", {0: (1.0, LOST), 1: (1.1, OWN)})
    assert _first_failure(st, {0: (1.5, 1), 1: (1.5, 1)}, 2) == (1, 1)
    # rank 1 recorded its exception, then was stopped before it exited
    assert _first_failure(st, {0: (1.5, 1)}, 2) == (1, None)
    # everyone lost a peer: the earliest of them
    st = _status(tmp_path / "c", {0: (1.3, LOST), 1: (1.2, LOST)})
    assert _first_failure(st, {0: (1.5, 1), 1: (1.5, 1)}, 2) == (1, 1)


# ---- Ctrl-C ----------------------------------------------------------------------------

def _terminal_sigint():
    """SIGINT as a terminal leaves it. pytest run in the background of a non-interactive
    shell (`pytest ... &`) ignores SIGINT, and an ignored SIGINT is inherited through exec:
    the launcher would never see the Ctrl-C this test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("to", ["launcher", "process group"])
def test_ctrl_c_is_one_line(tmp_path, to):
    """SIGINT to the launcher (or, as a terminal's Ctrl-C does, to its whole process
    group, ranks included) mid-training: the ranks are stopped, exit code 130, one line
    on stderr, no traceback from the launcher or any rank."""
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err_f:
        p = subprocess.Popen([sys.executable, "-m", "dhelix.cli", "train", "--nproc", "2",
                              *TINY, "--train-iters", "100000", "--log-interval", "1"],
                             stdout=out, stderr=err_f, stdin=subprocess.DEVNULL,
                             start_new_session=True, preexec_fn=_terminal_sigint)
    try:
        deadline = time.time() + 120
        while "iter    2/" not in out_path.read_text():
            assert p.poll() is None, err_path.read_text()[-3000:]
            assert time.time() < deadline, err_path.read_text()[-3000:]
            time.sleep(0.2)
        kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True,
                              text=True).stdout.split()
        assert len(kids) == 2, kids
        if to == "launcher":
            os.kill(p.pid, signal.SIGINT)
        else:
            os.killpg(p.pid, signal.SIGINT)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    err = err_path.read_text()
    assert p.returncode == 130, err[-3000:]
    assert err.strip() == "dhelix train: SIGINT received: stopped 2 ranks", err[-3000:]
    for k in kids:          # the ranks are gone (reaped by the launcher)
        assert not os.path.exists(f"/proc/{k}") or \
            open(f"/proc/{k}/stat").read().split()[2] == "Z", k


# ---- step lines ------------------------------------------------------------------------

def test_step_lines_carry_elapsed_and_eta():
    r = dhelix("train", "--nproc", "2", *TINY, "--train-iters", "3", "--timeout", "200")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [l for l in r.stdout.splitlines() if l.startswith(" iter ")]
    assert [l.split("|")[0] for l in lines] == [" iter    1/3 ", " iter    2/3 ",
                                                " iter    3/3 "]
    for l in lines:
        fields = [f.strip() for f in l.split("|")]
        assert len(fields) == 9, l
        assert fields[1].startswith("loss ") and fields[2].endswith("tokens/s")
        assert fields[3].endswith(" ms") and fields[4].startswith("peak act. ")
        assert fields[5].startswith("lr ") and fields[6].startswith("grad norm ")
        assert fields[7].startswith("elapsed ") and fields[8].startswith("ETA "), l
    assert lines[-1].endswith("ETA 0:00:00")


def test_progress_clock():
    from dhelix.train.trainer import clock, progress_clock
    assert clock(0) == "0:00:00" and clock(59.6) == "0:01:00"
    assert clock(3 * 3600 + 25 * 60 + 7) == "3:25:07" and clock(30 * 3600) == "30:00:00"
    # the first (warm-up) step is left out of the rate once there are others
    assert progress_clock(12.0, [10.0, 1.0, 1.0], 1003) == "elapsed 0:00:12 | ETA 0:16:40"
    assert progress_clock(2.0, [2.0], 4) == "elapsed 0:00:02 | ETA 0:00:06"
    assert progress_clock(5.0, [2.0, 3.0], 2) == "elapsed 0:00:05 | ETA 0:00:00"


# ---- the trace picture -----------------------------------------------------------------

def _events():
    """Two micro-batches: F1 alone, F2 ∥ B1, B2 alone (ms: 0-10, 10-30, 30-40)."""
    from dhelix.strand.trace import TraceEvent as E
    return [E("α", "ag_attn", "intra", 0.000, 0.008, 0, "F1"),
            E("α", "qkv", "compute", 0.008, 0.0082, 1, "F1"),        # too narrow to name
            E("α", "rs_attn", "intra", 0.010, 0.020, 2, "F2"),
            E("β", "fc1_wgrad", "compute", 0.012, 0.028, 2, "B1"),
            E("β", "ag_attn_w", "intra", 0.030, 0.040, 3, "B2")]


def test_trace_picture_names_ops_marks_phases_has_legend():
    import matplotlib.pyplot as plt
    from dhelix.strand.trace import phases, timeline_figure
    ev = _events()
    assert [(k, l) for k, l, _, _ in phases(ev)] == [("F", "F(1)"), ("F∥B", "F(2) ∥ B(1)"),
                                                     ("B", "B(2)")]
    fig = timeline_figure(ev, "rank 0")
    try:
        ax = fig.axes[0]
        texts = [t.get_text() for t in ax.texts]
        for name in ("ag_attn", "rs_attn", "fc1_wgrad", "ag_attn_w"):   # wide enough
            assert name in texts, texts
        assert "qkv" not in texts                                        # does not fit
        for mark in ("F(1)", "F(2) ∥ B(1)", "B(2)"):
            assert mark in texts, texts
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert legend == ["α: forward ops", "β: backward ops", "F alone (first forward)",
                          "F ∥ B (paired)", "B alone (last backward)"]
        assert [t.get_text() for t in ax.get_yticklabels()] == ["compute", "intra"]
    finally:
        plt.close(fig)


def test_trace_phases_of_the_paired_tail():
    """`--dhelix-pair-last`: F(1) and F(2) alone, F(3) ∥ B(1), then B(2) and B(3) both β
    and overlapping in time: one phase, B(2) ∥ B(3), drawn with its own legend entry."""
    import matplotlib.pyplot as plt
    from dhelix.strand.trace import TraceEvent as E, phases, timeline_figure
    ev = [E("α", "qkv", "compute", 0.000, 0.010, 0, "F1"),
          E("α", "qkv", "compute", 0.010, 0.020, 1, "F2"),
          E("α", "qkv", "compute", 0.020, 0.030, 2, "F3"),
          E("β", "fc1_wgrad", "compute", 0.021, 0.029, 2, "B1"),
          E("β", "fc1_wgrad", "compute", 0.030, 0.035, 3, "B2"),
          E("β", "ag_attn_w", "intra", 0.032, 0.040, 4, "B3"),
          E("β", "fc1_wgrad", "compute", 0.036, 0.045, 5, "B2")]
    got = [(k, l, round(t0 * 1e3), round(t1 * 1e3)) for k, l, t0, t1 in phases(ev)]
    assert got == [("F", "F(1)", 0, 10), ("F", "F(2)", 10, 20),
                   ("F∥B", "F(3) ∥ B(1)", 20, 30), ("B∥B", "B(2) ∥ B(3)", 30, 45)]
    fig = timeline_figure(ev, "rank 0")
    try:
        legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert "B ∥ B (the paired last two)" in legend
    finally:
        plt.close(fig)


def test_time_report_per_phase_with_the_link_track():
    """Where the time goes, from the events of `_events` and three link transfers
    (0-5, 15-25, 20-30 ms): each phase's span and the shares of it the compute lane and
    the link were busy (a union: the overlapping transfers count once), the time between
    the phases, and the whole; the link track never makes a phase of its own."""
    from dhelix.strand.trace import LINK, TraceEvent, link_events, phases, time_report
    link = link_events([(100.000, 100.005), (100.015, 100.025), (100.020, 100.030)], 100.0)
    assert all(e.lane == LINK for e in link)
    ev = _events() + link
    assert [l for _, l, _, _ in phases(ev)] == ["F(1)", "F(2) ∥ B(1)", "B(2)"]
    rnd = lambda v: None if v is None else round(v, 4)
    got = {r["phase"]: (round(r["seconds"] * 1e3, 3), rnd(r["compute_busy"]),
                        rnd(r["link_busy"])) for r in time_report(ev)}
    assert got == {"F(1)": (8.2, round(0.2 / 8.2, 4), round(5 / 8.2, 4)),
                   "F(2) ∥ B(1)": (18.0, round(16 / 18, 4), round(13 / 18, 4)),
                   "B(2)": (10.0, 0.0, 0.0),
                   "between phases": (3.8, None, round(2 / 3.8, 4)),
                   "whole (traced)": (40.0, round(16.2 / 40, 4), 0.5)}, got
    assert time_report(link) == []          # no layer op traced: nothing to report
    assert isinstance(ev[0], TraceEvent)


def test_trace_files_carry_the_rank_on_rank_0_too(tmp_path):
    from dhelix.strand.trace import trace_files, write_trace
    path = str(tmp_path / "t" / "trace.json")
    assert trace_files(path, 0) == (str(tmp_path / "t" / "trace.rank0.json"),
                                    str(tmp_path / "t" / "trace.rank0.png"))
    written = write_trace(_events(), path, 0)
    assert written == list(trace_files(path, 0)) + [str(tmp_path / "t" / "trace.rank0.md")]
    assert sorted(os.listdir(tmp_path / "t")) == ["trace.rank0.json", "trace.rank0.md",
                                                  "trace.rank0.png"]
    assert os.path.getsize(written[1]) > 1000
    md = open(written[2]).read()
    assert "| F(2) ∥ B(1) | 18.0 | 89% | - |" in md, md     # no link track: no link share
    assert trace_files(str(tmp_path / "tr"), 3) == (str(tmp_path / "tr.rank3.json"),
                                                     str(tmp_path / "tr.rank3.png"))
