"""Strand runners: who executes a DHelix layer's op chains when autograd asks.

`SoloRunner` runs each layer's forward or backward alone, by the plan's order (the
trivial interleaving: nothing paired). The co-executing schedule's runner, which pairs
one strand's forward with another's backward, lives in `dhelix.strand.schedule`.
"""
from __future__ import annotations

from typing import Callable, Optional

from dhelix.planner.plan import Plan, check_same_plan_across_ranks, trivial_plan, validate
from dhelix.strand.executor import Tracer, run_layer_step
from dhelix.strand.lanes import Lanes, make_lanes
from dhelix.strand.state import StrandState


class PlanBook:
    """The plan of every layer: one plan validated against each layer's op chains."""

    def __init__(self, seq_length: int, micro_batch_size: int,
                 plan: Optional[Plan] = None,
                 make_plan: Callable = trivial_plan, source: str = "<plan>"):
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        self.plan, self.make_plan, self.source = plan, make_plan, source
        self._by_sig = {}
        self._by_layer = {}

    def for_layer(self, layer) -> Plan:
        plan = self._by_layer.get(id(layer))
        if plan is not None:
            return plan
        ops = layer.program.layer_ops(self.seq_length, self.micro_batch_size)
        sig = ops.signature()
        if sig not in self._by_sig:
            plan = self.plan if self.plan is not None else self.make_plan(ops)
            validate(plan, ops, self.source)
            check_same_plan_across_ranks(plan, self.source)
            self._by_sig[sig] = plan
        self._by_layer[id(layer)] = self._by_sig[sig]
        return self._by_sig[sig]


class SoloRunner:
    def __init__(self, plans: PlanBook, lanes: Optional[Lanes] = None,
                 tracer: Optional[Tracer] = None):
        self.plans = plans
        self.lanes = lanes or make_lanes()
        self.tracer = tracer

    def new_state(self, layer) -> StrandState:
        return StrandState(self.lanes)

    def forward(self, layer, S):
        run_layer_step(self.plans.for_layer(layer), fwd=(layer.program, S), tracer=self.tracer)

    def backward(self, layer, S):
        run_layer_step(self.plans.for_layer(layer), bwd=(layer.program, S), tracer=self.tracer)
