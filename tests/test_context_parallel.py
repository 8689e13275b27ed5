"""Context parallelism: ring attention equals full-sequence attention, CP training equals
CP = 1 training, and `--dhelix` trains exactly like the CP baseline for random plans."""
import random

import pytest

from dhelix.models.config import ConfigError
from dhelix.testing import run_ranks
from compare import same_numbers, same_runs
from train_fns import train_result

STEPS = 10


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_core_equals_full_attention(cp):
    """Causal GQA, fp32: output, dQ, dK, dV of every rank's rows, ≤1e-5 relative to the
    largest value (the ring's order of summation), none non-finite."""
    from cp_fns import ring_core_errors
    assert run_ranks(ring_core_errors, cp, timeout=200) == [None] * cp   # checked on ranks


LAYER_PLANS = 24      # random legal plans per layout, on top of the trivial and paired


@pytest.mark.parametrize("config,tp,sp,cp", [("tiny-llama", 1, False, 2),
                                             ("tiny", 1, False, 4),
                                             ("tiny-llama", 2, True, 2)])
def test_layer_equals_full_sequence_layer(config, tp, sp, cp):
    """On every rank: megatron's layer with the ring and the DHelix layer under the
    trivial, paired and 24 random legal plans (its ring exchanges are comm ops of the CP
    group) against megatron's layer on the whole sequence — output, input gradient and
    every parameter gradient (none missing; summed over CP), ≤1e-5 relative (the ring's
    order of summation); DHelix ≡ megatron's layer with the same ring bit for bit. RoPE
    from global positions; tiny-llama has GQA."""
    from cp_fns import layer_check
    res = run_ranks(layer_check, tp * cp, config, tp, sp, cp, 32, 2, LAYER_PLANS,
                    timeout=400)
    for r in res:
        assert len(r["ring_ops"]) == 2 * cp, r["ring_ops"]     # C−1 forward, C+1 backward
        assert r["plans"] == r["distinct"] == LAYER_PLANS + 2
        assert r["ngrads"] >= 6


def _train(world, **kw):
    kw.setdefault("config", "tiny-llama")
    kw = dict(train_iters=STEPS, seq_length=64, micro_batch_size=2, data="synthetic", **kw)
    return run_ranks(train_result, world, timeout=600, **kw)


def _close_losses(a, b, tol=1e-5):
    """CP vs no CP: the ring sums attention in another order, so ≤1e-5 relative."""
    assert len(a) == STEPS
    same_numbers(b, a, tol, "losses with CP vs without")


def test_cp2_trains_like_cp1():
    one = _train(1, global_batch_size=8)
    two = _train(2, global_batch_size=8, context_parallel_size=2)
    assert two[0]["config"]["context_parallel_size"] == 2
    same_numbers(two[1]["losses"], two[0]["losses"], 0.0, "CP rank 1 vs 0")  # whole sequence's
    _close_losses(one[0]["losses"], two[0]["losses"])
    # each CP rank keeps half the activations
    assert two[0]["peak_memory_bytes"] < 0.6 * one[0]["peak_memory_bytes"]


def test_cp2_tp2_sp_trains_like_tp2_sp():
    kw = dict(global_batch_size=8, tensor_model_parallel_size=2, sequence_parallel=True)
    tp = _train(2, **kw)
    cp = _train(4, context_parallel_size=2, **kw)
    assert cp[0]["config"]["data_parallel_size"] == 1
    _close_losses(tp[0]["losses"], cp[0]["losses"])


def _random_plan(tmp_path, seed, tp, sp, cp):
    """A random legal plan for tiny-llama's layer at this layout, planned from the shape
    (no ranks): the live DHelix layer must accept it. Even seeds: β's chain rotated by a
    random r (`Plan.rotation`), which may cut the ring."""
    from dhelix.models.config import load_model_config
    from dhelix.planner.enumerate import random_legal_plan
    from dhelix.planner.shapes import layer_ops_for_shape
    ops = layer_ops_for_shape(load_model_config("tiny-llama"), tp, sp, 64, 2, cp=cp)
    path = str(tmp_path / f"cp{cp}_tp{tp}_{seed}.json")
    rng = random.Random(seed)
    rot = 0 if seed % 2 else rng.randrange(1, len(ops.backward))
    random_legal_plan(ops, rng, rotation=rot).save(path)
    return path


@pytest.mark.parametrize("tp,cp,seeds", [(1, 2, [1, 2]), (2, 2, [3]), (1, 4, [4])])
def test_dhelix_equals_cp_baseline_for_random_plans(tmp_path, tp, cp, seeds):
    """Bit-identical to the CP baseline (megatron's layer with the same ring run op after
    op): losses, every step's gradient checksums, final weights, on every rank."""
    kw = dict(global_batch_size=6, tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
              context_parallel_size=cp, checksums=True)
    base = _train(tp * cp, **kw)
    for seed in seeds:
        plan = _random_plan(tmp_path, seed, tp, tp > 1, cp)
        dh = _train(tp * cp, dhelix={"enabled": True, "plan": plan}, **kw)
        assert dh[0]["config"]["schedule"] == "dhelix"
        assert same_runs(dh, base) == 0.0


def test_cp_layouts_are_checked(tmp_path):
    from dhelix.train.config import TrainConfig, preflight
    with pytest.raises(ConfigError, match=r"--seq-length 60 does not split into 2·CP = 8 "
                                          r"chunks.*multiple of 8"):
        preflight(TrainConfig(config="tiny-llama", seq_length=60, context_parallel_size=4), 4)
    with pytest.raises(ConfigError, match=r"not TP×CP×PP×DP = 1×2×1×2; launch 4 ranks"):
        preflight(TrainConfig(config="tiny-llama", context_parallel_size=2,
                              data_parallel_size=2), 2)
    with pytest.raises(ConfigError, match="--context-parallel-size 0"):
        preflight(TrainConfig(config="tiny-llama", context_parallel_size=0), 2)
    with pytest.raises(ConfigError, match="with a MoE model: not built yet"):
        preflight(TrainConfig(config="tiny-moe", context_parallel_size=2), 2)
    # a plan made for another CP size is refused before any rank starts
    from dhelix.planner.plan import PlanError
    plan = _random_plan(tmp_path, 1, 1, False, 1)
    with pytest.raises(PlanError):
        preflight(TrainConfig(config="tiny-llama", context_parallel_size=2,
                              dhelix={"enabled": True, "plan": plan}), 2)


def test_cp_cli_refuses_uneven_sequence():
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "dhelix.cli", "train", "--nproc", "2",
                        "--config", "tiny-llama", "--context-parallel-size", "2",
                        "--seq-length", "66", "--train-iters", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "--seq-length 66 does not split into 2·CP = 4 chunks" in p.stderr + p.stdout
