"""DHelix against Megatron-LM's real training code (`$MEGATRON_LM`, else
../shared/megatron-lm): its argument parser with DHelix's extra_args_provider, the install
hook in its `megatron.training.training` and `gpt_builders`, the model its
`model_provider`/`gpt_builder` build, and the forward-backward function its `train_step`
would call. Without a checkout these tests skip, naming MEGATRON_LM; under CI=true a
missing checkout fails them."""
import os

import pytest

from dhelix.testing import run_ranks
import megatron_lm_fns as fns

ML = fns.megatron_lm_path()
if not os.path.exists(os.path.join(ML, "pretrain_gpt.py")):
    msg = (f"no Megatron-LM checkout at {ML}: set MEGATRON_LM to one (tag core_v0.16.1 pairs "
           f"with megatron-core 0.16.1)")
    if os.environ.get("CI") == "true":
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg, allow_module_level=True)


def test_real_parser_takes_dhelix_flags():
    r = run_ranks(fns.parsed, 1, fns.SMALL + ["--dhelix", "--dhelix-plan", "paired",
                                              "--dhelix-trace", "t.json"], timeout=300)[0]
    assert r["dhelix"] is True and r["dhelix_plan"] == "paired"
    assert r["dhelix_trace"] == "t.json" and r["transformer_impl"] == "local"
    assert (r["micro_batch_size"], r["global_batch_size"]) == (2, 8)


def test_real_builder_and_schedule_train_like_megatron():
    """TP=2 + sequence parallel on 2 ranks, through the install hook: the DHelix model
    Megatron-LM's gpt_builder builds with --dhelix (DHelix's spec, whose final norm takes
    sequence parallel), run by the forward-backward function its training module returns,
    gives the losses and gradients of --dhelix-sdpa-baseline (megatron's layer and
    schedule on the same spec) bit for bit."""
    argv = fns.SMALL + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    base = run_ranks(fns.train_real, 2, argv + ["--dhelix-sdpa-baseline"], False,
                     timeout=400)
    dh = run_ranks(fns.train_real, 2, argv, True, timeout=400)
    for b, d in zip(base, dh):
        assert b["installed"] is True and d["installed"] is True
        assert set(b["layers"]) == {"TransformerLayer"} and set(d["layers"]) == {"DHelixLayer"}
        assert len(d["layers"]) == 2
        assert b["schedule"] == "forward_backward_no_pipelining"
        assert d["schedule"] == "forward_backward_dhelix"
        assert b["losses"] == d["losses"], (b["losses"], d["losses"])
        assert b["grad_abs_sum"] == d["grad_abs_sum"]


def test_real_megatron_lm_with_context_parallel():
    """Megatron-LM's builder after the hook, --context-parallel-size 2 --dhelix: the DHelix
    layers get the ring (megatron's local spec has no CP attention), batches are cut by
    megatron-core's get_batch_on_this_cp_rank as pretrain_gpt's get_batch does, and the
    whole sequence's loss (both CP ranks' sums over their tokens) and the later steps equal
    the CP=1 run's."""
    one = run_ranks(fns.train_real, 1, fns.SMALL, True, timeout=400)[0]
    two = run_ranks(fns.train_real, 2, fns.SMALL + ["--context-parallel-size", "2"], True,
                    timeout=400)
    assert two[0]["schedule"] == "forward_backward_dhelix"
    for step, mbs in enumerate(one["loss_sums"]):
        for k, (s1, n1) in enumerate(mbs):
            (sa, na), (sb, nb) = two[0]["loss_sums"][step][k], two[1]["loss_sums"][step][k]
            assert na + nb == n1 and na == nb
            assert abs((sa + sb) / (na + nb) - s1 / n1) <= 1e-5 * abs(s1 / n1), (step, k)


def test_wrapper_reaches_megatron_pretrain():
    """scripts/pretrain_gpt_dhelix.py takes the --dhelix flags off, installs the hook into
    Megatron-LM's training module and runs its pretrain_gpt.py unchanged — here until
    Megatron-LM's own first CUDA requirement (initialize_megatron asserts CUDA)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    r = subprocess.run([sys.executable, "scripts/pretrain_gpt_dhelix.py", "--megatron-lm", ML,
                        *fns.SMALL, "--dhelix", "--dhelix-plan", "paired"], cwd=root,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "Megatron requires CUDA" in r.stderr, r.stderr[-3000:]
    assert "unrecognized arguments" not in r.stderr
    r = subprocess.run([sys.executable, "scripts/pretrain_gpt_dhelix.py", *fns.SMALL],
                       cwd=root, env=dict(env, MEGATRON_LM=""), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "--megatron-lm PATH (or MEGATRON_LM)" in r.stderr
