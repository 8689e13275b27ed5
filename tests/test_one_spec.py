"""One DHelix layer spec on every device (issue 22): SDPA core attention, the one-node
norm, megatron's linears — chosen by get_dhelix_layer_spec, with_dhelix_layer, the
install hook, dhelix train and the profiler alike, whatever torch says of CUDA; and the
same spec with megatron's layer as the baseline with the same kernels."""
import argparse

import pytest
import torch

import spec_fns
from dhelix.testing import run_ranks


def _shape(spec):
    """A spec as nested module names, to compare two specs."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    if isinstance(spec, ModuleSpec):
        sub = spec.submodules
        fields = vars(sub) if sub is not None and hasattr(sub, "__dict__") else {}
        return (getattr(spec.module, "__name__", str(spec.module)),
                tuple(sorted((k, _shape(v)) for k, v in fields.items())))
    return getattr(spec, "__name__", repr(spec))


def _specs_seen():
    from megatron.core.models.gpt import gpt_layer_specs
    from dhelix.megatron.install import install, uninstall
    from dhelix.megatron.spec import dhelix_layer_spec, get_dhelix_layer_spec, with_dhelix_layer
    from dhelix.models.spec import block_spec
    from dhelix.strand.layer import DHelixLayer
    from test_megatron import _args
    local = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    out = {"get_dhelix_layer_spec": _shape(get_dhelix_layer_spec(argparse.Namespace())),
           "dhelix_layer_spec": _shape(dhelix_layer_spec),
           "with_dhelix_layer": _shape(with_dhelix_layer(local)),
           "dhelix train": _shape(block_spec(2, DHelixLayer).layer_specs[0])}
    try:
        install(_args("--dhelix"))
        out["install hook"] = _shape(gpt_layer_specs.get_gpt_layer_local_spec())
    finally:
        uninstall()
    return out


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "torch-says-cuda"])
def test_one_spec_whatever_the_device_says(monkeypatch, cuda):
    """The switch the code used to read (torch.cuda.is_available) set both ways: every way
    of asking gives DHelix's spec (SDPAttention, Norm, megatron's linears)."""
    from dhelix.models.spec import layer_spec
    from dhelix.strand.layer import DHelixLayer
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    want = _shape(layer_spec(DHelixLayer))
    seen = _specs_seen()
    assert set(seen.values()) == {want}, seen
    assert "SDPAttention" in str(want) and "Norm" in str(want)
    assert "DotProductAttention" not in str(want) and "WrappedTorchNorm" not in str(want)


def test_sdpa_equals_megatron_dot_product_attention():
    """fp32, causal, GQA: output and dQ, dK, dV."""
    assert run_ranks(spec_fns.sdpa_vs_dot_product_attention, 1, timeout=200)[0] <= 1e-6


@pytest.mark.parametrize("config", ["tiny-llama", "tiny"])
def test_layer_on_dhelix_spec_equals_megatron_local_layer(config):
    """megatron's layer on its local spec vs on DHelix's (same state dict keys and
    weights): output, input grad, every parameter grad (SwiGLU/GQA/RoPE/RMSNorm and
    GeLU/MHA/LayerNorm)."""
    r = run_ranks(spec_fns.layer_vs_megatron_local, 1, timeout=200, config=config)[0]
    assert r["keys_ok"] and r["core"] == ["SDPAttention", "DotProductAttention"]
    assert r["worst"] <= 1e-6, r


def test_with_dhelix_layer_keeps_the_structure_and_refuses_what_it_lacks():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from dhelix.megatron.spec import SpecError, with_dhelix_layer
    from dhelix.models.spec import Norm
    from dhelix.models.ring_attention import RingAttention
    from dhelix.compat import mcore
    moe = with_dhelix_layer(get_gpt_layer_local_spec(num_experts=4))
    assert mcore.spec_class(moe.submodules.mlp).__name__ == "MoELayer"
    experts = mcore.spec_submodules(moe.submodules.mlp).experts
    assert mcore.spec_class(experts).__name__ == "SequentialMLP"
    dense = with_dhelix_layer(get_gpt_layer_local_spec())
    assert mcore.spec_class(dense.submodules.mlp).__name__ == "MLP"
    cp = with_dhelix_layer(get_gpt_layer_local_spec(), context_parallel_size=2)
    assert cp.submodules.self_attention.submodules.core_attention is RingAttention
    base = with_dhelix_layer(get_gpt_layer_local_spec(), layer_module=TransformerLayer)
    assert base.module is TransformerLayer
    block = with_dhelix_layer(TransformerBlockSubmodules(
        layer_specs=[get_gpt_layer_local_spec()] * 2, layer_norm=None))
    assert block.layer_norm is Norm and len(block.layer_specs) == 2
    with pytest.raises(SpecError, match="--qk-layernorm"):
        with_dhelix_layer(get_gpt_layer_local_spec(qk_layernorm=True))


def test_install_hook_final_norm_and_the_sdpa_baseline():
    """With --dhelix or --dhelix-sdpa-baseline, a block of layer specs ends with DHelix's
    Norm (megatron's torch norm refuses sequence parallel); the baseline keeps megatron's
    layer and schedule; uninstall restores everything."""
    from megatron.core import pipeline_parallel
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from dhelix.megatron.install import install, uninstall
    from dhelix.models.spec import Norm
    from test_megatron import _args
    norm, fb = transformer_block.LayerNormImpl, pipeline_parallel.get_forward_backward_func
    try:
        assert install(_args("--dhelix-sdpa-baseline")) is True
        spec = gpt_layer_specs.get_gpt_layer_local_spec()
        assert spec.module is TransformerLayer
        assert spec.submodules.self_attention.submodules.core_attention.__name__ == \
            "SDPAttention"
        assert transformer_block.LayerNormImpl is Norm
        assert pipeline_parallel.get_forward_backward_func is fb
    finally:
        uninstall()
    assert transformer_block.LayerNormImpl is norm
    from dhelix.megatron.args import DHelixArgError
    with pytest.raises(DHelixArgError, match="give one of them"):
        install(_args("--dhelix", "--dhelix-sdpa-baseline"))


def test_transformer_engine_is_refused_with_the_reason():
    from dhelix.megatron.args import DHelixArgError, check_dhelix_args
    from test_megatron import _args
    args = _args("--dhelix")
    args.transformer_impl = "transformer_engine"
    with pytest.raises(DHelixArgError, match="Transformer Engine's layers are not DHelix "
                                             "ops yet.*--transformer-impl local"):
        check_dhelix_args(args)


def test_wrapper_says_which_layer_and_refuses_transformer_engine():
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "scripts"))
    import pretrain_gpt_dhelix as w
    assert w._local_impl(["--foo"]) == ["--foo", "--transformer-impl", "local"]
    assert w._local_impl(["--transformer-impl", "local"]) == ["--transformer-impl", "local"]
    r = subprocess.run([sys.executable, "scripts/pretrain_gpt_dhelix.py", "--megatron-lm",
                        root, "--dhelix", "--transformer-impl", "transformer_engine"],
                       cwd=root, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, MEGATRON_LM=""))
    assert r.returncode != 0 and "Transformer Engine" in r.stderr


def test_norm_fused_branch_is_one_node_and_the_same():
    """The branch CUDA takes (torch's fused RMSNorm kernels) run on CPU where torch has
    them: the forward equals the plain math, the node is one; its backward kernel exists
    on CUDA only, so here only its shapes are checked (meta tensors)."""
    from dhelix.models.spec import _RMSNorm, fused_norm_available
    assert not fused_norm_available(torch.randn(2))
    x, w = torch.randn(4, 3, 16), torch.randn(16)
    xr = x.clone().requires_grad_()
    y = _RMSNorm.apply(xr, w.clone().requires_grad_(), 1e-5, True)
    assert torch.allclose(y, _RMSNorm.apply(x, w, 1e-5, False), rtol=1e-6, atol=1e-6)
    assert type(y.grad_fn).__name__ == "_RMSNormBackward"
    xm, wm = x.to("meta"), w.to("meta")
    _, rstd = torch.ops.aten._fused_rms_norm(xm, [16], wm, 1e-5)
    gx, gw = torch.ops.aten._fused_rms_norm_backward(xm, xm, [16], rstd, wm, [True, True])
    assert gx.shape == x.shape and gw.shape == w.shape


def test_train_layer_spec_megatron_local_is_the_same_model():
    """`dhelix train --layer-spec megatron-local` (megatron's unfused local layer, the
    baseline the GPU timing row puts beside DHelix's spec) trains the same model: the
    same losses (≤1e-5) from the same seed; with --dhelix it is refused."""
    from train_fns import train_result
    from dhelix.models.config import ConfigError
    from dhelix.train.config import TrainConfig, check_layout
    from dhelix.models.config import load_model_config
    kw = dict(config="tiny-llama", train_iters=3, quiet=True)
    local = run_ranks(train_result, 1, timeout=300, layer_spec="megatron-local", **kw)[0]
    ours = run_ranks(train_result, 1, timeout=300, **kw)[0]
    from compare import same_numbers     # ≤1e-5: SDPA and megatron's attention sum apart
    same_numbers(ours["losses"], local["losses"], 1e-5, "DHelix spec vs megatron-local")
    with pytest.raises(ConfigError, match="--layer-spec megatron-local"):
        check_layout(TrainConfig(config="tiny-llama", layer_spec="megatron-local",
                                 dhelix={"enabled": True}), load_model_config("tiny-llama"), 1)
