"""Helix checks run on every rank: small programs parallelized with PyTorch's own tensor
parallel API (DTensor), compiled with the Helix backend, against eager execution."""
import torch
import torch.distributed as dist

from dhelix.helix.models import build


def compiled_vs_eager(kind="block", tiles=2, reorder=True, batch=4, seq=8, bucketing=False,
                      link="paced:1gbit", budget=None, tol=1e-6):
    """The Helix-compiled program against eager execution on this rank: the output and
    every gradient (input and parameters; none missing or extra, nothing non-finite)
    within `tol` relative to the largest value (`compare.same_tensors`; tiling splits the
    batch, so a weight's grad adds the tiles' parts in another order). Raises
    `compare.Mismatch`; returns the worst difference and the report."""
    import torch._dynamo
    from torch.distributed.tensor import DTensor

    from dhelix.helix import HelixOptions, helix_backend
    torch._dynamo.reset()
    model, mesh = build(kind)
    g = torch.Generator().manual_seed(1)
    r, w = dist.get_rank(), dist.get_world_size()
    if kind == "block":
        full = torch.randn(batch, seq, 32, generator=g)

        def inp():      # this rank's sequence shard (SP), local: the plans wrap it
            x = full.chunk(w, dim=1)[r].contiguous().requires_grad_()
            return x, x
    else:
        ids = torch.randint(0, 64, (batch, seq), generator=g)

        def inp():
            return None, ids
    gout = None

    def run(m):
        nonlocal gout
        leaf, x = inp()
        y = m(x)
        y = y.to_local() if isinstance(y, DTensor) else y
        if gout is None:
            gout = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
        for p in m.parameters():
            p.grad = None
        y.backward(gout)
        grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
                 for n, p in m.named_parameters()}
        if leaf is not None:
            grads["input"] = leaf.grad.clone()
        return y.detach(), grads

    y0, g0 = run(model)
    backend = helix_backend(HelixOptions(tiles=tiles, reorder=reorder, bucketing=bucketing,
                                         link=link, memory_budget_bytes=budget))
    y1, g1 = run(torch.compile(model, backend=backend))
    from compare import same_tensors
    compiled = {"output": y1, **{n[len("_orig_mod."):] if n.startswith("_orig_mod.") else n: g
                                 for n, g in g1.items()}}
    worst = same_tensors(compiled, {"output": y0, **g0}, tol,
                         f"rank {r}: {kind} K={tiles} compiled vs eager:")
    return {"worst": worst, "report": backend.report.graphs}


def refusal():
    """A program that mixes batch elements (a mean over the batch): tiling must refuse
    it and name the op."""
    import torch._dynamo
    from dhelix.helix import HelixOptions, helix_backend
    from dhelix.helix.tiling import TilingError
    torch._dynamo.reset()
    lin = torch.nn.Linear(8, 8)

    def f(x):
        y = lin(x)
        return y - y.mean(dim=0, keepdim=True)
    c = torch.compile(f, backend=helix_backend(HelixOptions(tiles=2)))
    try:
        c(torch.randn(4, 8, requires_grad=True))
    except Exception as e:          # dynamo wraps backend errors
        cause = e
        while cause is not None and not isinstance(cause, TilingError):
            cause = cause.__cause__ or cause.__context__
        return str(cause) if cause is not None else f"other error: {e!r}"
    return "not refused"


def paced_all_gather():
    """One compiled functional all-gather on a 100 Mbit/s paced link: wall time vs the
    link model's."""
    import time

    import torch._dynamo
    import torch.distributed._functional_collectives as fc
    from torch._dynamo.backends.common import aot_autograd

    from dhelix.helix import paced
    from dhelix.planner.costmodel import collective_seconds
    torch._dynamo.reset()
    link = paced.GraphLink(100e6 / 8, 20e-6)
    paced.use_link(link)
    n = {}

    def comp(gm, ex):
        n["rerouted"] = paced.pace(gm)
        return gm

    def f(x):
        return fc.all_gather_tensor(x, 0, dist.group.WORLD) * 2

    c = torch.compile(f, backend=aot_autograd(fw_compiler=comp))
    x = torch.ones(1 << 19)                  # 2 MiB; gathered 4 MiB
    c(x)                                     # compile
    dist.barrier()
    t = time.perf_counter()
    y = c(x)
    wall = time.perf_counter() - t
    paced.use_link(None)
    assert y.numel() == 2 * x.numel()
    return {"rerouted": n["rerouted"], "wall": wall,
            "model": collective_seconds("all_gather", y.numel() * 4, 2, link.rate,
                                        link.latency)}


def simulated_vs_measured_memory(tiles=2, bucketing=False):
    """Peak bytes of each graph's intermediate values: DHelix's simulator (tensor
    lifetimes of the scheduled graph) against a node-by-node measurement."""
    import torch._dynamo

    from dhelix.helix import HelixOptions, helix_backend
    from dhelix.helix.backend import _Timed
    from dhelix.helix.simulate import simulate_graph
    torch._dynamo.reset()
    model, _ = build("block", hidden=64, heads=4)
    # at 5 ms per message bucketing merges (its buffers then count)
    backend = helix_backend(HelixOptions(tiles=tiles, bucketing=bucketing,
                                         link="paced:1gbit,5ms"))
    m = torch.compile(model, backend=backend)
    x = torch.randn(8, 16 // dist.get_world_size(), 64, requires_grad=True)
    m(x).sum().backward()                         # compile
    _Timed.memory = {}
    m(x).sum().backward()
    measured, _Timed.memory = _Timed.memory, None
    out = {}
    for g, timed in backend.report.modules.items():
        # unit durations: one thread runs the ops in order (memory needs only the order)
        unit = {n.name: 1e-3 for n in timed.gm.graph.nodes}
        sim = simulate_graph(timed.gm, unit, 1e9, 0.0, dist.get_world_size())
        out[g] = (sim.peak_bytes, measured[g])
    if bucketing:                                 # buckets were made, so they are measured
        assert all(g["buckets"]["chosen"] for g in backend.report.graphs)
    return out


def paced_by_name():
    """Code calling the functional collectives by name at run time (as Inductor's
    generated programs do) is paced inside `patched_ops`, and only there."""
    import time

    import torch.distributed._functional_collectives as fc  # noqa: F401 (registers ops)

    from dhelix.helix import paced
    from dhelix.planner.costmodel import collective_seconds
    link = paced.GraphLink(100e6 / 8, 20e-6)
    paced.use_link(link)
    x = torch.ones(1 << 19)
    group = dist.group.WORLD.group_name

    def run():
        dist.barrier()
        t = time.perf_counter()
        y = torch.ops._c10d_functional.all_gather_into_tensor.default(x, 2, group)
        y = torch.ops._c10d_functional.wait_tensor.default(y)
        return time.perf_counter() - t, y
    with paced.patched_ops():
        inside, y = run()
    outside, _ = run()
    paced.use_link(None)
    return {"inside": inside, "outside": outside,
            "model": collective_seconds("all_gather", y.numel() * 4, 2, link.rate,
                                        link.latency),
            "restored": type(torch.ops._c10d_functional.wait_tensor).__name__}


def dp_vs_exhaustive(kind, tiles, link, budget_share=None, batch=4, seq=8, layers=2):
    """Bucketing by the dynamic program and by trying every subset, on the same graphs:
    per graph, the DP's choice and the best fitting subset (makespan, peak), how many
    subsets each simulated. `budget_share` puts the budget that share of the way from
    the smallest simulated peak to the largest."""
    import torch._dynamo
    from dhelix.helix import HelixOptions, helix_backend
    from dhelix.helix.models import build as build_model

    def compile_once(search, budget=None):
        torch._dynamo.reset()
        model, _ = build_model(kind, layers=layers)
        be = helix_backend(HelixOptions(tiles=tiles, bucketing=True, link=link,
                                        memory_budget_bytes=budget, bucketing_search=search))
        c = torch.compile(model, backend=be)
        g = torch.Generator().manual_seed(1)
        if kind == "block":
            x = torch.randn(batch, seq // dist.get_world_size(), 32, generator=g,
                            requires_grad=True)
        else:
            x = torch.randint(0, 64, (batch, seq), generator=g)
        y = c(x)
        y = y.to_local() if hasattr(y, "to_local") else y
        y.sum().backward()
        return be.report.graphs
    budget = None
    exh = compile_once("exhaustive")
    if budget_share is not None:
        peaks = [x["peak_bytes"] for g in exh for x in g["buckets"]["tried"]]
        lo = max(min(x["peak_bytes"] for x in g["buckets"]["tried"]) for g in exh)
        budget = lo + budget_share * (max(peaks) - lo)
        exh = compile_once("exhaustive", budget)
    dp = compile_once("dp", budget)
    out = {}
    for e, d in zip(exh, dp):
        eb, db = e["buckets"], d["buckets"]
        fit = [x for x in eb["tried"] if x["fits"]]
        best = min(fit, key=lambda x: x["makespan_s"])
        pick = next(x for x in eb["tried"] if sorted(x["merged"]) == sorted(db["chosen"]))
        out[e["graph"]] = {"candidates": len(eb["candidates"]), "best_s": best["makespan_s"],
                           "dp_s": pick["makespan_s"], "dp_peak": pick["peak_bytes"],
                           "budget": budget, "dp_fits": pick["fits"],
                           "dp_simulated": len(db["tried"]), "exh_simulated": len(eb["tried"]),
                           "states": db["states"], "search": db["search"]}
    return out
