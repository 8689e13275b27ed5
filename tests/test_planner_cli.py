"""`dhelix plan | simulate | plan-sweep` (dhelix/cli/plan.py, simulate.py, plan_sweep.py), run
in-process."""
import json
import os

import pytest

from dhelix.cli import main
from dhelix.models.config import load_model_config
from dhelix.base.units import parse_bytes
from dhelix.planner.costmodel import analytical_table, load_cluster
from dhelix.planner.plan import Plan, validate
from dhelix.planner.shapes import layer_ops_for_shape

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config", "tiny", "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--seq-length", "128", "--micro-batch-size", "2"]
L8 = ["--config", "llama-8b", "--tensor-model-parallel-size", "8", "--sequence-parallel",
      "--seq-length", "4096", "--micro-batch-size", "1", "--bf16"]


def tiny_layer(seq=128):
    return layer_ops_for_shape(load_model_config("tiny"), 2, True, seq, 2)


def run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_tiny_a800_writes_a_valid_plan(tmp_path, capsys):
    out = str(tmp_path / "tiny.json")
    rc, stdout, err = run(["plan", *TINY, "--cluster", "a800", "--out", out], capsys)
    assert rc == 0, err
    p = Plan.load(out)
    validate(p, tiny_layer())
    m = p.meta
    assert m["predicted_s"] <= m["trivial_predicted_s"]
    assert m["shape"] == {"config": "tiny", "tp": 2, "sp": True, "seq": 128, "mbs": 2,
                          "bf16": False, "lane": "intra"}
    assert m["cost_source"]["kind"] == "cluster" and m["cost_source"]["name"] == "a800"
    assert m["layer"] == tiny_layer().to_json()
    # the printout: the plan table, predicted vs trivial, peak memory, planning time
    assert "forward (α)" in stdout and "backward (β)" in stdout
    assert "trivial plan" in stdout and "speedup" in stdout
    assert "peak mem" in stdout and "backend" in stdout


def test_plan_python_backend_gives_the_same_plan(tmp_path, capsys):
    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    # (the node-order search is C++ ≡ Python in test_reorder.py, on smaller layers: on
    # this one the Python search takes minutes)
    assert run(["plan", *TINY, "--cluster", "a800", "--out", a, "--backend", "python",
                "--no-reorder"], capsys)[0] == 0
    assert run(["plan", *TINY, "--cluster", "a800", "--out", b, "--no-reorder"],
               capsys)[0] == 0
    assert Plan.load(a).steps == Plan.load(b).steps
    assert Plan.load(a).meta["backend"] == "python"


@pytest.fixture(scope="module")
def llama_plan(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("l8") / "llama8b.json")
    assert main(["plan", *L8, "--cluster", "h100", "--out", out]) == 0
    return out


def test_plan_llama8b_tp8_sp_h100(llama_plan):
    p = Plan.load(llama_plan)
    layer = layer_ops_for_shape(load_model_config("llama-8b"), 8, True, 4096, 1, bf16=True)
    validate(p, layer)
    m = p.meta
    assert m["predicted_s"] < m["trivial_predicted_s"]          # TP comm to hide
    assert p.num_paired() > 0
    assert m["predicted_peak_bytes"] > 0 and m["planning_time_s"] >= 0
    assert m["cost_source"]["group_sizes"] == {"tp": 8} and m["cost_source"]["dtype"] == "bf16"


def test_simulate_writes_png_and_trace(llama_plan, capsys):
    rc, out, err = run(["simulate", llama_plan], capsys)
    assert rc == 0, err
    root = os.path.splitext(llama_plan)[0]
    png, trace = root + ".png", root + ".trace.json"
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(trace) as f:
        evs = json.load(f)["traceEvents"]
    assert any(e.get("ph") == "X" for e in evs)
    assert "makespan" in out and "peak memory" in out and "lane busy" in out
    assert "trivial plan" in out
    # the simulated makespan is what the planner predicted (same costs, same model)
    p = Plan.load(llama_plan)
    ms = float(out.split("makespan:")[1].split("ms")[0])
    assert ms == pytest.approx(p.meta["predicted_s"] * 1e3, rel=1e-3)


def test_simulate_explicit_outputs_and_other_cluster(llama_plan, tmp_path, capsys):
    png, trace = str(tmp_path / "t.png"), str(tmp_path / "t.json")
    rc, out, err = run(["simulate", llama_plan, "--cluster", "a40", "--png", png,
                        "--trace", trace], capsys)
    assert rc == 0, err
    assert os.path.getsize(png) > 0 and "traceEvents" in json.load(open(trace))
    assert "cluster a40" in out


def test_simulate_without_meta_needs_shape_flags(tmp_path, capsys):
    path = str(tmp_path / "p.json")
    assert run(["plan", *TINY, "--cluster", "a800", "--out", path], capsys)[0] == 0
    d = json.load(open(path))
    del d["meta"]["layer"], d["meta"]["shape"]
    json.dump(d, open(path, "w"))
    rc, out, err = run(["simulate", path], capsys)
    assert rc == 2 and err.startswith("dhelix simulate: error:") and "--config" in err
    assert "Traceback" not in err
    rc, out, err = run(["simulate", path, *TINY], capsys)
    assert rc == 0, err
    # a shape that is not the plan's is a validation error, not a traceback
    rc, out, err = run(["simulate", path, "--config", "tiny", "--tensor-model-parallel-size",
                        "2", "--seq-length", "256"], capsys)
    assert rc == 2 and "layer-shape" in err


def test_table_for_another_shape_refused_unless_forced(tmp_path, capsys):
    other = tiny_layer(seq=256)                   # same ops, different shape
    table = str(tmp_path / "other.json")
    analytical_table(other, load_cluster(os.path.join(REPO, "configs/clusters/a40.yaml")),
                     {"tp": 2}, dtype="fp32").save(table)
    out = str(tmp_path / "plan.json")
    rc, stdout, err = run(["plan", *TINY, "--table", table, "--out", out], capsys)
    assert rc == 2
    assert err.startswith("dhelix plan: error:") and err.count("\n") == 1
    assert other.signature() in err and tiny_layer().signature() in err
    assert "seq 128" in err and "--force" in err
    assert not os.path.exists(out)

    rc, stdout, err = run(["plan", *TINY, "--table", table, "--out", out, "--force"], capsys)
    assert rc == 0, err
    p = Plan.load(out)
    validate(p, tiny_layer())
    assert p.meta["cost_source"] == {"kind": "table", "path": os.path.abspath(table),
                                     "forced": True}
    # simulate from the plan alone reuses the forced table
    rc, stdout, err = run(["simulate", out], capsys)
    assert rc == 0, err
    assert "(forced)" in stdout


def test_missing_table_and_bad_cluster_are_one_line_errors(tmp_path, capsys):
    for extra, words in ((["--table", str(tmp_path / "nope.json")], "not found"),
                         (["--cluster", "no-such-cluster"], "a800"),
                         (["--cluster", "a800", "--memory-budget", "lots"], "memory-budget")):
        rc, out, err = run(["plan", *TINY, *extra, "--out", str(tmp_path / "x.json")], capsys)
        assert rc == 2 and err.startswith("dhelix plan: error:") and words in err, err
        assert err.count("\n") == 1 and "Traceback" not in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\npeak_flops: {bf16: -1}\n")
    rc, out, err = run(["plan", *TINY, "--cluster", str(bad)], capsys)
    assert rc == 2 and "peak_flops" in err


def test_memory_budget_too_small(tmp_path, capsys):
    rc, out, err = run(["plan", *TINY, "--cluster", "a800", "--memory-budget", "1KiB",
                        "--out", str(tmp_path / "x.json")], capsys)
    assert rc == 2 and err.startswith("dhelix plan: error:") and err.count("\n") == 1
    assert "over the budget" in err and "too much" in err
    # a budget that fits is honoured
    out_path = str(tmp_path / "ok.json")
    rc, out, err = run(["plan", *TINY, "--cluster", "a800", "--memory-budget", "1GiB",
                        "--out", out_path], capsys)
    assert rc == 0, err
    m = Plan.load(out_path).meta
    assert m["memory_budget_bytes"] == 2**30 and m["predicted_peak_bytes"] <= 2**30


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("500MB") == 500e6
    assert parse_bytes("1.5G") == 1.5 * 2**30
    assert parse_bytes("123") == 123
    for bad in ("", "x", "-1", "2 GX"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_plan_sweep(tmp_path, capsys):
    js, png = str(tmp_path / "sweep.json"), str(tmp_path / "sweep.png")
    rc, out, err = run(["plan-sweep", "--configs", "llama-8b", "gpt-6.7b", "--clusters", "h100",
                        "--json", js, "--png", png], capsys)
    assert rc == 0, err
    d = json.load(open(js))
    assert [(r["config"], r["cluster"]) for r in d["rows"]] == [("llama-8b", "h100"),
                                                                ("gpt-6.7b", "h100")]
    for r in d["rows"]:
        assert r["speedup"] >= 1.0 and r["predicted_s"] <= r["trivial_predicted_s"]
    assert d["setting"]["tp"] == 8 and d["setting"]["seq"] == 4096 and d["setting"]["bf16"]
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "| llama-8b" in out and "speedup" in out
    # the speedup is over the trivial plan, and says so (not over megatron)
    assert "| speedup vs trivial plan |" in out and "x the trivial plan" in out
    assert d["setting"]["speedup_vs"] == "trivial plan"


def test_plan_sweep_chart_title_fits(tmp_path, monkeypatch):
    """A long setting wraps: the whole title lies inside the picture."""
    import matplotlib.figure
    from dhelix.planner.sweep import sweep_chart
    seen = {}
    save = matplotlib.figure.Figure.savefig

    def savefig(fig, *a, **k):
        save(fig, *a, **k)
        r = fig.canvas.get_renderer()
        seen["title"] = fig.axes[0].title.get_window_extent(r)
        seen["fig"] = fig.bbox
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    rows = [{"config": "llama-8b", "cluster": c, "speedup": 1.3} for c in ("a800", "h100")]
    title = ("DHelix planner, predicted speedup vs trivial plan (TP=8, SP, seq 4096, mbs 1, "
             "bf16, lane intra, CP=2 (ring attention, 2048 tokens per rank, inter-node); "
             "DP=2 × TP=8 × CP=2 × PP=2 = 64 GPUs, 4 micro-batches per step)")
    sweep_chart(rows, str(tmp_path / "s.png"), title)
    t, f = seen["title"], seen["fig"]
    assert f.x0 <= t.x0 and t.x1 <= f.x1 and f.y0 <= t.y0 and t.y1 <= f.y1, (t, f)


def test_plan_sweep_reports_failing_combinations(tmp_path, capsys):
    js, png = str(tmp_path / "s.json"), str(tmp_path / "s.png")
    rc, out, err = run(["plan-sweep", "--configs", "tiny,llama-8b", "--clusters", "a800",
                        "--json", js, "--png", png, "--no-progress"], capsys)
    assert rc == 1                      # tiny has 4 heads: TP=8 is impossible
    rows = json.load(open(js))["rows"]
    assert "error" in rows[0] and "num_attention_heads" in rows[0]["error"]
    assert "speedup" in rows[1] and os.path.exists(png)


def test_plan_and_simulate_a_chunked_mlp(tmp_path, capsys):
    """`--dhelix-mlp-chunks 2`: the plan covers the chunked chains, its meta keeps the
    shape (so `simulate` replays it without the flag); without sequence parallel it is a
    one-line error naming the config and the fix."""
    out = str(tmp_path / "c2.json")
    rc, stdout, err = run(["plan", *TINY, "--dhelix-mlp-chunks", "2", "--cluster", "a800",
                           "--out", out], capsys)
    assert rc == 0, err
    p = Plan.load(out)
    assert p.meta["shape"]["mlp_chunks"] == 2 and "MLP in 2 chunks" in stdout
    assert {"ag_mlp.0", "ag_mlp.1", "rs_mlp.1"} <= set(p.forward)
    validate(p, layer_ops_for_shape(load_model_config("tiny"), 2, True, 128, 2,
                                    mlp_chunks=2))
    rc, stdout, err = run(["simulate", out, "--cluster", "a800"], capsys)
    assert rc == 0, err
    assert "MLP in 2 chunks" in stdout and "planner said:" in stdout
    rc, _, err = run(["plan", "--config", "tiny", "--tensor-model-parallel-size", "2",
                      "--dhelix-mlp-chunks", "2", "--cluster", "a800", "--out", out], capsys)
    assert rc == 2 and "sequence parallel" in err and len(err.strip().splitlines()) == 1


def test_plan_a_layer_that_keeps_its_gathers(tmp_path, capsys):
    """`--dhelix-keep-gathered`: the plan's layer has no backward re-gathers and the plain
    layer's table serves it (its ops are a subset, each the same work); the simulated peak
    grows by the kept gathered inputs; `simulate` replays it from the plan's meta; a table
    made for the keeping layer does not serve the plain one; without sequence parallel it
    is a one-line error."""
    from dhelix.planner.costs import CostTable, TableError
    plain = tiny_layer()
    keep = layer_ops_for_shape(load_model_config("tiny"), 2, True, 128, 2, keep_gathered=True)
    assert {o.name for o in plain.backward} - {o.name for o in keep.backward} == \
        {"ag_attn_w", "ag_mlp_w"}
    assert keep.signature() != plain.signature() and keep.tables_for()[1] == plain.signature()
    cl = load_cluster(os.path.join(REPO, "configs/clusters/a800.yaml"))
    table = str(tmp_path / "table.json")
    analytical_table(plain, cl, {"tp": 2}, dtype="fp32").save(table)
    outs = {}
    for name, flags in (("plain", []), ("keep", ["--dhelix-keep-gathered"])):
        outs[name] = str(tmp_path / f"{name}.json")
        rc, stdout, err = run(["plan", *TINY, *flags, "--table", table, "--out", outs[name]],
                              capsys)
        assert rc == 0, err
    p = Plan.load(outs["keep"])
    assert p.meta["shape"]["keep_gathered"] is True
    validate(p, keep)
    assert not {"ag_attn_w", "ag_mlp_w"} & set(p.backward)
    peak = {n: Plan.load(o).meta["predicted_peak_bytes"] for n, o in outs.items()}
    assert peak["keep"] > peak["plain"]
    rc, stdout, err = run(["simulate", outs["keep"], "--table", table], capsys)
    assert rc == 0, err
    assert "gathered inputs kept" in stdout
    with pytest.raises(TableError, match="signature"):
        analytical_table(keep, cl, {"tp": 2}).check(plain)
    rc, _, err = run(["plan", "--config", "tiny", "--tensor-model-parallel-size", "2",
                      "--dhelix-keep-gathered", "--cluster", "a800"], capsys)
    assert rc == 2 and "--sequence-parallel" in err and len(err.strip().splitlines()) == 1
    # one part kept: its re-gather gone, the other's kept; the peak between plain and both
    mlp = str(tmp_path / "mlp.json")
    rc, _, err = run(["plan", *TINY, "--dhelix-keep-gathered", "mlp", "--table", table,
                      "--out", mlp], capsys)
    assert rc == 0, err
    p = Plan.load(mlp)
    assert p.meta["shape"]["keep_gathered"] == "mlp"
    assert "ag_attn_w" in p.backward and "ag_mlp_w" not in p.backward
    assert peak["plain"] < p.meta["predicted_peak_bytes"] < peak["keep"]
    rc, stdout, err = run(["simulate", mlp, "--table", table], capsys)
    assert rc == 0 and "gathered inputs kept (mlp)" in stdout, err
    with pytest.raises(SystemExit):
        run(["plan", *TINY, "--dhelix-keep-gathered", "fc1", "--table", table], capsys)


def test_a_plan_that_gains_too_little_gives_way_to_the_trivial_plan(tmp_path, capsys):
    """`--min-gain`: the planner's best co-step against the trivial plan's. Just above the
    best plan's predicted gain the trivial plan is written (its meta says why, the
    printout too); just below, the best plan; 0 never gives way; out of [0, 1) refused."""
    out = str(tmp_path / "p.json")
    assert run(["plan", *TINY, "--cluster", "a800", "--out", out, "--min-gain", "0"],
               capsys)[0] == 0
    best = Plan.load(out)
    m = best.meta
    gain = m["co_step_layers"] * m["trivial_predicted_s"] / m["co_step_predicted_s"] - 1
    assert gain > 0.002 and best.num_paired() > 0 and "kept_trivial" not in m
    rc, stdout, _ = run(["plan", *TINY, "--cluster", "a800", "--out", out,
                         "--min-gain", f"{gain + 0.001:.6f}"], capsys)
    assert rc == 0
    triv = Plan.load(out)
    validate(triv, tiny_layer())
    assert triv.num_paired() == 0 and triv.rotation == 0
    assert triv.meta["kept_trivial"]["gain"] == pytest.approx(gain)
    assert triv.meta["predicted_s"] == triv.meta["trivial_predicted_s"]
    assert "kept the trivial plan" in stdout and f"{gain * 100:.1f}%" in stdout
    assert run(["plan", *TINY, "--cluster", "a800", "--out", out,
                "--min-gain", f"{gain - 0.001:.6f}"], capsys)[0] == 0
    assert Plan.load(out).steps == best.steps
    rc, _, err = run(["plan", *TINY, "--cluster", "a800", "--min-gain", "1.5"], capsys)
    assert rc == 2 and "--min-gain 1.5" in err


def test_a_run_says_when_it_keeps_the_trivial_plan(monkeypatch, capsys):
    """`dhelix train --dhelix --dhelix-cluster/--dhelix-overlap-table`: the plan book plans
    with `min_gain.MIN_GAIN`; a layer given the trivial plan for it says so on stdout."""
    from dhelix.planner import min_gain
    from dhelix.schedules.plans import plan_book_from_options
    book = plan_book_from_options({"cluster": "a800"}, 128, 2)
    ops = tiny_layer()
    ops.co_step_layers = 2
    monkeypatch.setattr(min_gain, "MIN_GAIN", 0.0)
    assert book.make_plan(ops).num_paired() > 0
    assert "trivial" not in capsys.readouterr().out
    monkeypatch.setattr(min_gain, "MIN_GAIN", 0.99)
    p = book.make_plan(ops)
    assert p.num_paired() == 0 and p.meta["kept_trivial"]["min_gain"] == 0.99
    out = capsys.readouterr().out
    assert "a800" in out and "running the trivial plan" in out
