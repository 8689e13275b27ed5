"""Ring attention for context parallelism, on any device and any CP size.

The sequence is split across the CP group in megatron's load-balanced way: cut into 2·C
chunks, CP rank r holds chunks r and 2C−1−r (as `get_batch_on_this_cp_rank` does), so
every rank has the same causal work. The K/V blocks travel the ring by P2P; each ring step
attends the local queries to one block and merges the partial result exactly with the
log-sum-exp. The backward passes K/V around again, with the dK/dV accumulated so far.

Steps, for rank r and block j = (r − i) mod C at step i (chunks A = first, B = second):
  i = 0      own block: A×A causal, B×A full, B×B causal
  j < r      every local query × chunk A of the block (its chunk B lies in our future)
  j > r      local chunk B × the whole block (our chunk A lies in its past: masked)

The math is plain functions of tensors (`forward_step`, `backward_step`, ...), called one
after the other by `RingAttention` (megatron's core attention slot: the CP baseline) and
one op at a time by the DHelix layer (`strand/ring.py`), so both compute the same
numbers in the same order. The message of each exchange is one tensor: K and V stacked
(`[2, b, ng, s, hn]`), with dK/dV stacked under them in the backward.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class ContextParallelError(ValueError):
    """A layout ring attention cannot run (names the flag and the fix)."""


def check_split(seq_length: int, cp: int, what: str = "--seq-length") -> None:
    """megatron's load-balanced CP needs the sequence in 2·CP equal chunks."""
    if cp > 1 and seq_length % (2 * cp):
        raise ContextParallelError(
            f"{what} {seq_length} does not split into 2·CP = {2 * cp} chunks (megatron's "
            f"load-balanced context parallel, --context-parallel-size {cp}); choose a "
            f"multiple of {2 * cp}")


# ---- geometry ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ring:
    """This rank's place in the CP ring: neighbours as global ranks, and the lane."""
    group: object
    size: int
    rank: int
    next: int        # global rank we send to
    prev: int        # global rank we receive from
    lane: str = "intra"

    @staticmethod
    def of(group) -> "Ring":
        from dhelix.strand.lanes import lane_of_group
        ranks = dist.get_process_group_ranks(group)
        r = dist.get_rank(group)
        c = len(ranks)
        return Ring(group, c, r, ranks[(r + 1) % c], ranks[(r - 1) % c],
                    lane_of_group(group) if c > 1 else "intra")

    def source(self, step: int) -> int:
        """CP rank whose K/V block this rank attends to at `step`."""
        return (self.rank - step) % self.size


@dataclass(frozen=True)
class Block:
    q: slice          # local query rows
    kv: slice         # rows of the K/V block
    causal: bool      # same chunk on both sides: triangular mask


def blocks(ring: Ring, step: int, s_loc: int) -> List[Block]:
    c = s_loc // 2
    a, b, whole = slice(0, c), slice(c, s_loc), slice(0, s_loc)
    if step == 0:
        return [Block(a, a, True), Block(b, a, False), Block(b, b, True)]
    if ring.source(step) < ring.rank:
        return [Block(whole, a, False)]
    return [Block(b, whole, False)]


# ---- layouts -------------------------------------------------------------------------------
def to_heads(x: torch.Tensor) -> torch.Tensor:
    """megatron's [s, b, heads, hn] -> [b, heads, s, hn] (contiguous)."""
    return x.permute(1, 2, 0, 3).contiguous()


def from_heads(x: torch.Tensor) -> torch.Tensor:
    """[b, heads, s, hn] -> [s, b, heads, hn]."""
    return x.permute(2, 0, 1, 3)


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V [b, ng, s, hn] repeated to the query heads (megatron's GQA grouping)."""
    ng = kv.shape[1]
    return kv if ng == heads else kv.repeat_interleave(heads // ng, dim=1)


def _reduce_groups(g: torch.Tensor, ng: int) -> torch.Tensor:
    b, heads, s, hn = g.shape
    return g if ng == heads else g.view(b, ng, heads // ng, s, hn).sum(2)


def _scores(q, k, blk: Block, scale):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if blk.causal:
        n = s.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=s.device).triu_(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


# ---- forward -------------------------------------------------------------------------------
def forward_init(q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Running output and log-sum-exp of the local queries (fp32)."""
    b, h, s, hn = q.shape
    return (torch.zeros(b, h, s, hn, dtype=torch.float32, device=q.device),
            torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device))


def forward_step(ring: Ring, step: int, q: torch.Tensor, kv: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, scale: float) -> None:
    """Attend q [b, h, s, hn] to the K/V block kv [2, b, ng, s, hn] of `step`; merge into
    the running (o, lse) in place."""
    qf = q.float()
    k, v = _expand(kv[0].float(), q.shape[1]), _expand(kv[1].float(), q.shape[1])
    for blk in blocks(ring, step, q.shape[2]):
        s = _scores(qf[:, :, blk.q], k[:, :, blk.kv], blk, scale)
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        l_blk = m.squeeze(-1) + torch.log(p.sum(-1))
        o_blk = torch.matmul(p, v[:, :, blk.kv]) / p.sum(-1, keepdim=True)
        l_old = lse[:, :, blk.q]
        l_new = torch.logaddexp(l_old, l_blk)
        o[:, :, blk.q] = (o[:, :, blk.q] * torch.exp(l_old - l_new).unsqueeze(-1)
                          + o_blk * torch.exp(l_blk - l_new).unsqueeze(-1))
        lse[:, :, blk.q] = l_new


def forward_finish(o: torch.Tensor, dtype) -> torch.Tensor:
    """The core attention's output as megatron returns it: [s, b, heads·hn]."""
    b, h, s, hn = o.shape
    return from_heads(o).reshape(s, b, h * hn).to(dtype)


# ---- backward ------------------------------------------------------------------------------
def backward_init(o: torch.Tensor, g_core: torch.Tensor):
    """dO in head layout (fp32), the row term D = rowsum(dO·O), and the dQ accumulator."""
    b, h, s, hn = o.shape
    do = to_heads(g_core.float().view(s, b, h, hn))
    delta = (do * o).sum(-1)
    return do, delta, torch.zeros_like(o)


def backward_step(ring: Ring, step: int, q: torch.Tensor, kv: torch.Tensor,
                  lse: torch.Tensor, do: torch.Tensor, delta: torch.Tensor,
                  dq: torch.Tensor, scale: float) -> torch.Tensor:
    """Gradient of `step`'s block: adds into dq (in place), returns this rank's dK/dV
    part for the block [2, b, ng, s, hn] (fp32)."""
    qf = q.float()
    heads, ng = q.shape[1], kv.shape[2]
    k, v = _expand(kv[0].float(), heads), _expand(kv[1].float(), heads)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for blk in blocks(ring, step, q.shape[2]):
        s = _scores(qf[:, :, blk.q], k[:, :, blk.kv], blk, scale)
        p = torch.exp(s - lse[:, :, blk.q].unsqueeze(-1))
        g = do[:, :, blk.q]
        dv[:, :, blk.kv] += torch.matmul(p.transpose(-1, -2), g)
        ds = p * (torch.matmul(g, v[:, :, blk.kv].transpose(-1, -2))
                  - delta[:, :, blk.q].unsqueeze(-1))
        dq[:, :, blk.q] += torch.matmul(ds, k[:, :, blk.kv]) * scale
        dk[:, :, blk.kv] += torch.matmul(ds.transpose(-1, -2), qf[:, :, blk.q]) * scale
    return torch.stack((_reduce_groups(dk, ng), _reduce_groups(dv, ng)))


def backward_finish(dq: torch.Tensor, dkv: torch.Tensor, dtype):
    """dQ, dK, dV in megatron's [s, b, heads, hn] layout."""
    return (from_heads(dq).to(dtype), from_heads(dkv[0]).to(dtype),
            from_heads(dkv[1]).to(dtype))


# ---- the messages --------------------------------------------------------------------------
def pack(*parts: torch.Tensor) -> torch.Tensor:
    """One message of stacked [2, b, ng, s, hn] parts, in the K/V dtype."""
    dtype = parts[0].dtype
    return torch.cat([p.to(dtype) for p in parts]) if len(parts) > 1 else parts[0]


def backward_message(step: int, cp: int, kv: Optional[torch.Tensor],
                     dkv: Optional[torch.Tensor]) -> torch.Tensor:
    """What exchange `kv_b_{step}` sends: at 0 the own K/V; then the K/V block just used
    (the next rank needs it one step later) over the dK/dV summed so far for the block
    before it; from C−1 on only dK/dV."""
    if step == 0:
        return kv
    if step < cp - 1:
        return pack(kv, dkv)
    return dkv


def unpack_backward(step: int, cp: int, msg: torch.Tensor):
    """(K/V block, dK/dV so far) of a received `kv_b_{step}` message (None where absent)."""
    if step == 0:
        return msg, None
    if step < cp - 1:
        return msg[:2], msg[2:]
    return None, msg


# ---- the CP baseline: megatron's core-attention slot ---------------------------------------
_LANES = {}


def lanes_for(device: torch.device):
    """One set of lanes per device for the baseline's ring (CUDA streams are made once,
    not at every call)."""
    from dhelix.strand.lanes import make_lanes
    key = str(device)
    if key not in _LANES:
        _LANES[key] = make_lanes(device)
    return _LANES[key]


def exchange(lanes, op: str, ring: Ring, x: torch.Tensor):
    return lanes.ring_exchange(op, x, ring.next, ring.prev, ring.group, ring.lane)


# `RingAttention`'s ring steps run under STEP(name), name the DHelix op the step is
# (attn_i, attn_b_i): paced compute (`train/emulate.py`) sets it to pace them.
STEP = lambda name: nullcontext()  # noqa: E731


class _RingFunction(torch.autograd.Function):
    """The ring run op after op, as one autograd node (megatron's CP attention is one
    node too). Each exchange is started one step ahead of the compute that needs it."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, scale: float):
        lanes = lanes_for(q.device)
        qh = to_heads(q)
        kv = torch.stack((to_heads(k), to_heads(v)))
        o, lse = forward_init(qh)
        cur = kv
        for i in range(ring.size):
            nxt = exchange(lanes, f"kv_{i}", ring, cur) if i < ring.size - 1 else None
            with STEP(f"attn_{i}"):
                forward_step(ring, i, qh, cur, o, lse, scale)
            cur = lanes.resolve(nxt) if nxt is not None else None
        ctx.save_for_backward(qh, kv, o, lse)
        ctx.ring, ctx.scale, ctx.dtype = ring, scale, q.dtype
        return forward_finish(o, q.dtype)

    @staticmethod
    def backward(ctx, g):
        qh, kv, o, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        lanes = lanes_for(qh.device)
        do, delta, dq = backward_init(o, g)
        dkv_final = run_backward_ring(lanes, ring, qh, kv, lse, do, delta, dq, scale)
        dqs, dks, dvs = backward_finish(dq, dkv_final, ctx.dtype)
        return dqs, dks, dvs, None, None


def add_part(acc: Optional[torch.Tensor], part: torch.Tensor) -> torch.Tensor:
    """dK/dV of a block so far (received, None at its owner) plus this rank's part."""
    return part if acc is None else acc.float() + part


def run_backward_ring(lanes, ring: Ring, qh, kv, lse, do, delta, dq, scale):
    """The whole backward ring op after op; returns this rank's finished dK/dV."""
    cur, acc = kv, None
    for i in range(ring.size + 1):
        part = None
        msg = backward_message(i, ring.size, cur, acc)
        pend = exchange(lanes, f"kv_b_{i}", ring, msg)
        if i < ring.size:
            with STEP(f"attn_b_{i}"):
                part = backward_step(ring, i, qh, cur, lse, do, delta, dq, scale)
        nxt, acc = unpack_backward(i, ring.size, lanes.resolve(pend))
        if part is not None:
            acc = add_part(acc, part)
        cur = nxt
    return acc


class RingAttention(MegatronModule):
    """Core attention over the CP group: megatron's `core_attention` slot, the same
    constructor as its DotProductAttention (which refuses CP without Transformer Engine).
    Causal self-attention only, no attention dropout (the ring merges exact softmax
    pieces; a dropout mask would have to be drawn per block)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type=None,
                 pg_collection=None, **_):
        super().__init__(config=config)
        from megatron.core import parallel_state
        if attn_mask_type != AttnMaskType.causal or attention_type != "self":
            raise ContextParallelError("ring attention: causal self-attention only "
                                       f"(got {attn_mask_type}, {attention_type})")
        p = config.attention_dropout if attention_dropout is None else attention_dropout
        if p:
            raise ContextParallelError(
                f"ring attention: attention dropout {p} is not supported with "
                f"--context-parallel-size {config.context_parallel_size}; set "
                f"attention_dropout: 0.0 in the model config")
        group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.ring = Ring.of(group or parallel_state.get_context_parallel_group())
        self.softmax_scale = softmax_scale or config.kv_channels ** -0.5

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **_):
        if packed_seq_params is not None:
            raise ContextParallelError("ring attention: packed sequences are not supported")
        check_split(query.shape[0] * self.ring.size, self.ring.size, "sequence length")
        return _RingFunction.apply(query, key, value, self.ring, self.softmax_scale)
