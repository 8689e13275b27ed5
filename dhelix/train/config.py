"""What a training run is: its flags as a dataclass (`TrainConfig`), the parallel layout
they make on a world (`Layout`, checked with errors that name the flag and the fix), and
`preflight`, everything that can be checked before any rank starts."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional

from dhelix.models.config import ConfigError, ModelConfig, load_model_config


@dataclass
class TrainConfig:
    config: str = "tiny"
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1               # ring attention over C ranks
    num_layers_per_virtual_pipeline_stage: Optional[int] = None   # megatron's interleaved
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None   # default: TP, as in megatron
    num_experts: Optional[int] = None            # MoE: overrides the model config's
    moe_router_topk: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    data_parallel_size: Optional[int] = None     # inferred from the world size if None
    sequence_parallel: bool = False
    micro_batch_size: int = 2
    global_batch_size: Optional[int] = None      # default: micro_batch_size * DP * below
    default_microbatches: int = 1                # micro-batches per step without a gbs
    seq_length: int = 64
    train_iters: int = 20
    seed: int = 1234
    bf16: bool = False
    fp16: bool = False                           # fp16 parameters, loss scaling (megatron's)
    loss_scale: Optional[float] = None           # static; None: dynamic, from initial
    initial_loss_scale: float = 2.0 ** 32
    layer_spec: str = "dhelix"                   # dhelix | megatron-local (baseline only)
    lr: float = 1e-3
    weight_decay: float = 0.0
    clip_grad: float = 0.0
    data: str = "corpus"                         # synthetic | corpus | indexed
    data_path: Optional[str] = None
    overlap_grad_reduce: bool = False
    use_distributed_optimizer: bool = False      # megatron's: optimizer state sharded over DP
    overlap_param_gather: bool = False           # with it: all-gather params in the forward
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    min_lr: float = 0.0
    lr_decay_style: str = "constant"             # megatron's: constant | linear | cosine | ...
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None         # default: --train-iters
    recompute_granularity: Optional[str] = None  # full | selective (megatron's)
    recompute_method: Optional[str] = None       # uniform | block (with full)
    recompute_num_layers: Optional[int] = None
    eval_iters: int = 0
    log_interval: int = 1
    json: Optional[str] = None
    checksums: bool = False                      # per-parameter grad/weight sums in the result
    save: Optional[str] = None                   # checkpoint root (megatron's torch_dist)
    save_interval: Optional[int] = None          # save every N iterations (and at the end)
    load: Optional[str] = None                   # resume from the latest save there
    finetune: bool = False                       # --load the weights only, iteration 0
    no_load_optim: bool = False
    no_load_rng: bool = False
    exit_signal_handler: bool = False            # SIGTERM: finish the step, save, exit 0
    exit_duration_in_mins: Optional[float] = None
    exit_interval: Optional[int] = None
    quiet: bool = False
    compute: str = "none"                        # paced:CLUSTER[,x=F] (train/emulate.py)
    emulate: str = ""                            # the emulated shape: MODEL[,seq=S][,mbs=B]
    dhelix: dict = field(default_factory=dict)   # --dhelix* options (schedule issue)


@dataclass
class Layout:
    world: int
    tp: int
    dp: int
    num_microbatches: int
    pp: int = 1
    vpp: int = 1            # model chunks per stage (megatron's interleaved schedule)
    fold: bool = False      # DHelix's U-folded pipeline
    ep: int = 1             # expert parallel: carved from the DP ranks, as in megatron
    etp: int = 1            # expert tensor parallel
    cp: int = 1             # context parallel (megatron's rank order: TP, CP, DP, PP)


def model_of(cfg: TrainConfig) -> ModelConfig:
    """The model config, with the MoE flags (--num-experts, --moe-router-topk) applied."""
    import dataclasses
    m = load_model_config(cfg.config)
    over = {k: v for k, v in (("num_experts", cfg.num_experts),
                              ("moe_router_topk", cfg.moe_router_topk),
                              ("moe_shared_expert_intermediate_size",
                               cfg.moe_shared_expert_intermediate_size)) if v is not None}
    if over:
        m = dataclasses.replace(m, **over)
        m.check(f"--config {cfg.config} with --num-experts/--moe-router-topk")
    return m


def check_layout(cfg: TrainConfig, m: ModelConfig, world: int) -> Layout:
    """Validate parallel sizes against the world and the model; errors name the flag."""
    check_positive(cfg)
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    cp = cfg.context_parallel_size
    if cp < 1:
        raise ConfigError(f"--context-parallel-size {cp}: must be a positive integer")
    if cfg.data_parallel_size is not None:
        if tp * pp * cp * cfg.data_parallel_size != world:
            raise ConfigError(
                f"world size {world} is not TP×CP×PP×DP = {tp}×{cp}×{pp}×"
                f"{cfg.data_parallel_size}; launch {tp * pp * cp * cfg.data_parallel_size} "
                f"ranks or change --tensor-model-parallel-size / --context-parallel-size / "
                f"--pipeline-model-parallel-size / --data-parallel-size")
    if world % (tp * pp * cp):
        raise ConfigError(f"world size {world} is not divisible by "
                          f"--tensor-model-parallel-size {tp} × --context-parallel-size {cp} "
                          f"× --pipeline-model-parallel-size {pp}")
    dp = world // (tp * pp * cp)
    _check_context_parallel(cfg, m, cp)
    if cfg.layer_spec not in ("dhelix", "megatron-local"):
        raise ConfigError(f"--layer-spec {cfg.layer_spec}: use dhelix or megatron-local")
    if cfg.layer_spec == "megatron-local" and (cfg.dhelix.get("enabled") or
                                                cfg.sequence_parallel or cp > 1 or
                                                m.num_experts or cfg.num_experts):
        raise ConfigError("--layer-spec megatron-local (megatron's unfused local layer, to "
                          "time against) runs megatron's schedule only, without sequence "
                          "parallel, context parallel or experts; DHelix runs its own spec")
    fold_layers = bool(cfg.dhelix.get("fold"))
    # the two ways of changing B(N), the backward without a partner: dense layers only
    for key, what in (("halves", "splits the dense layers of DHelix's B(N)"),
                      ("pair_last", "pairs the dense layers of DHelix's B(N-1) and B(N)")):
        # (the pair runs the CP ring as it is; the halves would split its sequence)
        if not cfg.dhelix.get(key):
            continue
        bad = [what for what, yes in (("--dhelix-fold", fold_layers), ("a MoE model",
               bool(m.num_experts or cfg.num_experts)), (f"--context-parallel-size {cp}",
               cp > 1 and key == "halves"), ("--dhelix-peer", bool(cfg.dhelix.get("peer"))),
               ("--recompute-granularity", key == "pair_last" and
                bool(cfg.recompute_granularity)),
               ("--dhelix-halves", key == "pair_last" and bool(cfg.dhelix.get("halves"))))
               if yes]
        if not cfg.dhelix.get("enabled") or bad:
            raise ConfigError(f"--dhelix-{key.replace('_', '-')} {what} (with --dhelix, "
                              f"TP/SP/{'CP/' if key == 'pair_last' else ''}DP); not built with "
                              f"{', '.join(bad) or 'megatron (add --dhelix)'}")
    vpp = 1
    if fold_layers:
        from dhelix.folding.placement import fold
        if not cfg.dhelix.get("enabled"):
            raise ConfigError("--dhelix-fold needs --dhelix")
        if cfg.num_layers_per_virtual_pipeline_stage:
            raise ConfigError("--dhelix-fold and --num-layers-per-virtual-pipeline-stage "
                              "are two pipeline placements; give one")
        fold(m.num_layers, pp)                  # raises FoldError (a ValueError)
    elif pp > 1:
        if cfg.dhelix.get("enabled") or cfg.dhelix.get("peer"):
            raise ConfigError("--dhelix with --pipeline-model-parallel-size > 1 runs the "
                              "U-folded pipeline: add --dhelix-fold")
        n = cfg.num_layers_per_virtual_pipeline_stage
        if n:
            if m.num_layers % (pp * n):
                raise ConfigError(f"{m.name}: num_layers ({m.num_layers}) is not divisible "
                                  f"by --pipeline-model-parallel-size {pp} × "
                                  f"--num-layers-per-virtual-pipeline-stage {n}")
            vpp = m.num_layers // (pp * n)
        elif m.num_layers % pp:
            raise ConfigError(f"{m.name}: num_layers ({m.num_layers}) is not divisible by "
                              f"--pipeline-model-parallel-size {pp}")
    elif cfg.num_layers_per_virtual_pipeline_stage:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage needs "
                          "--pipeline-model-parallel-size > 1")
    if m.num_attention_heads % tp:
        raise ConfigError(f"{m.name}: num_attention_heads ({m.num_attention_heads}) is not "
                          f"divisible by --tensor-model-parallel-size {tp}")
    if m.kv_groups % tp and tp % m.kv_groups:
        raise ConfigError(f"{m.name}: num_query_groups ({m.kv_groups}) and "
                          f"--tensor-model-parallel-size {tp} must divide one another")
    if m.ffn_hidden_size % tp:
        raise ConfigError(f"{m.name}: ffn_hidden_size ({m.ffn_hidden_size}) is not divisible "
                          f"by --tensor-model-parallel-size {tp}")
    if cfg.sequence_parallel and tp > 1 and (cfg.seq_length // cp) % tp:
        raise ConfigError(f"--seq-length {cfg.seq_length} must be divisible by "
                          f"--context-parallel-size {cp} × --tensor-model-parallel-size {tp} "
                          f"with --sequence-parallel")
    if m.shapes_only:
        raise ConfigError(f"{m.name}: this config holds a published shape for planning and "
                          f"simulation only (shapes_only: true); train a small config such "
                          f"as 'tiny'")
    gbs = cfg.global_batch_size or cfg.micro_batch_size * dp * cfg.default_microbatches
    if gbs % (cfg.micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size {gbs} is not divisible by "
                          f"--micro-batch-size × DP = {cfg.micro_batch_size}×{dp}")
    nmb = gbs // (cfg.micro_batch_size * dp)
    ep = _check_experts(cfg, m, dp)
    if vpp > 1 and nmb % pp:
        raise ConfigError(f"megatron's interleaved schedule needs a multiple of "
                          f"--pipeline-model-parallel-size {pp} micro-batches per step, got "
                          f"{nmb}; change --global-batch-size")
    etp = cfg.expert_tensor_parallel_size or tp
    if m.num_experts and etp not in (1, tp):
        raise ConfigError(f"--expert-tensor-parallel-size {etp}: give 1 or the TP size {tp}")
    layout = Layout(world, tp, dp, nmb, pp, vpp, fold_layers, ep, etp, cp)
    from dhelix.train.optim import check_optimizer
    from dhelix.train.recompute import check_recompute
    check_optimizer(cfg, layout)
    check_recompute(cfg, m, layout)
    check_checkpoint_flags(cfg)
    return layout


def _check_context_parallel(cfg: TrainConfig, m: ModelConfig, cp: int) -> None:
    from dhelix.models.ring_attention import check_split
    if cp == 1:
        return
    try:
        check_split(cfg.seq_length, cp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if m.attention_dropout:
        raise ConfigError(f"--context-parallel-size {cp}: ring attention has no attention "
                          f"dropout, and {m.name} sets attention_dropout "
                          f"{m.attention_dropout}; use a config with attention_dropout: 0.0")
    for flag, bad in (("a MoE model", bool(m.num_experts)),
                      ("--dhelix-peer", bool(cfg.dhelix.get("peer")))):
        if bad:
            raise ConfigError(f"--context-parallel-size {cp} with {flag}: not built yet "
                              f"(context parallel runs with TP, SP, DP and PP: megatron's "
                              f"1F1B, its interleaved schedule and the fold)")


def _check_experts(cfg: TrainConfig, m: ModelConfig, dp: int) -> int:
    ep = cfg.expert_model_parallel_size
    if ep < 1:
        raise ConfigError(f"--expert-model-parallel-size {ep}: must be a positive integer")
    if not m.num_experts:
        if ep > 1:
            raise ConfigError(f"--expert-model-parallel-size {ep}: {m.name} has no experts; "
                              f"give --num-experts E or a MoE config such as tiny-moe")
        return 1
    if dp % ep:
        raise ConfigError(f"--expert-model-parallel-size {ep} must divide the data-parallel "
                          f"size {dp} (megatron carves expert-parallel groups from the DP "
                          f"ranks); launch TP×PP×{ep}·k ranks")
    if m.num_experts % ep:
        raise ConfigError(f"--num-experts {m.num_experts} is not divisible by "
                          f"--expert-model-parallel-size {ep}")
    if cfg.dhelix.get("peer"):
        raise ConfigError(f"--dhelix-peer with a MoE model ({m.name}): the intra-batch peer "
                          f"splits dense layers only; use --dhelix")
    if cfg.dhelix.get("enabled") and cfg.tensor_model_parallel_size > 1 and \
            (cfg.expert_tensor_parallel_size or cfg.tensor_model_parallel_size) > 1:
        raise ConfigError("--dhelix with experts split over TP: the DHelix MoE layer keeps "
                          "experts whole; add --expert-tensor-parallel-size 1")
    return ep


def check_positive(cfg: TrainConfig) -> None:
    for flag, v in (("--tensor-model-parallel-size", cfg.tensor_model_parallel_size),
                    ("--micro-batch-size", cfg.micro_batch_size),
                    ("--seq-length", cfg.seq_length),
                    ("--log-interval", cfg.log_interval),
                    ("--global-batch-size", cfg.global_batch_size),
                    ("--data-parallel-size", cfg.data_parallel_size)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} {v}: must be a positive integer")
    if cfg.eval_iters < 0:
        raise ConfigError(f"--eval-iters {cfg.eval_iters}: must be >= 0")
    if cfg.train_iters < 1 and not (cfg.train_iters == 0 and cfg.save):
        raise ConfigError(f"--train-iters {cfg.train_iters}: must be a positive integer (0 "
                          f"only with --save: write the initial weights)")


def check_checkpoint_flags(cfg: TrainConfig) -> None:
    if cfg.save_interval is not None:
        if not cfg.save:
            raise ConfigError("--save-interval saves nowhere without --save DIR")
        if cfg.save_interval < 1:
            raise ConfigError(f"--save-interval {cfg.save_interval}: must be >= 1")
    if cfg.exit_interval is not None and cfg.exit_interval < 1:
        raise ConfigError(f"--exit-interval {cfg.exit_interval}: must be >= 1")
    if cfg.exit_duration_in_mins is not None and not cfg.exit_duration_in_mins > 0:
        raise ConfigError(f"--exit-duration-in-mins {cfg.exit_duration_in_mins}: must be "
                          f"> 0")
    for flag, on in (("--finetune", cfg.finetune), ("--no-load-optim", cfg.no_load_optim),
                     ("--no-load-rng", cfg.no_load_rng)):
        if on and not cfg.load:
            raise ConfigError(f"{flag} says what --load restores: add --load DIR")


def preflight(cfg: TrainConfig, world: int) -> List[str]:
    """Everything about a run that can be checked before any rank starts: flags, the
    model config, the parallel layout, the data files, a plan file against the layer it
    will meet. Raises ValueError (ConfigError, PlanError) naming the flag or field and the
    fix; returns warnings."""
    m = model_of(cfg)
    layout = check_layout(cfg, m, world)
    if cfg.data_path:
        for ext in (".bin", ".idx"):
            if not os.path.exists(cfg.data_path + ext):
                raise ConfigError(f"--data-path {cfg.data_path}: {cfg.data_path}{ext} not "
                                  f"found (write one with `dhelix make-corpus --output "
                                  f"{cfg.data_path}` or Megatron's tools/preprocess_data.py)")
    if cfg.load:
        from dhelix.train.checkpoint import check_load
        check_load(cfg, m)
    if cfg.compute != "none":
        from dhelix.train import emulate
        for flag, on in (("--dhelix-mlp-chunks", (cfg.dhelix.get("mlp_chunks") or 1) > 1),
                         ("--dhelix-keep-gathered", bool(cfg.dhelix.get("keep_gathered")))):
            if on:
                raise ConfigError(f"--compute paced:... waits out each op of the emulated "
                                  f"layer, whose chains are the plain ones: drop {flag}")
        emu = emulate.parse(cfg.compute, cfg.emulate)
        emulate._cluster(emu.cluster)
        load_model_config(emu.model)
    warnings = []
    dh = cfg.dhelix
    if dh.get("enabled") and layout.num_microbatches == 1:
        warnings.append(
            f"--dhelix pairs nothing with one micro-batch per step: F(k+1) ∥ B(k) needs two "
            f"micro-batches; raise --global-batch-size (now {cfg.micro_batch_size * layout.dp}"
            f" = --micro-batch-size × DP) to a multiple, e.g. "
            f"{cfg.micro_batch_size * layout.dp * 4}")
    plan = dh.get("plan")
    if dh.get("enabled") and plan and plan not in ("trivial", "paired"):
        from dhelix.planner.plan import Plan, validate
        from dhelix.planner.shapes import layer_ops_for_shape
        ops = layer_ops_for_shape(m, layout.tp, cfg.sequence_parallel, cfg.seq_length,
                                  cfg.micro_batch_size, bf16=cfg.bf16, cp=layout.cp,
                                  mlp_chunks=dh.get("mlp_chunks") or 1,
                                  keep_gathered=dh.get("keep_gathered") or False)
        validate(Plan.load(plan), ops, plan)
    return warnings
