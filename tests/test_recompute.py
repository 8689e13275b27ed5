"""Activation recomputation (megatron's --recompute-granularity/-method/-num-layers) in
`dhelix train`, with megatron's schedule and with `--dhelix` (docs/recompute.md).

One spawn (`recompute_fns.train_many`) trains tiny4 (4 layers) on 2 ranks, TP=2 + SP,
3 micro-batches, 2 steps, fp32, every run from the same seed and data:
  megatron's schedule and `--dhelix`, each without recompute, with full/uniform (groups
  of 2 layers), full/block (the first layer) and selective; and, with dropout 0.1 in
  the layers (hidden and attention), full/uniform and selective under both schedules.
Compared (`compare.same_runs`: losses, every parameter's gradient checksum at every
step, the final weights' checksums, every rank):
  - `--dhelix` against megatron with the same recompute flags: bit for bit (tolerance
    0) — the recomputed forward is the same ops on the same input, and with dropout the
    same generator states give the same masks;
  - megatron with recompute against megatron without: equal losses and gradients;
  - peak activation memory (`peak_memory_bytes`, saved-tensor accounting, rank 0):
    with recompute below without, for both schedules and each setting.
Then flag checks (no ranks): megatron's combinations and what is not built are refused
before any rank starts, naming the flag; and the planner's memory model.
"""
import functools

import pytest

from compare import same_numbers, same_runs
from dhelix.testing import run_ranks
from recompute_fns import train_many

COMMON = dict(config="tiny4", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=2, micro_batch_size=2, global_batch_size=6)
SETTINGS = {
    "none": {},
    "uniform": dict(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=2),
    "block": dict(recompute_granularity="full", recompute_method="block",
                  recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
}
DROPOUT = ("uniform", "selective")


@functools.lru_cache(maxsize=None)
def _all():
    runs = []
    for name, flags in SETTINGS.items():
        runs.append((f"mg/{name}", flags))
        runs.append((f"dh/{name}", dict(flags, dhelix={"enabled": True})))
    for name in DROPOUT + ("none",):
        runs.append((f"mg/{name}/dropout", dict(SETTINGS[name], dropout=0.1)))
        if name != "none":
            runs.append((f"dh/{name}/dropout", dict(SETTINGS[name], dropout=0.1,
                                                    dhelix={"enabled": True})))
    per_rank = run_ranks(train_many, 2, runs, timeout=400, **COMMON)
    return {name: [r[name] for r in per_rank] for name, _ in runs}


def _pick(name):
    return _all()[name]


@pytest.mark.timeout(500)
@pytest.mark.parametrize("setting", ["uniform", "block", "selective"])
def test_dhelix_recompute_matches_megatron_recompute(setting):
    """`--dhelix` with the recompute flags against megatron's schedule with the same
    flags: losses, gradient and weight checksums bit for bit, every rank; the run did
    use DHelix's schedule."""
    dh, mg = _pick(f"dh/{setting}"), _pick(f"mg/{setting}")
    assert dh[0]["config"]["schedule"] == "dhelix" and mg[0]["config"]["schedule"] == "megatron"
    assert same_runs(dh, mg) == 0.0


@pytest.mark.timeout(500)
def test_rotated_plan_with_recompute(tmp_path):
    """A random plan with β's chain rotated (`Plan.rotation`) under block recompute (the
    first of tiny4's 4 layers recomputed): β is walked across two nodes except into the
    recomputed one, which runs beside α by itself in its own order; bit for bit against
    megatron's schedule with the same flags."""
    from train_fns import write_random_plan
    plan = str(tmp_path / "rotated.json")
    run_ranks(write_random_plan, 2, plan, "tiny4", 4, 2, 5, timeout=200)
    runs = [("dh", dict(SETTINGS["block"], dhelix={"enabled": True, "plan": plan}))]
    dh = [r["dh"] for r in run_ranks(train_many, 2, runs, timeout=400, **COMMON)]
    assert dh[0]["config"]["schedule"] == "dhelix"
    assert same_runs(dh, _pick("mg/block")) == 0.0


@pytest.mark.timeout(500)
@pytest.mark.parametrize("setting", DROPOUT)
def test_recompute_with_dropout_replays_the_masks(setting):
    """With dropout 0.1 (hidden and attention): the dropout is live (the losses differ
    from the run without it), and `--dhelix` recomputing equals megatron recomputing
    bit for bit — both restore the generator states of the first forward (CPU
    generator and the model-parallel tracker), so the recomputed masks are the first
    forward's. Megatron recomputing equals megatron not recomputing too."""
    dh, mg = _pick(f"dh/{setting}/dropout"), _pick(f"mg/{setting}/dropout")
    plain = _pick("mg/none/dropout")
    assert dh[0]["losses"] != _pick("mg/none")[0]["losses"]
    assert same_runs(dh, mg) == 0.0
    assert same_runs(mg, plain, 1e-5) <= 1e-5


@pytest.mark.timeout(500)
@pytest.mark.parametrize("setting", ["uniform", "block", "selective"])
def test_megatron_recompute_changes_no_number(setting):
    """megatron's schedule with recompute against without: the same losses (bit for
    bit: the recomputed forward is the same ops), gradients within 1e-5."""
    mg, plain = _pick(f"mg/{setting}"), _pick("mg/none")
    assert same_numbers(mg[0]["losses"], plain[0]["losses"], 0.0, "losses") == 0.0
    assert same_runs(mg, plain, 1e-5, keys=("grad_checksums",)) <= 1e-5


@pytest.mark.timeout(500)
@pytest.mark.parametrize("schedule", ["mg", "dh"])
def test_recompute_lowers_peak_activation_memory(schedule):
    """Peak activation memory (saved-tensor accounting) with each recompute setting is
    below the same schedule's without recompute; full/uniform (every layer keeps only
    its input) below full/block (one of four layers) below none."""
    peak = {s: _pick(f"{schedule}/{s}")[0]["peak_memory_bytes"] for s in SETTINGS}
    assert all(peak[s] > 0 for s in SETTINGS), peak
    for s in ("uniform", "block", "selective"):
        assert peak[s] < peak["none"], (s, peak)
    assert peak["uniform"] < peak["block"] < peak["none"], peak


@pytest.mark.timeout(500)
def test_dhelix_full_recompute_keeps_less_than_megatron_full():
    """A measured fact, kept: with every layer recomputed in groups of 2, DHelix's step
    peaks below megatron's — megatron recomputes a group's 2 layers at once and holds both
    layers' activations during the group's backward, a DHelix node recomputes its own
    layer only (per-layer recompute of the group: the same math)."""
    assert _pick("dh/uniform")[0]["peak_memory_bytes"] < \
        _pick("mg/uniform")[0]["peak_memory_bytes"]


# ---- flags, before any rank starts --------------------------------------------------------

def _check(world=2, **kw):
    from dhelix.train.config import TrainConfig, check_layout, model_of
    cfg = TrainConfig(**dict(dict(config="tiny4", tensor_model_parallel_size=2,
                                  sequence_parallel=True), **kw))
    return check_layout(cfg, model_of(cfg), world)


@pytest.mark.parametrize("flags, match", [
    (dict(recompute_granularity="full"), "full needs --recompute-method uniform or block"),
    (dict(recompute_granularity="full", recompute_method="block"),
     "full needs --recompute-num-layers"),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
     "groups of 3, which must divide 4"),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=5),
     "give at most 4"),
    (dict(recompute_granularity="selective", recompute_method="uniform"),
     "selective .* takes no --recompute-method"),
    (dict(recompute_granularity="selective", recompute_num_layers=1),
     "selective .* takes no --recompute-method or --recompute-num-layers"),
    (dict(recompute_method="block", recompute_num_layers=1),
     "without --recompute-granularity"),
    (dict(recompute_granularity="selective", dhelix={"enabled": True, "halves": True}),
     "--dhelix-halves: not built"),
    (dict(recompute_granularity="selective", num_experts=4),
     "a MoE model: not built"),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1,
          dhelix={"enabled": True, "fold": True}, pipeline_model_parallel_size=2,
          tensor_model_parallel_size=1, sequence_parallel=False),
     "--dhelix-fold: not built"),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
          dhelix={"peer": True}), "--dhelix-peer: not built"),
])
def test_bad_recompute_flags_are_refused_before_ranks(flags, match):
    from dhelix.models.config import ConfigError
    with pytest.raises(ConfigError, match=match):
        _check(**flags)


def test_good_recompute_flags_pass():
    for flags in SETTINGS.values():
        assert _check(**flags).tp == 2
    assert _check(dhelix={"enabled": True}, **SETTINGS["block"]).num_microbatches == 1


def test_which_layers_recompute():
    """megatron's choice of layers (`TransformerBlock._checkpointed_forward`), shared by
    DHelix's programs and the memory model."""
    from dhelix.planner.recompute import recomputed_layers
    assert recomputed_layers(None, None, None, 3) == [None] * 3
    assert recomputed_layers("full", "uniform", 2, 4) == ["full"] * 4
    assert recomputed_layers("full", "block", 1, 4) == ["full", None, None, None]
    assert recomputed_layers("selective", None, None, 2) == ["selective"] * 2
    with pytest.raises(ValueError, match="must divide"):
        recomputed_layers("full", "uniform", 3, 4)


# ---- the memory model -----------------------------------------------------------------------

def _tiny4_ops():
    from dhelix.models.config import load_model_config
    from dhelix.planner.shapes import layer_ops_for_shape
    return layer_ops_for_shape(load_model_config("tiny4"), 2, True, 64, 2)


def test_memory_model_knows_what_a_recomputed_layer_keeps():
    """A fully recomputed layer keeps its input ([s/tp, b, h] fp32 = 32·2·64·4 bytes) and
    re-creates the rest in its backward; a selective one drops only the attention core's
    saved state. The whole-step play (`step_activation_peak`, 4 layers, 3 micro-batches)
    against hand-computed values (K: what an ordinary layer keeps, I: its input), and
    every recompute peak below the plain one."""
    from dhelix.planner import recompute as rc
    lo = _tiny4_ops()
    full, sel = rc.recomputed_layer_ops(lo, "full"), rc.recomputed_layer_ops(lo, "selective")
    inp = 32 * 2 * 64 * 4
    assert rc.input_bytes(lo) == inp
    assert rc.kept_bytes(full) == inp
    assert rc.recompute_bytes(full) == rc.kept_bytes(lo) - inp
    attn = next(o for o in lo.forward if o.name == "attn").saved_bytes
    assert attn > 0 and rc.kept_bytes(sel) == rc.kept_bytes(lo) - attn
    assert rc.recompute_bytes(sel) == attn and rc.recompute_bytes(lo) == 0.0
    assert full.backward == lo.backward and full.signature() != lo.signature()
    K = rc.kept_bytes(lo)
    L, N = 4, 3
    # megatron: one micro-batch at a time; at the top layer's backward all L layers'
    # kept bytes are alive plus its recompute
    assert rc.step_activation_peak([lo] * L, N, "megatron") == L * K
    assert rc.step_activation_peak([full] * L, N, "megatron") == L * inp + (K - inp)
    # DHelix: after F(1) α's L layers; in a co-step β's layer j is recomputed, then α's
    # layer i adds its kept bytes before β's layer frees: L + 1 layers' kept (first
    # pair) plus one recompute
    assert rc.step_activation_peak([lo] * L, N, "dhelix") == (L + 1) * K
    assert rc.step_activation_peak([full] * L, N, "dhelix") == (L + 1) * inp + (K - inp)
    block = [full] + [lo] * (L - 1)
    for sch in ("megatron", "dhelix"):
        plain = rc.step_activation_peak([lo] * L, N, sch)
        assert rc.step_activation_peak([full] * L, N, sch) < \
            rc.step_activation_peak(block, N, sch) < plain
        assert rc.step_activation_peak([sel] * L, N, sch) < plain


def test_simulator_peak_reflects_recompute():
    """The lane simulator plays a recomputed α layer beside β's layer (the paired plan,
    the analytical A40 model): its peak is lower by what α's forward no longer keeps —
    β's activations are alive in both (a recomputed β layer re-created them before the
    pair)."""
    from dhelix.models.config import find_named_yaml
    from dhelix.planner import recompute as rc
    from dhelix.planner.costmodel import ClusterError, group_sizes_of, load_cluster
    from dhelix.planner.plan import paired_plan
    from dhelix.planner.simulate import simulate
    cluster = load_cluster(find_named_yaml("a40", "clusters", "--cluster", "cluster",
                                           ClusterError))
    lo = _tiny4_ops()
    peaks = {}
    for kind in (None, "selective", "full"):
        v = rc.recomputed_layer_ops(lo, kind)
        peaks[kind] = simulate(v, paired_plan(v), cluster=cluster,
                               group_sizes=group_sizes_of(v.shape, v), dtype="fp32").peak_bytes
    assert peaks["full"] < peaks["selective"] < peaks[None], peaks
    beta = sum(o.saved_bytes for o in lo.backward)     # β's layer, alive at the start
    assert peaks["full"] >= beta + rc.input_bytes(lo)


def test_megatron_lm_recompute_flags_checked_before_training():
    """Megatron-LM's pretrain_gpt.py with --dhelix and megatron's recompute flags: full and
    selective (attention core) pass; with the halves, experts, context parallel or
    selective modules other than core_attn they are refused by flag before training;
    without --dhelix nothing is refused."""
    import argparse
    from dhelix.megatron.args import DHelixArgError, add_dhelix_args, check_dhelix_args

    def args(*argv, **over):
        p = argparse.ArgumentParser()
        add_dhelix_args(p)
        a = p.parse_args(list(argv))
        for k, v in dict(dict(recompute_granularity="full", recompute_method="uniform",
                              recompute_num_layers=1, context_parallel_size=1,
                              micro_batch_size=2), **over).items():
            setattr(a, k, v)
        return a
    check_dhelix_args(args("--dhelix"))
    check_dhelix_args(args("--dhelix", recompute_granularity="selective",
                           recompute_modules=["core_attn"]))
    check_dhelix_args(args(num_experts=4, context_parallel_size=2))      # megatron's own
    for argv, over, flag in (
            (("--dhelix", "--dhelix-halves"), {}, "--dhelix-halves"),
            (("--dhelix",), dict(num_experts=4), "--num-experts"),
            (("--dhelix",), dict(context_parallel_size=2), "--context-parallel-size 2"),
            (("--dhelix",), dict(recompute_granularity="selective",
                                 recompute_modules=["core_attn", "mlp"]), "core_attn")):
        with pytest.raises(DHelixArgError, match=flag):
            check_dhelix_args(args(*argv, **over))
