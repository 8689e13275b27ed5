"""The legal layouts of a job: how `--gpus` GPUs split into TP, CP, PP, DP (and EP), with
which micro-batch, pipeline schedule and recomputation — megatron's rules, as plain data.

    TP   a power of 2 up to a node's GPUs (TP stays inside a node), dividing the heads,
         the FFN width, and the KV groups (or divided by them); sequence parallel with it
    CP   1, 2, 4, 8 with the sequence split into 2·CP chunks (and SP's TP split of each)
    PP   L a multiple of 2·PP; 1F1B, interleaved (two model chunks per stage) or the
         DHelix fold (two half-stages); PP = 1: megatron's order, DHelix's paired step, or
         DHelix's with the paired tail (`--dhelix-pair-last`: dense, 2+ micro-batches, no
         recomputation)
    DP   what is left: GPUs / (TP·CP·PP)
    EP   MoE: a divisor of the experts and of DP (expert TP 1; `dhelix train`'s rule: the
         EP groups are carved from the DP ranks); MoE layouts keep CP 1 (DHelix's MoE
         layer with context parallel is not built)
    mbs  1, 2, 4, 8 dividing the global batch per DP rank; the micro-batch count is at
         least PP (and a multiple of PP for interleaved, as megatron requires)
    recomputation: none or full (every layer, uniform 1)

The distributed optimizer is always on (its state sharded over DP).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterator, List

MEGATRON, DHELIX = "megatron", "dhelix"
# pipeline schedule -> whose it is
SCHEDULES = {"megatron": MEGATRON, "1f1b": MEGATRON, "interleaved": MEGATRON,
             "dhelix": DHELIX, "pair-last": DHELIX, "fold": DHELIX}


class AdviseError(ValueError):
    """A job no layout can run; the message names the flag and the fix."""


@dataclass(frozen=True)
class Layout:
    tp: int
    cp: int
    pp: int
    dp: int
    ep: int
    mbs: int                   # micro-batch size
    microbatches: int          # per step and DP rank
    schedule: str              # megatron | dhelix | pair-last (PP = 1); 1f1b | interleaved | fold
    recompute: bool            # full recomputation of every layer

    @property
    def who(self) -> str:
        return SCHEDULES[self.schedule]

    def name(self) -> str:
        s = f"TP{self.tp} CP{self.cp} PP{self.pp} DP{self.dp}"
        if self.ep > 1:
            s += f" EP{self.ep}"
        return s + f" mbs{self.mbs}×{self.microbatches} {self.schedule}" + \
            (" +recompute" if self.recompute else "")

    def to_json(self) -> dict:
        return asdict(self)


def _pow2_upto(n: int) -> List[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def tp_sizes(m, gpus_per_node: int) -> List[int]:
    g = m.kv_groups
    return [t for t in _pow2_upto(gpus_per_node)
            if m.num_attention_heads % t == 0 and m.ffn_hidden_size % t == 0
            and (g % t == 0 or t % g == 0)]


def enumerate_layouts(m, gpus: int, gpus_per_node: int, seq_length: int,
                      global_batch_size: int, recompute=(False, True),
                      max_pp: int = 16) -> Iterator[Layout]:
    """Every legal layout of `m` on `gpus` GPUs (module doc)."""
    L = m.num_layers
    for tp in tp_sizes(m, gpus_per_node):
        for cp in ((1,) if m.num_experts else (1, 2, 4, 8)):
            if seq_length % (2 * cp) or (tp > 1 and (seq_length // cp) % tp):
                continue
            # PP > 1: L a multiple of 2·PP (the fold's two half-stages, interleaved's two
            # chunks; the pipeline simulator prices all three schedules on one layout)
            for pp in (p for p in range(1, min(L, max_pp) + 1)
                       if p == 1 or L % (2 * p) == 0):
                if gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                eps = [1] if not m.num_experts else \
                    [e for e in range(1, m.num_experts + 1)
                     if m.num_experts % e == 0 and dp % e == 0]
                for ep in eps:
                    for mbs in (1, 2, 4, 8):
                        if global_batch_size % (mbs * dp):
                            continue
                        n = global_batch_size // (mbs * dp)
                        for sched in _schedules(L, pp, n, bool(m.num_experts)):
                            for rc in recompute:
                                if not (rc and sched == "pair-last"):
                                    yield Layout(tp, cp, pp, dp, ep, mbs, n, sched, rc)


def _schedules(L: int, pp: int, n: int, moe: bool) -> List[str]:
    if pp == 1:     # --dhelix-pair-last: dense layers, 2+ micro-batches, no recomputation
        return ["megatron", "dhelix"] + (["pair-last"] if n >= 2 and not moe else [])
    if n < pp:
        return []
    return ["1f1b"] + (["interleaved"] if n % pp == 0 else []) + ["fold"]


def check_job(m, gpus: int, gpus_per_node: int, seq_length: int,
              global_batch_size: int) -> None:
    """AdviseError for a job with no layout at all (before any pricing)."""
    if gpus < 1:
        raise AdviseError(f"--gpus {gpus}: give 1 or more")
    if not tp_sizes(m, gpus_per_node):
        raise AdviseError(f"--config {m.name}: no TP size up to a node's {gpus_per_node} "
                          f"GPUs divides its heads ({m.num_attention_heads}) and FFN "
                          f"({m.ffn_hidden_size})")
    if next(enumerate_layouts(m, gpus, gpus_per_node, seq_length, global_batch_size,
                              (False,)), None) is None:
        raise AdviseError(
            f"--gpus {gpus} --global-batch-size {global_batch_size}: no layout divides "
            f"them: TP×CP×PP must divide the GPUs (TP a power of 2 up to "
            f"{gpus_per_node}, PP a divisor of the {m.num_layers} layers) and micro-batch "
            f"size × DP the global batch; try a GPU count such as "
            f"{gpus_per_node * max(1, gpus // gpus_per_node)} or a global batch that is a "
            f"multiple of {gpus}")
