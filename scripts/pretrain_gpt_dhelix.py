"""Run a Megatron-LM checkout's pretrain_gpt.py with DHelix.

    python scripts/pretrain_gpt_dhelix.py --megatron-lm /path/to/Megatron-LM \
        <pretrain_gpt.py arguments> --dhelix [--dhelix-plan P]
    ... --dhelix-sdpa-baseline        (megatron's layer and schedule, DHelix's kernels)

The `--dhelix*` flags are taken out of the command line (Megatron's parser does not know
them), the install hook swaps in the DHelix layer spec and schedule, then pretrain_gpt.py
runs unchanged as __main__. Under torchrun or srun, launch this script instead of
pretrain_gpt.py. Without --dhelix it is plain Megatron-LM.
"""
import argparse
import os
import runpy
import sys


def _local_impl(rest):
    """DHelix builds its own layer spec on megatron's local modules: say so, add
    --transformer-impl local, and refuse Transformer Engine's layers."""
    impl = None
    for i, a in enumerate(rest):
        if a == "--transformer-impl" and i + 1 < len(rest):
            impl = rest[i + 1]
        elif a.startswith("--transformer-impl="):
            impl = a.split("=", 1)[1]
    if impl == "transformer_engine":
        sys.exit("pretrain_gpt_dhelix.py: --transformer-impl transformer_engine: DHelix's "
                 "layer is not built from Transformer Engine's modules yet (no fp8, no fused "
                 "LayerNorm-linear, no userbuffers TP overlap). Use --transformer-impl local "
                 "(DHelix's spec: SDPA core attention, a one-node norm, megatron's linears), "
                 "and compare with --dhelix-sdpa-baseline for the same kernels, or with "
                 "plain Megatron-LM for Transformer Engine's")
    print("pretrain_gpt_dhelix.py: building DHelix's layer spec (dhelix/models/spec.py): "
          "SDPA core attention (FlashAttention/cuDNN on CUDA), a one-node RMSNorm/LayerNorm "
          "(torch's fused kernel on CUDA), megatron's linears and bias-dropout-add; "
          "--transformer-impl local", file=sys.stderr, flush=True)
    return rest if impl else rest + ["--transformer-impl", "local"]


def main():
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM"),
                     help="Megatron-LM checkout (or set MEGATRON_LM)")
    from dhelix.megatron.args import add_dhelix_args
    add_dhelix_args(pre)
    ours, rest = pre.parse_known_args()
    if ours.dhelix or ours.dhelix_sdpa_baseline:
        rest = _local_impl(rest)
    if not ours.megatron_lm or not os.path.exists(os.path.join(ours.megatron_lm,
                                                               "pretrain_gpt.py")):
        sys.exit("pretrain_gpt_dhelix.py: --megatron-lm PATH (or MEGATRON_LM) must name a "
                 "Megatron-LM checkout containing pretrain_gpt.py")
    sys.path.insert(0, ours.megatron_lm)
    # imported first, so that the hook also patches the names they imported
    import megatron.training.training  # noqa: F401
    import gpt_builders  # noqa: F401
    from dhelix.megatron.install import install
    install(ours)
    sys.argv = [os.path.join(ours.megatron_lm, "pretrain_gpt.py")] + rest
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
