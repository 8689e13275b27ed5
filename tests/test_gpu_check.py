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
    run can leave at most 8 files in $OUT; the order protects the timing: setup, lanes,
    fp32, timing, then the distributed optimizer and recompute; extras (Megatron-LM among
    them) come after."""
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
    assert sections == ["setup", "lanes", "fp32", "timing", "distopt", "recompute"]
    last_core = max(i for i, s in enumerate(p["steps"]) if not s["extra"])
    assert all(s["extra"] for s in p["steps"][last_core + 1:])
    assert all(s["extra"] for s in p["steps"] if s["gpus"] > 1)
    for s in p["steps"]:
        assert (s["timeout_s"] is None) == s["command"].startswith("@"), s
    by = {s["name"]: s for s in p["steps"]}
    assert "gpu_lanes_check.py" in by["lanes"]["command"]
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in by["lanes"]["command"]   # as dhelix train
    assert "gpu_megatron_lm.sh" in by["megatron-lm/dhelix"]["command"]
    assert by["megatron-lm/dhelix"]["extra"]
    # every pair of runs is compared, and the timing compare gates on the goals
    assert by["timing/compare"]["command"].endswith(" timing")
    assert by["megatron-lm/same-kernels"]["after"] == ["megatron-lm/sdpa",
                                                        "megatron-lm/dhelix"]
    for name in ("fp32", "distopt", "recompute", "moe", "fp16", "selective"):
        assert by[f"{name}/compare"]["command"].startswith("@compare "), name
        assert by[f"{name}/compare"]["after"] == [f"{name}/base", f"{name}/dhelix"]
    assert "hidden_dropout: 0.1" in by["recompute/base"]["command"]
    assert by["resume/compare"]["command"].startswith("@compare-resumed ")
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
    the summary and in hang.log; a later step that needs it skipped, a later independent
    step still run (a slow step costs only what depends on it)."""
    a = json.dumps({"losses": [1.0], "tokens_per_s": 1.0, "peak_memory_bytes": 1})
    plan = f"""
ok     | 10 |             | echo hello; echo 'RESULT {{"x": 1}}'
files  | 10 | keep=k.txt  | echo kept > $T/k.txt; echo '{a}' > $T/a.json; cp $T/a.json $T/b.json
bad    | 10 |             | echo boom >&2; exit 3
absent | 10 |             | echo "skip: no such thing here"; exit 77
dep    | 10 | after=bad   | echo never
cmp    | -  | after=files | @compare $T/a.json $T/b.json 1e-5
hang   | 2  |             | python3 -c "import time; print('waiting', flush=True); time.sleep(60)"
hdep   | 10 | after=hang  | echo never
later  | 10 |             | echo later
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
    assert by["hdep"]["status"] == "skip: needs hang (timeout)"
    assert by["later"]["status"] == "pass" and by["later"]["lines"] == ["later"]
    assert s["counts"] == {"pass": 4, "fail": 1, "skip": 3, "timeout": 1}
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


# ---- the gates, on planted wrong results ----------------------------------------------

def _result(steps=3, speed=1000.0, memory=2**30):
    """A `dhelix train --json --checksums` result of a few parameters."""
    names = ["embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight",
             "decoder.layers.0.self_attention.linear_qkv.bias"]
    grads = [{n: [0.01 * (i + 1) * (k + 1), 0.5 + i + k] for k, n in enumerate(names)}
             for i in range(steps)]
    return {"losses": [6.0 - 0.1 * i for i in range(steps)], "tokens_per_s": speed,
            "peak_memory_bytes": memory, "grad_checksums": grads,
            "weight_checksums": {n: [1.0 + k, 3.0 + k] for k, n in enumerate(names)}}


def _flip_grad(r, step=1, name="decoder.layers.0.mlp.linear_fc1.weight"):
    r = json.loads(json.dumps(r))
    r["grad_checksums"][step][name][0] *= -1        # a gradient sign flip
    return r


def _dropped_update(r, name="decoder.layers.0.self_attention.linear_qkv.bias"):
    r = json.loads(json.dumps(r))
    r["weight_checksums"][name] = [2.5, 4.0]        # the weight as it was before a step
    return r


def _compare(tmp_path, a, b, tol=1e-5, timing=False):
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    return gc.compare_runs(str(tmp_path / "a.json"), str(tmp_path / "b.json"), tol, timing)


def test_compare_gates_catch_planted_faults(tmp_path):
    """Equal runs pass; each planted fault fails with a line naming it: a gradient's sign
    flipped at one step (losses unchanged), a weight update dropped (final weights only),
    a parameter missing on one side, a NaN loss, 0.9x speed, 1.1x memory."""
    base = _result()
    ok, num, lines = _compare(tmp_path, base, base)
    assert ok and num["failures"] == 0 and not any(l.startswith("FAIL") for l in lines)
    ok, _, lines = _compare(tmp_path, base, _flip_grad(base))
    assert not ok and any("gradient step 2 decoder.layers.0.mlp.linear_fc1.weight" in l
                          for l in lines), lines
    ok, _, lines = _compare(tmp_path, base, _dropped_update(base))
    assert not ok and any(l.startswith("FAIL final weight decoder.layers.0.self_attention")
                          for l in lines), lines
    missing = json.loads(json.dumps(base))
    del missing["weight_checksums"]["embedding.word_embeddings.weight"]
    ok, _, lines = _compare(tmp_path, base, missing)
    assert not ok and any("only in the baseline" in l for l in lines), lines
    ok, _, lines = _compare(tmp_path, base, dict(base, losses=[6.0, float("nan"), 5.8]))
    assert not ok and any(l.startswith("FAIL losses: step 2") for l in lines), lines
    # a sum near zero of large entries is measured against its sum of squares' root
    near = json.loads(json.dumps(base))
    near["grad_checksums"][0]["embedding.word_embeddings.weight"] = [1e-9, 4.0]
    other = json.loads(json.dumps(near))
    other["grad_checksums"][0]["embedding.word_embeddings.weight"] = [2e-9, 4.0]
    assert _compare(tmp_path, near, other)[0]
    slow = dict(base, tokens_per_s=900.0)
    ok, num, lines = _compare(tmp_path, base, slow, 5e-2, timing=True)
    assert not ok and not num["goal_speed_met"] and "FAIL speed 0.900x < goal 0.97x" in lines
    assert _compare(tmp_path, base, slow)[0], "speed gates only the timing compare"
    ok, num, lines = _compare(tmp_path, base, dict(base, peak_memory_bytes=int(1.1 * 2**30)),
                              5e-2, timing=True)
    assert not ok and not num["goal_memory_met"]
    assert _compare(tmp_path, base, dict(base, tokens_per_s=980.0,
                                         peak_memory_bytes=int(1.04 * 2**30)), 5e-2, True)[0]


def test_compare_resumed(tmp_path):
    """A resumed run's steps against the straight run's last ones, and the weights."""
    straight = _result(steps=10)
    resumed = dict(straight, losses=straight["losses"][5:],
                   grad_checksums=straight["grad_checksums"][5:])
    for name, d in (("s", straight), ("r", resumed), ("bad", _dropped_update(resumed))):
        (tmp_path / f"{name}.json").write_text(json.dumps(d))
    ok, num, _ = gc.compare_resumed(tmp_path / "s.json", tmp_path / "r.json", 1e-5)
    assert ok and num["resumed_steps"] == 5
    ok, _, lines = gc.compare_resumed(tmp_path / "s.json", tmp_path / "bad.json", 1e-5)
    assert not ok and any("final weight" in l for l in lines)
    shifted = dict(resumed, losses=straight["losses"][4:9])      # one step off
    (tmp_path / "x.json").write_text(json.dumps(shifted))
    assert not gc.compare_resumed(tmp_path / "s.json", tmp_path / "x.json", 1e-5)[0]


def _record(plan, rec, faults=None):
    """Recorded results for every step of the real plan that writes one (its `--json`
    file, or a Megatron-LM log): equal runs, except the `faults` {step: fn(result)}."""
    faults = faults or {}
    good = _result(steps=10)
    log = "".join(f" iteration {i} | elapsed time per iteration (ms): 100.0 | lm loss: "
                  f"{6.0 - 0.01 * i:.6E} |\n" for i in range(1, 11))
    for s in plan["steps"]:
        key = s["name"].replace("/", "-")
        if "--json" in s["command"]:
            r = good
            if s["name"] == "resume/resumed":
                r = dict(good, losses=good["losses"][5:],
                         grad_checksums=good["grad_checksums"][5:])
            r = faults.get(s["name"], lambda x: x)(r)
            (rec / f"{key}.json").write_text(json.dumps(r))
        elif "gpu_megatron_lm.sh" in s["command"]:
            (rec / f"{key}.log").write_text(log)


@pytest.mark.parametrize("fault", ["none", "gradient sign", "dropped update", "speed 0.9x"])
def test_dry_run_of_the_whole_plan(tmp_path, fault):
    """scripts/gpu_check.sh --dry-run on recorded results, one GPU: every step of the real
    plan in its order, each command replaced by its recorded result, every gate judging
    them. Equal runs: everything runs and passes (the multi-GPU steps skip). A planted
    fault fails exactly its own gate: a gradient's sign flipped in the fp32 DHelix run, a
    dropped weight update in the distributed optimizer's DHelix run, 0.9x speed in the
    timing row's."""
    plan = _plan()
    rec = tmp_path / "rec"
    rec.mkdir()
    planted = {"none": ({}, None),
               "gradient sign": ({"fp32/dhelix": _flip_grad}, "fp32/compare"),
               "dropped update": ({"distopt/dhelix": _dropped_update}, "distopt/compare"),
               "speed 0.9x": ({"timing/dhelix": lambda r: dict(r, tokens_per_s=900.0)},
                              "timing/compare")}[fault]
    _record(plan, rec, planted[0])
    out = tmp_path / "out"
    r = subprocess.run(["bash", os.path.join(SCRIPTS, "gpu_check.sh"), "--gpus", "1",
                        "--dry-run", str(rec), "--out", str(out)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    s = json.loads((out / "summary.json").read_text())
    by = {x["name"]: x for x in s["steps"]}
    assert [x["name"] for x in s["steps"]] == [x["name"] for x in plan["steps"]]
    multi = set()                   # the steps that need 2 GPUs, or a step that does
    for x in plan["steps"]:
        if x["gpus"] > 1 or any(d in multi for d in x["after"]):
            multi.add(x["name"])
    single = [x for x in plan["steps"] if x["name"] not in multi]
    for x in single:
        want = "fail" if x["name"] == planted[1] else "pass"
        assert by[x["name"]]["status"] == want, (x["name"], by[x["name"]])
    assert len(multi) >= 10
    for name in multi:
        assert by[name]["status"].startswith("skip: needs "), name
    compares = [x["name"] for x in single if x["command"].startswith("@")]
    assert len(compares) >= 11 and all(by[c]["numbers"] for c in compares)
    assert by["timing/compare"]["numbers"]["goal_speed_met"] == (fault != "speed 0.9x")
    assert (r.returncode, s["status"]) == ((0, "pass") if fault == "none" else (1, "fail"))


# ---- device decisions on a GPU machine (stubbed: no GPU here) -------------------------

def test_a_rank_forced_to_cpu_patches_megatron_even_where_cuda_is_visible():
    """A stub, honestly: torch.cuda.is_available is made to answer True in a fresh
    process (no GPU here). With DHELIX_FORCE_CPU=1 (what every test rank sets) the process
    counts as CPU: the compat patches apply and megatron's buffers land on the CPU, the
    hardware is the CPU; without it they do not apply (the CUDA path, untested here)."""
    code = """
import json, torch
torch.cuda.is_available = lambda: True
from dhelix.base.hardware import hardware, uses_cuda
from dhelix.compat import cpu
applied = cpu.apply()
import megatron.core.tensor_parallel.mappings as m
print(json.dumps({"uses_cuda": uses_cuda(), "applied": applied,
                  "device": str(m.torch.cuda.current_device()) if applied else None,
                  "hardware": None if uses_cuda() else hardware()["device"].split(":")[0]}))
"""
    def run(force):
        env = dict(os.environ)
        env.pop("DHELIX_FORCE_CPU", None)
        if force:
            env["DHELIX_FORCE_CPU"] = "1"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, env=env, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])
    assert run(True) == {"uses_cuda": False, "applied": True, "device": "cpu",
                         "hardware": "cpu"}
    visible = run(False)
    assert visible["uses_cuda"] is True and visible["applied"] is False


def test_rng_state_of_the_other_device_is_not_restored(monkeypatch):
    """A save's RNG state records its device; one from the other device type is not
    restored (torch.cuda.set_rng_state would fail after the model and optimizer loaded)
    and says so in the `resumed from` line; a save without the record is told by its CUDA
    generator state's size. The GPU side is a stub: uses_cuda made to answer True."""
    import torch
    from dhelix.train import checkpoint as ck, rng_state
    cpu_state = {"cuda_rng_state": torch.get_rng_state(), "rng_device": "cpu"}
    legacy_cpu = {"cuda_rng_state": torch.get_rng_state()}
    legacy_gpu = {"cuda_rng_state": torch.zeros(16, dtype=torch.uint8)}
    assert [rng_state.device(s) for s in (cpu_state, legacy_cpu, legacy_gpu)] == \
        ["cpu", "cpu", "cuda"]
    assert rng_state.restorable(cpu_state) is None and rng_state.restorable(legacy_cpu) is None
    assert rng_state.restorable(legacy_gpu).startswith("RNG state, saved on CUDA; this run "
                                                    "is on cpu")
    monkeypatch.setattr(rng_state, "uses_cuda", lambda: True)
    assert "saved on cpu; this run is on CUDA" in rng_state.restorable(cpu_state)
    assert rng_state.restorable(legacy_gpu) is None
    r = ck.Resumed("ck/iter_0000002", 2, restored=["optimizer state"],
                   skipped=[rng_state.restorable(cpu_state)])
    assert r.line().startswith("resumed from ck/iter_0000002: iteration 2, optimizer "
                               "state (not restored: RNG state, saved on cpu")


def test_cuda_lane_events_carry_timing_only_for_a_trace():
    """CudaLanes' comm events are created without timestamps unless a trace's CUDA clock
    reads them (constructing the lanes touches no device)."""
    from dhelix.strand.lanes import CudaLanes
    from dhelix.strand.trace import CudaClock, clock_for
    lanes = CudaLanes()
    assert lanes.timing is False
    assert isinstance(clock_for(lanes), CudaClock) and lanes.timing is True
