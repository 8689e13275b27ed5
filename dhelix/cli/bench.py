"""`dhelix bench`: baseline vs the intra-batch peer vs DHelix over emulated links
(dhelix/bench/run.py)."""
from __future__ import annotations

from dhelix.bench.run import BenchOptions
from dhelix.cli.common import options
from dhelix.megatron.args import add_keep_gathered_arg

D = BenchOptions          # the defaults


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="baseline vs intra-batch peer vs DHelix over "
                                     "emulated slow links (tbf links need root)")
    p.add_argument("--configs", default=D.configs,
                   help="comma-separated model configs (default: %(default)s, 16 layers)")
    p.add_argument("--links", default=D.links,
                   help="comma-separated links, each as --link takes it: 'none', "
                        "'paced:RATE[,LATENCY]' (link model, no CPU cost) or 'RATE' (tc tbf "
                        "namespace: needs root) (default: %(default)s)")
    p.add_argument("--nproc", type=int, default=D.nproc, help="ranks (default: %(default)s)")
    p.add_argument("--tensor-model-parallel-size", type=int,
                   default=D.tensor_model_parallel_size,
                   help="TP, with sequence parallel (default: %(default)s)")
    p.add_argument("--seq-length", type=int, default=D.seq_length, help="(default: %(default)s)")
    p.add_argument("--micro-batch-size", type=int, default=D.micro_batch_size,
                   help="(default: %(default)s)")
    p.add_argument("--pipeline-model-parallel-size", type=int,
                   default=D.pipeline_model_parallel_size, metavar="G",
                   help="G > 1: compare the pipeline schedules (1F1B, interleaved, DHelix "
                        "fold) on TP × G ranks (default: %(default)s)")
    p.add_argument("--context-parallel-size", type=int,
                   default=D.context_parallel_size, metavar="C",
                   help="C > 1: every sequence over C ranks, ring attention; --nproc must "
                        "hold TP×C (default: %(default)s)")
    p.add_argument("--expert-model-parallel-size", type=int,
                   default=D.expert_model_parallel_size, metavar="P",
                   help="MoE configs (tiny-moe, small-moe): experts over P ranks, all-to-all "
                        "between them; rows megatron, DHelix trivial, DHelix plan "
                        "(default: %(default)s)")
    p.add_argument("--num-microbatches", type=int, default=D.num_microbatches,
                   help="micro-batches per step (default: %(default)s)")
    p.add_argument("--train-iters", type=int, default=D.train_iters,
                   help="steps per run; the first is not timed (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=D.rounds,
                   help="run every method this many times, alternating, and take the "
                        "median step over all rounds (this machine's speed drifts; "
                        "default: %(default)s)")
    p.add_argument("--planner-source", choices=["table", "analytical"],
                   default=D.planner_source,
                   help="plan 4 from a pairwise table profiled in the same namespace just "
                        "before (DHelix's way), or from the analytical model of this machine")
    p.add_argument("--profile-repeats", type=int, default=D.profile_repeats,
                   help="timed repeats per op and pair in the profile (default: %(default)s)")
    p.add_argument("--profile-runs", type=int, default=D.profile_runs, metavar="N",
                   help="profile N times, each in rank processes of its own, and plan from "
                        "every entry's smallest median (`dhelix profile --runs`; default: "
                        "%(default)s)")
    p.add_argument("--dhelix-mlp-chunks", type=int, default=D.dhelix_mlp_chunks,
                   metavar="C", help="C > 1: one more method, dhelix-chunks: the planned "
                   "run with each layer's MLP forward in C token chunks, planned from a "
                   "table profiled for that layer (default: %(default)s)")
    add_keep_gathered_arg(p, default=D.dhelix_keep_gathered,
                          help="one more method, dhelix-keep: the planned run whose layers "
                               "keep the forward's gathered inputs for the weight gradients "
                               "(no backward re-gathers; more activation memory; PARTS: "
                               "attn, mlp or both, the default), planned from the same table")
    p.add_argument("--compute", default=D.compute, metavar="paced:CLUSTER[,x=F]",
                   help="paced compute: the ranks keep --emulate's time on CLUSTER (a40, "
                        "a800, h100 or a YAML), with one paced link; each row's emulated "
                        "step beside the simulators' prediction (docs/bench.md)")
    p.add_argument("--emulate", default=D.emulate, metavar="MODEL[,seq=S][,mbs=B]",
                   help="with --compute: the emulated model shape (the small model that "
                        "runs: --configs, default tiny-llama-emu / tiny-moe-emu)")
    p.add_argument("--methods", default=D.methods, metavar="M[,M...]",
                   help="run only these of the layout's methods (the first, the baseline, "
                        "among them; e.g. megatron,dhelix-plan); dhelix-last "
                        "(--dhelix-pair-last) runs only when named here")
    p.add_argument("--distributed-optimizer", action="store_true",
                   help="every method with megatron's distributed optimizer, "
                        "--overlap-grad-reduce and --overlap-param-gather (with DP > 1)")
    p.add_argument("--out", default=D.out, help="prefix for .md, .json and .png "
                                                  "(default: %(default)s)")
    p.set_defaults(func=run)


def run(a) -> int:
    from dhelix.bench.run import run_bench
    return run_bench(options(BenchOptions, a))
