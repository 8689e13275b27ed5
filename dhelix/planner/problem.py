"""What the planner is given: one layer shape (a plain dict), the layer's ops for it and
their costs, from a measured pairwise table or a cluster file's analytical model.

A shape dict: config (a model config name or YAML path), tp, sp, seq, mbs, bf16, lane
("intra"/"inter": where the TP group lives), and ep, cp when > 1. The lanes of the CP and
EP groups follow from the cluster's GPUs per node. Bad values raise `InputError` (or the
config, cluster, table and plan errors, all ValueErrors: `expected_errors()`), whose
messages name the command-line flag to change.
"""
from __future__ import annotations

import os
import re
from typing import List, Optional, Tuple

from dhelix.base.units import SizeError, fmt_bytes
from dhelix.planner.costmodel import DEFAULT_GPUS_PER_NODE

DEFAULT_CLUSTERS = ("a40", "a800", "h100")

# the defaults of `dhelix train`, so that a plan made without shape flags fits its runs
DEFAULT_SEQ, DEFAULT_MBS = 64, 2


class InputError(ValueError):
    """A bad shape or cost-source value; printed as one line, exit status 2."""


def expected_errors() -> tuple:
    """The exception types that mean bad input (one-line error, exit 2), not a bug."""
    from dhelix.models.config import ConfigError
    from dhelix.planner.costmodel import ClusterError
    from dhelix.planner.costs import TableError
    from dhelix.planner.plan import PlanError
    return (InputError, SizeError, ConfigError, ClusterError, TableError, PlanError)


def dtype_name(bf16: bool) -> str:
    return "bf16" if bf16 else "fp32"


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


# ---- shapes ----------------------------------------------------------------------------------

def make_shape(config: Optional[str], tp: Optional[int] = None, sp: Optional[bool] = None,
               seq: Optional[int] = None, mbs: Optional[int] = None,
               bf16: Optional[bool] = None, lane: Optional[str] = None,
               ep: Optional[int] = None, cp: Optional[int] = None,
               mlp_chunks: Optional[int] = None,
               keep_gathered: Optional[bool] = None) -> dict:
    """A checked shape dict; None means the default (TP 1, `dhelix train`'s sequence
    length and micro-batch size, fp32, lane intra, no EP or CP)."""
    if config is None:
        raise InputError("--config is required to describe the layer shape")
    tp = 1 if tp is None else tp
    seq = DEFAULT_SEQ if seq is None else seq
    mbs = DEFAULT_MBS if mbs is None else mbs
    for flag, v in (("--tensor-model-parallel-size", tp), ("--seq-length", seq),
                    ("--micro-batch-size", mbs)):
        if v <= 0:
            raise InputError(f"{flag} must be a positive integer, got {v}")
    sp = bool(sp)
    cp = 1 if cp is None else cp
    check_cp(cp, seq)
    if sp and tp > 1 and (seq // cp) % tp:
        per_rank = "" if cp == 1 else f" (its {seq // cp} tokens per CP rank)"
        raise InputError(f"--seq-length {seq}{per_rank} must be divisible by "
                         f"--tensor-model-parallel-size {tp} with --sequence-parallel")
    ep = ep or 1
    if ep < 1:
        raise InputError(f"--expert-model-parallel-size must be a positive integer, got {ep}")
    shape = {"config": config, "tp": tp, "sp": sp and tp > 1, "seq": seq, "mbs": mbs,
             "bf16": bool(bf16), "lane": lane or "intra"}
    if ep > 1:
        shape["ep"] = ep
    if cp > 1:
        shape["cp"] = cp
    mlp_chunks = mlp_chunks or 1
    if mlp_chunks < 1:
        raise InputError(f"--dhelix-mlp-chunks must be a positive integer, got {mlp_chunks}")
    if mlp_chunks > 1:
        shape["mlp_chunks"] = mlp_chunks
    if keep_gathered:
        if not shape["sp"]:
            raise InputError("--dhelix-keep-gathered keeps the all-gathered inputs of sequence "
                             "parallel: it needs --tensor-model-parallel-size > 1 with "
                             "--sequence-parallel")
        from dhelix.planner.chains import keep_parts, keep_value
        shape["keep_gathered"] = keep_value(keep_parts(keep_gathered))
    return shape


def check_cp(cp: int, seq: int) -> None:
    """A context-parallel size megatron accepts for this sequence length."""
    if cp < 1:
        raise InputError(f"--context-parallel-size must be a positive integer, got {cp}")
    if cp > 1 and seq % (2 * cp):
        raise InputError(f"--seq-length {seq} does not split into 2·CP = {2 * cp} chunks "
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
                                   cp_lane=cp_lane(shape, gpus_per_node),
                                   mlp_chunks=shape.get("mlp_chunks", 1),
                                   keep_gathered=shape.get("keep_gathered") or False)
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
    if shape.get("mlp_chunks", 1) > 1:
        parts.append(f"MLP in {shape['mlp_chunks']} chunks")
    if shape.get("keep_gathered"):
        kept = shape["keep_gathered"]
        parts.append("gathered inputs kept" + ("" if kept is True else f" ({kept})"))
    parts += [f"seq {shape.get('seq')}", f"mbs {shape.get('mbs')}",
              "bf16" if shape.get("bf16") else "fp32", f"lane {shape.get('lane')}"]
    return ", ".join(parts)


# ---- cost sources ----------------------------------------------------------------------------

def load_costs(layer, shape: Optional[dict], table: Optional[str], cluster: Optional[str],
               force: bool, host_scale: float = 1.0) -> Tuple[object, dict]:
    """(CostTable, cost_source dict for the plan's meta). `host_scale` multiplies the
    table's comm host times (`--host-scale`: what a plan would do were a collective's own
    work on the issuing thread that share of what was measured; 0 is a GPU's ~10 µs launch,
    next to nothing)."""
    from dhelix.planner.costs import CostTable, TableError
    if host_scale != 1.0 and not (host_scale >= 0.0 and table):
        raise InputError(f"--host-scale {host_scale:g}: " + (
            "must be >= 0 (a share of the measured host times)" if table else
            "scales a measured table's comm host times; the analytical model has none "
            "(give --table)"))
    if table:
        try:
            t = CostTable.load(table, layer=layer, force=force, pairs="concurrent")
        except TableError as e:
            msg = str(e)
            if "signature" in msg and not force and shape is not None:
                msg += f" [this layer: {shape_str(shape)}; pass --force to use the table anyway]"
            raise TableError(msg)
        src = {"kind": "table", "path": os.path.abspath(table), "forced": bool(force)}
        if host_scale != 1.0:
            if not (t.host_f or t.host_b):
                raise InputError(f"--host-scale {host_scale:g}: {table} has no comm host "
                                 f"times (host_f/host_b) to scale: profile the layer again "
                                 f"with `dhelix profile`")
            t.host_f = {k: v * host_scale for k, v in t.host_f.items()}
            t.host_b = {k: v * host_scale for k, v in t.host_b.items()}
            src["host_scale"] = host_scale
        return t, src
    from dhelix.planner.costmodel import analytical_table, group_sizes_of, load_cluster
    if shape is None:
        raise InputError("the analytical cost model needs the layer's TP size and dtype; give "
                         "the shape flags (--config, --tensor-model-parallel-size, --bf16, ...)")
    path = resolve_cluster(cluster)
    c = load_cluster(path)
    name = c.get("name") or os.path.splitext(os.path.basename(path))[0]
    groups = group_sizes_of(shape, layer)
    t = analytical_table(layer, c, groups, dtype=dtype_name(shape["bf16"]), cluster_name=name)
    return t, {"kind": "cluster", "name": name, "path": os.path.abspath(path),
               "dtype": dtype_name(shape["bf16"]), "group_sizes": groups}


def cost_str(src: dict) -> str:
    if src.get("kind") == "table":
        return f"measured table {src.get('path')}" + (" (forced)" if src.get("forced") else "") \
            + (f", comm host times x {src['host_scale']:g}" if "host_scale" in src else "")
    return f"analytical, cluster {src.get('name')} ({src.get('path')})"


def plan_cost_source(plan_path: str, meta: dict, table: Optional[str],
                     cluster: Optional[str], force: bool):
    """(table, cluster, force): the ones given, else the one the plan was made with."""
    if not table and not cluster:
        src = meta.get("cost_source")
        if not isinstance(src, dict) or src.get("kind") not in ("table", "cluster"):
            raise InputError(f"{plan_path} does not record its cost source: give --table PATH "
                             f"or --cluster NAME")
        if src["kind"] == "table":
            table = src.get("path")
            force = force or bool(src.get("forced"))     # forced when planned
        else:
            cluster = src.get("path") if src.get("path") and os.path.isfile(src["path"]) \
                else src.get("name")
    return table, cluster, force


def plan_layer(plan_path: str, meta: dict, shape: Optional[dict] = None,
               gpus_per_node: int = DEFAULT_GPUS_PER_NODE):
    """(LayerOps, shape or None, where the layer came from) for a plan file: the `shape`
    given, else the layer its meta records (`dhelix plan` writes it), else its meta's
    shape."""
    from dhelix.planner.opspec import LayerOps
    from dhelix.planner.plan import PlanError
    meta_shape = meta.get("shape") if isinstance(meta.get("shape"), dict) else None
    if shape is not None:
        return layer_for_shape(shape, gpus_per_node), shape, "the shape flags"
    if isinstance(meta.get("layer"), dict):
        try:
            layer = LayerOps.from_json(meta["layer"])
        except (KeyError, TypeError) as e:
            raise PlanError(f"{plan_path}: meta.layer is not a layer description ({e}); "
                            f"give the shape flags (--config, ...)")
        return layer, meta_shape, "the plan file"
    if meta_shape:
        shape = dict(meta_shape)
        return layer_for_shape(shape, gpus_per_node), shape, "the plan's shape"
    raise InputError(f"{plan_path} does not record its layer (no meta.layer; not written by "
                     f"`dhelix plan`): give the shape flags --config, "
                     f"--tensor-model-parallel-size, --sequence-parallel, --seq-length, "
                     f"--micro-batch-size, --bf16, --lane, --context-parallel-size "
                     f"as for `dhelix plan`")


def readable_budget_error(e: BaseException) -> BaseException:
    """Add human units to the planner's 'memory budget ... cannot be met' message."""
    m = re.search(r"budget (\d+) bytes cannot be met: the lowest-peak plan peaks at (\d+) "
                  r"bytes, (\d+) bytes", str(e))
    if not m:
        return e
    budget, peak, over = (float(x) for x in m.groups())
    return type(e)(f"{e} [budget {fmt_bytes(budget)}, lowest possible peak {fmt_bytes(peak)}, "
                   f"{fmt_bytes(over)} too much; raise --memory-budget]")


# ---- planning --------------------------------------------------------------------------------

def make_plan(shape: dict, table: Optional[str] = None, cluster: Optional[str] = None,
              memory_budget: Optional[float] = None, backend: str = "auto",
              force: bool = False, rotate: bool = True, reorder: bool = True,
              min_gain: Optional[float] = None, host_scale: float = 1.0):
    """Plan one layer shape; returns (plan, layer_ops) with the layer, shape and cost
    source in the plan's meta (what `dhelix simulate` and `dhelix train` read back).
    With `rotate`, rotations of β's chain are tried for a co-step of the model's layers;
    with `reorder`, other orders of β's node (`dp.plan`); a plan predicted to gain less
    than `min_gain` (default `min_gain.MIN_GAIN`, not with a memory budget) over the trivial plan
    gives way to it. `host_scale`: `load_costs`'s."""
    from dhelix.models.config import load_model_config
    from dhelix.planner import dp
    from dhelix.planner.min_gain import MIN_GAIN
    layer = layer_for_shape(shape, node_size(cluster))
    costs, src = load_costs(layer, shape, table, cluster, force, host_scale)
    p = dp.plan(layer, costs, memory_budget_bytes=memory_budget, backend=backend, force=force,
                rotate=rotate, reorder=reorder,
                num_layers=load_model_config(shape["config"]).num_layers,
                min_gain=MIN_GAIN if min_gain is None else min_gain)
    p.meta["layer"] = layer.to_json()
    p.meta["shape"] = dict(shape)
    p.meta["cost_source"] = src
    return p, layer
