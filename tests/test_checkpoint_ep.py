"""Checkpoints with expert parallelism: experts named by their global index (EP rank ×
local experts + i, megatron's convention), written once per EP rank from
expert-data-parallel rank 0 (`DIR/experts-etp{e}-ep{r}-pp{p}.pt`), loaded by global name
at any EP size and any pipeline placement.

One checkpoint (`ckpt`: tiny-moe4, EP=2 on 2 ranks, 2 steps trained) serves every test:
  (a) loaded at EP=2 and at EP=1 (one rank holding all 4 experts): every weight equals
      what was saved, by checksum and, re-saved at EP=1, tensor by tensor;
  (b) EP=2 × PP=2 on 4 ranks: megatron's 1F1B and the DHelix fold both load it and train
      bit for bit alike (untied embeddings, as tests/test_cp_pp.py);
  (c) loaded into a model with another expert count: a CheckpointError naming the file,
      the field and the fix.
"""
import glob
import os

import pytest
import torch

from dhelix.testing import run_ranks
from compare import merge_stages, same_checksums, same_numbers, same_runs
from checkpoint_ep_fns import load_only, train_summary

MOE = dict(config="tiny-moe4", data="synthetic", micro_batch_size=1, seq_length=32,
           global_batch_size=8, expert_tensor_parallel_size=1)
EP2 = dict(MOE, expert_model_parallel_size=2)


def _params(directory, pattern="*.pt"):
    """global name -> tensor over the checkpoint files matching `pattern`."""
    out = {}
    for f in sorted(glob.glob(os.path.join(directory, pattern))):
        d = torch.load(f, map_location="cpu", weights_only=True)
        assert not set(out) & set(d["params"]), f"{f}: a name written twice"
        out.update(d["params"])
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ep2") / "ckpt")
    saved = run_ranks(train_summary, 2, timeout=300, train_iters=2, checksums=True,
                      save=d, **EP2)
    return d, saved


@pytest.mark.timeout(400)
def test_ep2_checkpoint_loads_at_ep2_and_ep1(ckpt, tmp_path):
    d, saved = ckpt
    # the files: dense weights once (DP rank 0), each EP rank's experts once
    assert sorted(os.listdir(d)) == ["experts-etp0-ep0-pp0.pt", "experts-etp0-ep1-pp0.pt",
                                     "tp0-pp0.pt"]
    for ep in (0, 1):
        e = torch.load(os.path.join(d, f"experts-etp0-ep{ep}-pp0.pt"), weights_only=True)
        assert (e["ep_size"], e["num_experts"], e["expert_tp_size"]) == (2, 4, 1)
        held = {n.split(".local_experts.")[1].split(".")[0] for n in e["params"]}
        assert held == {str(2 * ep), str(2 * ep + 1)}          # global expert indices
        assert len(e["params"]) == 4 * 2 * 2        # layers × local experts × fc1, fc2
    assert not any(".local_experts." in n for n in _params(d, "tp*.pt"))
    # each EP rank names its experts globally: rank 0 experts 0, 1; rank 1 experts 2, 3
    for r in saved:
        idx = {n.split(".local_experts.")[1].split(".")[0] for n in r["expert_names"]}
        assert idx == {str(2 * r["ep_rank"]), str(2 * r["ep_rank"] + 1)}, r["expert_names"]

    b, c = str(tmp_path / "ep2-again"), str(tmp_path / "ep1")
    ep2 = run_ranks(train_summary, 2, timeout=300, train_iters=0, eval_iters=1,
                    checksums=True, load=d, save=b, **EP2)
    ep1 = run_ranks(train_summary, 1, timeout=300, train_iters=0, eval_iters=1,
                    checksums=True, load=d, save=c, **MOE)[0]
    # EP=2: each rank's weights, experts and dense, are the ones its rank saved
    for got, want in zip(ep2, saved):
        assert same_checksums(got["weight_checksums"], want["weight_checksums"], 0.0,
                              f"EP=2 rank {want['ep_rank']} loaded") == 0.0
    # EP=1: one rank holds every expert, each equal to the EP rank's that saved it
    union = {**saved[0]["weight_checksums"], **saved[1]["weight_checksums"]}
    assert len(ep1["expert_names"]) == 4 * 4 * 2
    assert same_checksums(ep1["weight_checksums"], union, 0.0, "EP=1 loaded") == 0.0
    # tensor by tensor: re-saved at EP=1 (all experts in one file) and at EP=2 (two)
    orig = _params(d)
    assert sorted(os.listdir(c)) == ["experts-etp0-ep0-pp0.pt", "tp0-pp0.pt"]
    for what, again in (("EP=1", _params(c)), ("EP=2", _params(b))):
        assert sorted(again) == sorted(orig), what
        bad = [n for n in orig if not torch.equal(again[n], orig[n])]
        assert not bad, f"{what} re-saved differs: {bad}"
    # the same model evaluates alike at EP=2 and EP=1 (the all-to-all only moves tokens)
    same_numbers([ep1["eval_loss"]], [ep2[0]["eval_loss"]], 1e-6, "eval loss EP=1 vs EP=2")


@pytest.mark.timeout(600)
def test_ep2_checkpoint_loads_into_1f1b_and_the_fold(ckpt):
    """EP=2 × PP=2 on 4 ranks (DP=2 = EP): megatron's 1F1B and the fold, both from the
    PP=1 EP=2 checkpoint, train bit for bit alike, merged over stages by global name."""
    d, saved = ckpt
    kw = dict(EP2, train_iters=2, checksums=True, load=d, pipeline_model_parallel_size=2)
    base = run_ranks(train_summary, 4, timeout=400, **kw)
    fold = run_ranks(train_summary, 4, timeout=400, dhelix={"enabled": True, "fold": True},
                     **kw)
    assert base[0]["config"]["schedule"] == "megatron"
    assert fold[0]["config"]["schedule"] == "dhelix-fold"
    got, want = merge_stages(fold), merge_stages(base)
    assert len(got) == 2                                     # two DP (= EP) positions
    assert same_runs(got, want) == 0.0
    # every position holds all 4 layers, its own two experts of each, by global index
    for pos, r in zip(want, sorted(base, key=lambda r: (r["coords"]["dp"],
                                                        r["coords"]["pp"]))[::2]):
        idx = {n.split(".local_experts.")[1].split(".")[0] for n in pos["weight_checksums"]
               if ".local_experts." in n}
        assert idx == {str(2 * r["ep_rank"]), str(2 * r["ep_rank"] + 1)}
        assert len([n for n in pos["weight_checksums"] if ".local_experts." in n]) == 16


@pytest.mark.timeout(300)
def test_checkpoint_with_another_expert_count_is_refused(ckpt):
    d, _ = ckpt
    r = run_ranks(load_only, 1, d, timeout=200, num_experts=8, **MOE)[0]
    assert r["error"] is not None
    assert "experts-etp0-ep0-pp0.pt: num_experts 4, this model has 8" in r["error"]
    assert "--num-experts 4" in r["error"]


def _tamper_shape(d):
    f = os.path.join(d, "experts-etp0-ep1-pp0.pt")
    e = torch.load(f, weights_only=True)
    n = "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"
    e["params"][n] = e["params"][n][:, :-1].clone()
    torch.save(e, f)
    return (f"experts-etp0-ep1-pp0.pt: {n} has shape (64, 127), this model (64, 128); "
            f"load with the model config")


def _tamper_stale(d):
    # a stale file of an EP=4 save left beside this EP=2 checkpoint
    e = torch.load(os.path.join(d, "experts-etp0-ep1-pp0.pt"), weights_only=True)
    torch.save(dict(e, ep_size=4), os.path.join(d, "experts-etp0-ep3-pp0.pt"))
    return ("files of two checkpoints mixed in one folder: experts-etp0-ep0-pp0.pt has "
            "ep_size 2, experts-etp0-ep3-pp0.pt ep_size 4; --save into an empty folder")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tamper", [_tamper_shape, _tamper_stale], ids=["shape", "stale"])
def test_damaged_ep_checkpoint_is_refused(ckpt, tmp_path, tamper):
    """A shape that differs (named with its file and the fix) and the files of an EP=4
    save left in the folder of an EP=2 one: refused at EP=1, before any weight is used."""
    import shutil
    d = str(tmp_path / "ckpt")
    shutil.copytree(ckpt[0], d)
    want = tamper(d)
    r = run_ranks(load_only, 1, d, timeout=200, **MOE)[0]
    assert r["error"] is not None and want in r["error"], r["error"]
