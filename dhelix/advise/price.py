"""What a layout costs: step time, tokens/s, MFU and memory per GPU, from the planner and
the simulators. Cost source, per layer shape: a profiled table (`dhelix profile`'s file,
`--overlap-table`) when one was made for exactly that shape (its LayerOps signature),
else the cluster file's analytical model; each `Prediction` names its source. With a
profiled table that carries `step_extras`, the head is the measured embedding + head +
loss per micro-batch, and the optimizer the measured step scaled to the rank's shard.

Time of one step (each term in `Prediction`):
  layers     PP = 1: megatron L·N·(f + b); DHelix L·(f + b + (N−1)·pair) — F(1) alone,
             N−1 paired steps, B(N) alone (`planner/whole_step.py`'s formula), where f, b
             are one layer's forward and backward alone and pair one planned layer pair
             (`LayerCosts.from_plan`: the layer simulator on the DP planner's plan);
             `--dhelix-pair-last` L·(2f + (N−2)·pair + tail), tail one layer of
             B(N−1) ∥ B(N) (`planner.tiles`).
             PP > 1: the pipeline simulator's makespan (1F1B, interleaved with two chunks
             per stage, the fold), the P2P message over the stage boundary's link.
             Full recomputation adds a layer forward to every backward (and pair).
  head       the output layer and loss of every micro-batch (forward, dgrad, wgrad
             GEMMs), on the last stage (the fold: stage 0), not overlapped.
  dp         the distributed optimizer's gradient reduce-scatter (fp32 main grads) and
             parameter all-gather (bf16) over DP×CP (experts: over their expert-DP
             group), less what overlaps the stage's last backward (the paired tail's
             two) / first forward.
  optimizer  Adam on the rank's shard: ~36 bytes of memory traffic per parameter at the
             cluster's memory bandwidth (0 when the file does not give one).

Memory per GPU (the busiest stage): bf16 weights, fp32 main grads, the optimizer's fp32
master weights and Adam moments sharded over DP (`dtype="fp32"`, as CPU runs train: fp32
weights and grads, Adam's two moments sharded, no master copy), the activations the schedule keeps at
its peak (the pipeline simulator's per-stage peak; PP = 1: L layers of one micro-batch
for megatron, L + 1 for DHelix's two strands, 2L with the paired tail; recomputation keeps layer inputs), the
layer step's transients, and the head's fp32 logits and inputs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, Sequence, Tuple

from dhelix.advise.layouts import Layout

GiB = 2 ** 30


@dataclass
class Prediction:
    layout: Layout
    step_s: float
    tokens_per_s: float
    mfu: float
    layers_s: float
    head_s: float
    dp_s: float
    optimizer_s: float
    memory: Dict[str, float] = field(default_factory=dict)    # bytes per GPU, by part
    cost_source: str = "analytical"     # or the profiled table's path

    @property
    def memory_bytes(self) -> float:
        return sum(self.memory.values())

    def to_json(self) -> dict:
        d = asdict(self)
        d["layout"] = self.layout.to_json()
        d["name"] = self.layout.name()
        d["memory_bytes"] = self.memory_bytes
        return d


def _lane(ranks_span: int, gpn: int) -> str:
    """A group of `ranks_span` consecutive ranks stays in a node while it fits one."""
    return "intra" if ranks_span <= gpn else "inter"


class Pricer:
    """Prices layouts of model `m` on `cluster` at `seq_length` × `global_batch_size`;
    a layer shape is planned once (memoised), a pipeline simulated once per shape."""

    def __init__(self, m, cluster: dict, seq_length: int, global_batch_size: int,
                 dtype: str = "bf16", tables: Sequence[str] = ()):
        from dhelix.planner.costmodel import gpus_per_node
        from dhelix.planner.costs import CostTable, TableError
        if dtype not in ("bf16", "fp32"):
            raise ValueError(f"dtype {dtype!r}: bf16 or fp32")
        # profiled tables by the layer signature they were measured for
        self.tables: Dict[str, Tuple[str, object]] = {}
        for path in tables:
            t = CostTable.load(path)
            if t.signature in self.tables:
                raise TableError(f"{path}: made for the same layer shape as "
                                 f"{self.tables[t.signature][0]}; give one table per shape")
            self.tables[t.signature] = (path, t)
        self.tables_used: Dict[str, int] = {}        # path -> layer shapes it priced
        self.m, self.cluster, self.dtype = m, cluster, dtype
        self.seq, self.gbs = seq_length, global_batch_size
        self.gpn = gpus_per_node(cluster)
        self._layers: Dict[tuple, tuple] = {}
        self._pipes: Dict[tuple, dict] = {}
        self._tails: Dict[tuple, float] = {}
        self._plans: Dict[tuple, object] = {}
        self.planned = 0                  # DP planner runs

    # ---- one layer shape ----------------------------------------------------------------
    def source(self, lo: Layout) -> str:
        """The cost source of the layout's layer shape: a profiled table's path or
        "analytical"."""
        return self.layer(lo)[4]

    def layer(self, lo: Layout) -> tuple:
        """(LayerOps, cost table, DHelix plan, LayerCosts, cost source) of the layout's
        layer shape. On the analytical model the DP planner runs once per (TP, CP, EP)
        group shape, at the smallest micro-batch size: every op's time scales with the
        micro-batch alike (latencies aside), so its plan is the plan of the larger
        micro-batches too, simulated on their own tables. A profiled table gets its own
        plan."""
        key = (lo.tp, lo.cp, lo.ep, lo.mbs)
        got = self._layers.get(key)
        if got is None:
            from dhelix.planner import dp
            from dhelix.planner.costmodel import analytical_table, group_sizes_of
            from dhelix.planner.pipeline import LayerCosts
            from dhelix.planner.plan import Plan
            from dhelix.planner.shapes import layer_ops_for_shape
            ops = layer_ops_for_shape(
                self.m, lo.tp, lo.tp > 1, self.seq, lo.mbs, bf16=self.dtype == "bf16",
                ep=lo.ep,
                ep_lane=_lane(lo.ep, self.gpn), cp=lo.cp,
                cp_lane=_lane(lo.tp * lo.cp, self.gpn))
            source, table = self.tables.get(ops.signature(), ("analytical", None))
            if table is None:
                table = analytical_table(
                    ops, self.cluster, group_sizes_of({"tp": lo.tp, "cp": lo.cp,
                                                       "ep": lo.ep}, ops), dtype=self.dtype)
                pkey = key[:3]
            else:
                table.check(ops, source, pairs="concurrent")
                self.tables_used[source] = self.tables_used.get(source, 0) + 1
                pkey = key + (source,)
            base = self._plans.get(pkey)
            if base is None:
                base = dp.plan(ops, table)
                self._plans[pkey] = base
                self.planned += 1
            plan = Plan(ops.signature(), [o.name for o in ops.forward],
                        [o.name for o in ops.backward], base.steps, dict(base.meta))
            got = (ops, table, plan, LayerCosts.from_plan(ops, plan, table), source)
            self._layers[key] = got
        return got

    def _costs(self, lo: Layout):
        """LayerCosts with megatron's kept activations (`kept_bytes`) and recomputation
        applied (module doc)."""
        from dataclasses import replace
        from dhelix.planner.recompute import input_bytes
        ops, _, _, lc, _ = self.layer(lo)
        lc = replace(lc, saved=kept_bytes(self.m, lo, self.seq, self._dt()) or lc.saved)
        if not lo.recompute:
            return lc
        return replace(lc, b=lc.b + lc.f, pair=lc.pair + lc.f, saved=input_bytes(ops),
                       transient=lc.transient + lc.saved)

    def _dt(self) -> int:
        return 2 if self.dtype == "bf16" else 4

    # ---- the pieces of a step -----------------------------------------------------------
    def _layers_s(self, lo: Layout, lc) -> Tuple[float, float]:
        """(the layers' time, the busiest stage's activation peak)."""
        L, N = self.m.num_layers, lo.microbatches
        if lo.pp == 1:
            if lo.schedule == "megatron":
                return L * N * (lc.f + lc.b), L * lc.saved + lc.transient
            if lo.schedule == "pair-last":      # two micro-batches held from F(2) on
                return L * (2 * lc.f + (N - 2) * lc.pair + self._tail(lo)), \
                    2 * L * lc.saved + lc.transient
            return L * (lc.f + lc.b + (N - 1) * lc.pair), (L + 1) * lc.saved + lc.transient
        key = (lo.tp, lo.cp, lo.ep, lo.mbs, lo.recompute, lo.pp, N,
               _lane(2 * lo.tp * lo.cp * lo.dp, self.gpn))
        res = self._pipes.get(key)
        if res is None:
            from dhelix.planner.pipeline import cluster_p2p_seconds
            act = self.seq // lo.cp // lo.tp * lo.mbs * self.m.hidden_size * \
                (2 if self.dtype == "bf16" else 4)
            lane = _lane(2 * lo.tp * lo.cp * lo.dp, self.gpn)
            res = _pipelines(lc, L, lo.pp, N, cluster_p2p_seconds(act, self.cluster, lane))
            self._pipes[key] = res
        r = res[{"1f1b": "megatron-1f1b", "interleaved": "megatron-interleaved",
                 "fold": "dhelix-fold"}[lo.schedule]]
        return r[0], r[1] + lc.transient

    def _tail(self, lo: Layout) -> float:
        """One layer of `--dhelix-pair-last`'s B(N−1) ∥ B(N): the two backward walks'
        ops tiled on the lanes (`planner.tiles`, as `whole_step` prices it)."""
        key = (lo.tp, lo.cp, lo.ep, lo.mbs)
        if key not in self._tails:
            from dhelix.planner.tiles import tiles_makespan
            ops, table = self.layer(lo)[:2]
            self._tails[key] = tiles_makespan(ops, table, "bwd", share=1.0)
        return self._tails[key]

    def _head(self, lo: Layout) -> Tuple[float, float]:
        """(output layer + loss seconds per micro-batch, what it keeps: the fp32 logits,
        the final norm's and the output layer's inputs)."""
        from dhelix.models.params import head_gemm_flops
        tokens = self.seq // lo.cp * lo.mbs
        flops = 3 * head_gemm_flops(self.m, tokens, lo.tp)
        t = flops / (self._peak() * float(self.cluster.get("achieved_fraction", 1.0)))
        local = tokens // (lo.tp if lo.tp > 1 else 1) * self.m.hidden_size * self._dt()
        return t, tokens * self.m.vocab_size / lo.tp * 4.0 + 2 * local

    def _stage_params(self, lo: Layout) -> Dict[str, float]:
        """Parameters on the busiest stage's GPU: dense (DP-reduced) and experts."""
        from dhelix.models.params import param_classes
        c = param_classes(self.m, lo.tp, lo.ep)
        per = self.m.num_layers // lo.pp
        ends = c["embedding"] + c["output"] + c["norm"]     # PP = 1, or the fold's stage 0
        if lo.pp > 1 and lo.schedule != "fold":
            ends = max(c["embedding"], c["output"] + c["norm"])
        return {"dense": per * c["layer"] + ends, "experts": per * c["experts"]}

    def _dp(self, lo: Layout, params: Dict[str, float], lc) -> float:
        from dhelix.planner.costmodel import collective_seconds, nic_share

        def coll(kind, nbytes, n):
            if n < 2 or not nbytes:
                return 0.0
            # DP (with CP) steps over TP×CP ranks: inside a node while TP·CP·DP fits one;
            # across nodes, the node's rings (one per TP·CP rank) share its NICs
            lane = _lane(lo.tp * lo.cp * n, self.gpn)
            ln = self.cluster[f"{lane}_node"]
            bw = float(ln["bandwidth_GBps"]) * 1e9 * float(ln.get("efficiency", 1.0))
            if lane == "inter":
                bw /= nic_share(self.cluster, self.gpn, max(1, self.gpn // (lo.tp * lo.cp)))
            return collective_seconds(kind, nbytes, n, bw, float(ln.get("latency_us", 0))
                                      * 1e-6)
        n_dense, n_exp = lo.dp * lo.cp, lo.tp * lo.cp * lo.dp // lo.ep
        rs = coll("reduce_scatter", params["dense"] * 4, n_dense) + \
            coll("reduce_scatter", params["experts"] * 4, n_exp)
        ag = coll("all_gather", params["dense"] * 2, n_dense) + \
            coll("all_gather", params["experts"] * 2, n_exp)
        per = self.m.num_layers // lo.pp
        # a bucket reduces once the last backward has passed its layer: behind B(N) alone,
        # or (the paired tail) behind B(N−1) ∥ B(N)
        behind = self._tail(lo) if lo.schedule == "pair-last" else lc.b
        return max(0.0, rs - per * behind) + max(0.0, ag - per * lc.f)

    def _shard(self, lo: Layout, params: Dict[str, float]) -> float:
        """Parameters in the rank's distributed-optimizer shard."""
        return params["dense"] / (lo.dp * lo.cp) + \
            params["experts"] / max(1, lo.tp * lo.cp * lo.dp // lo.ep)

    def _measured_extras(self, lo: Layout, shard: float):
        """(head seconds per micro-batch, optimizer seconds) from the profiled table's
        step_extras, or None. The optimizer step was timed over the whole model of
        `num_layers` layers at the table's TP size (`dhelix profile` does not shard it):
        scaled by the parameters of the rank's shard."""
        _, table, _, _, source = self.layer(lo)
        ex = getattr(table, "step_extras", None)
        if source == "analytical" or ex is None:
            return None
        from dhelix.models.params import param_classes
        c = param_classes(self.m, lo.tp, lo.ep)
        whole = ex.num_layers * (c["layer"] + c["experts"]) + c["embedding"] + \
            c["output"] + c["norm"]
        return (ex.per_microbatch(),
                (ex.optimizer_s + ex.zero_grad_s) * shard / whole)

    def price(self, lo: Layout) -> Prediction:
        lc = self._costs(lo)
        layers_s, act = self._layers_s(lo, lc)
        head1, logits = self._head(lo)
        params = self._stage_params(lo)
        dp_s = self._dp(lo, params, lc)
        shard = self._shard(lo, params)
        bw = self.cluster.get("memory_bandwidth_GBps")
        opt_s = shard * 36 / (float(bw) * 1e9) if bw else 0.0
        measured = self._measured_extras(lo, shard)
        if measured is not None:
            head1, opt_s = measured
        head_s = lo.microbatches * head1
        step = layers_s + head_s + dp_s + opt_s
        tokens = self.gbs * self.seq
        n_all = params["dense"] + params["experts"]
        w, opt = (2, 12) if self.dtype == "bf16" else (4, 8)
        memory = {"weights": n_all * w, "grads": n_all * 4, "optimizer": shard * opt,
                  "activations": act, "logits": logits}
        return Prediction(lo, step, tokens / step,
                          self.model_flops() / (self.gpus(lo) * self._peak() * step),
                          layers_s, head_s, dp_s, opt_s, memory, self.source(lo))

    # ---- MFU ----------------------------------------------------------------------------
    def _peak(self) -> float:
        return float(self.cluster["peak_flops"][self.dtype])

    @staticmethod
    def gpus(lo: Layout) -> int:
        return lo.tp * lo.cp * lo.pp * lo.dp

    def model_flops(self) -> float:
        """One step's model FLOPs: 6 × active parameters × tokens plus attention's
        12 × layers × hidden × sequence per token (recomputation not counted)."""
        m = self.m
        from dhelix.models.params import param_classes
        c = param_classes(m, 1, 1)
        active = c["layer"] + (c["experts"] * m.moe_router_topk / m.num_experts
                               if m.num_experts else 0)
        per_token = 6 * (m.num_layers * active + c["output"]) + \
            12 * m.num_layers * m.hidden_size * self.seq
        return per_token * self.gbs * self.seq


def kept_bytes(m, lo: Layout, seq: int, dt: int) -> float:
    """What one dense layer of megatron's GPT (DHelix's spec: SDPA core attention, the
    one-node norm, megatron's linears, SwiGLU) keeps for its backward per micro-batch, by
    what its autograd saves (measured on this machine: `tests/test_advise.py`): each norm's
    input and fp32 inverse RMS; the QKV and FC1 inputs (sequence-parallel shards); the
    QKV output (V's storage), the rotated Q and K, the attention output and its fp32
    log-sum-exp; the projection's input; FC1's output and three FFN-wide tensors of the
    activation (SwiGLU's SiLU output and product; GELU's two). 0 where this is not known
    (MoE, context parallel): the planner's estimate is used."""
    if m.num_experts or lo.cp > 1:
        return 0.0
    tp = lo.tp
    h = m.hidden_size
    hn = getattr(m, "kv_channels", None) or h // m.num_attention_heads
    ap, kvp = m.num_attention_heads * hn, m.kv_groups * hn
    qkv = ap + 2 * kvp
    f, f1 = m.ffn_hidden_size, m.ffn_hidden_size * (2 if m.activation == "swiglu" else 1)
    T = seq * lo.mbs
    Tl = T // tp if tp > 1 else T
    wide = (qkv + ap + kvp + ap + ap + f1 + 3 * f) / tp
    return float(dt * (4 * Tl * h + T * wide) + 4 * (2 * Tl + T * m.num_attention_heads / tp))


def _pipelines(lc, L: int, pp: int, N: int, p2p: float) -> Dict[str, tuple]:
    """schedule -> (makespan, the busiest stage's activation peak) from the pipeline
    simulator. Past its warm-up a schedule repeats every PP micro-batches, so a long step
    is simulated at two short lengths (multiples of PP) and extended along the line
    through them: exact for the periodic part, and the peak is reached before it."""
    from dhelix.planner.pipeline import simulate_pipeline
    short = 4 * pp
    if N <= short + pp:        # (interleaved needs a multiple of PP micro-batches)
        got = simulate_pipeline(lc, L, pp, N, p2p,
                                vpp_layers=L // (2 * pp) if N % pp == 0 else None)
        return {k: (r.makespan, max(r.peak_bytes)) for k, r in got.items()}
    a = simulate_pipeline(lc, L, pp, short, p2p, vpp_layers=L // (2 * pp))
    b = simulate_pipeline(lc, L, pp, short + pp, p2p, vpp_layers=L // (2 * pp))
    return {k: (a[k].makespan + (b[k].makespan - a[k].makespan) / pp * (N - short),
                max(max(a[k].peak_bytes), max(b[k].peak_bytes))) for k in a
            if N % pp == 0 or k != "megatron-interleaved"}


def fits(p: Prediction, memory_per_gpu_GiB: float) -> bool:
    """Within 90% of the GPU's memory (the rest: the CUDA context, NCCL's buffers, the
    allocator's fragmentation)."""
    return p.memory_bytes <= 0.9 * memory_per_gpu_GiB * GiB

