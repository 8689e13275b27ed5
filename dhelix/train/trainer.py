"""`dhelix train`: a megatron-core GPT trained on local, torchrun or Slurm ranks.

The step is Megatron's: its DDP wrapper, its forward-backward schedule function (or
DHelix's, with --dhelix), `finalize_model_grads`, then an AdamW step on fp32 master
weights (megatron-core's optimizer, `train/optim.py`). Only the rank-0 process prints.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict
from functools import partial
from typing import List, Optional

import torch
import torch.distributed as dist

from dhelix.models.config import ModelConfig
from dhelix.train.schedules import make_schedule
from dhelix.train.config import Layout, TrainConfig, check_layout, model_of


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
                                 bf16=cfg.bf16, fp16=cfg.fp16, pp=layout.pp, ep=layout.ep,
                                 etp=layout.etp, cp=layout.cp,
                                 recompute_granularity=cfg.recompute_granularity,
                                 recompute_method=cfg.recompute_method,
                                 recompute_num_layers=cfg.recompute_num_layers)
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
    from dhelix.base.memory import METER, StepMemory, model_bytes, peak_rss_bytes

    m = model_of(cfg)
    info = init_distributed()
    layout = check_layout(cfg, m, info.world_size)
    tconfig = setup_megatron(cfg, m, layout)
    from megatron.core import parallel_state

    schedule = make_schedule(cfg.dhelix)
    from dhelix.train.build import build, loss_stage_rank
    built = build(cfg, m, tconfig, layout, info.device, schedule.layer_module, layout.fold)
    chunks = built.chunks
    schedule.prepare(chunks, tconfig)
    if schedule.name != "megatron":     # DHelix's ops read weights past megatron's hooks
        from dhelix.megatron.param_gather import guard_param_gather
        guard_param_gather(chunks)
    from dhelix.train import emulate
    if emulate.active() is not None:     # a run before this one in the process
        emulate.uninstall()
    pacer = None
    if cfg.compute != "none":            # time on the ranks: an emulated cluster's
        pacer = emulate.install_for_run(cfg, m, layout, chunks)
        plan = cfg.dhelix.get("plan")    # (trivial, paired: made for the running layer)
        if hasattr(schedule, "options") and plan not in ("trivial", "paired") and not any(
                cfg.dhelix.get(k) for k in ("overlap_table", "cluster")):
            # the plan for the emulated shape: --dhelix-plan FILE made for it, or planned
            schedule.options = dict(schedule.options,
                                    emulated_plan=emulate.plan_maker(pacer, plan))
    schedule.check(chunks, cfg.seq_length, cfg.micro_batch_size)
    from dhelix.train.optim import build_optimizer
    samples_per_step = cfg.micro_batch_size * layout.num_microbatches * layout.dp
    optimizer = build_optimizer(cfg, chunks, samples_per_step)
    dp_rank = parallel_state.get_data_parallel_rank()
    rank0 = info.rank == 0 and not cfg.quiet
    start, consumed, resumed = 0, 0, None           # the iteration and data position this run starts at
    if cfg.load:
        from dhelix.train import checkpoint
        resumed = checkpoint.load(chunks, optimizer, cfg, m, layout, finetune=cfg.finetune,
                                  load_optim=not cfg.no_load_optim,
                                  load_rng=not cfg.no_load_rng)
        start, consumed = resumed.iteration, resumed.consumed_samples
    if consumed % samples_per_step:
        from dhelix.train.checkpoint import CheckpointError
        raise CheckpointError(
            f"--load {cfg.load}: the data position ({consumed} samples) is not a whole "
            f"number of steps of this run's --global-batch-size {samples_per_step}; resume "
            f"with a global batch size that divides it")

    def stream():
        return _to_device(make_batches(
            cfg.data, seq_length=cfg.seq_length, micro_batch_size=cfg.micro_batch_size,
            num_microbatches=layout.num_microbatches, vocab_size=m.vocab_size, seed=cfg.seed,
            dp_rank=dp_rank, dp_size=layout.dp, data_path=cfg.data_path,
            start_step=consumed // samples_per_step), info.device, layout.cp)
    # megatron's interleaved schedule reads one iterator per model chunk
    data = [stream() for _ in chunks] if layout.vpp > 1 else stream()
    model = chunks if len(chunks) > 1 or layout.pp > 1 else chunks[0]
    loss_rank = loss_stage_rank(built.loss_stage)
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
        if resumed:
            print(f"dhelix train: {resumed.line()}", flush=True)
    losses, times, grad_sums, idle = [], [], [], []
    memory = StepMemory(info.device)
    act_peaks, total_peaks = [], []      # per iteration, bytes
    lrs, grad_norms, skipped = [], [], []
    from dhelix.train.dist import report_progress
    started = time.perf_counter()
    saved_at = None

    def save(iteration):
        from dhelix.train import checkpoint
        nonlocal saved_at
        if cfg.overlap_param_gather:      # whole weights on disk, as Megatron-LM saves
            for c in chunks:
                c.disable_forward_pre_hook(param_sync=True)
        path = checkpoint.save(chunks, optimizer, cfg, m, layout, iteration,
                               consumed + (iteration - start) * samples_per_step)
        if cfg.overlap_param_gather and iteration < cfg.train_iters:
            for c in chunks:
                c.enable_forward_pre_hook()
        saved_at = iteration
        if rank0:
            print(f"dhelix train: saved iteration {iteration} to {path}", flush=True)
    if start and start >= cfg.train_iters and rank0:
        print(f"dhelix train: nothing to train: resumed at iteration {start}, "
              f"--train-iters {cfg.train_iters}", flush=True)
    from dhelix.train.exit import ExitCheck
    exit_check = ExitCheck(cfg, info.device)
    exited = None           # why the run stopped before --train-iters
    end = max(start, cfg.train_iters)
    # emulated time: the first step (its time not kept) at the warm-up factor
    warming = pacer is not None and cfg.train_iters - start >= 2
    if warming:
        emulate.warm_up(emulate.parse(cfg.compute, cfg.emulate))
    for it in range(start, cfg.train_iters):
        report_progress(it + 1)
        t0, c0 = time.perf_counter(), time.thread_time()
        for c in chunks:
            c.zero_grad_buffer()
        optimizer.zero_grad()
        memory.begin()          # what this step's forward-backward adds to what lives on
        with METER.autograd():
            out = schedule.forward_backward(
                forward_step_func=forward_step, data_iterator=data, model=model,
                num_microbatches=layout.num_microbatches, seq_length=cfg.seq_length,
                micro_batch_size=cfg.micro_batch_size, forward_only=False)
        act_peaks.append(memory.activation_peak())   # before the optimizer's temporaries
        if warming:
            emulate.end_warm_up(pacer)
            warming = False
        if cfg.checksums:
            grad_sums.append(checksums(chunks, "main_grad"))
        lr = optimizer.lr                  # the rate this step applies
        scale = optimizer.loss_scale
        ok, grad_norm = optimizer.step()
        lrs.append(lr)
        grad_norms.append(grad_norm)
        if not ok and not cfg.fp16:
            raise FloatingPointError(f"the optimizer skipped iteration {it + 1} (a non-finite "
                                     f"gradient)")
        if not ok:          # fp16: an overflow at this loss scale; megatron lowers it
            skipped.append(it + 1)
            if rank0:
                print(f" iter {it + 1:4d}/{cfg.train_iters} | skipped: gradient overflow at "
                      f"loss scale {scale:g}, now {optimizer.loss_scale:g}", flush=True)
        total_peaks.append(memory.total_peak())
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
            print(f" iter {it + 1:4d}/{cfg.train_iters} | loss {loss:.6f} | "
                  f"{tokens_per_step / dt:9.0f} tokens/s | {dt * 1000:7.1f} ms | "
                  f"peak act. {act_peaks[-1] / 2**20:.2f} MiB | lr {lr:.3e} | "
                  f"{f'grad norm {grad_norm:.3f} | ' if grad_norm is not None else ''}"
                  f"{f'loss scale {optimizer.loss_scale:g} | ' if cfg.fp16 else ''}"
                  f"{progress_clock(time.perf_counter() - started, times, cfg.train_iters - start)}",
                  flush=True)
        if cfg.save and cfg.save_interval and (it + 1) % cfg.save_interval == 0:
            save(it + 1)
        exited = exit_check(it + 1) if it + 1 < cfg.train_iters else None
        if exited:
            end = it + 1
            break
    exit_check.close()
    if cfg.save and saved_at != end:      # as Megatron-LM: the last iteration is saved
        save(end)
    if exited and rank0:
        print(f"dhelix train: {exited}: exiting after iteration {end}" +
              (f" (resume with --load {cfg.save})" if cfg.save else " (nothing saved: no "
               "--save)"), flush=True)
    if cfg.overlap_param_gather and saved_at != end:
        # the last step's gathers would wait for a next forward: finish them now, and
        # evaluate, checksum and save whole weights (as Megatron-LM does before both)
        for c in chunks:
            c.disable_forward_pre_hook(param_sync=True)
    eval_loss = None
    if cfg.eval_iters and not exited:
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
        for md in [w for w in written if w.endswith(".md")]:
            with open(md) as f:
                print(f.read(), end="")
    steady = (times[1:] if len(times) > 1 else times) or [float("nan")]
    act_peak = max(act_peaks, default=0)
    total_peak = max(total_peaks, default=0)
    per_stage = _per_stage(act_peak, info.device) if layout.pp > 1 else None
    steady_idle = statistics.median(idle[1:] if len(idle) > 1 else idle) if idle else None
    idle_per_stage = (_per_stage(steady_idle, info.device, torch.float64)
                      if layout.pp > 1 and idle else None)
    result = {
        "config": {**asdict(cfg), "model": asdict(m), "world_size": layout.world,
                   "data_parallel_size": layout.dp, "num_microbatches": layout.num_microbatches,
                   "pipeline_stages": layout.pp, "virtual_chunks": layout.vpp,
                   "backend": info.backend, "schedule": schedule.name},
        "first_iteration": start + 1,    # > 1 when resumed
        "exited": exited,                # why it stopped before --train-iters (None: it ran)
        "losses": losses,
        "learning_rates": lrs,
        "grad_norms": grad_norms,        # megatron's, before clipping
        "skipped_iters": skipped,        # fp16: overflows, the loss scale lowered
        "eval_loss": eval_loss,
        "step_times_s": times,
        "tokens_per_s": tokens_per_step * len(steady) / sum(steady),
        # activations: the max over iterations of (peak − allocated at the step's start)
        "peak_memory_bytes": act_peak,
        "peak_memory_bytes_per_iter": act_peaks,
        "peak_memory_bytes_per_stage": per_stage,
        "peak_memory_total_bytes": total_peak,
        "idle_share": steady_idle,
        "idle_share_per_stage": idle_per_stage,
        "peak_rss_bytes": peak_rss_bytes(),
        "memory_method": memory.method,
        # what lives across steps: weights, gradient buffers, the optimizer's states
        "model_state_bytes": dict(model_bytes(chunks), optimizer=optimizer.state_bytes()),
        # where this rank sits, so that tests merge pipeline stages by TP position
        "coords": {"tp": parallel_state.get_tensor_model_parallel_rank(),
                   "cp": parallel_state.get_context_parallel_rank(),
                   "pp": parallel_state.get_pipeline_model_parallel_rank(),
                   "dp": dp_rank},
        "link": _link_stats(len(times) - (pacer is not None and len(times) >= 2)),
        "emulation": None,
    }
    if pacer is not None:
        result["emulation"] = e = emulate.report(
            pacer, emulate.parse(cfg.compute, cfg.emulate), statistics.median(steady),
            layout.num_microbatches, layout.dp, cfg.seq_length, cfg.micro_batch_size)
        emulate.uninstall()
        if rank0:
            print(f"dhelix train: emulated {e['emulate']} on {e['cluster']}: step "
                  f"{e['step_s'] * 1e3:.1f} ms, {e['tokens_per_s']:.0f} tokens/s (the ranks "
                  f"ran {e['factor']:g}x slower; the small ops' own share of paced compute "
                  f"{e['own_share']:.1%}, woken late {e['overslept_share']:.1%})", flush=True)
    if cfg.checksums:
        result["grad_checksums"] = grad_sums
        result["weight_checksums"] = checksums(chunks, "data")
    if rank0 and losses:
        print(f"dhelix train: done | final loss {losses[-1]:.6f} | "
              f"{result['tokens_per_s']:.0f} tokens/s | peak activations "
              f"{act_peak / 2**20:.2f} MiB ({memory.method}), total "
              f"{total_peak / 2**20:.2f} MiB", flush=True)
    if cfg.json and info.rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.json)), exist_ok=True)
        with open(cfg.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def clock(seconds: float) -> str:
    """H:MM:SS (hours unbounded)."""
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def progress_clock(elapsed: float, times: List[float], total: int) -> str:
    """'elapsed H:MM:SS | ETA H:MM:SS' after len(times) of `total` steps: the remaining
    steps at the mean steady step time (the first step, which warms up, left out once
    there are others)."""
    steady = times[1:] if len(times) > 1 else times
    per_step = sum(steady) / len(steady) if steady else 0.0
    return f"elapsed {clock(elapsed)} | ETA {clock(per_step * (total - len(times)))}"


def _link_stats(steps: int) -> Optional[dict]:
    """What the paced link did in this process over its last `steps` steps (an emulated
    run's warm-up step is forgotten, `emulate.end_warm_up`; None without a link):
    collectives it paced, their modelled seconds, the seconds their waits slept past the data's arrival, and
    with `slow=` the GEMMs stretched and the seconds charged for them; and the seconds
    it waited for a peer rank, which the link model does not price: for a free
    shared-memory slot at issue (`peer_slot_s`), for data a peer posted after the modelled
    end (`peer_late_s`)."""
    from dhelix.links.paced import active
    from dhelix.links.shm import PEER_WAIT
    link = active()
    if link is None:
        return None
    return {"collectives": link.count, "modelled_s": link.modelled_s,
            "waited_s": link.waited_s, "stretched_ops": link.stretched_ops,
            "stretched_s": link.stretched_s, "peer_slot_s": PEER_WAIT["slot_s"],
            "peer_late_s": link.late_s, "steps": steps}


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
