"""Megatron-LM integration: spec forms and the install hook on unmodified megatron-core."""
import argparse
import functools

from dhelix.megatron.args import add_dhelix_args


def _args(*argv):
    p = argparse.ArgumentParser()
    add_dhelix_args(p)
    return p.parse_args(list(argv))


def test_spec_object_and_callable():
    from megatron.core.transformer.spec_utils import ModuleSpec
    from dhelix.megatron.spec import dhelix_layer_spec, get_dhelix_layer_spec
    from dhelix.strand.layer import DHelixLayer
    assert isinstance(dhelix_layer_spec, ModuleSpec) and dhelix_layer_spec.module is DHelixLayer
    spec = get_dhelix_layer_spec(argparse.Namespace(normalization="RMSNorm"))
    assert spec.module is DHelixLayer


def test_install_hook_swaps_only_with_flag():
    from megatron.core import pipeline_parallel
    from megatron.core.models.gpt import gpt_layer_specs
    from dhelix.megatron.install import install, uninstall
    from dhelix.strand.layer import DHelixLayer
    from dhelix.schedules.dhelix import forward_backward_dhelix
    before = pipeline_parallel.get_forward_backward_func
    assert install(_args()) is False
    assert pipeline_parallel.get_forward_backward_func is before
    try:
        assert install(_args("--dhelix")) is True
        fb = pipeline_parallel.get_forward_backward_func()
        # DHelix's forward-backward, behind the --overlap-param-gather layer wait
        # (megatron/param_gather.py), under its name
        assert isinstance(fb, functools.partial)
        assert fb.func.__wrapped__ is forward_backward_dhelix
        assert fb.func.__name__ == "forward_backward_dhelix"
        assert gpt_layer_specs.get_gpt_layer_local_spec().module is DHelixLayer
    finally:
        uninstall()
    assert pipeline_parallel.get_forward_backward_func is before
    assert gpt_layer_specs.get_gpt_layer_local_spec().module is not DHelixLayer


def test_install_refuses_the_fold_in_pretrain_gpt():
    """pretrain_gpt.py places layers the megatron way; the fold is `dhelix train`'s."""
    import pytest
    from megatron.core import pipeline_parallel
    from dhelix.megatron.args import DHelixArgError
    from dhelix.megatron.install import install
    before = pipeline_parallel.get_forward_backward_func
    args = _args("--dhelix", "--dhelix-fold")
    args.pipeline_model_parallel_size = 2
    with pytest.raises(DHelixArgError, match="dhelix train --pipeline-model-parallel-size G "
                                             "--dhelix --dhelix-fold"):
        install(args)
    assert pipeline_parallel.get_forward_backward_func is before     # nothing half-installed


def test_cluster_by_name_or_path():
    import pytest
    from dhelix.megatron.args import DHelixArgError, check_dhelix_args
    check_dhelix_args(_args("--dhelix", "--dhelix-cluster", "h100"))
    check_dhelix_args(_args("--dhelix", "--dhelix-cluster", "configs/clusters/a40.yaml"))
    with pytest.raises(DHelixArgError, match=r"--dhelix-cluster: cluster file 'nope' not "
                                             r"found; .*a40, a800, h100"):
        check_dhelix_args(_args("--dhelix", "--dhelix-cluster", "nope"))


def test_halves_checked_before_training():
    """`--dhelix-halves` in pretrain_gpt.py's arguments: an odd micro-batch, experts, CP or
    the fold are refused before any rank trains; without --dhelix it is refused too."""
    import pytest
    from dhelix.megatron.args import DHelixArgError, check_dhelix_args

    def args(*argv, **extra):
        a = _args(*argv)
        for k, v in extra.items():
            setattr(a, k, v)
        return a
    check_dhelix_args(args("--dhelix", "--dhelix-halves", micro_batch_size=2))
    with pytest.raises(DHelixArgError, match="--micro-batch-size must be even"):
        check_dhelix_args(args("--dhelix", "--dhelix-halves", micro_batch_size=3))
    with pytest.raises(DHelixArgError, match="not built with --num-experts"):
        check_dhelix_args(args("--dhelix", "--dhelix-halves", micro_batch_size=2, num_experts=4))
    with pytest.raises(DHelixArgError, match="not built with --context-parallel-size"):
        check_dhelix_args(args("--dhelix", "--dhelix-halves", micro_batch_size=2,
                               context_parallel_size=2))
    with pytest.raises(DHelixArgError, match="--dhelix-halves needs --dhelix"):
        check_dhelix_args(args("--dhelix-halves"))


def _tp_sp_args(*argv, **extra):
    """pretrain_gpt.py's arguments with TP=2, sequence parallel, seq 64, and `extra`."""
    a = _args(*argv)
    for k, v in dict(dict(tensor_model_parallel_size=2, sequence_parallel=True,
                          seq_length=64), **extra).items():
        setattr(a, k, v)
    return a


def test_mlp_chunks_checked_before_training():
    """`--dhelix-mlp-chunks C`: TP > 1 with sequence parallel, a dense MLP, C dividing each
    rank's sequence rows, and --dhelix; each refusal names the flag and the fix."""
    import pytest
    from dhelix.megatron.args import DHelixArgError, check_dhelix_args
    args = _tp_sp_args
    check_dhelix_args(args("--dhelix", "--dhelix-mlp-chunks", "4"))
    with pytest.raises(DHelixArgError, match="not with no --sequence-parallel"):
        check_dhelix_args(args("--dhelix", "--dhelix-mlp-chunks", "2", sequence_parallel=False))
    with pytest.raises(DHelixArgError, match="--tensor-model-parallel-size 1"):
        check_dhelix_args(args("--dhelix", "--dhelix-mlp-chunks", "2",
                               tensor_model_parallel_size=1))
    with pytest.raises(DHelixArgError, match="--num-experts"):
        check_dhelix_args(args("--dhelix", "--dhelix-mlp-chunks", "2", num_experts=4))
    with pytest.raises(DHelixArgError, match="--context-parallel-size 2"):
        check_dhelix_args(args("--dhelix", "--dhelix-mlp-chunks", "2", context_parallel_size=2))
    with pytest.raises(DHelixArgError, match="divides 32"):
        check_dhelix_args(args("--dhelix", "--dhelix-mlp-chunks", "3"))
    with pytest.raises(DHelixArgError, match="chunk count >= 1"):
        check_dhelix_args(args("--dhelix", "--dhelix-mlp-chunks", "0"))
    with pytest.raises(DHelixArgError, match="--dhelix-mlp-chunks needs --dhelix"):
        check_dhelix_args(args("--dhelix-mlp-chunks", "2"))


def test_keep_gathered_checked_before_training():
    """`--dhelix-keep-gathered`: TP > 1 with sequence parallel, on the layouts checked
    against megatron (dense, no CP, no fold, no recompute), and --dhelix."""
    import pytest
    from dhelix.megatron.args import DHelixArgError, check_dhelix_args
    args = _tp_sp_args
    check_dhelix_args(args("--dhelix", "--dhelix-keep-gathered"))
    check_dhelix_args(args("--dhelix", "--dhelix-keep-gathered", "--dhelix-mlp-chunks", "2"))
    for extra, what in ((dict(sequence_parallel=False), "no --sequence-parallel"),
                        (dict(tensor_model_parallel_size=1), "--tensor-model-parallel-size 1"),
                        (dict(num_experts=4), "--num-experts"),
                        (dict(context_parallel_size=2), "--context-parallel-size 2"),
                        (dict(recompute_granularity="full"), "--recompute-granularity")):
        with pytest.raises(DHelixArgError, match=f"not with {what}.*drop --dhelix-keep"):
            check_dhelix_args(args("--dhelix", "--dhelix-keep-gathered", **extra))
    with pytest.raises(DHelixArgError, match="--dhelix-keep-gathered needs --dhelix"):
        check_dhelix_args(args("--dhelix-keep-gathered"))
    # PARTS: one linear's input, checked and in the chains' order; the flag alone is both
    assert args("--dhelix", "--dhelix-keep-gathered").dhelix_keep_gathered is True
    assert args("--dhelix", "--dhelix-keep-gathered", "mlp").dhelix_keep_gathered == "mlp"
    assert args("--dhelix", "--dhelix-keep-gathered",
                "mlp,attn").dhelix_keep_gathered == "attn,mlp"
    check_dhelix_args(args("--dhelix", "--dhelix-keep-gathered", "attn",
                           "--dhelix-mlp-chunks", "2"))
    with pytest.raises(DHelixArgError, match="chunks.*keep attn only"):
        check_dhelix_args(args("--dhelix", "--dhelix-keep-gathered", "mlp",
                               "--dhelix-mlp-chunks", "2"))
    with pytest.raises(SystemExit):
        args("--dhelix", "--dhelix-keep-gathered", "qkv")
