"""Rank functions of tests/test_emulate.py (paced compute)."""
import statistics

import torch


def layer_step(config, emulate, compute, seq, mbs, reps):
    """One DHelix layer step (α's forward ∥ β's backward) under the trivial and the paired
    plan, paced as `compute`/`emulate` say: the median emulated step time of each plan,
    the simulator's prediction for the emulated shape (× the factor), the small ops' own
    share, and whether every output equals the unpaced step's."""
    import layer_fns
    from megatron.core import parallel_state
    from dhelix.train import emulate as em
    from dhelix.models.config import load_model_config
    from dhelix.planner.plan import paired_plan, trivial_plan
    from dhelix.planner.simulate import simulate
    from dhelix.strand.lanes import make_lanes

    _, dh, cfg, rope = layer_fns.setup_layer(config, 2, True, 3, seq, mbs)
    prog = dh.program
    ops = prog.layer_ops(seq, mbs)
    plans = {"trivial": trivial_plan(ops), "paired": paired_plan(ops)}
    x = layer_fns.inputs(cfg, seq, mbs, 1, True)
    g = layer_fns.inputs(cfg, seq, mbs, 2, True)
    lanes = make_lanes()
    meta = {"attention_mask": None, "rotary_pos_emb": rope}

    def step(plan):
        dt, Sa = layer_fns.timed_layer_step(prog, plan, plans["trivial"], lanes, meta, x, g)
        return dt, [Sa.get("out").clone()] + [
            p.main_grad.clone() if getattr(p, "main_grad", None) is not None else
            p.grad.clone() for p in dh.parameters() if p.grad is not None]

    plain = {k: step(p)[1] for k, p in plans.items()}
    for p in dh.parameters():
        p.grad = None
    emu = em.parse(compute, emulate)
    pacer = em.install(emu, load_model_config(config), ops, tp=2, sp=True, seq_length=seq,
                       micro_batch_size=mbs,
                       groups={"tp": parallel_state.get_tensor_model_parallel_group()})
    try:
        times, same = {k: [] for k in plans}, {}
        for rep in range(reps + 1):
            for name, plan in plans.items():
                for p in dh.parameters():
                    p.grad = None
                dt, outs = step(plan)
                if rep:                      # the first is a warm-up
                    times[name].append(dt)
                same[name] = all(torch.equal(a, b) for a, b in zip(outs, plain[name]))
        scales = dict(pacer.link.byte_scale)
    finally:
        em.uninstall()
    pacer.link.byte_scale = scales
    big = {"trivial": trivial_plan(pacer.emulated), "paired": paired_plan(pacer.emulated)}
    assert all([(st.fwd, st.bwd) for st in big[k].steps] ==
               [(st.fwd, st.bwd) for st in plans[k].steps] for k in plans)
    pred = {k: simulate(pacer.emulated, p, pacer.table).makespan * emu.factor
            for k, p in big.items()}
    # what must hold whatever the machine's noise: compute runs serially and each op sleeps
    # out its emulated time, so a step lasts at least the sum of both strands' compute
    compute = {k: sum(pacer.seconds[n] for st in plans[k].steps for n in st.fwd + st.bwd
                      if n in pacer.seconds) for k in plans}
    return {"measured": {k: statistics.median(v) for k, v in times.items()},
            "min": {k: min(v) for k, v in times.items()}, "compute_s": compute,
            "predicted": pred, "own_share": pacer.own_share, "late": pacer.late,
            "same": same, "byte_scale": sorted(pacer.link.byte_scale.values())
            if pacer.link.byte_scale else [], "paced_ops": pacer.ops}


def train_paced_and_not(runs):
    """For each keyword dict of `runs`, in one launch on the paced link: `train` plainly,
    then with paced compute; both results."""
    from dhelix.train.trainer import TrainConfig, train
    out = []
    for kw in runs:
        kw = dict(kw, quiet=True)
        emulate = kw.pop("emulate", "llama-8b,seq=1024,mbs=1")
        plain = train(TrainConfig(**kw))
        paced = train(TrainConfig(compute="paced:a40,x=2", emulate=emulate, **kw))
        out.append((plain, paced))
    return out


def train_with_plan_files(made_for_emulated, made_for_small):
    """Paced `dhelix train --dhelix` with a plan file made for the emulated shape (its
    result), then with one made for the small model's shape (the error it raises)."""
    from dhelix.train.trainer import TrainConfig, train
    kw = dict(config="tiny-llama-emu", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=1, micro_batch_size=1, global_batch_size=2, seq_length=64,
              quiet=True, compute="paced:a40,x=2", emulate="llama-8b,seq=1024,mbs=1")
    ok = train(TrainConfig(dhelix={"enabled": True, "plan": made_for_emulated}, **kw))
    try:
        train(TrainConfig(dhelix={"enabled": True, "plan": made_for_small}, **kw))
        err = None
    except Exception as e:          # noqa: BLE001 - the test reads the message
        err = f"{type(e).__name__}: {e}"
    return ok["losses"], ok["emulation"]["paced_ops"], err
