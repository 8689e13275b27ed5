"""The ring attention core of a DHelix layer as ops (`planner.chains.ring_chains`).

The math is `models/ring_attention.py`'s, the same functions the CP baseline's core
attention calls op after op, so the DHelix layer computes the same numbers whatever plan
interleaves the ring with the other strand. Each exchange is its own comm op on the CP
group's lane; the attention of a step is a compute op. State keys of one micro-batch:
  rq, rkv              local queries and own K/V (head layout), kept for the backward
  ro, rlse             running output and log-sum-exp; the final ones are kept too
  rkv_i                the K/V block of forward step i (a Pending of exchange kv_{i-1})
  rmsg_i               what exchange kv_b_i received (next K/V block, dK/dV so far)
  rpart_i, rdo, rdq    backward temporaries
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Dict

import torch

from dhelix.models import ring_attention as R
from dhelix.strand.traced import traced
from dhelix.strand.state import StrandState


class _Capture(torch.nn.Module):
    """Stands in for megatron's core attention: returns Q, K, V (after RoPE) flattened
    and concatenated, so one local graph covers the split and the rotary embedding."""

    def __init__(self, owner: "RingOps"):
        super().__init__()
        self.owner = owner

    def forward(self, q, k, v, *args, **kwargs):
        self.owner.dims = (q.shape[2], k.shape[2], q.shape[3])
        return torch.cat((q.flatten(2), k.flatten(2), v.flatten(2)), dim=-1)


class RingOps:
    """The ring's ops for one DHelix layer (its LayerProgram runs QKV and projections)."""

    def __init__(self, program, group):
        self.p = program
        self.ring = R.Ring.of(group)
        self.scale = program.attn.core_attention.softmax_scale
        self.dims = None                    # (heads, kv groups, head dim) of this rank

    def fns(self) -> Dict[str, Callable[[StrandState], None]]:
        c = self.ring.size
        fns = {"attn_in": self._attn_in, "attn_in_b": self._attn_in_b}
        for i in range(c):
            fns[f"attn_{i}"] = partial(self._attn_step, i)
            fns[f"attn_b_{i}"] = partial(self._attn_b_step, i)
            if i < c - 1:
                fns[f"kv_{i}"] = partial(self._kv, i)
        for i in range(c + 1):
            fns[f"kv_b_{i}"] = partial(self._kv_b, i)
        return fns

    # ---- forward ---------------------------------------------------------------------------
    def _attn_in(self, S):
        self.p._meta = S.meta
        x = S.get("qkv").detach().requires_grad_()
        y = traced(self._split_of, x, owned=(x,))
        S.drop("qkv")
        heads, groups, hn = self.dims
        s, b = y.shape[:2]
        q, k, v = y.split((heads * hn, groups * hn, groups * hn), dim=-1)
        qh = R.to_heads(q.reshape(s, b, heads, hn))
        S.put("rq", qh)
        S.put("rkv", torch.stack((R.to_heads(k.reshape(s, b, groups, hn)),
                                  R.to_heads(v.reshape(s, b, groups, hn)))))
        # the backward needs only y's graph: its data now lives on in rq and rkv
        y.detach().untyped_storage().resize_(0)
        S.put("g:attn_in", (x, y))
        o, lse = R.forward_init(qh)
        S.put("ro", o)
        S.put("rlse", lse)

    def _split_of(self, qkv):
        attn = self.p.attn
        saved = attn.core_attention
        attn.core_attention = _Capture(self)
        try:
            return self.p._attn_core(qkv)
        finally:
            attn.core_attention = saved

    def _block(self, S, i):
        return S.get("rkv") if i == 0 else S.get(f"rkv_{i}")

    def _kv(self, i, S):
        """Send forward step i's K/V block on; receive step i+1's."""
        S.put(f"rkv_{i + 1}", R.exchange(S.lanes, f"kv_{i}", self.ring, self._block(S, i)))

    def _attn_step(self, i, S):
        R.forward_step(self.ring, i, S.get("rq"), self._block(S, i), S.get("ro"),
                       S.get("rlse"), self.scale)
        if i:
            S.drop(f"rkv_{i}")
        if i == self.ring.size - 1:
            S.put("core", R.forward_finish(S.get("ro"), self.p.w_proj.dtype))

    # ---- backward --------------------------------------------------------------------------
    def _received(self, S, i):
        """(K/V block for step i+1, dK/dV so far of step i's block) from exchange kv_b_i."""
        return R.unpack_backward(i, self.ring.size, S.get(f"rmsg_{i}"))

    def _kv_b(self, i, S):
        """Send: the K/V block of step i (the next rank needs it at i+1) over the dK/dV of
        step i−1's block with this rank's part added (see models/ring_attention.py)."""
        c = self.ring.size
        cur = acc = None
        if i == 0:
            cur = S.get("rkv")
        else:
            nxt, got = self._received(S, i - 1)
            cur = nxt if i < c else None
            acc = R.add_part(got, S.get(f"rpart_{i - 1}"))
            S.drop(f"rpart_{i - 1}", f"rmsg_{i - 1}")
            if i < c:
                S.put(f"rkv_b_{i}", cur)
        msg = R.backward_message(i, c, cur, acc)
        S.put(f"rmsg_{i}", R.exchange(S.lanes, f"kv_b_{i}", self.ring, msg))

    def _attn_b_step(self, i, S):
        if i == 0:
            do, delta, dq = R.backward_init(S.get("ro"), S.get("g_core"))
            S.put("rdo", do)
            S.put("rdelta", delta)
            S.put("rdq", dq)
            S.drop("g_core", "ro")
        kv = S.get("rkv") if i == 0 else S.get(f"rkv_b_{i}")
        S.put(f"rpart_{i}", R.backward_step(self.ring, i, S.get("rq"), kv, S.get("rlse"),
                                            S.get("rdo"), S.get("rdelta"), S.get("rdq"),
                                            self.scale))
        S.drop(f"rkv_b_{i}")

    def _attn_in_b(self, S):
        c = self.ring.size
        _, dkv = self._received(S, c)
        dq, dk, dv = R.backward_finish(S.get("rdq"), dkv, self.p.w_proj.dtype)
        g = torch.cat((dq.flatten(2), dk.flatten(2), dv.flatten(2)), dim=-1)
        (gx,) = self.p._grad(S, "g:attn_in", g, [])
        S.put("g_qkv", gx)
        S.drop(f"rmsg_{c}", "rq", "rkv", "rlse", "rdo", "rdelta", "rdq")
