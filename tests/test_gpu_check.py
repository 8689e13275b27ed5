"""scripts/gpu_check.sh, its plan and runner (scripts/gpu_check_plan.py, gpu_check_run.py), on CPU: the scripts
parse, the plan fits the lent machine (the worst case within 540 s, at most 8 files
back), and the runner's budget, timeouts, hang stop (SIGABRT with a faulthandler dump),
skips and summary work on synthetic plans of shell commands. No GPU check runs here, and
none is mocked: the lanes check itself only proves it skips without CUDA."""
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
LANES = os.path.join(SCRIPTS, "gpu_lanes_check.py")
RUNNER = os.path.join(SCRIPTS, "gpu_check_run.py")


def _module(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, name + ".py"))
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m      # dataclasses look their module up
    spec.loader.exec_module(m)
    return m


gc = _module("gpu_check_plan")


def _plan(*extra, env=None):
    r = subprocess.run(["bash", os.path.join(SCRIPTS, "gpu_check.sh"), "--plan", *extra],
                       capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=dict(os.environ, **(env or {})))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _run(plan, tmp_path, *args, timeout=60):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, RUNNER, "run", "--out", str(out), "--gpus", "1", *args],
                       input=plan, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    summary = json.loads((out / "summary.json").read_text())
    return r, summary, {s["name"]: s for s in summary["steps"]}, sorted(os.listdir(out))


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_megatron_lm.sh", "gpu_prep.sh"])
def test_shell_scripts_parse(script):
    r = subprocess.run(["bash", "-n", os.path.join(SCRIPTS, script)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


def test_plan_fits_the_lent_machine():
    """One GPU: the steps that always run, each at its timeout plus the SIGABRT->SIGKILL
    grace, with the GPU probe and the final reserve, end within 540 s with headroom; the
    run can leave at most 8 files in $OUT; the order is setup, lanes, fp32, Megatron-LM,
    timing; extras come after."""
    p = _plan()
    assert p["budget_s"] == 540 and p["gpus"] == 1
    core = [s for s in p["steps"] if s["runs_with_gpus"] and not s["extra"]]
    worst = p["probe_s"] + p["reserve_s"] + sum(
        (s["timeout_s"] + p["grace_s"]) if s["timeout_s"] else 1 for s in core)
    assert worst == p["worst_case_s"] <= 540 - 30, worst
    assert p["fits"] and p["headroom_s"] >= 30
    assert p["max_files"] == len(p["outputs"]) <= 8 and "summary.json" in p["outputs"]
    sections = []
    for s in core:
        if s["section"] not in sections:
            sections.append(s["section"])
    assert sections == ["setup", "lanes", "fp32", "megatron-lm", "timing"]
    last_core = max(i for i, s in enumerate(p["steps"]) if not s["extra"])
    assert all(s["extra"] for s in p["steps"][last_core + 1:])
    assert all(s["extra"] for s in p["steps"] if s["gpus"] > 1)
    for s in p["steps"]:
        assert (s["timeout_s"] is None) == s["command"].startswith("@"), s
    by = {s["name"]: s for s in p["steps"]}
    assert "gpu_lanes_check.py" in by["lanes"]["command"]
    assert "CUDA_DEVICE_MAX_CONNECTIONS=32" in by["lanes"]["command"]
    assert "gpu_megatron_lm.sh" in by["megatron-lm/dhelix"]["command"]
    assert by["setup"]["required"] and by["setup"]["gpus"] == 0
    # what --only and a smaller budget leave (a rerun)
    q = _plan("--budget", "240", "--only", "setup,lanes,fp32/base,fp32/dhelix,fp32/compare")
    assert q["fits"] and q["worst_case_s"] <= 240


def test_megatron_lm_section_is_self_contained():
    text = open(os.path.join(SCRIPTS, "gpu_megatron_lm.sh")).read()
    for flag in ("--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
                 "--no-persist-layer-norm"):
        assert flag in text
    assert ".megatron-lm" in text and "exit 77" in text
    prep = open(os.path.join(SCRIPTS, "gpu_prep.sh")).read()
    # the release users run today unless told otherwise (MCORE=0.16.1), with its own
    # Megatron-LM training code
    assert "MCORE=${MCORE:-0.19.2}" in prep and "megatron-core==$MCORE" in prep
    assert "../shared/megatron-lm-0.19" in prep and "--python-version 3.12" in prep
    ignored = open(os.path.join(ROOT, ".gitignore")).read().split()
    assert "/.megatron-lm/" in ignored and "/.whl/" in ignored    # carried, never committed


def test_budget_on_a_fake_clock():
    now = [100.0]
    b = gc.Budget(60, clock=lambda: now[0])
    assert b.left() == 60 and b.fits(60 - gc.RESERVE_S) and not b.fits(61 - gc.RESERVE_S)
    now[0] += 45
    assert b.elapsed() == 45 and b.left() == 15
    assert b.fits(5) and not b.fits(6)


def test_parse_plan_refuses_bad_lines():
    ok = gc.parse_plan("# c\na | 5 | | echo a\nb | - | after=a | @compare x y 1\n")
    assert [s.cost for s in ok] == [5 + gc.GRACE_S, 1] and ok[1].after == ("a",)
    for bad in ("a | 5 | | @compare x y 1",              # a builtin with a timeout
                "a | - | | echo a",                       # a command without one
                "a | 0 | | echo a",
                "a | 5 | nope | echo a",
                "a | 5 | after=b | echo a",               # after a step not (yet) there
                "a | 5 | | echo a\na | 5 | | echo b",     # twice
                "a | 5 | keep=../x | echo a",
                "a | 5 |",
                "a | 5 | keep=" + ",".join(f"f{i}" for i in range(5)) + " | echo"):  # > 8 files
        with pytest.raises(ValueError):
            gc.parse_plan(bad)


def test_compare_builtins(tmp_path):
    base = {"losses": [2.0, 1.5], "tokens_per_s": 1000.0, "peak_memory_bytes": 2**30,
            "peak_memory_total_bytes": 2 * 2**30,
            "grad_checksums": [{"w": [1.0, 4.0]}, {"w": [1.0, 2.0]}]}
    same = dict(base, tokens_per_s=990.0, peak_memory_bytes=int(1.02 * 2**30))
    off = dict(base, losses=[2.0, 1.6])
    for name, d in (("a", base), ("b", same), ("c", off)):
        (tmp_path / f"{name}.json").write_text(json.dumps(d))
    ok, num, lines = gc.compare_runs(tmp_path / "a.json", tmp_path / "b.json", 1e-5, True)
    assert ok and num["loss_max_rel_diff"] == 0 and num["speed_ratio"] == pytest.approx(0.99)
    assert num["goal_speed_met"] and num["goal_memory_met"] and len(lines) == 2
    ok, num, _ = gc.compare_runs(tmp_path / "a.json", tmp_path / "c.json", 1e-5)
    assert not ok and num["loss_max_rel_diff"] == pytest.approx(0.1 / 1.5)
    log = "".join(f" iteration {i} | elapsed time per iteration (ms): {ms} | lm loss: {l} |\n"
                  for i, (ms, l) in enumerate([(900, 10.5), (100, 9.0), (100, 8.0)]))
    (tmp_path / "m.log").write_text(log)
    (tmp_path / "d.log").write_text(log.replace("lm loss: 8.0", "lm loss: 8.08"))
    ok, num, _ = gc.compare_logs(tmp_path / "m.log", tmp_path / "d.log", 2e-2)
    assert ok and num["iterations"] == [3, 3] and num["loss_max_rel_diff"] == pytest.approx(0.01)
    assert num["iter_ms"] == [100.0, 100.0]
    (tmp_path / "e.log").write_text("crashed\n")
    ok, num, _ = gc.compare_logs(tmp_path / "m.log", tmp_path / "e.log", 2e-2)
    assert not ok and num["iterations"] == [3, 0]


def test_runner_stops_at_a_hang_with_the_stacks(tmp_path):
    """pass, fail (its log kept), skip by exit 77, skip after a failed step, a kept file, a
    builtin, then a Python step that hangs: SIGABRT at its timeout, faulthandler's dump in
    the summary and in hang.log, and every later step skipped."""
    a = json.dumps({"losses": [1.0], "tokens_per_s": 1.0, "peak_memory_bytes": 1})
    plan = f"""
ok     | 10 |             | echo hello; echo 'RESULT {{"x": 1}}'
files  | 10 | keep=k.txt  | echo kept > $T/k.txt; echo '{a}' > $T/a.json; cp $T/a.json $T/b.json
bad    | 10 |             | echo boom >&2; exit 3
absent | 10 |             | echo "skip: no such thing here"; exit 77
dep    | 10 | after=bad   | echo never
cmp    | -  | after=files | @compare $T/a.json $T/b.json 1e-5
hang   | 2  |             | python3 -c "import time; print('waiting', flush=True); time.sleep(60)"
later  | 10 |             | echo never
"""
    t0 = time.monotonic()
    r, s, by, files = _run(plan, tmp_path)
    assert time.monotonic() - t0 < 30
    assert r.returncode == 2 and s["status"] == "hang", r.stdout + r.stderr
    assert by["ok"]["status"] == "pass" and by["ok"]["numbers"] == {"x": 1}
    assert by["ok"]["lines"][0] == "hello"
    assert by["bad"]["status"] == "fail" and by["bad"]["rc"] == 3 and "boom" in by["bad"]["tail"]
    assert by["absent"]["status"] == "skip: no such thing here"
    assert by["dep"]["status"] == "skip: needs bad (fail)"
    assert by["cmp"]["status"] == "pass" and by["cmp"]["numbers"]["loss_max_rel_diff"] == 0
    assert by["files"]["files"] == ["k.txt"]
    h = by["hang"]
    assert h["status"] == "timeout" and 2 <= h["seconds"] < 2 + gc.GRACE_S + 3
    assert "most recent call first" in h["tail"] and "<string>" in h["tail"], h["tail"]
    assert by["later"]["status"] == "skip: after the hang in hang"
    assert s["counts"] == {"pass": 3, "fail": 1, "skip": 3, "timeout": 1}
    assert files == sorted(s["files"]) == ["fail-1-of-3.log", "hang.log", "k.txt",
                                           "summary.json"]
    assert "most recent call first" in (tmp_path / "out" / "hang.log").read_text()
    assert any("gpu check: hang" in l for l in s["log"])


def test_runner_budget_and_required(tmp_path):
    """A step whose timeout no longer fits is skipped, never squeezed; a failed `required`
    step ends the run; --only leaves the rest unselected."""
    plan = """
a    | 5  |          | true
big  | 30 |          | true
c    | 5  | extra    | true
"""
    r, s, by, _ = _run(plan, tmp_path, "--budget", "35")
    assert [by[n]["status"].split(" (")[0] for n in ("a", "big", "c")] == [
        "pass", "skip: no time left", "pass"]
    assert r.returncode == 0 and s["status"] == "pass"
    r, s, by, _ = _run("setup | 5 | required | exit 1\nnext | 5 | | true\n", tmp_path)
    assert by["setup"]["status"] == "fail" and by["next"]["status"] == "skip: setup failed"
    assert r.returncode == 1
    r, s, by, _ = _run("a | 5 | | true\nb | 5 | | true\n", tmp_path, "--only", "b")
    assert by["a"]["status"].startswith("skip: not selected") and by["b"]["status"] == "pass"


def test_runner_caps_the_files_it_leaves(tmp_path):
    m = gc.Summary(str(tmp_path / "out"), {})
    src = tmp_path / "x"
    src.write_bytes(b"0123456789" * 10)
    got = [m.copy_in(str(src), f"f{i}", tail_bytes=25) for i in range(10)]
    assert got == [f"f{i}" for i in range(gc.OUT_FILES_MAX - 1)] + [None] * 3
    assert (tmp_path / "out" / "f0").read_bytes().endswith(b"56789" * 1)
    assert len((tmp_path / "out" / "f0").read_bytes().split(b"\n", 1)[1]) == 25


def test_runner_interrupted_leaves_a_summary(tmp_path):
    """SIGTERM from outside: the running step's group is killed and the summary says so."""
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, RUNNER, "run", "--out", str(out), "--gpus", "1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    p.stdin.write("long | 60 | | sleep 60\n")
    p.stdin.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (out / "summary.json").exists() and '"running"' in (out / "summary.json").read_text():
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 2
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "hang" and s["steps"][0]["status"] == "interrupted (SIGTERM)"


def test_lanes_check_skips_without_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the lanes check belongs to scripts/gpu_check.sh")
    r = subprocess.run([sys.executable, LANES], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 77, r.stderr
    res = json.loads(re.search(r"^RESULT (.*)$", r.stdout, re.M).group(1))
    assert res == {"status": "skip", "reason": "no CUDA device"}
