"""`dhelix train`: a megatron-core GPT trained on local, torchrun or Slurm ranks.

The step is Megatron's: its DDP wrapper, its forward-backward schedule function (or
DHelix's, with --dhelix), `finalize_model_grads`, then an AdamW step on fp32 master
weights. Only the rank-0 process prints.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import List, Optional

import torch
import torch.distributed as dist

from dhelix.models.config import ConfigError, ModelConfig, load_model_config
from dhelix.schedules import make_schedule


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
    lr: float = 1e-3
    weight_decay: float = 0.0
    clip_grad: float = 0.0
    data: str = "corpus"                         # synthetic | corpus | indexed
    data_path: Optional[str] = None
    overlap_grad_reduce: bool = False
    eval_iters: int = 0
    log_interval: int = 1
    json: Optional[str] = None
    checksums: bool = False                      # per-parameter grad/weight sums in the result
    save: Optional[str] = None                   # checkpoint folder (weights, global names)
    load: Optional[str] = None
    quiet: bool = False
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
    fold_layers = bool(cfg.dhelix.get("fold"))
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
    return Layout(world, tp, dp, nmb, pp, vpp, fold_layers, ep, etp, cp)


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
    for flag, bad in (("--pipeline-model-parallel-size > 1", cfg.pipeline_model_parallel_size > 1),
                      ("a MoE model", bool(m.num_experts)),
                      ("--dhelix-peer", bool(cfg.dhelix.get("peer")))):
        if bad:
            raise ConfigError(f"--context-parallel-size {cp} with {flag}: not built yet "
                              f"(context parallel runs with TP, SP and DP)")


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
    if ep > 1 and (cfg.save or cfg.load):
        raise ConfigError(f"--save/--load with --expert-model-parallel-size {ep}: DHelix's "
                          f"checkpoints name parameters globally and expert-parallel ranks "
                          f"hold different experts under one local name; not written yet")
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
                                  cfg.micro_batch_size, bf16=cfg.bf16, cp=layout.cp)
        validate(Plan.load(plan), ops, plan)
    return warnings


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-style masked mean of per-token losses. With context parallel each rank
    holds part of every sequence: the sum and the token count are summed over the CP
    group (the value is the whole sequence's mean, the gradient flows through this rank's
    part), and megatron's schedule scales it by the CP size, as for its own loss_func."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    local = torch.sum(losses * mask)
    stats = torch.stack((local.detach(), mask.sum()))
    from megatron.core import parallel_state
    if parallel_state.get_context_parallel_world_size() > 1:
        dist.all_reduce(stats, group=parallel_state.get_context_parallel_group())
    loss = (local + (stats[0] - local.detach())) / stats[1]
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    """The forward_step_func megatron's schedules call."""
    batch = next(data_iterator)
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return out, partial(loss_func, batch["loss_mask"])


class MasterAdamW:
    """AdamW on fp32 master copies of the parameters, reading megatron DDP's main_grad."""

    def __init__(self, params, lr, weight_decay, clip_grad):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone() for p in self.params]
        for m in self.master:
            m.requires_grad_(True)
        self.opt = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay)
        self.clip_grad = clip_grad

    def step(self):
        for p, m in zip(self.params, self.master):
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            m.grad = None if g is None else g.float()
        if self.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.master, self.clip_grad)
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)


def setup_megatron(cfg: TrainConfig, m: ModelConfig, layout: Layout):
    """Model-parallel groups, seeds, CPU compat; returns the TransformerConfig."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from dhelix.compat import cpu as cpu_compat
    from dhelix.models.gpt import transformer_config

    cpu_compat.apply()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    kw = {}
    if layout.vpp > 1:
        kw["virtual_pipeline_model_parallel_size"] = layout.vpp
    if layout.fold:     # embedding and output layer both on stage 0: no embedding group
        kw["get_embedding_ranks"] = lambda pp_ranks: [pp_ranks[0]]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=layout.tp,
                                             pipeline_model_parallel_size=layout.pp,
                                             context_parallel_size=layout.cp,
                                             expert_model_parallel_size=layout.ep,
                                             expert_tensor_parallel_size=layout.etp, **kw)
    torch.manual_seed(cfg.seed)
    model_parallel_cuda_manual_seed(cfg.seed)
    tconfig = transformer_config(m, tp=layout.tp, sequence_parallel=cfg.sequence_parallel,
                                 bf16=cfg.bf16, pp=layout.pp, ep=layout.ep,
                                 etp=layout.etp, cp=layout.cp)
    if layout.vpp > 1:
        tconfig.virtual_pipeline_model_parallel_size = layout.vpp
    tconfig.batch_p2p_comm = False          # gloo: plain isend/irecv, no coalescing
    return tconfig


def _average_loss(values: List[float], device: torch.device, loss_rank) -> float:
    """The step's loss on every rank: the loss stage's mean (pipeline), averaged over DP."""
    from megatron.core import parallel_state
    # on the group's device: NCCL accepts no CPU tensor
    t = torch.tensor([sum(values) / max(len(values), 1)], dtype=torch.float64, device=device)
    if loss_rank is not None:
        dist.broadcast(t, src=loss_rank, group=parallel_state.get_pipeline_model_parallel_group())
    dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
    return t.item() / parallel_state.get_data_parallel_world_size()


def checksums(chunks, attr: str) -> dict:
    """global name -> [sum, sum of squares] (float64) of each parameter's `attr`
    ("main_grad": the gradient megatron DDP accumulated and reduced; "data": the weight),
    this rank's shard: two runs compare without moving tensors."""
    from dhelix.train.build import named_parameters_global
    out = {}
    for name, p in named_parameters_global(chunks):
        t = getattr(p, attr, None)
        if t is not None:
            t = t.detach().double()
            out[name] = [t.sum().item(), (t * t).sum().item()]
    return out


def train(cfg: TrainConfig) -> dict:
    """Run training on the current process group; returns the result dict (all ranks)."""
    from dhelix.train.data import make_batches
    from dhelix.train.dist import init_distributed
    from dhelix.base.memory import METER, peak_memory_bytes

    m = model_of(cfg)
    info = init_distributed()
    layout = check_layout(cfg, m, info.world_size)
    tconfig = setup_megatron(cfg, m, layout)
    from megatron.core import parallel_state

    schedule = make_schedule(cfg.dhelix)
    from dhelix.train.build import build, loss_stage_rank
    built = build(cfg, m, tconfig, layout, info.device, schedule.layer_module, layout.fold)
    chunks = built.chunks
    if cfg.load:
        from dhelix.train.checkpoint import load
        load(chunks, cfg.load, layout.tp)
    schedule.prepare(chunks, tconfig)
    schedule.check(chunks, cfg.seq_length, cfg.micro_batch_size)
    params = list({id(p): p for c in chunks for p in c.parameters()}.values())
    optimizer = MasterAdamW(params, cfg.lr, cfg.weight_decay, cfg.clip_grad)
    dp_rank = parallel_state.get_data_parallel_rank()

    def stream():
        return _to_device(make_batches(
            cfg.data, seq_length=cfg.seq_length, micro_batch_size=cfg.micro_batch_size,
            num_microbatches=layout.num_microbatches, vocab_size=m.vocab_size, seed=cfg.seed,
            dp_rank=dp_rank, dp_size=layout.dp, data_path=cfg.data_path), info.device,
            layout.cp)
    # megatron's interleaved schedule reads one iterator per model chunk
    data = [stream() for _ in chunks] if layout.vpp > 1 else stream()
    model = chunks if len(chunks) > 1 or layout.pp > 1 else chunks[0]
    loss_rank = loss_stage_rank(built.loss_stage)
    rank0 = info.rank == 0 and not cfg.quiet
    tokens_per_step = cfg.seq_length * cfg.micro_batch_size * layout.num_microbatches * layout.dp
    if rank0:
        print(f"dhelix train: {m.name} world={layout.world} TP={layout.tp} "
              f"{f'PP={layout.pp} ' if layout.pp > 1 else ''}"
              f"{f'VPP={layout.vpp} ' if layout.vpp > 1 else ''}"
              f"{f'CP={layout.cp} ' if layout.cp > 1 else ''}DP={layout.dp} "
              f"{f'EP={layout.ep} experts={m.num_experts} top-{m.moe_router_topk} ' if m.num_experts else ''}"
              f"SP={cfg.sequence_parallel} mbs={cfg.micro_batch_size} "
              f"microbatches={layout.num_microbatches} seq={cfg.seq_length} "
              f"{'bf16' if cfg.bf16 else 'fp32'} schedule={schedule.name} "
              f"backend={info.backend}", flush=True)
    losses, times, grad_sums, idle = [], [], [], []
    METER.reset_peak()
    from dhelix.train.dist import report_progress
    for it in range(cfg.train_iters):
        report_progress(it + 1)
        t0, c0 = time.perf_counter(), time.thread_time()
        for c in chunks:
            c.zero_grad_buffer()
        with METER.autograd():
            out = schedule.forward_backward(
                forward_step_func=forward_step, data_iterator=data, model=model,
                num_microbatches=layout.num_microbatches, seq_length=cfg.seq_length,
                micro_batch_size=cfg.micro_batch_size, forward_only=False)
        if cfg.checksums:
            grad_sums.append(checksums(chunks, "main_grad"))
        optimizer.step()
        loss = _average_loss([o["lm loss"].item() for o in out], info.device, loss_rank)
        dt = time.perf_counter() - t0
        # this thread's CPU time is the stage's work (one intra-op thread; comm runs in
        # gloo's and the link's threads): the rest of the step the stage waited
        idle.append(max(0.0, 1.0 - (time.thread_time() - c0) / dt))
        losses.append(loss)
        times.append(dt)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at iteration {it + 1}")
        if rank0 and (it + 1) % cfg.log_interval == 0:
            peak = peak_memory_bytes(info.device)["activations"]
            print(f" iter {it + 1:4d}/{cfg.train_iters} | loss {loss:.6f} | "
                  f"{tokens_per_step / dt:9.0f} tokens/s | {dt * 1000:7.1f} ms | "
                  f"peak act. {peak / 2**20:.2f} MiB", flush=True)
    eval_loss = None
    if cfg.eval_iters:
        for c in chunks:
            c.eval()
        vals = []
        with torch.no_grad():
            for _ in range(cfg.eval_iters):
                out = schedule.forward_backward(
                    forward_step_func=forward_step, data_iterator=data, model=model,
                    num_microbatches=layout.num_microbatches, seq_length=cfg.seq_length,
                    micro_batch_size=cfg.micro_batch_size, forward_only=True)
                vals += [o["lm loss"].item() for o in out]
        eval_loss = _average_loss(vals, info.device, loss_rank)
        for c in chunks:
            c.train()
        if rank0:
            print(f" eval loss {eval_loss:.6f}", flush=True)
    written = schedule.finish(info.rank)
    if written and rank0:
        print(f"dhelix train: trace of the last iteration: {', '.join(written)}")
    if cfg.save:
        from dhelix.train.checkpoint import save
        save(chunks, cfg.save, layout.tp)
    steady = (times[1:] if len(times) > 1 else times) or [float("nan")]
    mem = peak_memory_bytes(info.device)
    per_stage = _per_stage(mem["activations"], info.device) if layout.pp > 1 else None
    steady_idle = statistics.median(idle[1:] if len(idle) > 1 else idle) if idle else None
    idle_per_stage = (_per_stage(steady_idle, info.device, torch.float64)
                      if layout.pp > 1 and idle else None)
    result = {
        "config": {**asdict(cfg), "model": asdict(m), "world_size": layout.world,
                   "data_parallel_size": layout.dp, "num_microbatches": layout.num_microbatches,
                   "pipeline_stages": layout.pp, "virtual_chunks": layout.vpp,
                   "backend": info.backend, "schedule": schedule.name},
        "losses": losses,
        "eval_loss": eval_loss,
        "step_times_s": times,
        "tokens_per_s": tokens_per_step * len(steady) / sum(steady),
        "peak_memory_bytes": mem["activations"],
        "peak_memory_bytes_per_stage": per_stage,
        "idle_share": steady_idle,
        "idle_share_per_stage": idle_per_stage,
        "peak_rss_bytes": mem["process_rss"],
        "memory_method": mem["method"],
    }
    if cfg.checksums:
        result["grad_checksums"] = grad_sums
        result["weight_checksums"] = checksums(chunks, "data")
    if rank0 and losses:
        print(f"dhelix train: done | final loss {losses[-1]:.6f} | "
              f"{result['tokens_per_s']:.0f} tokens/s | peak activations "
              f"{mem['activations'] / 2**20:.2f} MiB ({mem['method']})", flush=True)
    if cfg.json and info.rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.json)), exist_ok=True)
        with open(cfg.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _per_stage(value, device, dtype=torch.int64) -> list:
    """Each pipeline stage's value (this DP/TP position), gathered over the pipeline."""
    from megatron.core import parallel_state
    g = parallel_state.get_pipeline_model_parallel_group()
    t = torch.tensor([value], dtype=dtype, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size(g))]
    dist.all_gather(out, t, group=g)
    return [x.item() for x in out]


def _to_device(it, device, cp: int = 1):
    """Batches on the model's device; with context parallel, this CP rank's two chunks of
    every sequence (megatron's `get_batch_on_this_cp_rank`)."""
    from megatron.core import parallel_state
    r = parallel_state.get_context_parallel_rank() if cp > 1 else 0
    for batch in it:
        if cp > 1:
            batch = {k: cp_chunks(v, r, cp) for k, v in batch.items()}
        yield {k: v.to(device) for k, v in batch.items()}


def cp_chunks(x: torch.Tensor, r: int, cp: int, dim: int = 1) -> torch.Tensor:
    """Chunks r and 2·cp−1−r of 2·cp along the sequence dimension."""
    parts = x.chunk(2 * cp, dim=dim)
    return torch.cat((parts[r], parts[2 * cp - 1 - r]), dim=dim)
