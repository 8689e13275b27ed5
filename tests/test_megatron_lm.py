"""DHelix against Megatron-LM's real training code (`$MEGATRON_LM`, else
../shared/megatron-lm): its argument parser with DHelix's extra_args_provider, the install
hook in its `megatron.training.training` and `gpt_builders`, the model its
`model_provider`/`gpt_builder` build, and the forward-backward function its `train_step`
would call. Without a checkout these tests skip, naming MEGATRON_LM; under CI=true a
missing checkout fails them."""
import os


from dhelix.testing import run_ranks
import megatron_lm_fns as fns
from compare import same_numbers, same_runs

ML = fns.require_megatron_lm()

NMB = 4            # fns.SMALL: global batch 8 / micro-batch 2, one data-parallel rank


def test_real_parser_takes_dhelix_flags():
    r = run_ranks(fns.parsed, 1, fns.SMALL + ["--dhelix", "--dhelix-plan", "paired",
                                              "--dhelix-trace", "t.json"], timeout=300)[0]
    assert r["dhelix"] is True and r["dhelix_plan"] == "paired"
    assert r["dhelix_trace"] == "t.json" and r["transformer_impl"] == "local"
    assert (r["micro_batch_size"], r["global_batch_size"]) == (2, 8)


STEPS = 3          # train_real's default: every step's gradients, then the final weights


def _same_real_runs(dh, base):
    """`train_real` results of two runs, rank by rank, bit for bit: every step's
    per-micro-batch losses, every step's per-parameter checksums of megatron DDP's
    main_grad (this rank's shard, after DDP's reduction), the final weights' checksums.
    Each run's checksums cover every one of its parameters, under the GPT model's
    parameter names (megatron's layer and the DHelix layer use the same ones)."""
    assert len(dh) == len(base)
    for rank, (d, b) in enumerate(zip(dh, base)):
        assert len(d["losses"]) == len(b["losses"]) == STEPS
        for step, (ld, lb) in enumerate(zip(d["losses"], b["losses"])):
            assert len(lb) == NMB
            assert same_numbers(ld, lb, 0.0, f"rank {rank} step {step + 1} losses") == 0.0
    assert same_runs(dh, base, 0.0, keys=("grad_checksums", "weight_checksums")) == 0.0
    # not a vacuous comparison: every step, every parameter of the model, by its name
    for rank, (d, b) in enumerate(zip(dh, base)):
        assert d["state_keys"] == b["state_keys"], f"rank {rank}: state dict keys differ"
        for r in (d, b):
            assert len(r["grad_checksums"]) == STEPS
            assert r["params"] > 0 and len(r["weight_checksums"]) == r["params"]
            assert all(len(c) == r["params"] for c in r["grad_checksums"])
            assert set(r["weight_checksums"]) <= set(r["state_keys"])


def _baseline_vs_dhelix(argv, attention):
    """--dhelix-sdpa-baseline (megatron's layer and schedule) and --dhelix on 2 ranks,
    each layer's core attention `attention`; compared by `_same_real_runs`."""
    base = run_ranks(fns.train_real, 2, argv + ["--dhelix-sdpa-baseline"], False,
                     timeout=400)
    dh = run_ranks(fns.train_real, 2, argv, True, timeout=400)
    for b, d in zip(base, dh):
        assert b["installed"] is True and d["installed"] is True
        assert b["layers"] == ["TransformerLayer"] * 2 and d["layers"] == ["DHelixLayer"] * 2
        assert b["core_attention"] == d["core_attention"] == [attention] * 2
        assert b["schedule"] == "forward_backward_no_pipelining"
        assert d["schedule"] == "forward_backward_dhelix"
        assert d["params"] == 28
    _same_real_runs(dh, base)
    return dh


def test_real_builder_and_schedule_train_like_megatron():
    """TP=2 + sequence parallel on 2 ranks, through the install hook: the DHelix model
    Megatron-LM's gpt_builder builds with --dhelix (DHelix's spec, whose final norm takes
    sequence parallel), run by the forward-backward function its training module returns,
    against --dhelix-sdpa-baseline (megatron's TransformerLayer and megatron's
    forward_backward_no_pipelining on the same spec). Bit-identical (tol=0.0) on both
    ranks: the 4 micro-batch losses of each of the 3 steps; at each step, [sum, sum of
    squares] of megatron DDP's main_grad of each of the 28 parameters (this rank's TP
    shard); the final weights' checksums; the same parameter names in both runs."""
    argv = fns.SMALL + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    _baseline_vs_dhelix(argv, "SDPAttention")


def test_real_megatron_lm_with_context_parallel():
    """Megatron-LM's builder after the hook, --context-parallel-size 2 on 2 ranks, batches
    cut by megatron-core's get_batch_on_this_cp_rank as pretrain_gpt's get_batch does: the
    --dhelix run (DHelix layers on the ring, DHelix's schedule) against
    --dhelix-sdpa-baseline at CP=2 (megatron's TransformerLayer with the same ring,
    `RingAttention`, in its core-attention slot, megatron's schedule). Bit-identical
    (tol=0.0) on both CP ranks: the 4 micro-batch losses (over this rank's tokens) of each
    of the 3 steps, every step's main_grad checksums of all 28 parameters, the final
    weights' checksums. Extra: the whole sequence's loss (both CP ranks' sums over their
    tokens) of the --dhelix CP=2 run equals the --dhelix CP=1 run's at every step and
    micro-batch, to 1e-5 relative — the ring merges attention blocks by log-sum-exp, in
    another order of floating-point sums than attention over the whole sequence — with
    the token counts exact (half the sequence on each CP rank)."""
    argv = fns.SMALL + ["--context-parallel-size", "2"]
    dh = _baseline_vs_dhelix(argv, "RingAttention")

    one = run_ranks(fns.train_real, 1, fns.SMALL, True, timeout=400)[0]
    assert one["core_attention"] == ["SDPAttention"] * 2
    assert len(one["loss_sums"]) == STEPS
    for step, mbs in enumerate(one["loss_sums"]):
        a, b = dh[0]["loss_sums"][step], dh[1]["loss_sums"][step]
        what = f"step {step + 1}"
        same_numbers([na for _, na in a], [nb for _, nb in b], 0.0, f"{what} CP tokens")
        same_numbers([na + nb for (_, na), (_, nb) in zip(a, b)], [n for _, n in mbs], 0.0,
                     f"{what} whole-sequence tokens")
        same_numbers([(sa + sb) / (na + nb) for (sa, na), (sb, nb) in zip(a, b)],
                     [s / n for s, n in mbs], 1e-5, f"{what} whole-sequence loss, CP=2 vs 1")


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


def test_real_megatron_lm_distributed_optimizer_with_a_delayed_gather():
    """DP=2 on 2 ranks, Megatron-LM's own optimizer as its training builds it
    (`get_megatron_optimizer_config`), --use-distributed-optimizer --overlap-grad-reduce
    --overlap-param-gather: --dhelix, with every parameter all-gather delayed until it is
    waited for (the other rank's half NaN until then), against --dhelix-sdpa-baseline
    undelayed, bit for bit (`_same_real_runs`): the install hook's forward-backward puts
    DHelix's wait on every DHelix layer (dhelix/megatron/param_gather.py)."""
    argv = fns.SMALL + ["--use-distributed-optimizer", "--overlap-grad-reduce",
                        "--overlap-param-gather"]
    base = run_ranks(fns.train_real, 2, argv + ["--dhelix-sdpa-baseline"], False,
                     timeout=400)
    dh = run_ranks(fns.train_real, 2, argv, True, delay_gather=True, timeout=400)
    assert dh[0]["schedule"] == "forward_backward_dhelix"
    assert dh[0]["layers"] == ["DHelixLayer"] * 2
    assert all(r["delayed_gathers"] >= 3 for r in dh)     # one or more a step, delayed
    _same_real_runs(dh, base)


def test_sigterm_mid_co_step_with_megatron_lms_signal_handler():
    """Megatron-LM's --exit-signal-handler (its DistributedSignalHandler around the train
    loop) with DHelix's schedule: SIGTERM to rank 0 in the forward step of step 2's third
    micro-batch, in the middle of DHelix's co-steps. The step completes: every loss,
    gradient checksum and final weight equals a run without the signal, bit for bit; the
    handler reports the signal from step 2 on (rank 0's flag, as every rank sees it), so
    Megatron-LM's loop would save and exit after step 2."""
    argv = fns.SMALL + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    plain = run_ranks(fns.train_real, 2, argv, True, timeout=400)
    hit = run_ranks(fns.train_real, 2, argv, True, signal_at=(2, 3), timeout=400)
    _same_real_runs(hit, plain)
    for r in hit:
        assert r["schedule"] == "forward_backward_dhelix"
        assert r["signals"] == [[False, False], [True, False], [True, False]], r["signals"]
