"""Functional collectives on the paced link (`dhelix.links.paced`), for measuring here.

PyTorch's functional collectives call the process group from C++, under the Python
methods the paced link wraps; so the graph itself is rewritten: each collective node
calls `_issue` (the collective, and its modelled completion from the same FIFO link
model and ring formula as everywhere else) and each `wait_tensor` calls `_wait` (the
real wait, then a sleep until the modelled completion). The same rewrite is applied with
and without the Helix passes, so both run on one link.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.fx as fx

from dhelix.links.paced import PacedLink

c10d = torch.ops._c10d_functional
_KINDS = {c10d.all_gather_into_tensor: ("all_gather", "out"),
          c10d.reduce_scatter_tensor: ("reduce_scatter", "in"),
          c10d.all_reduce: ("all_reduce", "in")}
_WAIT = c10d.wait_tensor.default         # the real op (`patched_ops` may stand in for it)
_LINK: Dict[str, Optional[PacedLink]] = {"link": None}
_DONE: Dict[int, float] = {}                 # id(result) -> modelled completion
STATS = {"modelled_s": 0.0, "slept_s": 0.0, "count": 0}


class GraphLink(PacedLink):
    """The paced link for a program's collectives: every group is paced, the default
    one too (a 1-D device mesh over the whole world is the default group)."""

    def link_of(self, pg):
        return f"group:{pg.group_name}"


def use_link(link: Optional[PacedLink]) -> None:
    _LINK["link"] = link


def _group_of(args):
    name = args[-1]
    return dist.distributed_c10d._resolve_process_group(name) if isinstance(name, str) \
        else name


def _issue(op, *args):
    out = op(*args)
    link = _LINK["link"]
    if link is not None:
        kind, which = _KINDS[op.overloadpacket]
        t = out if which == "out" else args[0]
        done = link.schedule(_group_of(args), kind, t.numel() * t.element_size())
        if done is not None:
            _DONE[id(out)] = done
            STATS["count"] += 1
    return out


def _wait(t):
    out = _WAIT(t)
    done = _DONE.pop(id(t), None)
    if done is not None:
        left = done - time.perf_counter()
        if left > 0:
            time.sleep(left)
            STATS["slept_s"] += left
    return out


def pace(gm: fx.GraphModule) -> int:
    """Route the graph's collectives and waits through the link model; returns how many
    collectives were rerouted."""
    n = 0
    for node in gm.graph.nodes:
        p = getattr(node.target, "overloadpacket", None)
        if p in _KINDS:
            node.args = (node.target,) + tuple(node.args)
            node.target = _issue
            n += 1
        elif p is _WAIT.overloadpacket:
            node.target = _wait
    gm.recompile()
    return n


class _Paced:
    """Stands in for `torch.ops._c10d_functional.<op>` while code runs: `.default` goes
    through the link model; anything else is the real op's."""

    def __init__(self, packet):
        self._packet = packet
        if packet is _WAIT.overloadpacket:
            self.default = _wait
        else:
            self.default = lambda *a: _issue(packet.default, *a)

    def __getattr__(self, name):
        return getattr(self._packet, name)


@contextlib.contextmanager
def patched_ops():
    """Code that calls the functional collectives by name at run time — Inductor's
    generated programs do — runs them on the link model inside this block. Enter it only
    after compiling: tracing needs the real ops."""
    ns = torch.ops._c10d_functional
    saved = {p.__name__: p for p in list(_KINDS) + [_WAIT.overloadpacket]}
    try:
        for name, packet in saved.items():
            setattr(ns, name, _Paced(packet))
        yield
    finally:
        for name, packet in saved.items():
            setattr(ns, name, packet)
