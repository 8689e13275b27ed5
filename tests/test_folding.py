"""The U-folded pipeline: placement, order, training like megatron's 1F1B, checkpoints
across layouts, refusals, a dead stage."""
import pytest

from dhelix.planner.pipeline_order import folded_order
from dhelix.folding.placement import FoldError, fold, megatron_pipeline
from dhelix.testing import RankError, run_ranks
from compare import merge_stages, same_numbers, same_runs
from train_fns import train_result

STEPS = 10


def test_fold_placement():
    rows = fold(8, 2)
    assert [c.layers for c in rows[0]] == [(0, 1), (6, 7)]
    assert [c.layers for c in rows[1]] == [(2, 3), (4, 5)]
    assert rows[0][0].pre_process and rows[0][1].post_process      # embedding, loss: stage 0
    assert not rows[1][0].pre_process and not rows[1][1].post_process
    assert sorted(l for r in fold(24, 4) for c in r for l in c.layers) == list(range(24))
    with pytest.raises(FoldError, match="6 layers do not fold evenly over "
                                        "--pipeline-model-parallel-size 2"):
        fold(6, 2)
    assert [c.layers for c in megatron_pipeline(8, 2, 2)[1]] == [(2, 3), (6, 7)]


@pytest.mark.parametrize("G,N", [(2, 3), (3, 4), (2, 4), (2, 8), (3, 6), (4, 8), (4, 16)])
def test_order_is_complete_and_respects_dependencies(G, N):
    o = folded_order(G, N)
    end = {}
    for g, steps in enumerate(o.steps):
        items = [it for s in steps for it in (s.fwd, s.bwd) if it]
        assert sorted(items) == sorted((k, c, m) for k in "FB" for c in (0, 1)
                                       for m in range(N)), g
        for s in steps:
            assert not (s.fwd and s.bwd and s.fwd[2] == s.bwd[2])   # two micro-batches
            for it in (s.fwd, s.bwd):
                if it:
                    end[(g, it)] = (s.start, s.end)
    for (g, (k, c, m)), (start, _) in end.items():
        deps = []
        if k == "F" and c == 0 and g > 0:
            deps = [(g - 1, ("F", 0, m))]
        elif k == "F" and c == 1:
            deps = [(g + 1, ("F", 1, m)) if g < G - 1 else (g, ("F", 0, m))]
        elif k == "B" and c == 1:
            deps = [(g, ("F", 1, m))] + ([(g - 1, ("B", 1, m))] if g else [])
        elif k == "B":
            deps = [(g, ("F", 0, m)), (g + 1, ("B", 0, m)) if g < G - 1 else (g, ("B", 1, m))]
        for d in deps:
            assert end[d][1] <= start, (g, (k, c, m), d)
    assert 0.0 <= o.bubble() < 0.5
    if N >= 2 * G:            # the V-shaped phases: every stage co-executes, N-2G+g+1 ≥ 1
        for g in range(G):
            assert sum(1 for s in o.steps[g] if s.fwd and s.bwd) >= 2 * (N - 2 * G + g + 1)
    # between steps a stage holds at most 2G chunk activations (1F1B's first stage: G
    # micro-batches × 2 halves); inside a paired step the backward frees what the forward
    # allocates, layer by layer
    for steps in o.steps:
        live = 0
        for s in steps:
            live += (1 if s.fwd else 0) - (1 if s.bwd else 0)
            assert live <= 2 * G


# The fold vs megatron's 1F1B: every loss, every step's gradient checksum of every
# parameter and the final weights', merged over the stages by global name (the two place
# layers on different stages), on every TP position, within 1e-5 relative. Not bit for
# bit: with tied embeddings the embedding's gradient is the sum of the input and output
# parts, which 1F1B adds across stages (an all-reduce) and the fold adds on stage 0 in
# another order; and the loss stage's per-micro-batch losses are averaged in another
# order. The untied cases meet the same bound. The final weights, after Adam's steps,
# within 1e-3: Adam moves an entry whose grad is near zero by about the learning rate,
# in whichever direction the rounding gave it (the tied case's reaches ~6e-5).
FOLD_TOL = 1e-5
FOLD_WEIGHT_TOL = 1e-3


def same_fold(dh, base):
    got, want = merge_stages(dh), merge_stages(base)
    worst = same_runs(got, want, FOLD_TOL, keys=("losses", "grad_checksums"))
    same_runs(got, want, FOLD_WEIGHT_TOL, keys=("weight_checksums",))
    return worst


def _runs(world, nmb, tp=1, tmp=None, config="tiny-llama4", pp=2, steps=STEPS, plan=None,
          **kw):
    """megatron 1F1B and the fold from the same initial weights (a PP=1 checkpoint); the
    fold with the plan file `plan` if given."""
    d = str(tmp)
    common = dict(config=config, tensor_model_parallel_size=tp,
                  sequence_parallel=tp > 1, micro_batch_size=1)
    run_ranks(train_result, tp, timeout=300, train_iters=0, save=d, **common)
    kw = dict(common, train_iters=steps, load=d, finetune=True, global_batch_size=nmb * world // (pp * tp),
              pipeline_model_parallel_size=pp, checksums=True, **kw)
    base = run_ranks(train_result, world, timeout=600, **kw)
    opts = {"enabled": True, "fold": True, **({"plan": plan} if plan else {})}
    dh = run_ranks(train_result, world, timeout=600, dhelix=opts, **kw)
    return base, dh


@pytest.mark.parametrize("world,tp,nmb,config", [
    (2, 1, 4, "tiny-llama4"), (2, 1, 8, "tiny-llama4"), (4, 2, 4, "tiny-llama4"),
    (4, 2, 8, "tiny-llama4"), (2, 1, 4, "tiny4")],
    ids=["pp2-mb4", "pp2-mb8", "pp2-tp2sp-mb4", "pp2-tp2sp-mb8", "pp2-mb4-tied"])
def test_fold_trains_like_megatron_1f1b(tmp_path, world, tp, nmb, config):
    """Tied embeddings (tiny4): megatron's 1F1B keeps a copy of the embedding on the last
    stage, synchronised by an all-reduce (compat (e) on CPU); the fold has both on stage 0."""
    base, dh = _runs(world, nmb, tp, tmp_path, config)
    assert base[0]["config"]["schedule"] == "megatron"
    assert dh[0]["config"]["schedule"] == "dhelix-fold"
    assert dh[0]["config"]["num_microbatches"] == nmb
    assert same_fold(dh, base) <= FOLD_TOL
    assert len(dh[0]["peak_memory_bytes_per_stage"]) == 2


def test_fold_with_a_rotated_plan(tmp_path):
    """The fold with a random plan whose β chain is rotated (`Plan.rotation`): each
    co-step walks its backward chunk's nodes across layer steps. TP=2+SP × PP=2, 8
    micro-batches, at the fold's tolerances."""
    from train_fns import write_random_plan
    plan = str(tmp_path / "rotated.json")
    run_ranks(write_random_plan, 2, plan, "tiny-llama4", 11, 1, 4, timeout=200)
    (tmp_path / "ckpt").mkdir()
    base, dh = _runs(4, 8, 2, tmp_path / "ckpt", "tiny-llama4", plan=plan)
    assert dh[0]["config"]["schedule"] == "dhelix-fold"
    assert same_fold(dh, base) <= FOLD_TOL


@pytest.mark.parametrize("G,N", [(2, 2), (4, 4), (4, 8), (4, 16)])
def test_fold_trains_like_megatron_1f1b_at_every_depth(tmp_path, G, N):
    """The fold's P2P batches at G = 2, 4 with N = G, 2G, 4G micro-batches (with the cases
    above), on strict lanes: NCCL's ordering and blocking rules, no deadlock."""
    base, dh = _runs(G, N, 1, tmp_path, "tiny-llama4" if G == 2 else "tiny-llama8", pp=G,
                     steps=3)
    assert dh[0]["config"]["num_microbatches"] == N
    assert same_fold(dh, base) <= FOLD_TOL


def test_checkpoint_moves_between_fold_and_unfolded(tmp_path):
    """Trained folded, saved; loaded unfolded (PP=1) and saved; loaded folded again: the
    same eval loss all three times (tied embeddings: both on stage 0 of the fold)."""
    a, b = str(tmp_path / "folded"), str(tmp_path / "unfolded")
    kw = dict(config="tiny4", micro_batch_size=1, global_batch_size=4, eval_iters=2)
    run_ranks(train_result, 2, timeout=300, train_iters=3, save=a,
              pipeline_model_parallel_size=2, dhelix={"enabled": True, "fold": True}, **kw)
    fold_eval = run_ranks(train_result, 2, timeout=300, train_iters=0, load=a, finetune=True, save=a + "2",
                          pipeline_model_parallel_size=2,
                          dhelix={"enabled": True, "fold": True}, **kw)[0]["eval_loss"]
    flat = run_ranks(train_result, 1, timeout=300, train_iters=0, load=a, finetune=True, save=b,
                     **kw)[0]["eval_loss"]
    back = run_ranks(train_result, 2, timeout=300, train_iters=0, load=b, finetune=True, save=b + "2",
                     pipeline_model_parallel_size=2, dhelix={"enabled": True, "fold": True},
                     **kw)[0]["eval_loss"]
    assert fold_eval is not None
    # ≤1e-6: the loss stage averages the micro-batches' losses in another order
    same_numbers([fold_eval, back], [flat, flat], 1e-6, "eval loss folded, back folded")


def test_uneven_fold_is_refused():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "dhelix.cli", "train", "--nproc", "2",
                        "--config", "tiny-llama", "--pipeline-model-parallel-size", "2",
                        "--dhelix", "--dhelix-fold"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert "2 layers do not fold evenly over --pipeline-model-parallel-size 2" in r.stderr


def test_dead_stage_is_an_error_not_a_hang():
    """Stage 1 exits in the second step: the job ends with an error naming the dead rank
    and its exit code (not the survivor's lost connection) long before the timeout."""
    import time
    from dhelix.testing import RankTimeout
    t = time.time()
    with pytest.raises(RankError) as e:
        run_ranks(_die_on_stage1, 2, timeout=200)
    assert not isinstance(e.value, RankTimeout)
    assert "rank 1 died with exit code 3" in str(e.value), str(e.value)[-2000:]
    assert time.time() - t < 120


def _die_on_stage1():
    import os
    import torch.distributed as dist
    from dhelix.folding import schedule as fs
    orig = fs.forward_backward_folded
    calls = {"n": 0}

    def dying(**kw):
        calls["n"] += 1
        if dist.get_rank() == 1 and calls["n"] == 2:
            os._exit(3)                       # stage 1 dies in the second step
        return orig(**kw)
    fs.forward_backward_folded = dying
    return train_result(config="tiny-llama4", micro_batch_size=1, global_batch_size=4,
                        train_iters=5, pipeline_model_parallel_size=2,
                        dhelix={"enabled": True, "fold": True})


@pytest.mark.parametrize("G,N,L,V", [(2, 4, 8, 2), (2, 8, 16, 4), (4, 8, 16, 2), (4, 16, 32, 4)])
def test_pipeline_simulator_matches_the_textbook_and_the_fold_gains(G, N, L, V):
    """Unit costs (f 1, b 2), no P2P: 1F1B's step is (N+G-1)(f+b)·L/G and the interleaved
    one N(f+b)·L/G + (G-1)(f+b)·V, megatron's own bubble formulas. The fold's pair
    costing what its two halves cost alone gains nothing from pairing yet keeps up with
    1F1B; a pair 20% cheaper makes it faster than both; its busiest stage holds the same
    activations as 1F1B's first stage."""
    from dhelix.planner.pipeline import LayerCosts, simulate_pipeline
    flat = LayerCosts(f=1.0, b=2.0, pair=3.0, saved=1.0, transient=0.0)
    r = simulate_pipeline(flat, L, G, N, 0.0, vpp_layers=V)
    n = L // G
    assert r["megatron-1f1b"].makespan == pytest.approx((N + G - 1) * 3 * n)
    assert r["megatron-1f1b"].bubble == pytest.approx((G - 1) / (N + G - 1))
    assert r["megatron-interleaved"].makespan == pytest.approx(N * 3 * n + (G - 1) * 3 * V)
    assert r["dhelix-fold"].makespan <= r["megatron-1f1b"].makespan
    assert max(r["dhelix-fold"].peak_bytes) == max(r["megatron-1f1b"].peak_bytes) == G * n
    for s, steps in zip(r["dhelix-fold"].busy, r["dhelix-fold"].order.steps):
        assert s == pytest.approx(N * 3 * n)                 # all the work, once
    paired = LayerCosts(f=1.0, b=2.0, pair=2.4, saved=1.0, transient=0.0)
    r2 = simulate_pipeline(paired, L, G, 4 * G, 0.1, vpp_layers=V)
    assert r2["dhelix-fold"].makespan < r2["megatron-1f1b"].makespan
    assert r2["dhelix-fold"].makespan < r2["megatron-interleaved"].makespan


def test_pipeline_simulator_refuses_bad_layouts():
    from dhelix.planner.pipeline import LayerCosts, PipelineError, simulate_pipeline
    c = LayerCosts(f=1.0, b=2.0, pair=3.0, saved=1.0, transient=0.0)
    with pytest.raises(PipelineError, match="6 layers do not fold evenly"):
        simulate_pipeline(c, 6, 2, 4, 0.0)
    with pytest.raises(PipelineError, match="needs the number of micro-batches \\(5\\) to be "
                                            "a multiple"):
        simulate_pipeline(c, 8, 2, 5, 0.0, vpp_layers=2)
    with pytest.raises(PipelineError, match="2 or more"):
        simulate_pipeline(c, 8, 1, 4, 0.0)


def test_simulate_and_plan_sweep_cli_report_the_pipeline(tmp_path):
    import json
    import subprocess
    import sys

    def cli(*argv):
        return subprocess.run([sys.executable, "-m", "dhelix.cli", *argv], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
    shape = ["--config", "llama-39b", "--tensor-model-parallel-size", "8",
             "--sequence-parallel", "--seq-length", "4096", "--micro-batch-size", "1",
             "--bf16", "--cluster", "a40"]
    assert cli("plan", *shape, "--out", "p.json").returncode == 0
    r = cli("simulate", "p.json", "--pipeline-model-parallel-size", "2",
            "--num-microbatches", "16", "--num-layers-per-virtual-pipeline-stage", "14")
    assert r.returncode == 0, r.stderr
    rows = {ln.split()[0]: ln.split() for ln in r.stdout.splitlines()
            if ln.startswith(("megatron-", "dhelix-fold"))}
    assert set(rows) == {"megatron-1f1b", "megatron-interleaved", "dhelix-fold"}
    assert float(rows["megatron-1f1b"][3].rstrip("x")) == 1.0
    assert float(rows["dhelix-fold"][3].rstrip("x")) > 1.0
    assert (tmp_path / "p.pipeline.png").stat().st_size > 1000
    tr = json.load(open(tmp_path / "p.pipeline.trace.json"))
    assert {e["pid"] for e in tr["traceEvents"]} == {0, 1, 2}
    bad = cli("simulate", "p.json", "--pipeline-model-parallel-size", "2", "--num-layers", "6")
    assert bad.returncode == 2 and "6 layers do not fold evenly" in bad.stderr
    s = cli("plan-sweep", "--configs", "llama-39b", "--clusters", "a40",
            "--pipeline-model-parallel-size", "2", "--data-parallel-size", "4",
            "--num-microbatches", "16", "--no-progress")
    assert s.returncode == 0, s.stderr
    assert "DP=4 × TP=8 × PP=2 = 64 GPUs" in s.stdout and "fold vs 1F1B" in s.stdout
    row = json.load(open(tmp_path / "plan-sweep.json"))["rows"][0]
    assert row["pp_speedup"] > 1.0 and row["pp_peak_vs_1f1b"] <= 1.1


def test_bench_pipeline_rows(tmp_path):
    """`dhelix bench --pipeline-model-parallel-size 2`: the three schedules trained from
    one checkpoint on the same data (the same losses), per-stage memory and idle share
    measured, the simulator's prediction beside them."""
    from bench_fns import run_bench
    rows, out, _ = run_bench(tmp_path, "tiny4", "--pipeline-model-parallel-size", "2",
                             "--micro-batch-size", "1")
    assert [x["method"] for x in rows] == ["megatron-1f1b", "megatron-interleaved",
                                           "dhelix-fold"]
    for x in rows:
        assert len(x["peak_activation_bytes_per_stage"]) == 2
        assert all(0.0 <= v < 1.0 for v in x["idle_share_per_stage"])
        assert x["sim_step_s"] > 0 and 0.0 <= x["sim_bubble"] < 1.0
        same_numbers([x["final_loss"]], [rows[0]["final_loss"]], FOLD_TOL, x["method"])
    assert rows[0]["speedup"] == 1.0 and rows[0]["sim_speedup"] == 1.0
    assert "| tiny4 | none | dhelix-fold |" in open(out + ".md").read()



@pytest.mark.parametrize("G,N", [(2, 4), (3, 6), (3, 4), (4, 8), (4, 16)])
def test_p2p_messages_match_by_order(G, N):
    """What a stage sends a neighbour is exactly what that neighbour's items take from
    it, and the receiver posts in the sender's order (`sends`): NCCL matches messages by
    order, and an activation and a grad have the same shape. For G ≥ 3 the receiver's
    own step order would post them differently (checked, so the test can fail)."""
    from dhelix.planner.pipeline_order import fold_deps, sends, travels_down
    o = folded_order(G, N)
    deps = fold_deps(G)
    differs = False
    for dst in range(G):
        for src in (dst - 1, dst + 1):
            if not 0 <= src < G:
                continue
            needed = [d[1] for s in o.steps[dst] for it in (s.fwd, s.bwd) if it
                      for d in deps(dst, it) if d[0] == src]
            sent = sends(o, src, dst)
            assert sorted(needed) == sorted(sent), (src, dst)
            assert all(travels_down(it) == (dst == src + 1) for it in sent)
            differs |= needed != sent
    if G >= 3 and N >= 2 * G:
        assert differs          # the V-shaped phases: the two orders really differ


@pytest.mark.parametrize("G,N", [(2, 2), (2, 4), (2, 8), (3, 6), (4, 4), (4, 8), (4, 16),
                                 (8, 8), (8, 32), (4, 3)])
def test_p2p_batches_cannot_deadlock_on_nccl(G, N):
    """The fold's P2P plan, played by NCCL's rules (a blocked send or receive holds its
    lane; messages of a pair match in posting order): every stage finishes. Each pair's
    messages go in the sender's order, and every receive is posted before its step."""
    from dhelix.planner.pipeline_order import sends
    from dhelix.folding.p2p import batches, simulate
    o = folded_order(G, N)
    plan = batches(o)
    simulate(plan, [len(s) for s in o.steps])
    for dst in range(G):
        for src in (dst - 1, dst + 1):
            if 0 <= src < G:
                posted = [m.item for b in plan[dst] for m in b.recvs if m.src == src]
                sent = [m.item for b in plan[src] for m in b.sends if m.dst == dst]
                assert posted == sent == sends(o, src, dst)


@pytest.mark.parametrize("G,N", [(4, 4), (3, 6), (8, 8)])
def test_p2p_simulation_catches_the_per_step_batch(G, N):
    """The check can fail: one batch a step (its sends with the next step's receives)
    deadlocks from G = 3 on — the last stage's early F1 output waits for a receive its
    neighbour posts steps later (seen on strict lanes too, before this plan)."""
    from dhelix.folding.p2p import simulate, step_batches
    o = folded_order(G, N)
    with pytest.raises(RuntimeError, match="deadlocks on NCCL"):
        simulate(step_batches(o), [len(s) for s in o.steps])
