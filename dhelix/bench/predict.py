"""What the simulators predict for a bench's runs, from the costs the planned runs used
(the profiled table, or the analytical model of this machine): the layer's speedup, the
whole step (`planner.whole_step`) and the pipeline schedules (`planner.pipeline`)."""
from __future__ import annotations

from typing import Dict

from dhelix.links import parse_link


def layer_costs(a, cfg, cost_source, chunks=None, keep=False):
    """The bench's layer (LayerOps) and the costs its planned runs used: the profiled
    table, or the analytical model of this machine. `chunks`: the layer's MLP chunks
    (default: the planned runs' for a table that is theirs, `--dhelix-mlp-chunks`);
    `keep`: the layer that keeps its gathered inputs (`--dhelix-keep-gathered`)."""
    from dhelix.planner.problem import layer_for_shape, load_costs
    tp = a.tensor_model_parallel_size
    if chunks is None:
        chunks = getattr(a, "dhelix_mlp_chunks", 1) if cost_source.endswith("-chunks.json") \
            else 1
    shape = {"config": cfg, "tp": tp, "sp": tp > 1, "seq": a.seq_length,
             "mbs": a.micro_batch_size, "bf16": False, "lane": "intra",
             "ep": a.expert_model_parallel_size, "cp": a.context_parallel_size,
             "mlp_chunks": chunks, "keep_gathered": keep}
    layer = layer_for_shape(shape)
    table = cost_source if cost_source.endswith(".json") else None
    costs, _ = load_costs(layer, shape, table, None if table else cost_source, False)
    return layer, costs


def layer_prediction(a, cfg, cost_source) -> float:
    """The simulator's layer speedup (trivial plan / planned) from the costs the planned
    run used."""
    from dhelix.planner import dp
    from dhelix.planner.min_gain import MIN_GAIN
    layer, costs = layer_costs(a, cfg, cost_source)
    meta = dp.plan(layer, costs, rotate=True, reorder=True, min_gain=MIN_GAIN).meta
    return meta["trivial_predicted_s"] / meta["predicted_s"]


def planned_step(a, cfg, cost_source, keep=False, halves=False, plan=None):
    """The whole step the simulator predicts for the planned run on the profiled table
    `cost_source` (its layer: `layer_costs`, keeping the gathers with `keep`; B(N) as two
    batch halves with `halves`, `planner.tiles`), or None where the table has no
    extras. `plan`: the planner's plan for that layer and table, if already made."""
    from dhelix.models.config import load_model_config
    from dhelix.planner import dp
    from dhelix.planner.min_gain import MIN_GAIN
    from dhelix.planner.whole_step import halves_alone, plan_steps_alone, simulate_step
    layer, costs = layer_costs(a, cfg, cost_source, keep=keep)
    if costs.step_extras is None:
        return None
    L, N = load_model_config(cfg).num_layers, a.num_microbatches
    plan = plan or dp.plan(layer, costs, rotate=True, reorder=True, num_layers=L,
                           min_gain=MIN_GAIN)      # what the run plans
    return simulate_step(layer, plan, costs, L, N, costs.step_extras,
                         alone=halves_alone(layer, costs) if halves else plan_steps_alone)


def step_floor(a, cfg, cost_source, keep=False):
    """The thread floor of the bench's whole step (`planner.whole_step.thread_floor`: every
    compute op's in-step time and every comm op's host work, nothing waited for, plus the
    extras) on the profiled table `cost_source`, for its layer (keeping the gathers with
    `keep`); None for the analytical model or a table without extras."""
    if not cost_source.endswith(".json"):
        return None
    from dhelix.models.config import load_model_config
    from dhelix.planner.whole_step import thread_floor
    layer, costs = layer_costs(a, cfg, cost_source, keep=keep)
    if costs.step_extras is None:
        return None
    return thread_floor(layer, costs, load_model_config(cfg).num_layers, a.num_microbatches,
                        costs.step_extras).step_s


def step_predictions(a, cfg, cost_source) -> Dict[str, object]:
    """method -> the whole step the simulator predicts for it (`planner.whole_step`), from
    the profiled table: its layer costs and its step extras (embedding, loss, optimizer,
    finalize, measured with it). Empty for the analytical model or a table without
    extras."""
    if not cost_source.endswith(".json"):
        return {}
    from dhelix.models.config import load_model_config
    from dhelix.planner.plan import trivial_plan
    from dhelix.planner.whole_step import simulate_megatron_step, simulate_step
    layer, costs = layer_costs(a, cfg, cost_source)
    ex = costs.step_extras
    if ex is None:
        return {}
    from dhelix.planner import dp
    from dhelix.planner.min_gain import MIN_GAIN
    L, N = load_model_config(cfg).num_layers, a.num_microbatches
    plan = dp.plan(layer, costs, rotate=True, reorder=True, num_layers=L,
                   min_gain=MIN_GAIN)                            # planned once
    return {"megatron": simulate_megatron_step(layer, costs, L, N, ex),
            "dhelix-trivial": simulate_step(layer, trivial_plan(layer), costs, L, N, ex),
            "dhelix-plan": planned_step(a, cfg, cost_source, plan=plan),
            "dhelix-halves": planned_step(a, cfg, cost_source, halves=True, plan=plan)}


def pp_simulate(a, cfg, link, cost_source) -> dict:
    from dhelix.planner.pipeline import LayerCosts, simulate_pipeline
    from dhelix.models.config import load_model_config
    from dhelix.planner import dp
    from dhelix.planner.min_gain import MIN_GAIN
    tp = a.tensor_model_parallel_size
    layer, costs = layer_costs(a, cfg, cost_source)
    lc = LayerCosts.from_plan(layer, dp.plan(layer, costs, rotate=True, reorder=True,
                                             min_gain=MIN_GAIN), costs)
    m = load_model_config(cfg)
    G = a.pipeline_model_parallel_size
    lk = parse_link(link)
    nbytes = a.seq_length // tp * a.micro_batch_size * m.hidden_size * 4
    p2p = 0.0 if lk.kind == "none" else \
        nbytes / (lk.rate_Bps / (2 if lk.kind == "tbf" else 1)) + lk.latency_s
    return simulate_pipeline(lc, m.num_layers, G, a.num_microbatches, p2p,
                             vpp_layers=m.num_layers // (2 * G))
