"""The comparison helper itself (tests/compare.py): each hole a hand-rolled check had is
closed, so an equivalence test built on it can fail."""
import math

import pytest
import torch

from compare import (Mismatch, merge_stages, rel_diff, same_checksums, same_numbers,
                     same_runs, same_tensors)

T = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}


def test_nan_fails_wherever_it_comes():
    # the hole: max(0.0, nan) is 0.0, so `worst = max(worst, err)` dropped a NaN
    assert max(0.0, math.nan) == 0.0
    for where in ("w", "b"):
        bad = dict(T, **{where: T[where] * math.nan})
        for tol in (0.0, 1e-6):
            with pytest.raises(Mismatch, match=f"{where}: non-finite"):
                same_tensors(bad, T, tol)
            with pytest.raises(Mismatch, match=f"{where}: non-finite"):
                same_tensors(T, bad, tol)         # a NaN in the reference fails too
    with pytest.raises(Mismatch, match="non-finite"):
        same_tensors({"w": torch.tensor([1.0, math.inf]), "b": T["b"]}, T, 1.0)
    with pytest.raises(Mismatch, match=r"\[1\]: non-finite"):
        same_numbers([1.0, math.nan], [1.0, 2.0], 1e-3)
    assert rel_diff(torch.tensor([math.nan]), torch.tensor([1.0])) == math.inf


def test_missing_and_extra_names_fail():
    with pytest.raises(Mismatch, match=r"grads: missing \['b'\]"):
        same_tensors({"w": T["w"]}, T, 0.0, "grads:")
    with pytest.raises(Mismatch, match=r"not in the reference \['x'\]"):
        same_tensors(dict(T, x=T["b"]), T)
    with pytest.raises(Mismatch, match=r"missing \['b'\]"):
        same_checksums({"w": [1.0, 2.0]}, {"w": [1.0, 2.0], "b": [0.0, 1.0]})


def test_exact_means_bit_for_bit_and_tolerances_are_kept():
    nudged = {"w": torch.nextafter(T["w"], torch.tensor(9.0)), "b": T["b"]}
    with pytest.raises(Mismatch, match="w: not bit-identical"):
        same_tensors(nudged, T, 0.0)
    assert 0.0 < same_tensors(nudged, T, 1e-6) <= 1e-6
    with pytest.raises(Mismatch, match="above 1e-08"):
        same_tensors({"w": T["w"] * 1.001, "b": T["b"]}, T, 1e-8)
    assert same_tensors(T, {k: v.clone() for k, v in T.items()}) == 0.0
    with pytest.raises(Mismatch, match=r"shape \(1, 2\)"):
        same_tensors({"w": T["w"][None], "b": T["b"]}, T, 1.0)
    with pytest.raises(Mismatch, match="2 values vs the reference's 3"):
        same_numbers([1.0, 2.0], [1.0, 2.0, 3.0])


def test_checksum_sum_is_relative_to_the_tensors_size():
    # a sum near zero of entries of size 1 (sum of squares 4): 1e-9 off is 5e-10 of √4
    assert same_checksums({"w": [1e-9, 4.0]}, {"w": [0.0, 4.0]}, 1e-6) == pytest.approx(5e-10)
    with pytest.raises(Mismatch, match="w sum of squares"):
        same_checksums({"w": [0.0, 4.1]}, {"w": [0.0, 4.0]}, 1e-3)


def _result(pp, tp, grads, losses=(2.0, 1.9), untied=True):
    return {"coords": {"tp": tp, "cp": 0, "pp": pp, "dp": 0}, "losses": list(losses),
            "config": {"model": {"untie_embeddings_and_output_weights": untied}},
            "grad_checksums": [grads, grads], "weight_checksums": grads}


def test_runs_are_checked_on_every_rank_and_stages_merge_by_global_name():
    a = [_result(0, 0, {"x": [1.0, 1.0]}), _result(0, 1, {"x": [2.0, 4.0]})]
    b = [_result(0, 0, {"x": [1.0, 1.0]}), _result(0, 1, {"x": [2.0, 4.5]})]
    assert same_runs(a, a) == 0.0
    with pytest.raises(Mismatch, match="rank 1 step 1 grad x sum of squares"):
        same_runs(b, a)
    # 1F1B: layer 0 on stage 0, layer 1 and a tied output-layer copy on stage 1; the
    # fold holds both layers and the one embedding on stage 0
    emb, l0, l1 = [3.0, 9.0], [1.0, 1.0], [2.0, 4.0]
    one_f_one_b = [_result(0, 0, {"embedding.word_embeddings.weight": emb, "l.0": l0},
                           untied=False),
                   _result(1, 0, {"l.1": l1, "output_layer.weight": emb}, untied=False)]
    fold = [_result(0, 0, {"embedding.word_embeddings.weight": emb, "l.0": l0, "l.1": l1},
                    untied=False), _result(1, 0, {}, untied=False)]
    assert same_runs(merge_stages(fold), merge_stages(one_f_one_b)) == 0.0
    one_f_one_b[1]["grad_checksums"][1] = {"l.1": l1, "output_layer.weight": [3.0, 9.5]}
    with pytest.raises(Mismatch, match="stage 1\\) tied copy"):
        merge_stages(one_f_one_b)
    twice = [_result(0, 0, {"l.0": l0}), _result(1, 0, {"l.0": l0})]
    with pytest.raises(Mismatch, match="'l.0' held by two stages"):
        merge_stages(twice)
