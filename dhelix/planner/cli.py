"""`dhelix plan | simulate | plan-sweep`: the planner and simulator from the command line.

* ``dhelix plan``       -- the DP planner (DESIGN §1.3) for one layer shape, costs from a
                           measured pairwise table (``--table``) or the analytical model of a
                           cluster file (``--cluster``); writes the plan JSON.
* ``dhelix simulate``   -- plays a plan file on the event simulator (DESIGN §1.5): makespan,
                           peak memory, lane busy times, timeline PNG and Chrome trace.
* ``dhelix plan-sweep`` -- plans many model shapes x clusters and reports the predicted
                           speed-up over the trivial plan (markdown, JSON, bar chart).

Every expected problem (missing or foreign table, bad cluster file, unknown model config,
a memory budget no plan meets, an illegal plan) prints one line
``dhelix <cmd>: error: ...`` on stderr and exits with status 2.

This module holds what the three commands share -- argument groups, size parsing and
formatting, layer-shape and cost-source resolution, error printing -- and ``register(sub)``;
each command's parser and body live in ``cmd_plan.py``, ``cmd_simulate.py`` and
``cmd_sweep.py``.
"""
from __future__ import annotations

import os
import re
import sys
from typing import List, Optional, Tuple

from dhelix.planner.costmodel import DEFAULT_GPUS_PER_NODE

DEFAULT_CLUSTERS = ("a40", "a800", "h100")


class CliError(ValueError):
    """A bad command-line value; printed as one line, exit status 2."""


# ---- small helpers ---------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> float:
    """'2GiB' -> 2147483648, '500MB' -> 5e8, '1.5G' -> 1.5 * 2**30, '123' -> 123.

    KB/MB/GB/TB are powers of 1000; KiB/MiB/GiB/TiB and the bare K/M/G/T powers of 1024."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise CliError(f"--memory-budget: cannot read {text!r} as a size; write e.g. 2GiB, "
                       f"500MB, 1.5G or a number of bytes")
    v = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if v <= 0:
        raise CliError(f"--memory-budget: {text!r} is not a positive size")
    return v


def fmt_bytes(v: Optional[float]) -> str:
    if v is None:
        return "-"
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= k:
            return f"{v / k:.2f} {unit}"
    return f"{v:.0f} B"


def fmt_time(s: Optional[float]) -> str:
    if s is None:
        return "-"
    if abs(s) >= 1.0:
        return f"{s:.3f} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.2f} µs"


def resolve_cluster(name_or_path: str) -> str:
    """`h100` -> configs/clusters/h100.yaml; an existing path is taken as given."""
    from dhelix.models.config import find_named_yaml
    from dhelix.planner.costmodel import ClusterError
    return find_named_yaml(name_or_path, "clusters", "--cluster", "cluster", ClusterError)


def shapes_only_configs() -> List[str]:
    from dhelix.models.config import CONFIG_DIR, load_model_config
    out = []
    for f in sorted(os.listdir(CONFIG_DIR)):
        if f.endswith(".yaml"):
            cfg = load_model_config(f[:-5])
            if cfg.shapes_only:
                # by family, then by size (layers x hidden²): gpt-6.7b before gpt-18b
                out.append(((f.split("-")[0], cfg.num_layers * cfg.hidden_size ** 2), f[:-5]))
    return [name for _, name in sorted(out)]


def _dtype(bf16: bool) -> str:
    return "bf16" if bf16 else "fp32"


def _split_list(values) -> List[str]:
    out: List[str] = []
    for v in values or []:
        out += [x.strip() for x in str(v).split(",") if x.strip()]
    return out


def _expected_errors():
    """The exception types that mean bad input (one-line error, exit 2), not a bug."""
    from dhelix.models.config import ConfigError
    from dhelix.planner.costmodel import ClusterError
    from dhelix.planner.costs import TableError
    from dhelix.planner.plan import PlanError
    return (CliError, ConfigError, ClusterError, TableError, PlanError)


def _fail(cmd: str, e: BaseException) -> int:
    msg = " ".join(str(e).split())          # one line
    print(f"dhelix {cmd}: error: {msg}", file=sys.stderr)
    return 2


# ---- shapes ----------------------------------------------------------------------------------

# the defaults of `dhelix train`, so that a plan made without shape flags fits its runs
DEFAULT_SEQ, DEFAULT_MBS = 64, 2


def _add_shape_args(p, required: bool) -> None:
    g = p.add_argument_group("layer shape (Megatron's flag names)")
    g.add_argument("--config", required=required, default=None, metavar="NAME",
                   help="model config: a name under configs/models (tiny, llama-8b, ...) or a "
                        "YAML path")
    g.add_argument("--tensor-model-parallel-size", type=int, default=None, metavar="N",
                   help="TP size (default 1)")
    g.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="Megatron sequence parallelism (needs TP > 1)")
    g.add_argument("--seq-length", type=int, default=None, metavar="S",
                   help=f"default {DEFAULT_SEQ}, as `dhelix train` (published shapes: pass "
                        f"their length, e.g. 4096)")
    g.add_argument("--micro-batch-size", type=int, default=None, metavar="B",
                   help=f"default {DEFAULT_MBS}, as `dhelix train`")
    g.add_argument("--bf16", action="store_true", default=None,
                   help="bf16 activations and peak FLOP/s (default fp32)")
    g.add_argument("--lane", choices=("intra", "inter"), default=None,
                   help="where the TP group lives: inside a node (intra, default) or across "
                        "nodes (inter)")
    g.add_argument("--expert-model-parallel-size", type=int, default=None, metavar="P",
                   help="MoE configs: experts over P ranks, all-to-all between them "
                        "(default 1); the EP group is inside a node while TP×EP ≤ 8")
    add_cp_arg(g, default=None)


def add_cp_arg(g, default) -> None:
    g.add_argument("--context-parallel-size", type=int, default=default, metavar="C",
                   help="context parallel (ring attention): the sequence over C ranks, K/V "
                        "blocks passed around the ring by P2P (default 1); the CP group is "
                        "inside a node while TP×CP fits in one (the cluster file's "
                        "gpus_per_node, 8)")


def _shape_given(a) -> bool:
    return any(getattr(a, k, None) is not None for k in
               ("config", "tensor_model_parallel_size", "sequence_parallel", "seq_length",
                "micro_batch_size", "bf16", "lane", "expert_model_parallel_size",
                "context_parallel_size"))


def _shape_from_args(a) -> dict:
    if a.config is None:
        raise CliError("--config is required to describe the layer shape")
    tp = 1 if a.tensor_model_parallel_size is None else a.tensor_model_parallel_size
    seq = DEFAULT_SEQ if a.seq_length is None else a.seq_length
    mbs = DEFAULT_MBS if a.micro_batch_size is None else a.micro_batch_size
    for flag, v in (("--tensor-model-parallel-size", tp), ("--seq-length", seq),
                    ("--micro-batch-size", mbs)):
        if v <= 0:
            raise CliError(f"{flag} must be a positive integer, got {v}")
    sp = bool(a.sequence_parallel)
    cp = getattr(a, "context_parallel_size", None)
    cp = 1 if cp is None else cp
    check_cp(cp, seq)
    if sp and tp > 1 and (seq // cp) % tp:
        per_rank = "" if cp == 1 else f" (its {seq // cp} tokens per CP rank)"
        raise CliError(f"--seq-length {seq}{per_rank} must be divisible by "
                       f"--tensor-model-parallel-size {tp} with --sequence-parallel")
    ep = getattr(a, "expert_model_parallel_size", None) or 1
    if ep < 1:
        raise CliError(f"--expert-model-parallel-size must be a positive integer, got {ep}")
    shape = {"config": a.config, "tp": tp, "sp": sp and tp > 1, "seq": seq, "mbs": mbs,
             "bf16": bool(a.bf16), "lane": a.lane or "intra"}
    if ep > 1:
        shape["ep"] = ep
    if cp > 1:
        shape["cp"] = cp
    return shape


def check_cp(cp: int, seq: int) -> None:
    """A context-parallel size megatron accepts for this sequence length."""
    if cp < 1:
        raise CliError(f"--context-parallel-size must be a positive integer, got {cp}")
    if cp > 1 and seq % (2 * cp):
        raise CliError(f"--seq-length {seq} does not split into 2·CP = {2 * cp} chunks "
                       f"(megatron's load-balanced context parallel, --context-parallel-size "
                       f"{cp}); choose a multiple of {2 * cp}")


def node_size(cluster: Optional[str]) -> int:
    """GPUs per node of a cluster (name or file); 8 without one, as in every file here."""
    from dhelix.planner.costmodel import gpus_per_node, load_cluster
    if not cluster:
        return DEFAULT_GPUS_PER_NODE
    return gpus_per_node(load_cluster(resolve_cluster(cluster)))


def group_lane(span: int, gpus_per_node: int) -> str:
    """The lane of a group whose ranks lie in one block of `span` consecutive ranks.
    Megatron numbers ranks TP fastest, then CP, then DP (EP over those): a CP group is TP
    apart inside TP×CP consecutive ranks, an EP group inside TP×EP. A node holds
    `gpus_per_node` consecutive ranks, so the group stays in one node when its blocks
    tile the node; a block that straddles two puts the ring across nodes on some ranks,
    and every rank runs the same plan."""
    return "intra" if span <= gpus_per_node and gpus_per_node % span == 0 else "inter"


def ep_lane(shape: dict, gpus_per_node: int = DEFAULT_GPUS_PER_NODE) -> str:
    """The EP group's lane: inside a node while TP × EP fits in one."""
    return group_lane(shape["tp"] * shape.get("ep", 1), gpus_per_node)


def cp_lane(shape: dict, gpus_per_node: int = DEFAULT_GPUS_PER_NODE) -> str:
    """The CP ring's lane: inside a node while TP × CP fits in one."""
    return group_lane(shape["tp"] * shape.get("cp", 1), gpus_per_node)


def layer_for_shape(shape: dict, gpus_per_node: int = DEFAULT_GPUS_PER_NODE):
    """LayerOps for a shape dict (config, tp, sp, seq, mbs, bf16, lane; ep, cp if > 1);
    the EP and CP groups' lanes follow from `gpus_per_node` (the cluster's)."""
    from dhelix.models.config import ConfigError, load_model_config
    from dhelix.planner.shapes import layer_ops_for_shape
    cfg = load_model_config(shape["config"])
    try:
        return layer_ops_for_shape(cfg, shape["tp"], shape["sp"], shape["seq"], shape["mbs"],
                                   bf16=shape["bf16"], lane=shape["lane"],
                                   ep=shape.get("ep", 1),
                                   ep_lane=ep_lane(shape, gpus_per_node),
                                   cp=shape.get("cp", 1),
                                   cp_lane=cp_lane(shape, gpus_per_node))
    except (ValueError, AssertionError) as e:  # megatron's TransformerConfig checks
        cp = f", CP={shape['cp']}" if shape.get("cp", 1) > 1 else ""
        raise ConfigError(f"--config {shape['config']} with TP={shape['tp']}{cp}: {e}")


def per_rank_shape(shape: dict) -> dict:
    """The shape as one CP rank holds it: seq/CP tokens (what it sends to the next
    pipeline stage)."""
    cp = shape.get("cp", 1)
    return dict(shape, seq=shape["seq"] // cp) if cp > 1 else shape


def shape_str(shape: dict, gpus_per_node: int = DEFAULT_GPUS_PER_NODE) -> str:
    parts = [str(shape.get("config")), f"TP={shape.get('tp')}"]
    if shape.get("sp"):
        parts.append("SP")
    if shape.get("cp", 1) > 1:
        parts.append(f"CP={shape['cp']} ({cp_lane(shape, gpus_per_node)})")
    if shape.get("ep", 1) > 1:
        parts.append(f"EP={shape['ep']} ({ep_lane(shape, gpus_per_node)})")
    parts += [f"seq {shape.get('seq')}", f"mbs {shape.get('mbs')}",
              "bf16" if shape.get("bf16") else "fp32", f"lane {shape.get('lane')}"]
    return ", ".join(parts)


# ---- cost sources ----------------------------------------------------------------------------

def _add_cost_args(p, required: bool) -> None:
    g = p.add_argument_group("cost source (one of)")
    m = g.add_mutually_exclusive_group(required=required)
    m.add_argument("--table", metavar="PATH",
                   help="measured pairwise overlap table from `dhelix profile`; refused if it "
                        "was made for another shape or cluster unless --force")
    m.add_argument("--cluster", metavar="NAME_OR_YAML",
                   help="analytical costs from a cluster file: a name under configs/clusters "
                        "(a40, a800, h100) or a YAML path")
    p.add_argument("--force", action="store_true",
                   help="use a table made for another layer signature (entries must still "
                        "cover this layer's ops)")


def load_costs(layer, shape: Optional[dict], table: Optional[str], cluster: Optional[str],
               force: bool) -> Tuple[object, dict]:
    """(CostTable, cost_source dict for the plan's meta)."""
    from dhelix.planner.costs import CostTable, TableError
    if table:
        try:
            t = CostTable.load(table, layer=layer, force=force, pairs="concurrent")
        except TableError as e:
            msg = str(e)
            if "signature" in msg and not force and shape is not None:
                msg += f" [this layer: {shape_str(shape)}; pass --force to use the table anyway]"
            raise TableError(msg)
        return t, {"kind": "table", "path": os.path.abspath(table), "forced": bool(force)}
    from dhelix.planner.costmodel import analytical_table, group_sizes_of, load_cluster
    if shape is None:
        raise CliError("the analytical cost model needs the layer's TP size and dtype; give "
                       "the shape flags (--config, --tensor-model-parallel-size, --bf16, ...)")
    path = resolve_cluster(cluster)
    c = load_cluster(path)
    name = c.get("name") or os.path.splitext(os.path.basename(path))[0]
    groups = group_sizes_of(shape, layer)
    t = analytical_table(layer, c, groups, dtype=_dtype(shape["bf16"]), cluster_name=name)
    return t, {"kind": "cluster", "name": name, "path": os.path.abspath(path),
               "dtype": _dtype(shape["bf16"]), "group_sizes": groups}


def _cost_str(src: dict) -> str:
    if src.get("kind") == "table":
        return f"measured table {src.get('path')}" + (" (forced)" if src.get("forced") else "")
    return f"analytical, cluster {src.get('name')} ({src.get('path')})"


def _readable_budget_error(e: BaseException) -> BaseException:
    """Add human units to the planner's 'memory budget ... cannot be met' message."""
    m = re.search(r"budget (\d+) bytes cannot be met: the lowest-peak plan peaks at (\d+) "
                  r"bytes, (\d+) bytes", str(e))
    if not m:
        return e
    budget, peak, over = (float(x) for x in m.groups())
    return type(e)(f"{e} [budget {fmt_bytes(budget)}, lowest possible peak {fmt_bytes(peak)}, "
                   f"{fmt_bytes(over)} too much; raise --memory-budget]")


# ---- registration ----------------------------------------------------------------------------

def _add_planner_args(p) -> None:
    p.add_argument("--memory-budget", metavar="BYTES", default=None,
                   help="highest simulated peak memory of the layer step (β's saved "
                        "activations + α's new ones + transients), e.g. 2GiB, 500MB; plans "
                        "above it are rejected")
    p.add_argument("--backend", choices=("auto", "cpp", "python"), default="auto",
                   help="DP core: C++ (dhelix._planner_core), the Python reference, or auto")


def register(sub) -> None:
    # imported here: the command modules import their shared helpers from this module
    from dhelix.planner import cmd_plan, cmd_simulate, cmd_sweep
    cmd_plan.add_parser(sub)
    cmd_simulate.add_parser(sub)
    cmd_sweep.add_parser(sub)
