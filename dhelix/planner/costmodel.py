"""Analytical cost model (DESIGN §1.5): op costs from a cluster file, for when no measured
table exists (planning for a cluster you do not have).

Cluster file (YAML, see configs/clusters/*.yaml)::

    name: a800
    peak_flops: {fp32: 19.5e12, bf16: 312e12}   # FLOP/s per GPU
    achieved_fraction: 0.6                      # fraction of peak a layer's kernels reach
    gpus_per_node: 8                            # optional, default 8: which groups
                                                # fit in a node (CP, EP lanes)
    nics_per_node: 1                            # optional, default 1: rings that cross
                                                # nodes share them (`nic_share`)
    intra_node: {bandwidth_GBps: 200, latency_us: 5}
    inter_node: {bandwidth_GBps: 25,  latency_us: 10}
    comm_compute_slowdown: 0.1                  # optional, default 0

Conventions
* ``OpSpec.flops`` are this rank's FLOPs; compute time = flops / (peak[dtype] * fraction).
* ``OpSpec.comm_bytes`` is the size in bytes of the whole collective buffer (NCCL's "size":
  the all-gather's output, the reduce-scatter's input, the all-reduce's buffer, the
  all-to-all's send buffer, the P2P message).  Ring formulas with group size n, bus
  bandwidth ``bw`` (bytes/s per direction per GPU) and per-hop latency ``lat``:
  all_gather / reduce_scatter / all_to_all: (n-1)/n * bytes / bw + (n-1) * lat;
  all_reduce: 2 * that; send/recv/p2p/broadcast: bytes / bw + lat.
* ``bandwidth_GBps`` is in 1e9 bytes/s; a lane's optional ``efficiency`` multiplies it.
  ``inter_node.bandwidth_GBps`` is one NIC's.
* Pair times: compute + comm: max(T_c * (1 + slowdown), T_m); compute + compute: sum;
  comm + comm on different lanes: max; on the same lane: sum.
"""
from __future__ import annotations

from typing import Dict, Optional

from dhelix.planner.costs import CostTable
from dhelix.planner.opspec import COMM, COMPUTE, LayerOps, OpSpec


DEFAULT_GPUS_PER_NODE = 8        # every cluster file here (HGX boards)


class ClusterError(ValueError):
    """A cluster description that lacks a field or holds a nonsensical value."""


_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                  "float": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16",
                  "torch.float32": "fp32"}


def load_cluster(path: str) -> dict:
    """Read a cluster YAML file and check it (raises ClusterError naming the file)."""
    import yaml
    try:
        with open(path) as f:
            d = yaml.safe_load(f)
    except FileNotFoundError:
        raise ClusterError(f"cluster file not found: {path}")
    except yaml.YAMLError as e:
        raise ClusterError(f"{path}: not valid YAML ({e})")
    d = _numbers(d)
    check_cluster(d, source=path)
    return d


def _numbers(x):
    """YAML 1.1 reads '1e12' (no exponent sign) as a string; accept it as a number."""
    if isinstance(x, dict):
        return {k: _numbers(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_numbers(v) for v in x]
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return x
    return x


def check_cluster(c: dict, source: str = "<cluster>") -> None:
    if not isinstance(c, dict):
        raise ClusterError(f"{source}: a cluster description is a mapping")
    pf = c.get("peak_flops")
    if not isinstance(pf, dict) or not pf:
        raise ClusterError(f"{source}: missing field 'peak_flops' ({{fp32: ..., bf16: ...}})")
    for k, v in pf.items():
        _pos(v, source, f"peak_flops.{k}")
    fr = c.get("achieved_fraction", 1.0)
    _pos(fr, source, "achieved_fraction")
    if fr > 1.0:
        raise ClusterError(f"{source}: achieved_fraction {fr} is above 1")
    for lane in ("intra_node", "inter_node"):
        l = c.get(lane)
        if not isinstance(l, dict):
            raise ClusterError(f"{source}: missing field '{lane}' "
                               f"({{bandwidth_GBps: ..., latency_us: ...}})")
        _pos(l.get("bandwidth_GBps"), source, f"{lane}.bandwidth_GBps")
        lat = l.get("latency_us", 0.0)
        if not isinstance(lat, (int, float)) or lat < 0:
            raise ClusterError(f"{source}: {lane}.latency_us must be a number >= 0")
        eff = l.get("efficiency", 1.0)
        _pos(eff, source, f"{lane}.efficiency")
    sd = c.get("comm_compute_slowdown", 0.0)
    if not isinstance(sd, (int, float)) or sd < 0:
        raise ClusterError(f"{source}: comm_compute_slowdown must be a number >= 0")
    for key, default in (("gpus_per_node", DEFAULT_GPUS_PER_NODE), ("nics_per_node", 1)):
        g = c.get(key, default)
        if isinstance(g, bool) or not isinstance(g, (int, float)) or g < 1 or g != int(g):
            raise ClusterError(f"{source}: {key} must be a positive integer, got {g!r}")


def nic_share(cluster: dict, on_node: int, members: int) -> float:
    """How many rings share each NIC when every rank of a node (`on_node` of them) is in
    a group of one kind that crosses nodes with `members` ranks on this node (megatron's
    DP, CP, EP and PP groups tile the node this way): the node's rings, `on_node /
    members`, over its `nics_per_node` (1 if not given), at least 1. A ring's bandwidth
    across nodes is the NIC's divided by this."""
    nics = int(cluster.get("nics_per_node", 1))
    return max(1.0, on_node / max(1, members) / nics)


def gpus_per_node(cluster: dict) -> int:
    """Ranks per node (megatron numbers a node's GPUs consecutively); 8 if not given."""
    return int(cluster.get("gpus_per_node", DEFAULT_GPUS_PER_NODE))


def _pos(v, source, what):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ClusterError(f"{source}: field '{what}' must be a positive number, got {v!r}")


def _dtype_key(dtype: str) -> str:
    d = str(dtype).lower()
    return _DTYPE_ALIASES.get(d, d)


def compute_time(op: OpSpec, cluster: dict, dtype: str = "bf16") -> float:
    key = _dtype_key(dtype)
    peaks = cluster["peak_flops"]
    if key not in peaks:
        raise ClusterError(f"cluster has no peak_flops entry for dtype '{key}' "
                           f"(has: {', '.join(sorted(peaks))})")
    return float(op.flops) / (float(peaks[key]) * float(cluster.get("achieved_fraction", 1.0)))


def comm_time(op: OpSpec, cluster: dict, n: int) -> float:
    lane = cluster["inter_node" if op.lane == "inter" else "intra_node"]
    bw = float(lane["bandwidth_GBps"]) * 1e9 * float(lane.get("efficiency", 1.0))
    lat = float(lane.get("latency_us", 0.0)) * 1e-6
    return collective_seconds(op.collective or "", float(op.comm_bytes), n, bw, lat)


P2P = ("send", "recv", "p2p", "send_recv", "sendrecv", "broadcast")


def collective_seconds(collective: str, nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring-algorithm time of one collective: `nbytes` is the whole buffer (NCCL's
    "size"), `n` the group size, `bw` bytes/s per direction per rank, `lat` seconds per
    hop. The one formula behind the analytical model and the paced link."""
    coll = collective.lower()
    if n <= 1 and coll not in P2P:
        return 0.0
    if coll in ("all_gather", "allgather", "reduce_scatter", "reducescatter",
                "all_to_all", "alltoall"):
        return (n - 1) / n * nbytes / bw + (n - 1) * lat
    if coll in ("all_reduce", "allreduce"):
        return 2.0 * ((n - 1) / n * nbytes / bw + (n - 1) * lat)
    # send / recv / p2p / broadcast / unknown: one transfer of the whole message
    return nbytes / bw + lat


def op_time(op: OpSpec, cluster: dict, group_sizes: Dict[str, int], dtype: str = "bf16") -> float:
    if op.kind == COMM:
        if op.group not in group_sizes:
            raise ClusterError(f"comm op '{op.name}' uses group '{op.group}' whose size is not "
                               f"given (group_sizes has: {', '.join(sorted(group_sizes)) or '-'})")
        return comm_time(op, cluster, int(group_sizes[op.group]))
    return compute_time(op, cluster, dtype)


def pair_time(f: OpSpec, tf: float, b: OpSpec, tb: float, slowdown: float) -> float:
    if f.kind == COMPUTE and b.kind == COMPUTE:
        return tf + tb
    if f.kind == COMM and b.kind == COMM:
        return tf + tb if f.lane == b.lane else max(tf, tb)
    tc, tm = (tf, tb) if f.kind == COMPUTE else (tb, tf)
    return max(tc * (1.0 + slowdown), tm)


def group_sizes_of(shape: dict, layer: LayerOps) -> Dict[str, int]:
    """The sizes of the process groups `layer`'s comm ops name, from a shape dict: tp
    always, ep when the layer has all-to-alls (a MoE layer; 1 if the shape has no EP), cp
    when it has the ring exchanges of context parallel."""
    groups = {"tp": int(shape["tp"])}
    named = {o.group for o in list(layer.forward) + list(layer.backward)}
    for g in ("ep", "cp"):
        if g in named:
            groups[g] = int(shape.get(g, 1))
    return groups


def analytical_table(layer: LayerOps, cluster: dict, group_sizes: Dict[str, int],
                     dtype: str = "bf16", cluster_name: Optional[str] = None) -> CostTable:
    """A full CostTable for ``layer`` from a cluster description (see module doc)."""
    check_cluster(cluster)
    sd = float(cluster.get("comm_compute_slowdown", 0.0))
    t = CostTable.empty(layer, provenance={
        "source": "analytical",
        "cluster": cluster_name or cluster.get("name", "?"),
        "dtype": _dtype_key(dtype),
        "group_sizes": dict(group_sizes),
        "achieved_fraction": cluster.get("achieved_fraction", 1.0),
        "comm_compute_slowdown": sd,
    })
    for o in layer.forward:
        t.alone_f[o.name] = op_time(o, cluster, group_sizes, dtype)
    for o in layer.backward:
        t.alone_b[o.name] = op_time(o, cluster, group_sizes, dtype)
    for f in layer.forward:
        for b in layer.backward:
            t.pair[(f.name, b.name)] = pair_time(f, t.alone_f[f.name], b, t.alone_b[b.name], sd)
    return t
