"""`dhelix advise` (dhelix/advise/): the legal layouts, their prices and the outputs.

Asserted: every enumerated layout is legal by megatron's rules and fills the GPUs; the
pipeline prices of long steps (simulated short and extended along the schedule's period)
equal the full simulation; a rank's weights are what megatron's GPT allocates (counted
from a real model); DHelix's PP = 1 step keeps one layer more than megatron's, with the
paired tail L more, priced as the whole-step simulator prices it; the CLI
writes the table, the picture, a plan that validates against the chosen layout's layer,
a command and an sbatch file with that layout's flags, ranks the fitting layouts by
tokens/s; bad input is one message each.
"""
import json
import subprocess
import sys

import pytest

from dhelix.advise.layouts import Layout, enumerate_layouts
from dhelix.models.config import load_model_config


def _advise(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dhelix.cli", "advise", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("config,gpus", [("llama3-70b", 64), ("phi-3.5-moe", 32)])
def test_layouts_are_legal(config, gpus):
    m = load_model_config(config)
    got = list(enumerate_layouts(m, gpus, 8, 4096, 256))
    assert got
    for lo in got:
        assert lo.tp * lo.cp * lo.pp * lo.dp == gpus and lo.tp <= 8
        assert m.num_attention_heads % lo.tp == 0 and 4096 % (2 * lo.cp) == 0
        assert lo.mbs * lo.dp * lo.microbatches == 256
        if lo.pp > 1:
            assert m.num_layers % (2 * lo.pp) == 0 and lo.microbatches >= lo.pp
            assert lo.schedule in ("1f1b", "interleaved", "fold")
            if lo.schedule == "interleaved":
                assert lo.microbatches % lo.pp == 0
        else:
            assert lo.schedule in ("megatron", "dhelix", "pair-last")
            if lo.schedule == "pair-last":   # --dhelix-pair-last's own refusals
                assert not m.num_experts and not lo.recompute and lo.microbatches >= 2
        if m.num_experts:
            assert m.num_experts % lo.ep == 0 and lo.dp % lo.ep == 0 and lo.cp == 1
        else:
            assert lo.ep == 1
    assert {lo.ep for lo in got} > {1} if load_model_config(config).num_experts else True
    assert any(lo.schedule == "pair-last" for lo in got) == (not m.num_experts)


def test_long_pipelines_priced_as_simulated():
    from dhelix.advise.price import _pipelines
    from dhelix.planner.pipeline import LayerCosts, simulate_pipeline
    lc = LayerCosts(1.0, 2.1, 2.6, 100.0, 10.0)
    for L, pp, N in ((16, 2, 40), (80, 5, 100), (80, 8, 96)):
        full = simulate_pipeline(lc, L, pp, N, 0.3, vpp_layers=L // (2 * pp))
        got = _pipelines(lc, L, pp, N, 0.3)
        for k, r in full.items():
            assert got[k][0] == pytest.approx(r.makespan, rel=1e-9)
            assert got[k][1] == pytest.approx(max(r.peak_bytes))
    # not a multiple of PP (no interleaved): within 0.1%
    full = simulate_pipeline(lc, 32, 4, 37, 0.3)
    got = _pipelines(lc, 32, 4, 37, 0.3)
    assert set(got) == set(full)
    for k, r in full.items():
        assert got[k][0] == pytest.approx(r.makespan, rel=1e-3)


def test_weights_per_gpu_are_megatrons():
    """A rank's parameters as `dhelix advise` counts them, against the GPT megatron-core
    builds (one rank: TP=1)."""
    from megatron.core import parallel_state as ps
    from dhelix.advise.price import Pricer
    from dhelix.planner.costmodel import load_cluster
    from dhelix.testing import run_ranks
    from spec_fns import count_params
    for name in ("tiny-llama-emu", "tiny-moe-emu"):
        got = run_ranks(count_params, 1, name, timeout=300)[0]
        m = load_model_config(name)
        p = Pricer(m, load_cluster("configs/clusters/a40.yaml"), 64, 2, "fp32")
        want = p.price(Layout(1, 1, 1, 1, 1, 1, 2, "megatron", False)).memory["weights"]
        assert got * 4 == want, (name, got)
    assert ps is not None


def test_dhelix_keeps_one_layer_more_at_pp1():
    from dhelix.advise.price import Pricer
    from dhelix.planner.costmodel import load_cluster
    m = load_model_config("llama-8b")
    p = Pricer(m, load_cluster("configs/clusters/a40.yaml"), 4096, 64)
    meg, dh = (p.price(Layout(8, 1, 1, 8, 1, 1, 8, s, False)) for s in ("megatron", "dhelix"))
    lc = p._costs(meg.layout)
    assert dh.memory["activations"] - meg.memory["activations"] == pytest.approx(lc.saved)
    assert dh.layers_s < meg.layers_s          # the paired steps overlap the TP collectives
    rc = p.price(Layout(8, 1, 1, 8, 1, 1, 8, "megatron", True))
    assert rc.memory["activations"] < meg.memory["activations"] and rc.step_s > meg.step_s


def test_pair_last_priced_as_the_whole_step_simulator():
    """`pair-last` (--dhelix-pair-last): L·(2f + (N−2)·pair + tail), the tail the whole-step
    simulator's B(N−1) ∥ B(N) layer; the DP reduce-scatter hides behind the L tail layers
    instead of B(N)'s; twice megatron's activations; its command carries the flag."""
    from dhelix.advise.price import Pricer
    from dhelix.advise.report import megatron_flags
    from dhelix.planner.costmodel import load_cluster
    from dhelix.planner.costs import StepExtras
    from dhelix.planner.whole_step import simulate_step
    m = load_model_config("llama-8b")
    p = Pricer(m, load_cluster("configs/clusters/a40.yaml"), 4096, 256)
    lo = {s: Layout(4, 1, 1, 16, 1, 1, 16, s, False) for s in ("megatron", "dhelix",
                                                                "pair-last")}
    meg, dh, last = (p.price(lo[s]) for s in ("megatron", "dhelix", "pair-last"))
    ops, table, plan, lc, _ = p.layer(lo["pair-last"])
    L, N = m.num_layers, 16
    w = simulate_step(ops, plan, table, L, N, StepExtras(0, 0, 0, 0, 0, 0, L),
                      pair_last=True)
    assert last.layers_s == pytest.approx(L * (2 * lc.f + (N - 2) * lc.pair + w.layer_tail_s))
    assert w.layer_tail_s < 2 * lc.b             # the two backwards overlap
    assert last.dp_s < dh.dp_s                   # more work behind the last gradients
    saved = p._costs(lo["megatron"]).saved
    assert last.memory["activations"] - meg.memory["activations"] == pytest.approx(L * saved)
    assert "--dhelix-pair-last" in megatron_flags("llama-8b", lo["pair-last"], 4096, 256, m)
    assert "--dhelix-pair-last" not in megatron_flags("llama-8b", lo["dhelix"], 4096, 256, m)


def test_advise_writes_the_table_plan_and_commands(tmp_path):
    from dhelix.planner.plan import Plan, validate
    from dhelix.planner.shapes import layer_ops_for_shape
    out = str(tmp_path / "adv")
    r = _advise("--config", "llama-8b", "--cluster", "a40", "--gpus", "16", "--seq-length",
                "4096", "--global-batch-size", "64", "--top", "5", "--out", out)
    assert r.returncode == 0, r.stderr
    res = json.load(open(out + ".json"))
    tps = [p["tokens_per_s"] for p in res["top"][:5]]
    assert tps == sorted(tps, reverse=True) and res["fit"] <= res["layouts"]
    assert res["search_s"] > 0 and "analytical model" in res["cost_source"]
    assert res["best"]["megatron"] and res["best"]["dhelix"]
    assert all(p["memory_bytes"] <= 0.9 * 45.0 * 2 ** 30 for p in res["top"])
    md = open(out + ".md").read()
    assert "megatron's best" in md and "DHelix's best" in md and "search" in md
    lo = res["best"]["dhelix"]["layout"]
    plan = Plan.load(out + ".plan.json")
    validate(plan, layer_ops_for_shape(load_model_config("llama-8b"), lo["tp"], lo["tp"] > 1,
                                       4096, lo["mbs"], bf16=True, ep=lo["ep"], cp=lo["cp"]))
    win = res["top"][0]["layout"]
    sb = open(out + ".sbatch").read()
    assert f"--tensor-model-parallel-size {win['tp']} " in sb
    assert f"--pipeline-model-parallel-size {win['pp']} " in sb
    assert "scripts/slurm/pretrain_gpt_dhelix.sbatch configs/slurm/a40.env" in sb
    assert "pretrain_gpt_dhelix.py" in md
    assert (tmp_path / "adv.png").stat().st_size > 1000


@pytest.mark.parametrize("args,msg", [
    (["--config", "llama3-70b", "--gpus", "8", "--seq-length", "8192",
      "--global-batch-size", "64", "--memory-per-gpu", "16"],
     "fits no layout on 8 GPUs of 16 GiB: the smallest needs"),
    (["--config", "llama3-70b", "--gpus", "7", "--global-batch-size", "64"],
     "--gpus 7 --global-batch-size 64: no layout divides them"),
    (["--config", "llama3-70b", "--cluster", "h200x"], "cluster file 'h200x' not found"),
])
def test_bad_input_is_one_message(args, msg, tmp_path):
    r = _advise(*args, "--out", str(tmp_path / "a"))
    assert r.returncode == 2 and msg in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp", [1, 2])
def test_kept_activations_are_what_megatron_keeps(tp, tmp_path):
    """`kept_bytes` per layer and the head's bytes against the saved-tensor peak of
    `dhelix train` (megatron's schedule, fp32, one micro-batch in flight) for 1 and 3
    layers of tiny-llama-emu: the per-layer difference and the rest each within 5%."""
    from dhelix.advise.price import Pricer, kept_bytes
    from dhelix.planner.costmodel import load_cluster
    peaks = {}
    for L in (1, 3):
        cfg = tmp_path / f"emu{L}.yaml"
        text = open("configs/models/tiny-llama-emu.yaml").read()
        cfg.write_text(text.replace("num_layers: 8", f"num_layers: {L}"))
        out = tmp_path / f"{L}.json"
        r = subprocess.run([sys.executable, "-m", "dhelix.cli", "train", "--nproc", str(tp),
                            "--config", str(cfg), "--tensor-model-parallel-size", str(tp),
                            *(["--sequence-parallel"] if tp > 1 else []), "--train-iters",
                            "2", "--data", "synthetic", "--seq-length", "64",
                            "--micro-batch-size", "1", "--global-batch-size", "1", "--json",
                            str(out)], capture_output=True, text=True, timeout=500)
        assert r.returncode == 0, r.stderr[-2000:]
        peaks[L] = json.load(open(out))["peak_memory_bytes"]
    m = load_model_config("tiny-llama-emu")
    lo = Layout(tp, 1, 1, 1, 1, 1, 1, "megatron", False)
    per_layer = (peaks[3] - peaks[1]) / 2
    assert kept_bytes(m, lo, 64, 4) == pytest.approx(per_layer, rel=0.05)
    head = Pricer(m, load_cluster("configs/clusters/a40.yaml"), 64, 1, "fp32")._head(lo)[1]
    assert head == pytest.approx(peaks[1] - per_layer, rel=0.05)


def _scaled_table(pricer, lo, factor, extras=None):
    """The analytical table of `lo`'s layer shape with every time × `factor`: stands for
    a table `dhelix profile` measured (a profile of the same shape: test_profile.py)."""
    from dhelix.planner.costs import CostTable
    d = pricer.layer(lo)[1].to_json()
    for k in ("alone_f", "alone_b", "in_step_f", "in_step_b"):
        d[k] = {n: v * factor for n, v in d.get(k, {}).items()}
    d["pair"] = {f: {b: v * factor for b, v in row.items()} for f, row in d["pair"].items()}
    if extras is not None:
        d["step_extras"] = extras.to_json()
    return CostTable.from_json(d)


def test_profiled_table_prices_its_shape_only(tmp_path):
    """A layout whose layer shape a profiled table was made for is priced from it (its
    layers, its head and optimizer from the table's step_extras) and names it; the other
    shapes stay analytical; the CLI says which table went unused, and a broken one is
    one message."""
    from dhelix.advise.price import Pricer
    from dhelix.planner.costmodel import load_cluster
    from dhelix.planner.costs import StepExtras
    m = load_model_config("tiny-llama-emu")
    cluster = load_cluster("configs/clusters/a40.yaml")
    ana = Pricer(m, cluster, 64, 8, "fp32")
    tp2, tp1 = (Layout(t, 1, 1, 2 // t, 1, 1, 8 // (2 // t), "megatron", False)
                for t in (2, 1))
    ex = StepExtras(0.01, 0.02, 0.03, 0.04, optimizer_s=0.5, finalize_s=0.0,
                    num_layers=m.num_layers, zero_grad_s=0.1)
    path = str(tmp_path / "tp2.json")
    _scaled_table(ana, tp2, 10.0, ex).save(path)
    prof = Pricer(m, cluster, 64, 8, "fp32", [path])
    a, p = ana.price(tp2), prof.price(tp2)
    assert (a.cost_source, p.cost_source) == ("analytical", path)
    assert p.layers_s == pytest.approx(10 * a.layers_s, rel=1e-9)
    assert p.head_s == pytest.approx(tp2.microbatches * 0.1)
    assert p.optimizer_s == pytest.approx(0.6)          # TP2, DP1: the whole model's shard
    assert prof.price(tp1).cost_source == "analytical"
    assert prof.price(tp1).step_s == pytest.approx(ana.price(tp1).step_s)
    # the CLI: the table names the source; a table of no layout's shape is said unused
    out = str(tmp_path / "adv")
    r = _advise("--config", "tiny-llama-emu", "--cluster", "a40", "--gpus", "2",
                "--seq-length", "64", "--global-batch-size", "8", "--dtype", "fp32",
                "--overlap-table", path, "--top", "100", "--out", out)
    assert r.returncode == 0, r.stderr
    res = json.load(open(out + ".json"))
    assert path in res["cost_source"]
    assert {p["cost_source"] for p in res["top"]} == {"analytical", path}
    assert "| cost |" in open(out + ".md").read()
    r = _advise("--config", "tiny-llama-emu", "--cluster", "a40", "--gpus", "2",
                "--seq-length", "128", "--global-batch-size", "8", "--dtype", "fp32",
                "--overlap-table", path, "--out", out)
    assert r.returncode == 0 and f"{path} matches no layout" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    r = _advise("--config", "tiny-llama-emu", "--gpus", "2", "--overlap-table", str(bad))
    assert r.returncode == 2 and str(bad) in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
