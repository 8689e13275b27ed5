"""The parts of a training step outside the DHelix layers, measured on the real ranks for
the whole-step simulator (`planner.whole_step`, `CostTable.step_extras`).

The model is the one `dhelix train` builds (`train.trainer.setup_megatron`,
`train.build.build`: megatron's GPTModel with the config's number of DHelix layers,
wrapped in megatron's DDP, at the table's TP / CP / EP sizes), and every piece is one of
its own modules or the trainer's own function:

* pre-process forward: `GPTModel._preprocess` (the embedding; under SP its scatter to
  the sequence-parallel region), backward: autograd from its output with a gradient;
* post-process forward: the decoder's final norm, the output layer (under SP its
  all-gather), megatron's vocab-parallel cross entropy and the trainer's `loss_func`,
  from a fresh leaf that stands for the last layer's output (as the DHelix node walk
  hands it over); backward: autograd from the loss (megatron DDP's grad hooks included);
* grad finalize: megatron's `finalize_model_grads`, as the trainer configures it (the
  layernorm grads' all-reduce under SP, the DP reduction over the ranks profiled);
* optimizer: the trainer's optimizer step (megatron-core's, `train/optim.py`) over the rank's model;
* zero grad: DDP's `zero_grad_buffer`, which starts every step.

Each piece runs after a barrier, repeated; the median of each is kept, slowest rank.
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from dhelix.planner.costs import StepExtras

PIECES = ("zero_grad_s", "pre_fwd_s", "post_fwd_s", "post_bwd_s", "pre_bwd_s",
          "finalize_s", "optimizer_s")


def train_config(o, m):
    """The TrainConfig `dhelix train` would get for the profile's shape (PP = 1)."""
    from dhelix.train.config import TrainConfig
    return TrainConfig(
        config=o.config, tensor_model_parallel_size=o.tensor_model_parallel_size,
        context_parallel_size=o.context_parallel_size,
        expert_model_parallel_size=o.expert_model_parallel_size,
        expert_tensor_parallel_size=1 if m.num_experts else None,
        num_experts=o.num_experts, moe_router_topk=o.moe_router_topk,
        moe_shared_expert_intermediate_size=o.moe_shared_expert_intermediate_size,
        sequence_parallel=o.sequence_parallel, micro_batch_size=o.micro_batch_size,
        seq_length=o.seq_length, seed=o.seed, bf16=o.bf16, data="synthetic")


class StepPieces:
    """The trainer's model on this rank, with one call per piece of the step."""

    def __init__(self, cfg, m, device: torch.device):
        from dhelix.strand.layer import DHelixLayer
        from dhelix.train.build import build
        from dhelix.train.config import check_layout
        from dhelix.train.optim import build_optimizer
        from dhelix.train.trainer import setup_megatron
        world = dist.get_world_size()
        self.layout = check_layout(cfg, m, world)
        self.tconfig = setup_megatron(cfg, m, self.layout)
        built = build(cfg, m, self.tconfig, self.layout, device, DHelixLayer)
        self.chunk = built.chunks[0]
        self.gpt = self.chunk.module
        self.num_layers = len(self.gpt.decoder.layers)
        self.optimizer = build_optimizer(cfg, built.chunks)
        self.device = device
        # one micro-batch on this rank: with CP, its share of every sequence
        s = cfg.seq_length // self.layout.cp
        g = torch.Generator().manual_seed(cfg.seed)
        b = cfg.micro_batch_size
        self.tokens = torch.randint(0, m.vocab_size, (b, s), generator=g).to(device)
        self.labels = torch.randint(0, m.vocab_size, (b, s), generator=g).to(device)
        self.position_ids = torch.arange(s).unsqueeze(0).expand(b, s).contiguous().to(device)
        self.loss_mask = torch.ones(b, s, device=device)

    def zero_grad(self):
        self.chunk.zero_grad_buffer()

    def pre_fwd(self):
        """megatron's pre-process: the embedding (and rotary tables); its output."""
        return self.gpt._preprocess(input_ids=self.tokens, position_ids=self.position_ids)[0]

    def leaf_like(self, x):
        """The last layer's output as the node walk hands it on: a fresh leaf."""
        return torch.randn_like(x).requires_grad_(True)

    def post_fwd(self, h):
        """The decoder's final norm, then megatron's `_postprocess` path: the output layer
        (the tied embedding weight, if tied), the vocab-parallel loss; the trainer's
        masked mean (`loss_func`)."""
        from dhelix.train.trainer import loss_func
        gpt = self.gpt
        norm = getattr(gpt.decoder, "final_layernorm", None)
        if norm is not None:
            h = norm(h)
        weight = gpt.shared_embedding_or_output_weight() \
            if gpt.share_embeddings_and_output_weights else None
        logits, _ = gpt.output_layer(h, weight=weight)
        loss = gpt.compute_language_model_loss(self.labels, logits)
        return loss_func(self.loss_mask, loss)[0]

    def finalize(self):
        self.tconfig.finalize_model_grads_func([self.chunk], None)

    def optimizer_step(self):
        self.optimizer.step()


def profile_step_extras(o, m, device: torch.device, warmup: int = 1, repeats: int = 5,
                        show_progress: bool = True) -> StepExtras:
    """Median seconds of every piece (module doc), slowest rank. `o` holds the shape as
    `ProfileOptions` does; `m` is the model config."""
    from tqdm import tqdm
    pieces = StepPieces(train_config(o, m), m, device)
    times: Dict[str, List[float]] = {k: [] for k in PIECES}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    def timed(name, rnd, fn, *args):
        sync()
        t = time.perf_counter()
        out = fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if rnd >= warmup:
            times[name].append(time.perf_counter() - t)
        return out

    bar = tqdm(total=warmup + repeats, desc="dhelix profile: embedding, loss, optimizer",
               unit="round", disable=not show_progress)
    for rnd in range(warmup + repeats):
        # the order of a step: zero the grads, a micro-batch's forward and backward around
        # its layers, the finalize, the optimizer
        timed("zero_grad_s", rnd, pieces.zero_grad)
        x = timed("pre_fwd_s", rnd, pieces.pre_fwd)
        h = pieces.leaf_like(x)
        loss = timed("post_fwd_s", rnd, pieces.post_fwd, h)
        timed("post_bwd_s", rnd, torch.autograd.backward, loss)
        timed("pre_bwd_s", rnd, torch.autograd.backward, x, h.grad)
        timed("finalize_s", rnd, pieces.finalize)
        timed("optimizer_s", rnd, pieces.optimizer_step)
        bar.update(1)
    bar.close()
    med = torch.tensor([statistics.median(times[k]) for k in PIECES], dtype=torch.float64,
                       device=device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)            # the slowest rank's
    got = dict(zip(PIECES, med.tolist()))
    return StepExtras(num_layers=pieces.num_layers,
                      data_parallel_size=pieces.layout.dp, **got)
