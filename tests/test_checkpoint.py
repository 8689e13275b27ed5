"""Checkpoints that resume: megatron's torch_dist format (dist_checkpointing) in
Megatron-LM's layout (`DIR/latest_checkpointed_iteration.txt`, `DIR/iter_NNNNNNN/`).

  exact resume   a straight run of 4 steps saving every 2, and a run resumed from its
                 save at iteration 2 (the save alone under a new root, as a run killed at
                 step 3 leaves it): steps 3 and 4 have the same losses, learning rates
                 (a cosine schedule with warmup) and final weights, bit for bit. For
                 megatron's schedule and DHelix (TP=2+SP), the fold (PP=2), EP=2 (MoE,
                 DHelix), and megatron's distributed optimizer (DP=2, bf16, overlapped
                 param gather). All in one launch of 2 ranks.
  reshard        a save at TP=2 (and a MoE one at EP=2) loads at other layouts (PP=2 1F1B,
                 the fold, DP=2, CP=2; EP=1, expert-TP=2), which save it again: every
                 weight and Adam moment of the re-save equals the original's, bit for bit
                 (compared as whole tensors, `dcp_to_torch_save`, layout-free). MoE from
                 EP=2 to EP=1: the weights (megatron keeps the experts' optimizer apart
                 at EP > 1 only: without --no-load-optim, one message saying so).
  killed saving  rank 1 SIGKILLed in the middle of saving iteration 4: the tracker still
                 names iteration 2, which resumes; the next save of 4 replaces the debris.
  bad input      (the CLI, before any rank starts) a missing folder, a save that never
                 finished, a missing or truncated shard, another model's save: exit 2 and
                 one line naming the file and the fix; no traceback.
The output lines: `saved iteration N to DIR/iter_...`, `resumed from ...: iteration N,
optimizer state, RNG state, data position`.
"""
import os
import subprocess
import sys

import pytest
import torch

from dhelix.testing import RankError, run_ranks
from compare import same_checksums, same_numbers, same_tensors
from checkpoint_fns import interrupted_and_resumed, killed_while_saving, train_many

SCHED = dict(lr_decay_style="cosine", lr_warmup_iters=1)
TP2 = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True, **SCHED)
MOE = dict(config="tiny-moe4", data="synthetic", micro_batch_size=1, seq_length=32,
           global_batch_size=8, expert_tensor_parallel_size=1)
RESUME_CASES = [
    ("megatron", TP2),
    ("dhelix", dict(TP2, dhelix={"enabled": True})),
    ("fold", dict(config="tiny4", micro_batch_size=1, global_batch_size=4,
                  pipeline_model_parallel_size=2, dhelix={"enabled": True, "fold": True},
                  **SCHED)),
    ("ep2", dict(MOE, expert_model_parallel_size=2, dhelix={"enabled": True}, **SCHED)),
    ("distributed-optimizer", dict(config="tiny", use_distributed_optimizer=True,
                                   overlap_grad_reduce=True, overlap_param_gather=True,
                                   bf16=True, **SCHED)),
]


@pytest.mark.timeout(900)
def test_resume_is_exact(tmp_path):
    r = run_ranks(interrupted_and_resumed, 2, str(tmp_path), RESUME_CASES, timeout=800)
    for name, _ in RESUME_CASES:
        root = tmp_path / name
        assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004",
                                            "latest_checkpointed_iteration.txt"], name
        assert (root / "latest_checkpointed_iteration.txt").read_text() == "4"
        for rank, res in enumerate(r):
            a, b = res[name]["straight"], res[name]["resumed"]
            what = f"{name}, rank {rank}"
            assert len(a["losses"]) == 4 and b["first_iteration"] == 3, what
            same_numbers(b["losses"], a["losses"][2:], 0.0, f"{what}: losses")
            same_numbers(b["learning_rates"], a["learning_rates"][2:], 0.0, f"{what}: lr")
            same_checksums(b["weight_checksums"], a["weight_checksums"], 0.0,
                           f"{what}: final weights")
    # the schedule did move: a resume that restarted it would not match
    lrs = r[0]["megatron"]["straight"]["learning_rates"]
    assert len(set(lrs)) == 4, lrs


def _tensors(save_dir) -> dict:
    """Every tensor of a save as whole, layout-free tensors (ShardedObjects left out)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = str(save_dir) + ".pt"
    dcp_to_torch_save(str(save_dir), out)
    sd = torch.load(out, weights_only=False)
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor) and "/shard_" not in k}


@pytest.mark.timeout(900)
def test_saves_reshard_between_layouts(tmp_path):
    dense = dict(config="tiny4", micro_batch_size=1, global_batch_size=4)
    moe = dict(MOE, expert_tensor_parallel_size=None)
    d, e = str(tmp_path / "tp2"), str(tmp_path / "ep2")
    loads = {
        "pp2": dict(dense, pipeline_model_parallel_size=2),
        "fold": dict(dense, pipeline_model_parallel_size=2,
                     dhelix={"enabled": True, "fold": True}),
        "dp2": dict(dense),
        "cp2": dict(dense, context_parallel_size=2),
        # MoE at EP=1 has one optimizer, at EP=2 two (experts apart): weights only
        "ep1": dict(moe, no_load_optim=True),
        "etp2": dict(moe, tensor_model_parallel_size=2, expert_tensor_parallel_size=2,
                     sequence_parallel=True, no_load_optim=True),
    }
    runs = [dict(dense, tensor_model_parallel_size=2, train_iters=2, save=d),
            dict(moe, expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                 train_iters=2, save=e)]
    runs += [dict(kw, load=e if name.startswith("e") else d, save=str(tmp_path / name))
             for name, kw in loads.items()]
    runs.append(dict(moe, load=e, save=str(tmp_path / "refused")))     # no --no-load-optim
    res = run_ranks(train_many, 2, [dict({"train_iters": 0}, **kw) for kw in runs],
                    timeout=800)
    want = {"tp2": _tensors(tmp_path / "tp2" / "iter_0000002"),
            "ep2": _tensors(tmp_path / "ep2" / "iter_0000002")}
    assert any(k.startswith("optimizer.state.exp_avg.") for k in want["tp2"])
    assert any(".experts." in k for k in want["ep2"])
    for name in loads:
        got = _tensors(tmp_path / name / "iter_0000002")
        ref = want["ep2" if name.startswith("e") else "tp2"]
        if loads[name].get("no_load_optim"):      # a fresh optimizer: compare the weights
            ref = {k: v for k, v in ref.items() if not k.startswith("optimizer.")}
            got = {k: v for k, v in got.items() if not k.startswith("optimizer.")}
        same_tensors(got, ref, 0.0, f"re-saved at {name}")
        # the layout changed: the RNG streams are not restored (and the line says so)
        assert res[0][2 + list(loads).index(name)]["first_iteration"] == 3
    assert res[0][-1]["error"] == (
        f"--load {e}/iter_0000002: saved at TP=1 PP=1 CP=1 EP=2 DP=2: its optimizer state "
        f"is 2 optimizer(s), this run has 1 (MoE: expert parameters get their own at EP > "
        f"1); the weights reshard: add --no-load-optim to resume with a fresh optimizer (or "
        f"--finetune)")


@pytest.mark.timeout(600)
def test_killed_while_saving_leaves_the_previous_save(tmp_path):
    root = str(tmp_path / "ck")
    with pytest.raises(RankError, match="rank 1 died"):
        run_ranks(killed_while_saving, 2, root, 6, 4, timeout=300, **TP2)
    assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read() == "2"
    assert os.path.isdir(os.path.join(root, "iter_0000004.saving"))   # the debris
    r = run_ranks(train_many, 2, [dict(TP2, load=root, save=root, train_iters=4)],
                  timeout=300)[0][0]
    assert r["first_iteration"] == 3 and len(r["losses"]) == 2
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004",
                                        "latest_checkpointed_iteration.txt"]


# ---- the CLI: what a user sees ---------------------------------------------------------

TINY = ["--config", "tiny", "--tensor-model-parallel-size", "2", "--sequence-parallel"]


def dhelix(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dhelix.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`dhelix train` for 2 steps with --save: its folder and stdout."""
    ck = tmp_path_factory.mktemp("cli") / "ck"
    r = dhelix("train", "--nproc", "2", *TINY, "--train-iters", "2", "--save", str(ck),
               "--timeout", "200")
    assert r.returncode == 0, r.stderr[-3000:]
    return ck, r.stdout


def test_cli_says_what_it_saved_and_resumed(saved):
    ck, out = saved
    assert f"dhelix train: saved iteration 2 to {ck}/iter_0000002" in out, out
    r = dhelix("train", "--nproc", "2", *TINY, "--train-iters", "3", "--load", str(ck),
               "--timeout", "200")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (f"dhelix train: resumed from {ck}/iter_0000002: iteration 2, optimizer state, "
            f"RNG state, data position") in r.stdout, r.stdout
    assert " iter    3/3 |" in r.stdout and " iter    1/" not in r.stdout, r.stdout


def _copy(saved, tmp_path):
    import shutil
    ck = tmp_path / "ck"
    shutil.copytree(saved[0], ck)
    return ck


def _shard(ck):
    d = ck / "iter_0000002"
    return d / sorted(f for f in os.listdir(d) if f.endswith(".distcp"))[-1]


def _missing_dir(saved, tmp_path):
    ck = tmp_path / "nowhere"
    return ck, [], f"--load {ck}: no such directory (write one with --save)"


def _never_finished(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    os.remove(ck / "latest_checkpointed_iteration.txt")
    return ck, [], (f"--load {ck}: no latest_checkpointed_iteration.txt, so no complete "
                    f"save; iter_0000002 there never finished saving")


def _missing_shard(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    f = _shard(ck)
    os.remove(f)
    return ck, [], f"--load {f}: missing (the save's .metadata lists it)"


def _truncated_shard(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    f = _shard(ck)
    with open(f, "r+b") as fh:
        fh.truncate(1000)
    return ck, [], f"--load {f}: truncated (1000 bytes, the save wrote at least"


def _another_model(saved, tmp_path):
    ck = saved[0]
    return ck, ["--config", "tiny4"], (
        f"--load {ck}/iter_0000002: saved with num_layers = 2, this run's model (tiny4) "
        f"has 4; load it with the model that saved: --config tiny")


@pytest.mark.parametrize("bad", [_missing_dir, _never_finished, _missing_shard,
                                 _truncated_shard, _another_model])
def test_bad_checkpoint_is_one_message(saved, tmp_path, bad):
    ck, extra, message = bad(saved, tmp_path)
    r = dhelix("train", "--nproc", "2", *TINY, *extra, "--train-iters", "3", "--load",
               str(ck), "--timeout", "100")
    err = r.stderr
    assert r.returncode == 2, err[-3000:]
    assert f"dhelix train: error: {message}" in err, err[-3000:]
    assert "Traceback" not in err and "[rank" not in err, err[-3000:]
    assert len([ln for ln in err.splitlines() if "error" in ln]) == 1, err[-3000:]
