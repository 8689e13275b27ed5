"""`dhelix train`: train a megatron-core GPT, megatron's schedule or DHelix's (--dhelix).

Megatron's own flag names for what it shares with pretrain_gpt.py; the `--dhelix*` flags
are Megatron-LM's (dhelix/megatron/args.py), the same in both.
"""
from __future__ import annotations

import argparse
import sys

from dhelix.cli.common import add_launch_args, add_model_args, run_here, spawn
from dhelix.train.config import TrainConfig

# without --global-batch-size: enough micro-batches per step for F(k+1) ∥ B(k) to happen
DEFAULT_MICROBATCHES = 4


def add_parser(sub) -> None:
    from dhelix.megatron.args import add_dhelix_args
    t = sub.add_parser("train", help="train a megatron-core GPT (baseline or --dhelix)")
    add_train_args(t)
    add_dhelix_args(t)
    t.set_defaults(func=run)


def add_train_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_launch_args(p)
    g = p.add_argument_group("data")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help=f"sequences per step over all DP ranks (default: micro-batch-size × "
                        f"DP × {DEFAULT_MICROBATCHES}, i.e. {DEFAULT_MICROBATCHES} "
                        f"micro-batches per step)")
    g.add_argument("--data", choices=["synthetic", "corpus", "indexed"], default=None,
                   help="synthetic tokens, the generated grammar corpus (default), or "
                        "Megatron indexed data (implied by --data-path)")
    g.add_argument("--data-path", default=None,
                   help="prefix of a Megatron .bin/.idx dataset (tools/preprocess_data.py "
                        "output, or `dhelix make-corpus`)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, metavar="G",
                   help="pipeline stages: megatron's 1F1B, its interleaved schedule with "
                        "--num-layers-per-virtual-pipeline-stage, or with --dhelix "
                        "--dhelix-fold DHelix's U-folded pipeline (default: %(default)s)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   metavar="N", help="megatron's interleaved (VPP) schedule: N layers per "
                                     "model chunk, several chunks per stage")
    g.add_argument("--data-parallel-size", type=int, default=None,
                   help="checked against the world size; inferred when omitted")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="megatron DDP: reduce grad buckets during the backward")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="megatron's distributed optimizer: fp32 master weights and Adam "
                        "state sharded over DP, grads reduce-scattered, params all-gathered")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer: all-gather each parameter "
                        "bucket during the next forward, not after the optimizer step")
    g = p.add_argument_group("activation recomputation (megatron's)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="full: recompute whole layers in the backward; selective: the "
                        "attention core only")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="with full: uniform (every --recompute-num-layers layers as one "
                        "checkpoint) or block (the first --recompute-num-layers layers of "
                        "each stage)")
    g.add_argument("--recompute-num-layers", type=int, default=None, metavar="N",
                   help="with full: layers per checkpoint (uniform) or recomputed (block)")
    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=20,
                   help="training steps (default: %(default)s)")
    g.add_argument("--eval-iters", type=int, default=0,
                   help="evaluation steps after training (default: %(default)s)")
    g.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate "
                                                         "(default: %(default)s)")
    g.add_argument("--weight-decay", type=float, default=0.0,
                   help="AdamW weight decay (default: %(default)s)")
    g.add_argument("--clip-grad", type=float, default=0.0,
                   help="clip the gradient norm to this; 0 = off (default: %(default)s)")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 parameters and math, fp32 main parameters, loss scaling "
                        "(megatron's; --bf16 needs none)")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="with --fp16: a static loss scale (default: dynamic, starting at "
                        "--initial-loss-scale, halved on an overflow, which skips the step)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32,
                   help="with --fp16 (default: %(default)g)")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="(default: %(default)s)")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="(default: %(default)s)")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="(default: %(default)s)")
    g.add_argument("--lr-decay-style", default="constant",
                   choices=["constant", "linear", "cosine", "inverse-square-root"],
                   help="megatron's learning-rate schedule (default: %(default)s)")
    g.add_argument("--lr-warmup-iters", type=int, default=0,
                   help="linear warmup from 0 to --lr (default: %(default)s)")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="iterations to decay over (default: --train-iters)")
    g.add_argument("--min-lr", type=float, default=0.0,
                   help="where the decay ends (default: %(default)s)")
    g.add_argument("--log-interval", type=int, default=1,
                   help="print every N steps (default: %(default)s)")
    g.add_argument("--json", default=None, help="write config, losses, tokens/s, peak memory")
    g = p.add_argument_group("checkpoints (megatron's torch_dist format, Megatron-LM's "
                             "layout and flags)")
    g.add_argument("--save", default=None, metavar="DIR",
                   help="save model, optimizer, iteration, data position and RNG states to "
                        "DIR/iter_NNNNNNN at the end (and every --save-interval steps)")
    g.add_argument("--save-interval", type=int, default=None, metavar="N",
                   help="with --save: also save every N iterations")
    g.add_argument("--load", default=None, metavar="DIR",
                   help="resume from the latest save under DIR (its "
                        "latest_checkpointed_iteration.txt): a --save of dhelix train or "
                        "Megatron-LM's torch_dist; any TP/PP/EP/CP layout")
    g.add_argument("--finetune", action="store_true",
                   help="with --load: the weights only; iteration 0, fresh optimizer")
    g.add_argument("--no-load-optim", action="store_true",
                   help="with --load: not the optimizer state (nor the scheduler's)")
    g.add_argument("--no-load-rng", action="store_true",
                   help="with --load: not the RNG states")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (to the launcher or any rank): finish the step, save to "
                        "--save, exit 0 (Megatron-LM's flag; Slurm: --signal=B:TERM@S)")
    g.add_argument("--exit-duration-in-mins", type=float, default=None, metavar="M",
                   help="save and exit 0 after the step that passes M minutes of training")
    g.add_argument("--exit-interval", type=int, default=None, metavar="N",
                   help="save and exit 0 after a step whose iteration is a multiple of N")
    g = p.add_argument_group("paced compute (an emulated cluster's time; docs/links.md)")
    g.add_argument("--compute", default="none", metavar="paced:CLUSTER[,x=F]",
                   help="with --dhelix and --link paced:...: every DHelix layer op waits out "
                        "the emulated shape's time on CLUSTER (a40, a800, h100 or a YAML), "
                        "F times slower; collectives at that shape's bytes on its links")
    g.add_argument("--emulate", default="", metavar="MODEL[,seq=S][,mbs=B]",
                   help="with --compute: the model shape whose time the ranks keep")
    g.add_argument("--checksums", action="store_true",
                   help="with --json: also per-parameter sums of every step's gradient and "
                        "of the final weights (to compare two runs exactly)")


def train_config_from_args(a: argparse.Namespace) -> TrainConfig:
    data = a.data or ("indexed" if a.data_path else "corpus")
    dh = {k[len("dhelix_"):]: v for k, v in vars(a).items() if k.startswith("dhelix_")}
    dh["enabled"] = bool(getattr(a, "dhelix", False))
    return TrainConfig(
        config=a.config, tensor_model_parallel_size=a.tensor_model_parallel_size,
        context_parallel_size=a.context_parallel_size,
        pipeline_model_parallel_size=a.pipeline_model_parallel_size,
        num_layers_per_virtual_pipeline_stage=a.num_layers_per_virtual_pipeline_stage,
        expert_model_parallel_size=a.expert_model_parallel_size,
        expert_tensor_parallel_size=a.expert_tensor_parallel_size,
        num_experts=a.num_experts, moe_router_topk=a.moe_router_topk,
        moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size,
        save=a.save, load=a.load, save_interval=a.save_interval, finetune=a.finetune,
        no_load_optim=a.no_load_optim, no_load_rng=a.no_load_rng,
        exit_signal_handler=a.exit_signal_handler,
        exit_duration_in_mins=a.exit_duration_in_mins, exit_interval=a.exit_interval,
        data_parallel_size=a.data_parallel_size, sequence_parallel=a.sequence_parallel,
        micro_batch_size=a.micro_batch_size, global_batch_size=a.global_batch_size,
        seq_length=a.seq_length, train_iters=a.train_iters, seed=a.seed, bf16=a.bf16,
        layer_spec=a.layer_spec,
        lr=a.lr, weight_decay=a.weight_decay, clip_grad=a.clip_grad, data=data,
        data_path=a.data_path, overlap_grad_reduce=a.overlap_grad_reduce,
        use_distributed_optimizer=a.use_distributed_optimizer,
        overlap_param_gather=a.overlap_param_gather, adam_beta1=a.adam_beta1,
        adam_beta2=a.adam_beta2, adam_eps=a.adam_eps, lr_decay_style=a.lr_decay_style,
        fp16=a.fp16, loss_scale=a.loss_scale, initial_loss_scale=a.initial_loss_scale,
        lr_warmup_iters=a.lr_warmup_iters, lr_decay_iters=a.lr_decay_iters, min_lr=a.min_lr,
        recompute_granularity=a.recompute_granularity, recompute_method=a.recompute_method,
        recompute_num_layers=a.recompute_num_layers,
        eval_iters=a.eval_iters, log_interval=a.log_interval, json=a.json,
        checksums=a.checksums, dhelix=dh, compute=a.compute, emulate=a.emulate,
        default_microbatches=DEFAULT_MICROBATCHES)


def run(a) -> int:
    from dhelix.megatron.args import check_dhelix_args
    from dhelix.train.config import preflight
    from dhelix.train.trainer import train

    cfg = train_config_from_args(a)
    if a.nproc:
        # Everything that can be checked is checked before any rank starts: one message.
        try:
            check_dhelix_args(a)
            if a.compute != "none" and not a.link.startswith("paced:"):
                raise ValueError("--compute paced:... prices collectives on the paced link: "
                                 "add --link paced:1gbit (its rate gives way to the "
                                 "cluster's)")
            for w in preflight(cfg, a.nproc):
                print(f"dhelix train: warning: {w}", file=sys.stderr)
        except ValueError as e:
            print(f"dhelix train: error: {e}", file=sys.stderr)
            return 2
        return spawn(a, a.argv)

    def body():
        check_dhelix_args(a)
        train(cfg)
    return run_here("train", body)
