"""Plain-data description of a layer's ops, shared by the executor, planner and simulator.

An `OpSpec` says what an op is (compute or comm, which lane, which process group), how
much work it does (FLOPs, bytes moved) and what memory it leaves behind, so the planner
and the simulator can reason about a layer without touching tensors.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import List, Optional

COMPUTE, COMM = "compute", "comm"
LANES = ("compute", "intra", "inter")


@dataclass(frozen=True)
class OpSpec:
    name: str                      # unique within its chain, e.g. "qkv", "rs_attn_b"
    kind: str                      # COMPUTE or COMM
    lane: str                      # "compute" | "intra" | "inter"
    group: Optional[str] = None    # process-group name for comm ops ("tp", "dp", ...)
    flops: float = 0.0             # compute work (FLOPs) for the cost model
    comm_bytes: float = 0.0        # comm ops: collective buffer bytes (all-gather output,
                                   # reduce-scatter input, all-reduce buffer)
    collective: Optional[str] = None  # "all_gather" | "reduce_scatter" | "all_reduce" | ...
    saved_bytes: float = 0.0       # activation bytes kept for backward (fwd) / freed (bwd)
    temp_bytes: float = 0.0        # transient bytes alive only while the op runs
    after: Optional[str] = None    # wgrad ops: the dgrad op they must follow
    wgrad: bool = False            # deferrable weight-gradient op
    reader: Optional[str] = None   # comm ops: the op that reads the result, where it is not
                                   # the chain's next non-wgrad op (a chunked MLP's gathers)

    def to_json(self) -> dict:
        # `reader` only where set: the chains without chunks keep their old signatures
        return {k: v for k, v in asdict(self).items() if k != "reader" or v is not None}

    @staticmethod
    def from_json(d: dict) -> "OpSpec":
        return OpSpec(**d)


@dataclass
class LayerOps:
    """The forward and backward chains of one layer, in chain order."""
    forward: List[OpSpec] = field(default_factory=list)
    backward: List[OpSpec] = field(default_factory=list)

    def signature(self) -> str:
        """Hash of the chains' structure and shapes: a plan or table is tied to it."""
        payload = json.dumps(
            {"f": [o.to_json() for o in self.forward], "b": [o.to_json() for o in self.backward]},
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def tables_for(self) -> tuple:
        """The layer signatures whose overlap tables serve this layer: its own, and for a
        layer that keeps its gathered inputs (`chains.kept_gathers`) the same layer's
        without (its ops are a subset of that one's, each the same work)."""
        return (self.signature(),) + tuple(s for s in [getattr(self, "table_signature", None)]
                                           if s)

    def to_json(self) -> dict:
        d = {"forward": [o.to_json() for o in self.forward],
             "backward": [o.to_json() for o in self.backward]}
        if getattr(self, "table_signature", None):
            d["table_signature"] = self.table_signature
        return d

    @staticmethod
    def from_json(d: dict) -> "LayerOps":
        lo = LayerOps([OpSpec.from_json(o) for o in d["forward"]],
                      [OpSpec.from_json(o) for o in d["backward"]])
        if d.get("table_signature"):
            lo.table_signature = str(d["table_signature"])
        return lo
