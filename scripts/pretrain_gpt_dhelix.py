"""Run a Megatron-LM checkout's pretrain_gpt.py with DHelix.

    python scripts/pretrain_gpt_dhelix.py --megatron-lm /path/to/Megatron-LM \
        <pretrain_gpt.py arguments> --transformer-impl local --dhelix [--dhelix-plan P]

The `--dhelix*` flags are taken out of the command line (Megatron's parser does not know
them), the install hook swaps in the DHelix layer spec and schedule, then pretrain_gpt.py
runs unchanged as __main__. Under torchrun or srun, launch this script instead of
pretrain_gpt.py. Without --dhelix it is plain Megatron-LM.
"""
import argparse
import os
import runpy
import sys


def main():
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM"),
                     help="Megatron-LM checkout (or set MEGATRON_LM)")
    from dhelix.megatron.args import add_dhelix_args
    add_dhelix_args(pre)
    ours, rest = pre.parse_known_args()
    if not ours.megatron_lm or not os.path.exists(os.path.join(ours.megatron_lm,
                                                               "pretrain_gpt.py")):
        sys.exit("pretrain_gpt_dhelix.py: --megatron-lm PATH (or MEGATRON_LM) must name a "
                 "Megatron-LM checkout containing pretrain_gpt.py")
    if ours.dhelix and "--transformer-impl" not in rest:
        rest += ["--transformer-impl", "local"]
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
