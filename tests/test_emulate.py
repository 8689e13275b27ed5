"""Paced compute (`dhelix/train/emulate.py`): a small model's DHelix layer step run on 2
ranks (TP=2+SP, tiny-llama, seq 64, mbs 2) while the ranks keep the time of llama-8b
(seq 4096, mbs 1) on the A40 cluster model, 8 times slower (`paced:a40,x=8`), under the
trivial and the paired plan.

Asserted (what holds whatever the machine's noise): every output and gradient equals the
unpaced step's, bit for bit (pacing only waits); every compute op was paced; each step
lasted at least the emulated compute of both strands (compute is serial, each op waits
out its emulated time); the TP collectives were priced at the emulated shape's bytes (the
ratio of the two shapes' all-gather sizes); `dhelix train` paced — megatron's layers GEMM
by GEMM, `--dhelix` op by op — keeps the unpaced losses and weights bit for bit, and both
pace the same emulated compute; GEMMs that cannot be told apart by shape are refused; bad
flags are one message each. How close the
emulated step time comes to the layer simulator's prediction is a measurement, not a
test (no timing thresholds in tests): `scripts/emulate_layer_step.py` (one layer step) and
`scripts/emulate_pipelines.py` (1F1B, interleaved, the fold) print it; docs/links.md has the
numbers.
"""
import subprocess
import sys

import pytest
import torch

from dhelix.testing import run_ranks
from emulate_fns import layer_step, train_paced_and_not

SMALL, BIG = "tiny-llama", "llama-8b,seq=4096,mbs=1"


@pytest.mark.timeout(600)
def test_paced_layer_step_keeps_emulated_time_and_results():
    r = run_ranks(layer_step, 2, SMALL, BIG, "paced:a40,x=8", 64, 2, 2, timeout=500,
                  env={"DHELIX_LINK": "paced:1gbit"})
    for x in r:
        assert x["same"] == {"trivial": True, "paired": True}
        assert x["paced_ops"] > 0
        for plan in ("trivial", "paired"):
            assert x["min"][plan] >= x["compute_s"][plan], (plan, x)
            assert x["predicted"][plan] > x["compute_s"][plan] * 0.5
        # the TP group's bytes scaled to the emulated shape's: tokens × hidden × dtype
        # bytes, bf16 there and fp32 here: (4096·1·4096·2)/(64·2·64·4)
        assert x["byte_scale"] == [pytest.approx(4096 * 4096 * 2 / (64 * 2 * 64 * 4))]


def _same_as_unpaced(rank_results):
    """(unpaced, paced) result pairs of a rank: the same losses and weights, bit for bit."""
    from compare import same_checksums, same_numbers
    for plain, paced in rank_results:
        same_numbers(paced["losses"], plain["losses"], 0.0, "losses")
        same_checksums(paced["weight_checksums"], plain["weight_checksums"], 0.0, "weights")


@pytest.mark.timeout(600)
def test_paced_training_changes_no_result():
    """`dhelix train` with paced compute, megatron's layers (paced GEMM by GEMM) and
    `--dhelix` (op by op): the same losses and final weights as without, bit for bit; both
    paced the same emulated compute (the layers' GEMMs and attention: within 1%, the DHelix
    path also paces its elementwise ops, near zero on the cluster model); the report is
    there."""
    kw = dict(config="tiny-llama-emu", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=2, checksums=True, micro_batch_size=2, global_batch_size=4)
    r = run_ranks(train_paced_and_not, 2, [kw, dict(kw, dhelix={"enabled": True})],
                  timeout=500, env={"DHELIX_LINK": "paced:1gbit"})
    for rank in r:
        _same_as_unpaced(rank)
        for plain, paced in rank:
            e = paced["emulation"]
            assert plain["emulation"] is None and e["paced_ops"] > 0 and e["step_s"] > 0
            assert e["emulate"] == "llama-8b" and e["factor"] == 2
        (_, megatron), (_, dhelix) = rank
        assert megatron["emulation"]["paced_compute_s"] == pytest.approx(
            dhelix["emulation"]["paced_compute_s"], rel=0.01)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["cp", "ep"])
def test_paced_ring_attention_and_experts_change_no_result(layout):
    """megatron's layer with context parallel (the ring attention's steps, paced as
    DHelix's attn_i / attn_b_i) and with experts (SequentialMLP: each expert's GEMMs
    paced as its rows' share of the expert op), 2 ranks: losses and weights as without
    pacing, bit for bit; the ring steps and expert GEMMs were paced; megatron's and
    DHelix's paced compute agree within 2% (per rank with CP; summed over the EP group
    with experts, whose rows per rank follow the routing)."""
    kw = dict(train_iters=2, checksums=True, micro_batch_size=1, global_batch_size=2,
              seq_length=64)
    if layout == "cp":
        kw.update(config="tiny-llama-emu", context_parallel_size=2)
        want = {"attn_0", "attn_1", "attn_b_0", "attn_b_1", "qkv", "fc2_wgrad"}
    else:
        kw.update(config="tiny-moe-emu", expert_model_parallel_size=2,
                  expert_tensor_parallel_size=1, emulate="phi-3.5-moe,seq=1024,mbs=1",
                  global_batch_size=4)
        want = {"experts_fc1", "experts_fc1_dgrad", "experts_fc2_wgrad", "qkv"}
    r = run_ranks(train_paced_and_not, 2, [kw, dict(kw, dhelix={"enabled": True})],
                  timeout=500, env={"DHELIX_LINK": "paced:1gbit"})
    for rank in r:
        _same_as_unpaced(rank)
        assert want <= set(rank[0][1]["emulation"]["paced_op_counts"]), rank[0][1]
    paced = [[x[i][1]["emulation"]["paced_compute_s"] for x in r] for i in (0, 1)]
    if layout == "ep":
        paced = [[sum(p)] for p in paced]
    for megatron, dhelix in zip(*paced):
        assert megatron == pytest.approx(dhelix, rel=0.02)


@pytest.mark.timeout(600)
def test_plan_file_for_the_emulated_shape(tmp_path):
    """`--dhelix-plan FILE` with paced compute is a plan for the emulated shape (`dhelix
    plan --config llama-8b ...`): it runs, stamped for the small layer; a plan made for
    the small model's own shape is refused, naming the file and what differs."""
    import subprocess
    import sys
    from emulate_fns import train_with_plan_files
    plans = {}
    for name, shape in (("big", ["--config", "llama-8b", "--seq-length", "1024", "--bf16"]),
                        ("small", ["--config", "tiny-llama-emu", "--seq-length", "64"])):
        plans[name] = str(tmp_path / f"{name}.json")
        r = subprocess.run([sys.executable, "-m", "dhelix.cli", "plan", *shape,
                            "--tensor-model-parallel-size", "2", "--sequence-parallel",
                            "--micro-batch-size", "1", "--cluster", "a40", "--out",
                            plans[name]], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    r = run_ranks(train_with_plan_files, 2, plans["big"], plans["small"], timeout=500,
                  env={"DHELIX_LINK": "paced:1gbit"})
    for losses, paced_ops, err in r:
        assert len(losses) == 1 and paced_ops > 0
        assert "small.json (--dhelix-plan, for the --emulate shape)" in err, err
        assert "seq_length: plan 64, this run 1024" in err, err


def test_megatron_gemms_that_cannot_be_told_apart_are_refused():
    """tiny-llama at TP=2: the QKV weight (64 x 64) and fc2's (64 x 64) have one shape but
    different emulated times: one message naming them and the fix."""
    from dhelix.train.emulate import EmulationError
    from dhelix.train.emulate_gemms import _gemm_names
    from dhelix.models.config import load_model_config
    with pytest.raises(EmulationError, match="qkv and fc2 have one shape"):
        _gemm_names(load_model_config("tiny-llama"), 2, True, 48, 2, 1,
                    {"qkv": 1.0, "qkv_dgrad": 1.0, "qkv_wgrad": 1.0, "proj": 1.0,
                     "proj_dgrad": 1.0, "proj_wgrad": 1.0, "fc1": 1.0, "fc1_dgrad": 1.0,
                     "fc1_wgrad": 1.0, "fc2": 2.0, "fc2_dgrad": 2.0, "fc2_wgrad": 2.0})


def test_expert_gemms_are_named_by_shape_with_their_rows_share():
    """tiny-moe-emu (hidden 96, expert FFN 160 gated: 320): an expert's fc1 forward is
    ("x", 96, 320), its wgrad ("w", 320, 96); an expert GEMM of m rows is m / (64 tokens ×
    top-2) of the op; a dense model has no expert keys."""
    from dhelix.models.config import load_model_config
    from dhelix.train.emulate_gemms import GemmPacer, _gemm_names
    ops = ("qkv", "proj", "experts_fc1", "experts_fc2")
    seconds = {f"{o}{x}": 1.0 for o in ops for x in ("", "_dgrad", "_wgrad")}
    names, tokens, experts, routed = _gemm_names(load_model_config("tiny-moe-emu"), 1,
                                                 False, 64, 1, 1, seconds)
    assert routed == 128 and tokens == {64}
    assert experts[("x", 96, 320)] == "experts_fc1"
    assert experts[("w", 320, 96)] == "experts_fc1_wgrad"
    assert experts[("x", 96, 160)] == "experts_fc2_dgrad"
    assert not set(experts) & set(names)
    g = GemmPacer(None, names, tokens, experts, routed)
    x = lambda *s: torch.empty(*s)  # noqa: E731
    assert g.name("mm", (x(32, 96), x(96, 320))) == ("experts_fc1", 0.25)
    assert g.name("mm", (x(320, 48), x(48, 96))) == ("experts_fc1_wgrad", 0.375)
    assert g.name("mm", (x(64, 96), x(96, 512))) is None          # the output layer
    dense = _gemm_names(load_model_config("tiny-llama-emu"), 1, False, 64, 1, 1,
                        {f"{o}{x}": 1.0 for o in ("qkv", "proj", "fc1", "fc2")
                         for x in ("", "_dgrad", "_wgrad")})
    assert dense[2] == {} and dense[3] == 0


def test_the_output_layer_is_paced_on_both_paths_at_the_emulated_vocabulary():
    """The head (the output layer's GEMMs) is named by its weight's shape beside megatron's
    layer GEMMs, or alone where DHelix runs the layers op by op; its emulated time is the
    one `dhelix advise` prices (a third of the head's three GEMMs); a head as wide as the
    tokens cannot be told apart and is refused."""
    from dhelix.advise.layouts import Layout
    from dhelix.advise.price import Pricer
    from dhelix.models.config import load_model_config
    from dhelix.train.emulate import EmulationError, _cluster
    from dhelix.train.emulate_gemms import GemmPacer, _gemm_names, head_seconds
    small = load_model_config("tiny-llama-emu")
    ops = ("qkv", "proj", "fc1", "fc2", "head")
    seconds = {f"{o}{x}": 1.0 for o in ops for x in ("", "_dgrad", "_wgrad")}
    names = _gemm_names(small, 4, True, 64, 1, 1, seconds, head=(96, 128))[0]
    assert names[("x", 96, 128)] == "head" and names[("w", 128, 96)] == "head_wgrad"
    assert names[("x", 96, 72)] == "qkv"
    alone, tokens = _gemm_names(small, 4, True, 64, 1, 1, seconds, head=(96, 128),
                                layers=False)[:2]
    assert set(alone.values()) == {"head", "head_dgrad", "head_wgrad"}
    g = GemmPacer(None, alone, tokens, {}, 0)
    x = lambda *s: torch.empty(*s)  # noqa: E731
    assert g.name("mm", (x(64, 128), x(128, 96))) == ("head_dgrad", 1.0)
    assert g.name("mm", (x(64, 96), x(96, 72))) is None     # a layer GEMM: DHelix's op
    with pytest.raises(EmulationError, match="head weight"):
        _gemm_names(small, 4, True, 64, 1, 1, seconds, head=(96, 64), layers=False)
    big, c = load_model_config("llama-8b"), _cluster("a40")
    lo = Layout(tp=4, cp=1, pp=1, dp=16, ep=1, mbs=1, microbatches=8, schedule="megatron",
                recompute=False)
    advised = Pricer(big, c, 4096, 128)._head(lo)[0]
    assert 3 * head_seconds(big, c, 4096, 4) == pytest.approx(advised, rel=1e-9)


@pytest.mark.parametrize("compute,emulate,msg", [
    ("paced:a40,x=0.5", "llama-8b", "x=0.5 would ask the small ops to run faster"),
    ("paced:a40", "", "needs --emulate MODEL"),
    ("paced:a40", "llama-8b,seq=abc", "use seq=S, mbs=B and dp=D"),
    ("fast", "llama-8b", "use paced:CLUSTER[,x=FACTOR]"),
    ("paced:a40,x=8,warm=16", "llama-8b", "warm=16: the first step's factor is between 1"),
])
def test_bad_flags_are_one_message(compute, emulate, msg):
    from dhelix.train.emulate import EmulationError, parse
    with pytest.raises(EmulationError, match=msg.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(")):
        parse(compute, emulate)
    assert parse("none", "") is None


def test_the_untimed_first_step_runs_at_the_warm_up_factor():
    """`paced:CLUSTER,x=F[,warm=W]`: the first step (its time not kept) waits out W/F of
    every op's emulated time (default W = min(F, 4)); after it, the full time again and
    the statistics cover only what followed."""
    import time
    from dhelix.links import clock
    from dhelix.train.emulate import Pacer, end_warm_up, parse, warm_up
    assert parse("paced:a40,x=32", "llama-8b").warm_factor == 4
    assert parse("paced:a40,x=32,warm=32", "llama-8b").warm_factor == 32
    assert parse("paced:a40,x=2", "llama-8b").warm_factor == 2
    pacer = Pacer({"fc1": 0.004})
    try:
        warm_up(parse("paced:a40,x=16,warm=2", "llama-8b"))
        pacer.after("fc1", time.perf_counter())
        assert pacer.paced_s == pytest.approx(0.004 * 2 / 16) and pacer.counts == {"fc1": 1}
        end_warm_up(pacer)
        assert clock.SCALE == 1.0 and pacer.paced_s == 0 and pacer.counts == {}
        pacer.after("fc1", time.perf_counter())
        assert pacer.paced_s == pytest.approx(0.004)
    finally:
        clock.SCALE = 1.0


# ---- dhelix bench at emulated time --------------------------------------------------------
class _Chunk:
    """Stands in for a model chunk: `grad_scales` reads only named parameters."""

    def __init__(self, params):
        self.params = params

    def named_parameters(self):
        return list(self.params.items())


def test_gradient_bytes_of_a_stage_are_the_emulated_models():
    """The DP reduction of a stage moves the emulated model's gradients: a stage of the
    small model (2 layers, the embedding; EP=2 experts) scaled by `grad_scales` is the
    bytes `stage_grad_bytes` gives the emulated model's stage — the number the bench's
    prediction uses."""
    from dhelix.models.config import load_model_config
    from dhelix.models.params import grad_scales, param_classes, stage_grad_bytes
    for small, big, tp, ep in (("tiny-llama-emu", "llama-39b", 2, 1),
                               ("tiny-moe-emu", "phi-3.5-moe", 1, 2)):
        s, b = load_model_config(small), load_model_config(big)
        c = param_classes(s, tp, ep)
        p = lambda n: torch.empty(int(n))  # noqa: E731
        params = {"embedding.word_embeddings.weight": p(c["embedding"])}
        for i in range(2):
            params[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = p(c["layer"])
            if c["experts"]:
                params[f"decoder.layers.{i}.mlp.experts.local_experts.0.linear_fc1.weight"] \
                    = p(c["experts"])
        scale = grad_scales(s, b, [_Chunk(params)], tp, ep)
        want = stage_grad_bytes(b, tp, ep, 2, True, False)
        dense = c["embedding"] + 2 * c["layer"]
        assert dense * 4 * scale["dp"] == pytest.approx(want["dp"])
        assert 2 * c["experts"] * 4 * scale["edp"] == pytest.approx(want["edp"])
        assert scale["dp"] > 1000          # a 39B / 42B model's stage over a tiny one's


def test_bench_prediction_puts_each_group_on_its_nodes_link():
    """The prediction's DP traffic (`StageDP`, one bucket per layer, the embedding with the
    first layer, the output layer and final norm with the last): on A40 (8 GPUs a node,
    one NIC), TP=2 × PP=2 × DP=4 keeps a stage's DP group in one node (PCIe), TP=2 × DP=8
    spans two (InfiniBand, the NIC shared by the node's 2 rings); with DP = 1 there is
    none, and the step is the layers and the head."""
    from types import SimpleNamespace
    from dhelix.bench import emulated
    from dhelix.models.config import load_model_config
    from dhelix.models.params import param_classes
    from dhelix.planner.costmodel import collective_seconds
    from dhelix.train.emulate import _cluster, parse
    emu = parse("paced:a40", "llama-8b,seq=4096,mbs=1")
    c = _cluster("a40")
    big = load_model_config("llama-8b")
    cl = param_classes(big, 2, 1)

    def opts(nproc, pp, tp=2):
        return SimpleNamespace(nproc=nproc, tensor_model_parallel_size=tp,
                               context_parallel_size=1, pipeline_model_parallel_size=pp,
                               expert_model_parallel_size=1, num_microbatches=4,
                               seq_length=64, micro_batch_size=1)

    def ring(lane, n, params, share=1.0):
        ln = c[f"{lane}_node"]
        return collective_seconds("all_reduce", params * 4, n,
                                  ln["bandwidth_GBps"] * 1e9 * ln["efficiency"] / share,
                                  ln["latency_us"] * 1e-6)
    first, last = emulated.stage_dp(opts(16, 2), big, c, [4, 4],
                                    [(True, False), (False, True)])
    layer = ring("intra", 4, cl["layer"])
    assert first.reduce == pytest.approx([layer] * 3 + [ring("intra", 4, cl["layer"] +
                                                             cl["embedding"])])
    assert last.reduce == pytest.approx([ring("intra", 4, cl["layer"] + cl["output"] +
                                              cl["norm"])] + [layer] * 3)
    (one,) = emulated.stage_dp(opts(16, 1), big, c, [8], [(True, True)])
    assert one.reduce[3] == pytest.approx(ring("inter", 8, cl["layer"], share=2))
    pred = emulated.predictions(opts(4, 2), "tiny-llama-emu", emu)
    assert set(pred) == {"megatron-1f1b", "megatron-interleaved", "dhelix-fold"}
    for p in pred.values():
        assert p["reduce_s"] == pytest.approx(0, abs=1e-9) and p["gather_s"] == 0
        assert p["head_s"] > 0
        assert p["step_s"] == pytest.approx(p["layers_s"] + p["head_s"])
    pred = emulated.predictions(opts(16, 2), "tiny-llama-emu", emu)
    for p in pred.values():
        assert 0 < p["reduce_s"] and p["step_s"] == pytest.approx(
            p["layers_s"] + p["head_s"] + p["reduce_s"] + p["gather_s"])


@pytest.mark.timeout(900)
def test_bench_at_emulated_time(tmp_path):
    """`dhelix bench --compute ... --emulate ...` on 2 ranks, PP=2: the three schedules'
    rows hold the measured emulated step beside the pipeline simulator's, the same losses
    (one initial checkpoint), the table and picture written; two links are refused."""
    import json
    import subprocess
    import sys
    out = tmp_path / "b"
    base = [sys.executable, "-m", "dhelix.cli", "bench", "--compute", "paced:a40,x=8",
            "--emulate", "llama-8b,seq=2048,mbs=1", "--nproc", "2",
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
            "--seq-length", "64", "--micro-batch-size", "1", "--num-microbatches", "2",
            "--train-iters", "2", "--out", str(out)]
    r = subprocess.run(base + ["--links", "paced:1gbit,paced:2gbit"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "give one paced link" in r.stderr, r.stderr
    r = subprocess.run(base + ["--links", "paced:1gbit"], capture_output=True, text=True,
                       timeout=800)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((out.parent / "b.json").read_text())["rows"]
    assert [x["method"] for x in rows] == ["megatron-1f1b", "megatron-interleaved",
                                           "dhelix-fold"]
    assert len({x["final_loss"] for x in rows}) == 1
    for x in rows:
        assert x["config"] == "tiny-llama-emu" and x["emulate"] == "llama-8b"
        assert x["step_s"] > 0 and x["predicted_step_s"] > 0 and x["own_share"] > 0
    md = (out.parent / "b.md").read_text()
    assert "| tiny-llama-emu | dhelix-fold |" in md and "simulator ms" in md
    assert (out.parent / "b.png").stat().st_size > 1000
