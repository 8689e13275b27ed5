"""Context parallel and expert parallel with pipelines, held to megatron.

CP=2 × PP=2: megatron's 1F1B, its interleaved schedule and DHelix's fold (the P2P tensors
each CP rank's part of the sequence, ring attention in every layer) train like the same
model at CP=1 (PP=2 and PP=1), and the fold like 1F1B. CP=2 × TP=2+SP × PP=2 (8 ranks):
the fold like 1F1B. EP=2 × PP=2 (MoE): the fold like 1F1B.

Every comparison merges a run's stages by global parameter name (`compare.merge_stages`)
and checks every loss, every step's gradient checksum of every parameter and the final
weights' checksums, on every (TP, CP, DP) position. CP=2 against CP=1: 1e-5 relative
(the ring sums attention block by block), the final weights after Adam's steps 1e-3
(Adam moves an entry whose grad is near zero by about the learning rate, whichever way
the rounding went: tests/test_folding.py). Everything else — the fold and the
interleaved schedule against 1F1B at the same CP, TP and EP — is bit for bit: the same
ops in the same order per micro-batch (untied embeddings, so no cross-stage sum of the
embedding's two grads; 4 micro-batches, whose losses both loss stages average alike).
"""
import os
import re

import pytest

from dhelix.testing import run_ranks
from compare import merge_stages, same_numbers, same_runs
from train_fns import train_result

TOL = 1e-5
WEIGHT_TOL = 1e-3
FOLD = {"enabled": True, "fold": True}


def _same(got, want, tol=TOL, weight_tol=WEIGHT_TOL):
    """Runs already merged over stages: losses and grads within `tol`, weights within
    `weight_tol`; returns the worst relative difference of the losses and grads."""
    worst = same_runs(got, want, tol, keys=("losses", "grad_checksums"))
    same_runs(got, want, weight_tol, keys=("weight_checksums",))
    return worst


def _against_one(merged, ref):
    """Every (TP, CP, DP) position of a CP run against the one position of a CP=1 run."""
    return max(_same([pos], ref) for pos in merged)


# ---- CP=2 × PP=2 ------------------------------------------------------------------------
CP_STEPS = 3


@pytest.fixture(scope="module")
def cp2_pp2(tmp_path_factory):
    """tiny-llama4 (4 layers, untied, GQA, RoPE), seq 32, 4 micro-batches of 1, from one
    PP=1 checkpoint: the PP=1 CP=1 reference, 1F1B at CP=1 and CP=2, the interleaved
    schedule and the fold at CP=2 (all PP=2), each with one evaluation step."""
    d = str(tmp_path_factory.mktemp("cp_pp_ckpt"))
    common = dict(config="tiny-llama4", micro_batch_size=1, seq_length=32,
                  data="synthetic")
    run_ranks(train_result, 1, timeout=200, train_iters=0, save=d, **common)
    kw = dict(common, train_iters=CP_STEPS, load=d, finetune=True, global_batch_size=4, checksums=True,
              eval_iters=1)
    out = {"pp1": run_ranks(train_result, 1, timeout=300, **kw)}
    pp = dict(kw, pipeline_model_parallel_size=2)
    out["1f1b_cp1"] = run_ranks(train_result, 2, timeout=300, **pp)
    cp = dict(pp, context_parallel_size=2)
    out["1f1b"] = run_ranks(train_result, 4, timeout=400, **cp)
    out["interleaved"] = run_ranks(train_result, 4, timeout=400,
                                   num_layers_per_virtual_pipeline_stage=1, **cp)
    out["fold"] = run_ranks(train_result, 4, timeout=400, dhelix=FOLD, **cp)
    return out


@pytest.mark.timeout(900)
def test_cp2_pp2_megatron_trains_like_cp1(cp2_pp2):
    """megatron's 1F1B at CP=2 × PP=2 against the same model at CP=1 (PP=2 and PP=1),
    ≤1e-5 (the ring's order of summation); the interleaved schedule at CP=2 × PP=2 bit for
    bit like 1F1B (the same layers, the same micro-batch order per layer); both CP ranks
    report the whole sequence's loss."""
    r = cp2_pp2
    one = r["1f1b"][0]["config"]
    assert one["context_parallel_size"] == 2 and one["pipeline_stages"] == 2
    assert one["schedule"] == "megatron" and r["interleaved"][0]["config"]["virtual_chunks"] == 2
    assert len(r["1f1b"][0]["losses"]) == CP_STEPS
    for run in ("1f1b", "interleaved"):
        coords = sorted((x["coords"]["cp"], x["coords"]["pp"]) for x in r[run])
        assert coords == [(0, 0), (0, 1), (1, 0), (1, 1)], (run, coords)
        for x in r[run][1:]:       # every rank: the whole sequence's mean, the same number
            same_numbers(x["losses"], r[run][0]["losses"], 0.0, f"{run}: ranks' losses")
    base = merge_stages(r["1f1b"])
    assert len(base) == 2                                          # two CP positions
    _against_one(base, merge_stages(r["1f1b_cp1"]))
    _against_one(base, merge_stages(r["pp1"]))
    same_numbers([r["1f1b"][0]["eval_loss"]], [r["pp1"][0]["eval_loss"]], TOL,
                 "1F1B CP=2 vs PP=1 CP=1 eval loss")
    assert same_runs(merge_stages(r["interleaved"]), base) == 0.0
    assert r["interleaved"][0]["eval_loss"] == r["1f1b"][0]["eval_loss"]
    # CP=1: 1F1B bit for bit like PP=1 (the same ops; what CP changes is the ring)
    assert same_runs(merge_stages(r["1f1b_cp1"]), merge_stages(r["pp1"])) == 0.0
    # the loss falls: the runs trained, not just agreed
    assert r["1f1b"][0]["losses"][-1] < r["1f1b"][0]["losses"][0]


@pytest.mark.timeout(900)
def test_cp2_pp2_fold_trains_like_1f1b(cp2_pp2):
    """The fold at CP=2 × PP=2 (DHelix's layers with the ring as ops, each CP rank's part
    of the sequence on the pipeline) against megatron's 1F1B at CP=2: bit for bit (the
    same ops in the same order per micro-batch; untied embeddings, and 4 micro-batches
    whose losses the two loss stages average alike) — losses, gradients, weights, the
    evaluation loss (the fold's forward-only path); against 1F1B at CP=1 ≤1e-5."""
    r = cp2_pp2
    assert r["fold"][0]["config"]["schedule"] == "dhelix-fold"
    assert r["fold"][0]["config"]["context_parallel_size"] == 2
    fold, base = merge_stages(r["fold"]), merge_stages(r["1f1b"])
    assert len(fold) == 2
    assert same_runs(fold, base) == 0.0
    assert r["fold"][0]["eval_loss"] == r["1f1b"][0]["eval_loss"]
    _against_one(fold, merge_stages(r["1f1b_cp1"]))
    for x in r["fold"][1:]:
        same_numbers(x["losses"], r["fold"][0]["losses"], 0.0, "fold: ranks' losses")


# ---- CP=2 × TP=2+SP × PP=2 (8 ranks) -----------------------------------------------------
@pytest.mark.timeout(600)
def test_cp2_tp2_sp_pp2_fold_trains_like_1f1b():
    """8 ranks: TP=2 with SP inside each CP rank's part (the P2P tensor is seq/CP/TP
    rows), the fold against megatron's 1F1B, bit for bit on every (TP, CP) position;
    tiny-llama4 with seq 16, 2 steps of 4 micro-batches (8 ranks share 2 cores). Both
    from the same weights, set by global name and TP rank (`cp_pp_fns.train_named_init`;
    no checkpoint run, to save the time of one more launch)."""
    from cp_pp_fns import train_named_init_many
    kw = dict(config="tiny-llama4", micro_batch_size=1, seq_length=16, data="synthetic",
              tensor_model_parallel_size=2, sequence_parallel=True, train_iters=2,
              global_batch_size=4, checksums=True, pipeline_model_parallel_size=2,
              context_parallel_size=2)
    base, fold = [list(r) for r in zip(*run_ranks(
        train_named_init_many, 8, [kw, dict(kw, dhelix=FOLD)], timeout=700))]
    assert fold[0]["config"]["schedule"] == "dhelix-fold"
    assert sorted((x["coords"]["tp"], x["coords"]["cp"], x["coords"]["pp"]) for x in fold) \
        == [(t, c, p) for t in (0, 1) for c in (0, 1) for p in (0, 1)]
    merged = merge_stages(fold)
    assert len(merged) == 4                                  # (TP, CP) positions
    assert same_runs(merged, merge_stages(base)) == 0.0
    assert fold[0]["losses"][-1] < fold[0]["losses"][0]


# ---- EP=2 × PP=2 (MoE) ---------------------------------------------------------------------
TINY_MOE4 = """\
# tiny-moe with 4 layers: folds over 2 pipeline stages
num_layers: 4
hidden_size: 64
num_attention_heads: 4
ffn_hidden_size: 128
num_experts: 4
moe_router_topk: 2
vocab_size: 512
max_position_embeddings: 256
normalization: RMSNorm
activation: swiglu
position_embedding_type: rope
add_bias_linear: false
untie_embeddings_and_output_weights: true
"""


@pytest.mark.timeout(600)
def test_ep2_pp2_fold_trains_like_1f1b(tmp_path):
    """MoE (tiny-moe's layer, 4 layers), EP=2 × PP=2 on 4 ranks (DP=2, experts split over
    the two DP ranks, --expert-tensor-parallel-size 1): the fold against megatron's 1F1B.
    Both from the same weights, set by global name (`cp_pp_fns.train_named_init`:
    --load refuses expert parallel); bit for bit, as the dense fold (untied)."""
    from cp_pp_fns import train_named_init_many
    cfg = tmp_path / "tiny-moe4.yaml"
    cfg.write_text(TINY_MOE4)
    kw = dict(config=str(cfg), micro_batch_size=1, seq_length=32, data="synthetic",
              global_batch_size=8, train_iters=3, checksums=True,
              pipeline_model_parallel_size=2, expert_model_parallel_size=2,
              expert_tensor_parallel_size=1)
    base, fold = [list(r) for r in zip(*run_ranks(
        train_named_init_many, 4, [kw, dict(kw, dhelix=FOLD)], timeout=600))]
    assert base[0]["config"]["model"]["num_experts"] == 4
    assert fold[0]["config"]["schedule"] == "dhelix-fold"
    assert fold[0]["config"]["num_microbatches"] == 4
    merged = merge_stages(fold)
    assert len(merged) == 2                                  # two DP (= EP) positions
    # the two EP ranks hold different experts, named by their global index: two halves
    # of experts 0-3 in each of the 4 layers
    held = [{(m.group(1), m.group(2)) for n in pos["weight_checksums"]
             for m in [re.search(r"layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.", n)]
             if m} for pos in merged]
    assert not held[0] & held[1]
    assert held[0] | held[1] == {(str(layer), str(e)) for layer in range(4) for e in range(4)}
    assert same_runs(merged, merge_stages(base)) == 0.0
    assert fold[0]["losses"][-1] < fold[0]["losses"][0]


# ---- what is checked before any rank starts --------------------------------------------
SHAPE8 = """\
# 8 heads, 8 layers: room for TP=8 and a fold over PP=2 (layout checks only)
num_layers: 8
hidden_size: 256
num_attention_heads: 8
ffn_hidden_size: 1024
vocab_size: 512
max_position_embeddings: 4096
"""


@pytest.mark.parametrize("dp,tp,cp,pp", [(2, 8, 2, 2), (1, 8, 4, 2)])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "fold"])
def test_published_cp_pp_layouts_pass_the_checks(tmp_path, dp, tp, cp, pp, schedule):
    """The published (DP, TP, CP, PP) layouts are accepted by `dhelix train`'s checks for
    every pipeline schedule; the layout says what it will run."""
    from dhelix.train.config import TrainConfig, check_layout, model_of
    cfg_path = tmp_path / "shape8.yaml"
    cfg_path.write_text(SHAPE8)
    extra = {"1f1b": {}, "interleaved": {"num_layers_per_virtual_pipeline_stage": 2},
             "fold": {"dhelix": FOLD}}[schedule]
    cfg = TrainConfig(config=str(cfg_path), tensor_model_parallel_size=tp,
                      sequence_parallel=True, context_parallel_size=cp,
                      pipeline_model_parallel_size=pp, seq_length=4096, micro_batch_size=1,
                      global_batch_size=8 * dp, **extra)
    layout = check_layout(cfg, model_of(cfg), dp * tp * cp * pp)
    assert (layout.dp, layout.tp, layout.cp, layout.pp) == (dp, tp, cp, pp)
    assert layout.fold == (schedule == "fold")
    assert layout.vpp == (2 if schedule == "interleaved" else 1)
    assert layout.num_microbatches == 8


def test_cp_with_pp_keeps_the_other_refusals():
    """What CP still refuses with a pipeline: a MoE model, the intra-batch peer, a
    sequence that does not split into 2·CP chunks, SP's split of each CP part."""
    from dhelix.models.config import ConfigError
    from dhelix.train.config import TrainConfig, preflight
    pp = dict(pipeline_model_parallel_size=2, context_parallel_size=2)
    with pytest.raises(ConfigError, match="with a MoE model: not built yet"):
        preflight(TrainConfig(config="tiny-moe", **pp), 4)
    with pytest.raises(ConfigError, match="--context-parallel-size 2 with --dhelix-peer"):
        preflight(TrainConfig(config="tiny-llama4", dhelix={"peer": True}, **pp), 4)
    with pytest.raises(ConfigError, match="does not split into 2·CP = 4 chunks"):
        preflight(TrainConfig(config="tiny-llama4", seq_length=30, **pp), 4)
    with pytest.raises(ConfigError, match="must be divisible by --context-parallel-size 2 × "
                                          "--tensor-model-parallel-size 4"):
        preflight(TrainConfig(config="tiny-llama4", seq_length=20, sequence_parallel=True,
                              tensor_model_parallel_size=4, **pp), 16)
    # and what it now builds passes
    assert preflight(TrainConfig(config="tiny-llama4", dhelix=FOLD, global_batch_size=8,
                                 **pp), 4) == []


def test_checkpoint_from_cp_loads_at_cp_pp(tmp_path):
    """CP=2 × TP=2 (4 ranks) --save; the checkpoint loads at CP=2 × PP=2 (8 ranks) and
    trains (dist_checkpointing: the CP ranks' identical weights are one shard's replicas,
    written once)."""
    d = str(tmp_path / "ck")
    common = dict(config="tiny4", tensor_model_parallel_size=2, sequence_parallel=True,
                  context_parallel_size=2)
    run_ranks(train_result, 4, timeout=300, train_iters=0, save=d, **common)
    assert open(os.path.join(d, "latest_checkpointed_iteration.txt")).read() == "0"
    r = run_ranks(train_result, 8, timeout=600, pipeline_model_parallel_size=2, load=d, finetune=True,
                  train_iters=1, global_batch_size=4, **common)
    assert all(x["losses"][0] == r[0]["losses"][0] for x in r)
