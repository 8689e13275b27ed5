"""`dhelix profile`: the pairwise overlap table of a layer, measured on the real ranks.

For each forward op i and backward op j: T_i alone, T_j alone and P_ij launched together,
each the median of repeated runs after warm-up (slowest rank). Written as JSON (with
provenance: shape, dtype, parallel sizes, node layout, hardware, versions) and CSV.
"""
from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from dhelix.base.hardware import hardware
from dhelix.base.nodes import node_ids
from dhelix.planner.costs import CostTable


def provenance(m, tp, sp, seq, mbs, bf16, ep: int = 1) -> dict:
    import megatron.core
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {
        "model": m.name, "hidden_size": m.hidden_size, "ffn_hidden_size": m.ffn_hidden_size,
        "num_attention_heads": m.num_attention_heads, "num_query_groups": m.kv_groups,
        "seq_length": seq, "micro_batch_size": mbs, "dtype": "bf16" if bf16 else "fp32",
        "tensor_model_parallel_size": tp, "sequence_parallel": sp, "world_size": world,
        **({"num_experts": m.num_experts, "moe_router_topk": m.moe_router_topk,
            "expert_model_parallel_size": ep} if m.num_experts else {}),
        "node_ids": node_ids(world), "hardware": hardware(), "host": socket.gethostname(),
        "versions": {"torch": torch.__version__,
                     "megatron-core": getattr(megatron.core, "__version__", "?"),
                     "dhelix": _dhelix_version()},
        "measured_at": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def _dhelix_version() -> str:
    try:
        from importlib.metadata import version
        return version("dhelix")
    except Exception:
        return "dev"


def profile_layer(harness, m, bf16: bool, warmup: int = 1, repeats: int = 5,
                  show_progress: bool = True, pairs: str = "concurrent") -> CostTable:
    """pairs="concurrent" measures the pairs that can overlap (ops on different lanes,
    the only ones the simulator reads); "all" measures every forward × backward pair."""
    from tqdm import tqdm

    from dhelix.planner.costs import concurrent
    ops = harness.ops
    nf, nb = len(ops.forward), len(ops.backward)
    todo = [(i, j) for i in range(nf) for j in range(nb)
            if pairs == "all" or concurrent(ops.forward[i], ops.backward[j])]
    table = CostTable.empty(ops, provenance(m, harness.tp, harness.sp, harness.seq,
                                            harness.mbs, bf16, harness.ep))
    table.provenance.update({"warmup": warmup, "repeats": repeats, "statistic": "median",
                             "pairs": pairs})
    bar = tqdm(total=nf + nb + len(todo) + 2, desc="dhelix profile", unit="meas",
               disable=not show_progress)
    # compute ops inside whole layer steps: the durations the simulator plays
    table.in_step_f, table.in_step_b = harness.time_in_step(warmup, max(repeats, 3))
    bar.update(1)
    # the thread's own work per comm op (issue, copies), which those durations leave out
    table.host_f, table.host_b = harness.time_comm_host(warmup, max(repeats, 3))
    bar.update(1)
    for i, o in enumerate(ops.forward):
        table.alone_f[o.name] = harness.time_ops(i, None, warmup, repeats)
        bar.update(1)
    for j, o in enumerate(ops.backward):
        table.alone_b[o.name] = harness.time_ops(None, j, warmup, repeats)
        bar.update(1)
    for i, j in todo:
        table.pair[(ops.forward[i].name, ops.backward[j].name)] = \
            harness.time_ops(i, j, warmup, repeats)
        bar.update(1)
    bar.close()
    return table
